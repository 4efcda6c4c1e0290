"""A/B on one GPU: the reduce-scatter owner's W-1 partial loads unrolled (all in flight) or rolled.

    python benchmarks/reduce_unroll_ab.py [--rounds 8] [--out FILE.json]

For the reduce-scatter cases of llama3-8b/70b/405b at TP 2, 4, 8 and 1024/4096/16384 tokens, the
fused GEMM-only mode with _matmul_reduce_scatter.REDUCE_UNROLL_MIN_WORLD forced to 2 (always unrolled) and to
never, beside the plain TMA twin of the same tiling and cuBLAS, as CUDA graph replays,
interleaved (fluxtp.bench.harness). The two fused variants must agree bitwise (the same sums in
the same order); the shipped rule unrolls from the world size where unrolled/rolled was below 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate

from fluxtp._dist import GroupInfo
from fluxtp.backends.fused import _matmul_reduce_scatter
from fluxtp.bench.gemm_grid import case_inputs, expected_rows, gemm_only_case, launched_config, model_cases
from fluxtp.bench.gemm_grid import relative_error
from fluxtp.bench.harness import Protocol, Variant, graphed, measure_rounds
from fluxtp.bench.results import command_line, envelope, write_json

sys.path.insert(0, str(Path(__file__).parent))
from gemm_efficiency import plain_matmul  # noqa: E402

NEVER = 1 << 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out")
    args = parser.parse_args()
    cases = [
        c for model in ("llama3-8b", "llama3-70b", "llama3-405b")
        for c in model_cases(model, tokens=(1024, 4096, 16384)) if c.op == "matmul_reduce_scatter"
    ]
    rows = []
    for case in cases:
        x, w = case_inputs(case, "cuda")
        ref = expected_rows(case, F.linear(x, w))
        runs, outs = {}, {}
        for name, min_world in (("rolled", NEVER), ("unrolled", 2)):
            _matmul_reduce_scatter.REDUCE_UNROLL_MIN_WORLD = min_world
            run = gemm_only_case(case, x, w)
            outs[name] = run().clone()
            runs[name] = graphed(run)
        if not torch.equal(outs["rolled"], outs["unrolled"]) or not relative_error(outs["unrolled"], ref) < 1e-2:
            raise AssertionError(f"{case.label()}: the unrolled reduction changes the result")
        runs["plain"] = graphed(plain_matmul(x, w, launched_config(case, x, w)))
        runs["cublas"] = graphed(lambda x=x, w=w: F.linear(x, w))
        ms = measure_rounds([Variant(n, (r,)) for n, r in runs.items()], Protocol(args.rounds, 2, 5),
                            GroupInfo(None, 0, 1), "cuda").ms
        rows.append({"case": case.label(), "M": case.M, "N": case.N, "K": case.K, "world": case.world,
                     "ms": {k: round(v, 5) for k, v in ms.items()},
                     "unrolled_vs_rolled": round(ms["unrolled"] / ms["rolled"], 4),
                     "rolled_vs_plain": round(ms["rolled"] / ms["plain"], 4),
                     "unrolled_vs_plain": round(ms["unrolled"] / ms["plain"], 4),
                     "plain_vs_cublas": round(ms["plain"] / ms["cublas"], 4)})
        del runs
        torch.cuda.empty_cache()
    keys = ("unrolled_vs_rolled", "rolled_vs_plain", "unrolled_vs_plain", "plain_vs_cublas")
    print(tabulate([[r["case"], *(r[k] for k in keys)] for r in rows], headers=["case", *keys]))
    if args.out:
        data = envelope("reduce_unroll_ab", rows, device=torch.cuda.get_device_name(), gpus=1, world=0,
                        command=command_line())
        print("wrote", write_json(data, args.out))


if __name__ == "__main__":
    main()
