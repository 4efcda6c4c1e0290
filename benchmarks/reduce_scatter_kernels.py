"""The reduce-scatter's two kernels side by side, GEMM-only, one GPU: where the reducer kernel pays.

    python benchmarks/reduce_scatter_kernels.py [--models llama3-8b,llama3-70b,llama3-405b,gpt3-175b]
        [--worlds 4,8] [--tokens 1024,2048,4096,8192,16384] [--rounds 5] [--out FILE.json]

Per reduce-scatter case of the grid (rank 0's GEMM-only work, CUDA graph replays interleaved,
time over cuBLAS's): `triton`, the Triton kernel with the config a call had before the reducer
kernel's rule (the tuned table's entry, else the heuristic; its transport); `reducer_push` and
`reducer_copy_engine`, the reducer kernel (fluxtp/kernels/_matmul_reduce_scatter_reducer.py) in
128x256x64 tiles, 3 stages, with either transport; `launched`, what a call launches now
(MatmulReduceScatterConfig.on_reducer_kernel's rule); `plain`, the table config's tiling in
Triton without the fusion. GEMM-only, push stores into local memory: the transports differ in
where the partials go, not in NVLink traffic. Every output is checked against F.linear first.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from fluxtp._dist import GroupInfo
from fluxtp.backends.fused import _matmul_reduce_scatter
from fluxtp.bench.gemm_grid import case_inputs, expected_rows, launched_config, relative_error
from fluxtp.bench.harness import graphed

sys.path.insert(0, str(Path(__file__).parent))
from _kernel_variants import case_parser, cases_of, report, time_case  # noqa: E402

REDUCER_TILING = {"block_m": 128, "block_n": 256, "block_k": 64, "num_stages": 3, "warp_specialized": True}


def main() -> None:
    parser = case_parser(__doc__, "llama3-8b,llama3-70b,llama3-405b,gpt3-175b", "4,8", "1024,2048,4096,8192,16384", {})
    parser.set_defaults(rounds=5, variants="")
    args = parser.parse_args()
    rows = []
    for case in cases_of(args, "matmul_reduce_scatter"):
        x, w = case_inputs(case, "cuda")
        want = expected_rows(case, F.linear(x, w))
        table = _matmul_reduce_scatter.table_config(x, w, case.world)
        configs = {
            "triton": table,
            "reducer_push": dataclasses.replace(table, transport="push", **REDUCER_TILING),
            "reducer_copy_engine": dataclasses.replace(table, transport="copy_engine", **REDUCER_TILING),
            "launched": launched_config(case, x, w),
        }
        runs = {}
        for name, config in configs.items():
            run = _matmul_reduce_scatter.gemm_only(x, w, None, GroupInfo(None, 0, case.world), config)
            if not relative_error(run(), want) < 1e-2:
                raise AssertionError(f"{case.label()}: {name} ({config}) computes a wrong result")
            runs[name] = graphed(run)
        launched = configs["launched"]
        kernel = "reducer" if launched.warp_specialized else "triton"
        rows.append(time_case(case, runs, x, w, table, args.rounds, launched=f"{kernel} {launched.transport}",
                              table_transport=table.transport))  # fmt: skip
        del runs
        torch.cuda.empty_cache()
    report("reduce_scatter_kernels", rows, ["triton", "reducer_push", "reducer_copy_engine", "launched", "plain"],
           "launched", args.out)  # fmt: skip


if __name__ == "__main__":
    main()
