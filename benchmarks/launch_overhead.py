"""Host time of one launch of the fused GEMM kernels: Triton's own launch against launch_compiled.

    python benchmarks/launch_overhead.py [--shapes 1024x28672x8192] [--world 2] [--rounds 7]
        [--calls 50] [--out FILE.json]

One GPU, no communication: each op's gemm_only mode launches exactly the kernel the op
launches (descriptors, config lookup and all) for the layer's global MxNxK split over --world
ranks, as rank 0. "triton" swaps the launchers' launch_compiled (fluxtp/backends/fused/_launch.py)
for the plain kernel[grid](...) it replaces. The GPU is kept busy by a long sleep so that no
launch waits on it; the host microseconds per launch are the median of --rounds rounds of
--calls launches, the two launch paths interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import ExitStack
from unittest import mock

import torch
from tabulate import tabulate

from fluxtp._dist import GroupInfo
from fluxtp.backends.fused import ag_gemm, gemm_rs
from fluxtp.bench.results import command_line, envelope, write_json

LAUNCHERS = (ag_gemm, gemm_rs)


def triton_launch(kernel, grid, *args, **constexprs):
    kernel[(grid,)](*args, **constexprs)


def host_us(run, calls: int) -> float:
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1e9))  # ~0.5 s of GPU work queued ahead: launches never wait
    start = time.perf_counter()
    for _ in range(calls):
        run()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def timed(run, path: str, calls: int) -> float:
    with ExitStack() as stack:
        if path == "triton":
            for module in LAUNCHERS:
                stack.enter_context(mock.patch.object(module, "launch_compiled", triton_launch))
        return host_us(run, calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1024x28672x8192", help="layer MxNxK,... (global, as fluxtp bench)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--out")
    args = parser.parse_args()
    info, bf = GroupInfo(None, 0, args.world), torch.bfloat16
    runs = {}
    for shape in args.shapes.split(","):
        m, n, k = map(int, shape.split("x"))
        w = args.world
        x_ag, w_ag = torch.randn(m // w, k, device="cuda", dtype=bf), torch.randn(n // w, k, device="cuda", dtype=bf)
        x_rs, w_rs = torch.randn(m, n // w, device="cuda", dtype=bf), torch.randn(k, n // w, device="cuda", dtype=bf)
        runs[("all_gather_matmul", shape)] = ag_gemm.gemm_only(x_ag, w_ag, None, info)
        runs[("matmul_reduce_scatter", f"{m}x{k}x{n}")] = gemm_rs.gemm_only(x_rs, w_rs, None, info)
    paths = ("triton", "compiled")
    samples = {(key, path): [] for key in runs for path in paths}
    for key, run in runs.items():  # compile, and give launch_compiled its key
        for path in paths:
            timed(run, path, 2)
    for _ in range(args.rounds):
        for key, run in runs.items():
            for path in paths:
                samples[(key, path)].append(timed(run, path, args.calls))
    rows = []
    for op, shape in runs:
        us = {path: round(statistics.median(samples[((op, shape), path)]), 1) for path in paths}
        saved = round(us["triton"] - us["compiled"], 1)
        rows.append({"op": op, "shape": shape, "world": args.world, "host_us": us, "saved_us": saved})
    device = torch.cuda.get_device_name()
    print(f"{device}: host us per launch, median of {args.rounds} interleaved rounds of {args.calls}")
    table = [[r["op"], r["shape"], r["host_us"]["triton"], r["host_us"]["compiled"], r["saved_us"]] for r in rows]
    print(tabulate(table, headers=["op", "MxNxK", "Triton launch", "launch_compiled", "saved"]))
    if args.out:
        data = envelope("launch_overhead", rows, device=device, gpus=1, world=args.world, command=command_line())
        print("wrote", write_json(data, args.out))


if __name__ == "__main__":
    main()
