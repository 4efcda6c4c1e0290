"""The fused all-gather's GPU timeline per call path and kernel: where its copies and barriers run.

    torchrun --nproc-per-node 4 benchmarks/all_gather_copy_timeline.py [--shapes MxNxK,...] [--out FILE.json]

Per shape (global M tokens, N and K of the layer), with the config the launcher looks up and that
config on either kernel (warp_specialized on: "ws", off: "tri"), two call paths: return_gathered
(fresh gathered rows, the stream-by-stream path fluxtp.nn's layers take) and the recorded graph
(return_gathered=False). First the calls timed interleaved beside NCCL-then-cuBLAS
(fluxtp.bench.harness, medians, slowest rank), then three calls of each under torch.profiler:
rank 0 lists the last call's GPU work, each copy, barrier and the GEMM, in microseconds from the
GEMM's start, with each copy's rate. A device-local copy (DtoD) runs on SMs, a peer copy (PtoP)
on a copy engine (docs/perf-log.md, "The gathered path's local copies").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import tempfile
from pathlib import Path

import torch
from tabulate import tabulate
from torch.profiler import ProfilerActivity, profile

import fluxtp
from fluxtp._dist import destroy_process_group, init_torchrun_cuda
from fluxtp.backends.fused import _all_gather_matmul
from fluxtp.bench.harness import Protocol, Variant, measure
from fluxtp.bench.ops import parse_shapes
from fluxtp.bench.results import envelope, write_json

DEFAULT_SHAPES = "4096x28672x8192,4096x10240x8192"  # LLaMA-70B's up projection and QKV, 4096 tokens


def _timeline(prof, work: str) -> list[dict]:
    """The last profiled call's GPU events from the end of the GEMM before it: name, stream,
    start and duration (us, from its GEMM's start), a copy's GB/s."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    events = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    gemms = [e for e in events if work in e["name"]]
    start, previous_end = gemms[-1]["ts"], gemms[-2]["ts"] + gemms[-2]["dur"]
    end = start + gemms[-1]["dur"]
    rows = []
    for e in events:
        if previous_end - 50 <= e["ts"] <= end + 50:
            row = {"event": e["name"][:60], "stream": e["args"].get("stream"), "start_us": round(e["ts"] - start, 1),
                   "dur_us": round(e["dur"], 1)}  # fmt: skip
            if e["cat"] == "gpu_memcpy" and e["dur"]:
                row["GB/s"] = round(e["args"].get("bytes", 0) / e["dur"] / 1e3)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"MxNxK,... global layer sizes (default {DEFAULT_SHAPES})")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", help="write the results JSON here")
    args = parser.parse_args()
    device, info = init_torchrun_cuda()
    world, rank = info.world_size, info.rank
    rows = []
    for shape in parse_shapes(args.shapes):
        m, n = shape.M // world, shape.N // world
        g = torch.Generator(device=device).manual_seed(rank)
        x = torch.randn(m, shape.K, device=device, dtype=torch.bfloat16, generator=g)
        weight = torch.randn(n, shape.K, device=device, dtype=torch.bfloat16, generator=g) * shape.K**-0.5
        looked_up = _all_gather_matmul._config_for(x, weight, world, None)
        calls = {}
        for kernel, specialized in (("ws", True), ("tri", False)):
            config = dataclasses.replace(looked_up, warp_specialized=specialized)
            for path, return_gathered in (("gathered", True), ("replayed", False)):
                plan = _all_gather_matmul.Plan(x, weight, None, info, return_gathered, config)
                calls[f"{path}-{kernel}"] = lambda plan=plan: plan(x, weight, None)[0]
        calls["nccl"] = lambda: fluxtp.all_gather_matmul(x, weight, backend="nccl")
        variants = [Variant(name, (call,)) for name, call in calls.items()]
        ms = measure(variants, Protocol(rounds=args.rounds, warmup_rounds=2, calls_per_sample=5), info, device)
        row = {"op": "all_gather_matmul", "M": shape.M, "N": shape.N, "K": shape.K, "dtype": "bfloat16",
               "config": repr(looked_up), "ms": {k: round(v, 4) for k, v in ms.items()}, "timelines": {}}  # fmt: skip
        for name, call in calls.items():
            if name == "nccl":
                continue
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            torch.distributed.barrier()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    call()
                torch.cuda.synchronize()
            if rank == 0:
                row["timelines"][name] = _timeline(prof, "all_gather_matmul")
        rows.append(row)
    if rank == 0:
        for row in rows:
            print(f"{row['M']}x{row['N']}x{row['K']}: ms per call", row["ms"])
            for name, events in row["timelines"].items():
                print(f"  {name}: the last call, us from its GEMM's start")
                print(tabulate(events, headers="keys"))
        if args.out:
            data = envelope(
                "all_gather_copy_timeline", rows, device=torch.cuda.get_device_name(device),
                gpus=torch.cuda.device_count(), world=world,
                command=f"torchrun --nproc-per-node {world} benchmarks/all_gather_copy_timeline.py " + shlex.join(sys.argv[1:]),
            )  # fmt: skip
            print("wrote", write_json(data, args.out))
    destroy_process_group()


if __name__ == "__main__":
    main()
