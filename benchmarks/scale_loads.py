"""Where the warp-specialized FP8 kernels load their row-wise scales, and what that costs, on one GPU.

    python benchmarks/scale_loads.py [--ops all_gather_matmul,matmul_reduce_scatter] [--models llama3-8b,llama3-70b]
        [--worlds 2,8] [--tokens 4096,16384] [--fast-accum] [--variants unscaled,...] [--rounds 5] [--out FILE.json]

A row-wise scaled call multiplies each tile by its x rows' and weight columns' scales, which both
kernels (the all-gather's, fluxtp/kernels/_all_gather_matmul_pingpong.py; the reduce-scatter's
reducer kernel) load once the tile's K loop has ended, both consumer warpgroups waiting them out
with the tensor cores idle. Per FP8 case of the named models' grid (fluxtp/bench/gemm_grid.py)
that a call runs on one of the two, its GEMM-only mode beside copies of its source
(benchmarks/_kernel_variants.py) and torch._scaled_mm (row-wise scales, bf16 out, the same
accumulation), as CUDA graph replays interleaved by the benchmark harness:
- `unscaled`: no scale loaded nor applied; wrong results, and other output bits (which move a
  power-capped GPU's clocks), so only a rough bound on what the loads cost;
- `scales_before_k_loop`: the scales of the accumulator's first columns loaded before the K loop
  (the all-gather's once the tile's first stage is there: a peer's row scales arrive before its
  rows), held in registers through it, applied after it (beside a precise 128x256 tile's
  accumulator halves that spills: 38 spill ops under Triton 3.6).
Time over torch._scaled_mm's, medians; every variant but `unscaled` is checked against it first.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

import fluxtp.kernels._all_gather_matmul_pingpong as ag_module
import fluxtp.kernels._matmul_reduce_scatter_reducer as rs_module
from fluxtp._dist import GroupInfo
from fluxtp.backends.fused import _all_gather_matmul, _matmul_reduce_scatter
from fluxtp.bench.gemm_grid import (
    cublas_reference,
    expected_rows,
    fp8_case_inputs,
    gathered,
    launched_config,
    relative_error,
)
from fluxtp.bench.harness import graphed

sys.path.insert(0, str(Path(__file__).parent))
from _kernel_variants import case_parser, cases_of, chosen_variants, report, time_case, variant_kernels  # noqa: E402

# The all-gather's scales of the accumulator's rows (consumer C's half of the tile) and first ACC_N
# columns loaded before the K loop, once the tile's first stage is there (a peer's row scales
# arrive before its rows); the epilogue then takes an already scaled accumulator (SCALING 0).
_AG_EARLY_LOADS = """        if SCALING == 2:
            if K > 0:  # the K loop's own first wait then returns at once
                FIRST: gl.constexpr = a_bufs.type.shape[0]
                mbarrier.wait(ready.index(used % FIRST), (used // FIRST) & 1)
            SCALED_ROWS: gl.constexpr = BLOCK_M // 2
            srows = pid_m * BLOCK_M + C * SCALED_ROWS + gl.arange(0, SCALED_ROWS, layout=gl.SliceLayout(1, layout))
            scols = pid_n * BLOCK_N + gl.arange(0, ACC_N, layout=gl.SliceLayout(0, layout))
            if segment == RANK:
                srow_ptrs = scale_own_ptr + srows
            else:
                srow_ptrs = scale_a_ptr + segment * rows_per_rank + srows
            early_a = gl.load(srow_ptrs, mask=srows < rows_per_rank, other=0.0)
            early_b = gl.load(scale_b_ptr + scols, mask=scols < N, other=0.0)
        if PRECISE_ACC:
            acc, acc_hi, used = accumulate(a_bufs, b_bufs, ready, empty, used, K, C, layout, SPLIT_ACC)
        else:
            acc, used = accumulate_plain(a_bufs, b_bufs, ready, empty, used, K, C, layout, B_KN)
        EPILOGUE_SCALING: gl.constexpr = 0 if SCALING == 2 else SCALING
        if SCALING == 2:
            acc = acc * gl.expand_dims(early_a, 1) * gl.expand_dims(early_b, 0)
        c_smem = c_bufs.index(C)
        _epilogue(acc, c_desc, c_smem, c_ptr, bias_ptr, scale_a_ptr, scale_own_ptr, scale_b_ptr, segment, pid_m,
                  pid_n * BLOCK_N, rows_per_rank, N, stride_cm, layout, C, RANK, HAS_BIAS, TMA_STORE, EPILOGUE_SCALING)
"""
AG_VARIANTS = {
    "unscaled": [("    elif SCALING == 2:  # row-wise", "    elif SCALING == 99:  # row-wise")],
    "scales_before_k_loop": [(
        "        if PRECISE_ACC:\n"
        "            acc, acc_hi, used = accumulate(a_bufs, b_bufs, ready, empty, used, K, C, layout, SPLIT_ACC)\n"
        "        else:\n"
        "            acc, used = accumulate_plain(a_bufs, b_bufs, ready, empty, used, K, C, layout, B_KN)\n"
        "        c_smem = c_bufs.index(C)\n"
        "        _epilogue(acc, c_desc, c_smem, c_ptr, bias_ptr, scale_a_ptr, scale_own_ptr, scale_b_ptr, segment, pid_m,\n"
        "                  pid_n * BLOCK_N, rows_per_rank, N, stride_cm, layout, C, RANK, HAS_BIAS, TMA_STORE, SCALING)  # fmt: skip\n",
        _AG_EARLY_LOADS)],
}
# The reducer kernel's scales of the accumulator's rows (consumer C's half of the tile) and first
# ACC_N columns loaded before the K loop (its A and scales are this rank's own: no wait); its
# partials' stores then take an already scaled accumulator (SCALING 0).
_RS_EARLY_LOADS = """        if (step >= first_step) & (step <= last_step):
            if SCALING == 2:
                srows = pid_m * BLOCK_M + C * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, layout))
                scols = pid_n * BLOCK_N + gl.arange(0, ACC_N, layout=gl.SliceLayout(0, layout))
                early_a = gl.load(scale_a_ptr + owner * rows_per_rank + srows, mask=srows < rows_per_rank, other=0.0)
                early_b = gl.load(scale_b_ptr + scols, mask=scols < N, other=0.0)
            if PRECISE_ACC:  # FP8 products"""
