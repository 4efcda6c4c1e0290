"""fluxtp.all_reduce latency by size on the local GPUs, under CUDA graphs, backends interleaved.

    torchrun --nproc-per-node 2 benchmarks/all_reduce_latency.py [--eager] [--out results.json]

For each size (bfloat16 values, the hidden states of a decode step up to 16 MB) every backend
(nccl: torch.distributed.all_reduce of a copy; torch: symmetric-memory one/two-shot; fused:
fluxtp's one-shot kernel; auto: what fluxtp.all_reduce picks) is captured once in a CUDA graph
and timed as replays (--eager: timed as calls) with fluxtp.bench.harness (interleaved rounds,
medians, max over ranks). Every backend's sum is checked against nccl's first. Writes the
fluxtp.bench/1 envelope (scenario "all_reduce").
"""

from __future__ import annotations

import argparse
import functools
import shlex
import sys

import torch

import fluxtp
from fluxtp._dist import destroy_process_group, init_torchrun_cuda
from fluxtp.bench.harness import Protocol, Variant, graphed, measure
from fluxtp.bench.results import envelope, write_json

SIZES = (8192, 8 * 8192, 64 * 8192, 512 * 8192, 1024 * 8192)  # values: B x hidden 8192, B = 1..1024
BACKENDS = ("nccl", "torch", "fused", "auto")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results JSON here")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--eager", action="store_true", help="time eager calls, not CUDA graph replays")
    parser.add_argument("--sizes", help="comma-separated numbers of values (default: " + ",".join(map(str, SIZES)) + ")")
    args = parser.parse_args()
    device, info = init_torchrun_cuda()
    rank = info.rank
    g = torch.Generator(device=device).manual_seed(rank)
    rows = []
    sizes = [int(v) for v in args.sizes.split(",")] if args.sizes else SIZES
    # Each sum rounds to bfloat16 up to W-1 times, in its own order: up to half an ulp a rounding
    # on either side (2**-8 of the largest sum's magnitude).
    tolerance = 2 * (info.world_size - 1) * 2**-8
    for numel in sizes:
        x = torch.randn(numel, device=device, dtype=torch.bfloat16, generator=g)
        ref = fluxtp.all_reduce(x, backend="nccl")
        for name in BACKENDS:
            out = fluxtp.all_reduce(x, backend=name)
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            assert err <= tolerance, f"all_reduce {name} {numel}: max-norm relative error {err:.3g} against nccl"
        calls = {n: functools.partial(fluxtp.all_reduce, x, backend=n) for n in BACKENDS}
        variants = [Variant(n, (call if args.eager else graphed(call),)) for n, call in calls.items()]
        ms = measure(variants, Protocol(rounds=args.rounds, warmup_rounds=3, calls_per_sample=20), info, device)
        row = {
            "op": "all_reduce",
            "numel": numel,
            "bytes": numel * 2,
            "dtype": "bfloat16",
            "cuda_graphs": not args.eager,
            "us": {n: round(v * 1000, 2) for n, v in ms.items()},
            "speedup_vs_nccl": {n: round(ms["nccl"] / v, 3) for n, v in ms.items()},
        }
        rows.append(row)
        if rank == 0:
            print(numel * 2, "bytes", row["us"], flush=True)
        del variants
    if rank == 0 and args.out:
        data = envelope(
            "all_reduce", rows, device=torch.cuda.get_device_name(device), gpus=torch.cuda.device_count(),
            world=info.world_size,
            command=f"torchrun --nproc-per-node {info.world_size} benchmarks/all_reduce_latency.py " + shlex.join(sys.argv[1:]),
        )
        print("wrote", write_json(data, args.out))
    destroy_process_group()


if __name__ == "__main__":
    main()
