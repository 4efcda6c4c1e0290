"""Where a training step's time goes, per backend: GPU time by kernel kind, and the idle gaps.

    torchrun --nproc-per-node 2 benchmarks/train_step_profile.py [--model llama3-70b] [--layers 2]
        [--seq 4096] [--variants nccl,fused,no_comm] [--steps 4] [--fp8] [--out profile.json]

The same model and steps as `fluxtp bench train` (fluxtp.bench.train.Trainer, whose no_comm
variant is the nccl step with every communication removed). For each variant: a few warm-up
steps, then the wall time of --steps steps (CUDA events, median), then the same steps under
torch.profiler. Kernels are grouped by kind (KINDS: first matching pattern wins); `busy` is
the union of all kernel intervals (any stream) per step, so `wall - busy` is time no kernel
ran at all (host launch cost, or a wait on the host). A spinning fused kernel counts as busy.
`wall` comes from unprofiled steps and `busy` from profiled ones, which the profiler slows:
where the GPU is rarely idle, `idle` can read slightly negative.
Rank 0 prints the table and writes the JSON (fluxtp.bench/1 envelope, scenario
"train_profile"); the other ranks' timelines are alike (the step is symmetric).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

import torch
from tabulate import tabulate
from torch.profiler import ProfilerActivity, profile

from fluxtp._dist import destroy_process_group, init_torchrun_cuda
from fluxtp.bench import train

sys.path.insert(0, str(Path(__file__).parent))
from _train_steps import trainer, write_results  # noqa: E402

# (kind, pattern on the kernel name, lower case); the first match wins.
# The fused kinds take every kernel of their op (the Triton, ping-pong and reducer kernels), and
# "cat" must not take a reduce-scatter ("scatter" holds it).
KINDS = (
    ("fused all_gather_matmul", r"all_gather_matmul\w*_kernel"),
    ("fused matmul_reduce_scatter", r"matmul_reduce_scatter\w*_kernel"),
    ("nccl", r"nccl"),
    ("symm barrier/signal", r"barrier|stream_write|write_value|memset"),
    ("attention", r"flash|fmha|attn|attention"),
    ("gemm (cuBLAS)", r"gemm|nvjet|xmma|cutlass|cublas"),
    ("copy/cat/transpose", r"copy|\bcat|catarray|transpose|memcpy"),
    ("optimizer", r"multi_tensor|adam"),
    ("other", r""),
)


def kind_of(name: str) -> str:
    lower = name.lower()
    return next(kind for kind, pattern in KINDS if re.search(pattern, lower))


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def profile_variant(trainer: train.Trainer, variant: str, steps: int) -> dict:
    for _ in range(3):  # warm-up: compile, allocate, tune lookups
        trainer.step(variant)
    torch.cuda.synchronize()
    walls = []
    for _ in range(steps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        trainer.step(variant)
        stop.record()
        stop.synchronize()
        walls.append(start.elapsed_time(stop))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            trainer.step(variant)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_kind: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for e in kernels:
        us, kind = e.time_range.elapsed_us(), kind_of(e.name)
        by_kind[kind] = by_kind.get(kind, 0.0) + us
        by_name[e.name] = by_name.get(e.name, 0.0) + us
    busy = union_us([(e.time_range.start, e.time_range.end) for e in kernels]) / steps / 1000
    top = sorted(by_name.items(), key=lambda item: -item[1])[:15]
    return {
        "variant": variant,
        "wall_ms": round(statistics.median(walls), 3),
        "busy_ms": round(busy, 3),
        "kinds_ms": {kind: round(by_kind.get(kind, 0.0) / steps / 1000, 3) for kind, _ in KINDS},
        "top_kernels_ms": [[name[:120], round(us / steps / 1000, 3)] for name, us in top],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-70b", choices=tuple(train.MODELS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--variants", default="nccl,fused,no_comm")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--fp8", action="store_true", help="the layers' GEMMs in FP8 (bench train --fp8 row-wise)")
    parser.add_argument("--out", help="write the results JSON here")
    args = parser.parse_args()
    device, info = init_torchrun_cuda()
    rank = info.rank
    model = trainer(args, info, device, train.TRAIN_FP8 if args.fp8 else None)
    model.set_input(args.seq)
    rows = [profile_variant(model, v.strip(), args.steps) for v in args.variants.split(",")]
    if rank == 0:
        kinds = [kind for kind, _ in KINDS]
        table = [[r["variant"], r["wall_ms"], r["busy_ms"], round(r["wall_ms"] - r["busy_ms"], 3)]
                 + [r["kinds_ms"][k] for k in kinds] for r in rows]
        print(tabulate(table, headers=["variant", "wall", "busy", "idle", *kinds], floatfmt=".2f"))
        for r in rows:
            print(f"\n{r['variant']}: top kernels (ms per step)")
            print(tabulate(r["top_kernels_ms"], floatfmt=".3f"))
        if args.out:
            for r in rows:
                r.update(model=args.model, layers=args.layers, seq=args.seq, steps=args.steps,
                         fp8=train.TRAIN_FP8 if args.fp8 else None)
            write_results("train_profile", rows, args.out, info, device)
    destroy_process_group()


if __name__ == "__main__":
    main()