RS_VARIANTS = {
    "unscaled": [("    if SCALING != 0:\n        acc = _scale(", "    if SCALING == 99:\n        acc = _scale(")],
    "scales_before_k_loop": [
        ("        if (step >= first_step) & (step <= last_step):\n            if PRECISE_ACC:  # FP8 products",
         _RS_EARLY_LOADS),
        ("                acc, used = accumulate_plain(a_bufs, b_bufs, ready, empty, used, K, C, layout, B_KN)\n",
         "                acc, used = accumulate_plain(a_bufs, b_bufs, ready, empty, used, K, C, layout, B_KN)\n"
         "            EPILOGUE_SCALING: gl.constexpr = 0 if SCALING == 2 else SCALING\n"
         "            if SCALING == 2:\n"
         "                acc = acc * gl.expand_dims(early_a, 1) * gl.expand_dims(early_b, 0)\n"),
        ("\n                        WORLD, PUSH, SCALING)  # fmt: skip", "\n                        WORLD, PUSH, EPILOGUE_SCALING)"),
    ],
}
VARIANTS = AG_VARIANTS  # the same names for both kernels
COMPUTES_THE_OP = ("fused", "scales_before_k_loop")
OPS = {  # op -> (the launcher, the kernel's module, its name, its file, its variants)
    "all_gather_matmul": (_all_gather_matmul, ag_module, "all_gather_matmul_pingpong_kernel",
                          "_all_gather_matmul_pingpong.py", AG_VARIANTS),
    "matmul_reduce_scatter": (_matmul_reduce_scatter, rs_module, "matmul_reduce_scatter_reducer_kernel",
                              "_matmul_reduce_scatter_reducer.py", RS_VARIANTS),
}


def gemm_only_with(op: str, kernel, x, w, world, config, scales, fast):
    """The launcher's GEMM-only mode for rank 0, launching `kernel` in place of the shipped
    warp-specialized kernel (the launcher imports it at each plan)."""
    launcher, module, name = OPS[op][:3]
    shipped = getattr(module, name)
    setattr(module, name, kernel)
    try:
        return launcher.gemm_only(x, w, None, GroupInfo(None, 0, world), config, scales=scales, use_fast_accum=fast)
    finally:
        setattr(module, name, shipped)


def main() -> None:
    parser = case_parser(__doc__, "llama3-8b,llama3-70b", "2,8", "4096,16384", VARIANTS)
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--fast-accum", action="store_true", help="use_fast_accum (the layers' forward)")
    parser.set_defaults(rounds=5)
    args = parser.parse_args()
    names = list(chosen_variants(parser, args, VARIANTS))
    rows = []
    for op in args.ops.split(","):
        _, module, kernel_name, kernel_file, variants = OPS[op]
        kernels = variant_kernels(module, kernel_name, kernel_file, {n: variants[n] for n in names})
        for case in cases_of(args, op):
            case = dataclasses.replace(case, dtype="float8_e4m3fn", fast_accum=args.fast_accum)
            x, w, scale_x, scale_w = fp8_case_inputs(case, "cuda")
            scales = (scale_x, scale_w)
            config = launched_config(case, x, w, scales)
            if not config.warp_specialized:
                print(f"{case.label()}: a call runs a Triton kernel here; skipped", flush=True)
                continue
            full, full_scales = gathered(case, x), (gathered(case, scale_x), scale_w)  # row scales travel with rows
            reference = lambda full=full, s=full_scales: cublas_reference(full, w, s, args.fast_accum)  # noqa: E731
            want = expected_rows(case, reference())
            runs = {}
            for name, kernel in kernels.items():
                run = gemm_only_with(op, kernel, x, w, case.world, config, scales, args.fast_accum)
                if name in COMPUTES_THE_OP and not relative_error(run(), want) < 2e-2:
                    raise AssertionError(f"{case.label()}: {name} computes a wrong result")
                runs[name] = graphed(run)
            rows.append(time_case(case, runs, full, w, config, args.rounds, reference,
                                  tiling=f"{config.block_m}x{config.block_n}x{config.block_k} s{config.num_stages}"))
            del runs
            torch.cuda.empty_cache()
    report("scale_loads", rows, ["fused", *names], "tiling", args.out)


if __name__ == "__main__":
    main()
