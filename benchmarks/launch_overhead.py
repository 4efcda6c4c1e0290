"""Host time of the fused ops on ONE GPU: whole calls (every host step) for worlds of 2, 4 and 8
beside F.linear, and one kernel launch through Triton against launch_compiled.

    python benchmarks/launch_overhead.py [--shapes 1024x28672x8192] [--worlds 2,4,8] [--rounds 7]
        [--calls 20] [--launch-calls 50] [--out FILE.json]

"call" rows: a world of W simulated on one GPU and one process (SimulatedWorld): the public op
`fluxtp.all_gather_matmul` / `matmul_reduce_scatter` with backend "fused" (and "auto" where auto
takes fused) as rank 0 of a group of W, so every host step of a real call runs: the op's plan
lookup, the launcher's plan, the outputs' allocation, and the launch of the call's recorded graph
with its kernels' arguments rebound (the publish, the barriers, the kernel, the W-1 peers' copies
and signals of the all-gather, or the reduce-scatter's band copies, waits and flags). The peers' symmetric buffers are
local tensors, and torch's symmetric-memory barrier is stood in for by one small kernel launch
that also marks the peers' data as delivered (so the kernels never wait on the GPU). "F.linear"
is the host time of the same rank's cuBLAS GEMM ([W*m, K] x [n, K]^T for the all-gather, [M, k] x
[N, k]^T for the reduce-scatter).

"launch" rows (the earlier measurement): each op's gemm_only mode launches exactly the kernel
the op launches, "triton" through kernel[grid](...), "compiled" through launch_compiled.

The GPU is kept busy by a long sleep queued first, so no host call waits on it; the host
microseconds per call are the median of --rounds rounds of --calls calls, the variants
interleaved round by round. The JSON (fluxtp.bench.results envelope) records the command.
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

from fluxtp.kernels import COMPILE_OPTIONS
from fluxtp.testing import simulated_world

OPS = ("all_gather_matmul", "matmul_reduce_scatter")  # the ops whose calls are timed
LAUNCH_QUEUE_LIMIT = 1000  # CUDA's launch queue blocks the host past about this many queued items


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1024x28672x8192", help="layer MxNxK,... (global, as fluxtp bench)")
    parser.add_argument("--worlds", default="2,4,8", help="simulated world sizes of the call rows")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=20, help="whole calls per sample (each queues ~10-40 items)")
    parser.add_argument("--launch-calls", type=int, default=50, help="kernel launches per sample (launch rows)")
    parser.add_argument("--what", default="call,launch", help="call, launch or both (call,launch)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    args.shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    args.worlds = [int(w) for w in args.worlds.split(",")]
    args.what = set(args.what.split(","))
    if not args.what <= {"call", "launch"}:
        parser.error(f"--what takes call and/or launch, got {sorted(args.what)}")
    if any(w < 2 for w in args.worlds):
        parser.error("--worlds: a simulated world has 2 ranks or more")
    for m, n, k in args.shapes:
        for w in args.worlds:
            if m % w or n % w or k % w:
                parser.error(f"--shapes {m}x{n}x{k}: M, N and K must divide by every world size ({w})")
    return args


def host_us(run, calls: int) -> float:
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1e9))  # ~0.5 s of GPU work queued ahead: no host call waits
    start = time.perf_counter()
    for _ in range(calls):
        run()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def call_variants(shape, world, group):
    """{name: zero-argument callable} for one shape and world: fused, auto (where it takes fused), F.linear."""
    import torch.nn.functional as F

    import fluxtp
    from fluxtp import backends
    from fluxtp._dist import GroupInfo

    m, n, k = shape
    bf, dev = torch.bfloat16, "cuda"
    info = GroupInfo(group, 0, world)
    variants = {}
    x_ag, w_ag = torch.randn(m // world, k, device=dev, dtype=bf), torch.randn(n // world, k, device=dev, dtype=bf)
    x_full = torch.randn(m, k, device=dev, dtype=bf)
    x_rs, w_rs = torch.randn(m, n // world, device=dev, dtype=bf), torch.randn(k, n // world, device=dev, dtype=bf)
    variants[("all_gather_matmul", "fused")] = lambda: fluxtp.all_gather_matmul(x_ag, w_ag, group=group, backend="fused")
    variants[("all_gather_matmul", "F.linear")] = lambda: F.linear(x_full, w_ag)
    variants[("matmul_reduce_scatter", "fused")] = lambda: fluxtp.matmul_reduce_scatter(
        x_rs, w_rs, group=group, backend="fused"
    )
    variants[("matmul_reduce_scatter", "F.linear")] = lambda: F.linear(x_rs, w_rs)
    if backends.choose("all_gather_matmul", "auto", x_ag, w_ag, info) == "fused":
        variants[("all_gather_matmul", "auto")] = lambda: fluxtp.all_gather_matmul(x_ag, w_ag, group=group)
    if backends.choose("matmul_reduce_scatter", "auto", x_rs, w_rs, info) == "fused":
        variants[("matmul_reduce_scatter", "auto")] = lambda: fluxtp.matmul_reduce_scatter(x_rs, w_rs, group=group)
    return variants


def measure_calls(args) -> list[dict]:
    rows = []
    for world in args.worlds:
        with simulated_world(world) as group:
            for shape in args.shapes:
                variants = call_variants(shape, world, group)
                for run in variants.values():  # plans, workspaces and kernels built outside the timing
                    run()
                    run()
                samples = {key: [] for key in variants}
                for _ in range(args.rounds):
                    for key, run in variants.items():
                        samples[key].append(host_us(run, args.calls))
                m, n, k = shape
                for op in OPS:
                    us = {v: round(statistics.median(s), 1) for (o, v), s in samples.items() if o == op}
                    layer = f"{m}x{n}x{k}" if op == "all_gather_matmul" else f"{m}x{k}x{n}"
                    rows.append({"what": "call", "op": op, "shape": layer, "world": world, "host_us": us})
    return rows


def measure_launches(args) -> list[dict]:
    """gemm_only's launch through Triton against launch_compiled (a Launch past its first call)."""
    from fluxtp._dist import GroupInfo
    from fluxtp.backends.fused import _launch, _all_gather_matmul, _matmul_reduce_scatter

    rows = []
    bf = torch.bfloat16
    for world in args.worlds:
        info = GroupInfo(None, 0, world)
        runs = {}
        for m, n, k in args.shapes:
            x_ag, w_ag = torch.randn(m // world, k, device="cuda", dtype=bf), torch.randn(n // world, k, device="cuda", dtype=bf)
            x_rs, w_rs = torch.randn(m, n // world, device="cuda", dtype=bf), torch.randn(k, n // world, device="cuda", dtype=bf)
            runs[("all_gather_matmul", f"{m}x{n}x{k}")] = _all_gather_matmul.gemm_only(x_ag, w_ag, None, info)
            runs[("matmul_reduce_scatter", f"{m}x{k}x{n}")] = _matmul_reduce_scatter.gemm_only(x_rs, w_rs, None, info)

        def timed(run, path, calls):
            if path == "compiled":
                return host_us(run, calls)
            with mock.patch.object(_launch.Launch, "__call__", _triton_launch):
                return host_us(run, calls)

        paths = ("triton", "compiled")
        samples = {(key, path): [] for key in runs for path in paths}
        for run in runs.values():
            for path in paths:
                timed(run, path, 2)
        for _ in range(args.rounds):
            for key, run in runs.items():
                for path in paths:
                    samples[(key, path)].append(timed(run, path, args.launch_calls))
        for op, shape in runs:
            us = {path: round(statistics.median(samples[((op, shape), path)]), 1) for path in paths}
            rows.append({"what": "launch", "op": op, "shape": shape, "world": world, "host_us": us})
    return rows


def _triton_launch(launch, *args):
    """A _launch.Launch through Triton's own binding, kernel[grid](...), as before launch_compiled."""
    launch.kernel[(launch.grid,)](*args, **launch.constexprs, **COMPILE_OPTIONS)


def main(argv=None) -> None:
    args = parse_args(argv)
    from tabulate import tabulate

    from fluxtp.bench.results import command_line, envelope, write_json

    rows = []
    if "call" in args.what:
        rows += measure_calls(args)
    if "launch" in args.what:
        rows += measure_launches(args)
    device = torch.cuda.get_device_name()
    print(f"{device}: host us per call, median of {args.rounds} interleaved rounds")
    for what in ("call", "launch"):
        chosen = [r for r in rows if r["what"] == what]
        if chosen:
            names = list(dict.fromkeys(v for r in chosen for v in r["host_us"]))
            table = [[r["op"], r["shape"], r["world"], *(r["host_us"].get(v, "-") for v in names)] for r in chosen]
            print(tabulate(table, headers=["op", "MxNxK", "W", *names]))
    if args.out:
        data = envelope("launch_overhead", rows, device=device, gpus=1, world=max(args.worlds), command=command_line())
        print("wrote", write_json(data, args.out))


if __name__ == "__main__":
    main()
