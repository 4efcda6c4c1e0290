"""The fused all-gather's call paths under several configs, side by side on the local GPUs.

    torchrun --nproc-per-node 2 benchmarks/all_gather_call_paths.py [--shapes MxNxK,...] [--paths ...]
        [--configs ...] [--out FILE.json]

Per shape (global M tokens, N and K of the layer), interleaved (fluxtp.bench.harness: rounds of
back-to-back eager calls, medians, slowest rank): cuBLAS alone on the gathered rows, NCCL then
cuBLAS, PyTorch's async-TP (backend torch), and the fused plan with
- the call as one recorded graph, the GEMM in it (return_gathered=False, the inference path),
- the same pulls issued eagerly into the same workspace rows,
- return_gathered=True (fresh gathered rows each call: the training path, what `fluxtp bench` times),
each under the configs asked for (--configs): the launcher's (`looked-up`: shipped table or user
cache, routed), the heuristic's, and `unrouted`, the looked-up tiling before the launcher's routing
(where stream-K splits the last wave, the same tiling without the split; skipped where it equals
`looked-up`).
Every variant's output is checked against NCCL-then-cuBLAS first. Writes the fluxtp.bench/1
envelope (scenario "all_gather_call_paths").
"""

from __future__ import annotations

import argparse
import shlex
import sys

import torch
import torch.nn.functional as F
from tabulate import tabulate

import fluxtp
from fluxtp._dist import destroy_process_group, init_torchrun_cuda
from fluxtp.backends.fused import _all_gather_matmul
from fluxtp.backends.fused._launch import num_sms
from fluxtp.bench.harness import Protocol, Variant, measure
from fluxtp.bench.ops import parse_shapes
from fluxtp.bench.results import envelope, write_json
from fluxtp.configs import AllGatherMatmulConfig

DEFAULT_SHAPES = "4096x28672x8192,8192x28672x8192,16384x28672x8192"  # LLaMA-70B's up projection


PATHS = ("replayed", "eager", "gathered")
CONFIGS = ("looked-up", "heuristic", "unrouted")


def _plan(x, weight, info, path: str, config):
    if path == "gathered":
        return _all_gather_matmul.Plan(x, weight, None, info, True, config)
    plan = _all_gather_matmul.Plan(x, weight, None, info, False, config)
    if path == "eager":
        plan.call_graph = None  # no recorded call: the GEMM launched apart from ...
        plan.copy_steps_replay.graph = False  # ... StreamReplay's "not recordable" state: issue eagerly
    return plan


def _plans(x, weight, info, configs: dict, paths) -> dict:
    """name -> a zero-argument call of one fused path under one config."""
    calls = {}
    for config_name, config in configs.items():
        for path in paths:
            plan = _plan(x, weight, info, path, config)
            calls[f"{path} {config_name}"] = lambda plan=plan: plan(x, weight, None)[0]
    return calls


def _configs(x, weight, world: int, names) -> dict:
    m, n, k = x.shape[0], weight.shape[0], x.shape[1]
    configs = {
        "looked-up": _all_gather_matmul._config_for(x, weight, world, None),
        "heuristic": AllGatherMatmulConfig.heuristic(m, n, k, world, num_sms(x.device)),
        "unrouted": _all_gather_matmul.looked_up(x, weight, world),
    }
    if configs["unrouted"] == configs["looked-up"]:
        del configs["unrouted"]
    return {name: configs[name] for name in names if name in configs}


def _names(text: str, allowed, flag: str) -> list[str]:
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in allowed]
    if unknown or not names:
        raise ValueError(f"{flag} {text!r}: expected a comma list of {', '.join(allowed)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"MxNxK,... global layer sizes (default {DEFAULT_SHAPES})")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma list of {', '.join(PATHS)} (default: all)")
    parser.add_argument("--configs", default="looked-up,heuristic", help=f"comma list of {', '.join(CONFIGS)}"
                        " (default: looked-up,heuristic)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", help="write the results JSON here")
    args = parser.parse_args()
    paths, config_names = _names(args.paths, PATHS, "--paths"), _names(args.configs, CONFIGS, "--configs")
    device, info = init_torchrun_cuda()
    world, rank = info.world_size, info.rank
    g = torch.Generator(device=device).manual_seed(rank)
    rows = []
    for shape in parse_shapes(args.shapes):
        if shape.M % world or shape.N % world:
            raise ValueError(f"--shapes: {shape} needs M and N divisible by the world size {world}")
        m, n = shape.M // world, shape.N // world
        x = torch.randn(m, shape.K, device=device, dtype=torch.bfloat16, generator=g)
        weight = torch.randn(n, shape.K, device=device, dtype=torch.bfloat16, generator=g) * shape.K**-0.5
        x_gathered = torch.randn(shape.M, shape.K, device=device, dtype=torch.bfloat16, generator=g)
        configs = _configs(x, weight, world, config_names)
        calls = {"cublas": lambda: F.linear(x_gathered, weight),
                 "nccl": lambda: fluxtp.all_gather_matmul(x, weight, backend="nccl"),
                 "torch": lambda: fluxtp.all_gather_matmul(x, weight, backend="torch")}  # fmt: skip
        fused = _plans(x, weight, info, configs, paths)
        ref = calls["nccl"]().float()
        for name, call in {"torch": calls["torch"], **fused}.items():
            err = ((call().float() - ref).abs().max() / ref.abs().max()).item()
            assert err <= 2**-7, f"{shape}: {name} differs from NCCL-then-cuBLAS (max-norm relative error {err:.3g})"
        calls.update(fused)
        variants = [Variant(name, (call,)) for name, call in calls.items()]
        ms = measure(variants, Protocol(rounds=args.rounds, warmup_rounds=2, calls_per_sample=5), info, device)
        row = {
            "op": "all_gather_matmul", "M": shape.M, "N": shape.N, "K": shape.K, "dtype": "bfloat16",
            "configs": {k: repr(c) for k, c in configs.items()},
            "ms": {k: round(v, 5) for k, v in ms.items()},
            "speedup_vs_nccl": {k: round(ms["nccl"] / v, 4) for k, v in ms.items()},
        }  # fmt: skip
        rows.append(row)
        del variants, calls, fused
    if rank == 0:
        names = list(dict.fromkeys(k for r in rows for k in r["ms"]))  # `unrouted` only where it differs
        table = [[f"{r['M']}x{r['N']}x{r['K']}",
                  *(f"{r['ms'][k]:.4f} ({r['speedup_vs_nccl'][k]:.3f})" if k in r["ms"] else "-" for k in names)]
                 for r in rows]  # fmt: skip
        print(tabulate(table, headers=["shape", *names]))
        print("ms per call (speedup over nccl); configs:", *(f"{r['M']}: {r['configs']}" for r in rows), sep="\n")
        if args.out:
            data = envelope(
                "all_gather_call_paths", rows, device=torch.cuda.get_device_name(device), gpus=torch.cuda.device_count(),
                world=world, command=f"torchrun --nproc-per-node {world} benchmarks/all_gather_call_paths.py "
                + shlex.join(sys.argv[1:]),
            )  # fmt: skip
            print("wrote", write_json(data, args.out))
    destroy_process_group()


if __name__ == "__main__":
    main()
