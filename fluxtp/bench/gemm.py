"""`fluxtp bench gemm`: the fused ops' GEMMs against cuBLAS on one GPU.

A fused op wins only where its kernel runs its GEMM at cuBLAS's speed. Per layer shape and TP
degree this times the GEMM one rank runs in a call two ways, interleaved as CUDA graph replays by
the harness (fluxtp/bench/harness.py): the fused op's GEMM-only mode (the kernel and config the op
launches as rank 0, its communication switched off: every peer's rows or partials already there)
and cuBLAS's GEMM of the same per-rank operands, what NCCL-then-GEMM runs after the collective
(F.linear; torch._scaled_mm with --fp8). fused/cuBLAS is time over time: below 1 the fused kernel
is faster. Every fused output is checked against cuBLAS's first.

It needs one NVIDIA GPU and no peers: `fluxtp bench` runs it on a host with one GPU, where the
ops need two or more. benchmarks/gemm_efficiency.py is the engineers' version of the same
measurement (the plain Triton twin, knob A/Bs, the GEMM-parity targets' report).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import textwrap
from dataclasses import dataclass, replace

import torch
from tabulate import tabulate

from fluxtp._dist import GroupInfo
from fluxtp._terminal import terminal_width
from fluxtp.bench.gemm_grid import DTYPE_NAMES, FP8_DTYPE_NAMES, GRIDS, TP_DEGREES, GemmCase, case_runs, grid
from fluxtp.bench.harness import GPU_PROTOCOL, Protocol, Variant, graphed, measure_rounds
from fluxtp.bench.ops import DEFAULT_SHAPES, parse_shapes
from fluxtp.bench.progress import describe as describe_bar
from fluxtp.bench.progress import progress_bar

GEMM_OPS = ("all_gather_matmul", "matmul_reduce_scatter")  # the ops with a GEMM-only mode
LEGEND = (
    "Per layer (M, N, K: its global sizes) and TP degree, the GEMM one rank runs in a call: the fused op's "
    "kernel with its communication switched off, and cuBLAS on the same per-rank operands. fused/cuBLAS = "
    "time over time (below 1: the fused kernel is faster); (p25-p75) = the middle half of the per-round ratios."
)


@dataclass(frozen=True)
class GemmConfig:
    cases: tuple[GemmCase, ...]
    protocol: Protocol


def add_arguments(group) -> None:
    group.add_argument(
        "--tp",
        metavar="W,...",
        help="gemm: the TP degrees whose per-rank GEMMs are timed (default: 2,4,8); the layers are --shapes "
        "(default: LLaMA-70B MLP dims, M 1024..8192) of --op (default: both ops that fuse a GEMM)",
    )
    group.add_argument(
        "--grid",
        choices=tuple(GRIDS),
        help="gemm: a named grid of cases instead of --shapes and --tp (fluxtp/bench/gemm_grid.py; full: "
        "both ops, TP 2/4/8, four models, 1024-16384 tokens, bf16 and fp16)",
    )


def _tp_degrees(text: str | None) -> tuple[int, ...]:
    if text is None:
        return TP_DEGREES
    degrees = []
    for item in text.split(","):
        if not item.strip().isdigit() or int(item) < 1:
            raise ValueError(f"--tp: {item.strip()!r} is not a positive integer (e.g. --tp 2,4,8)")
        degrees.append(int(item))
    return tuple(dict.fromkeys(degrees))


def make_config(args: argparse.Namespace, world: int, device_type: str) -> GemmConfig:
    if device_type != "cuda":
        raise ValueError("fluxtp bench gemm times the fused kernels on an NVIDIA GPU; this host has none")
    if world != 1:
        raise ValueError(
            f"fluxtp bench gemm runs on one GPU, in one process: got {world} (leave out --nproc and torchrun)"
        )
    if getattr(args, "backends", None):
        raise ValueError("--backends: fluxtp bench gemm times the fused kernel and cuBLAS, no backends")
    fp8, fast_accum = getattr(args, "fp8", None), bool(getattr(args, "fast_accum", False))
    dtype_name, shapes = getattr(args, "dtype", None), getattr(args, "shapes", None)
    layout, tp = getattr(args, "weight_layout", None) or "linear", getattr(args, "tp", None)
    op = getattr(args, "op", None) or "all"
    if op not in (*GEMM_OPS, "all"):
        raise ValueError(f"--op {op}: fluxtp bench gemm times {' and '.join(GEMM_OPS)}")
    ops = GEMM_OPS if op == "all" else (op,)
    grid_name = getattr(args, "grid", None)
    if grid_name is not None:
        if shapes or tp or dtype_name or fp8 or layout != "linear":
            raise ValueError(f"--grid {grid_name} names its own shapes, TP degrees, dtypes and layouts: "
                             "leave out --shapes, --tp, --dtype, --fp8 and --weight-layout")  # fmt: skip
        cases = [c for c in grid(grid_name) if c.op in ops]
        if fast_accum:
            if not any(c.fp8 for c in cases):
                raise ValueError(f"--fast-accum: --grid {grid_name} has no FP8 case")
            cases = [replace(c, fast_accum=True) if c.fp8 else c for c in cases]
    else:
        if fp8 not in (None, "row-wise"):
            raise ValueError(f"--fp8 {fp8}: fluxtp bench gemm times row-wise scaling (--fp8 row-wise)")
        if fast_accum and fp8 is None:
            raise ValueError("--fast-accum needs --fp8 (it is the scaled ops' use_fast_accum)")
        if fp8 is not None and dtype_name not in (None, "bfloat16"):
            raise ValueError("--fp8 quantizes bfloat16 data: leave --dtype at its default")
        dtype = next(iter(FP8_DTYPE_NAMES)) if fp8 else (dtype_name or "bfloat16")
        if dtype not in (*DTYPE_NAMES, *FP8_DTYPE_NAMES):
            raise ValueError(f"--dtype: the fused kernels take {' or '.join(DTYPE_NAMES)} (or --fp8), not {dtype}")
        degrees = _tp_degrees(tp)
        layer_shapes = {o: parse_shapes(shapes) if shapes else DEFAULT_SHAPES["cuda"][o] for o in ops}
        # GemmCase checks that the sizes divide by the TP degree (ValueError naming the case).
        cases = [GemmCase(o, s.M, s.N, s.K, w, dtype, layout, fast_accum=fast_accum)
                 for o in ops for w in degrees for s in layer_shapes[o]]  # fmt: skip
    if not cases:
        raise ValueError(f"--grid {grid_name} has no case of {' or '.join(ops)}")
    rounds = getattr(args, "rounds", None)
    protocol = replace(GPU_PROTOCOL, rounds=GPU_PROTOCOL.rounds if rounds is None else rounds)
    calls = getattr(args, "calls_per_sample", None)
    if calls is not None:
        if calls < 1:
            raise ValueError(f"--calls-per-sample must be at least 1, got {calls}")
        protocol = replace(protocol, calls_per_sample=calls)
    return GemmConfig(tuple(cases), protocol)


def kernel_name(config) -> str:
    """Which of the fused kernels a config launches (fluxtp/kernels)."""
    return "warp-specialized" if getattr(config, "warp_specialized", False) else "Triton"


def run(config: GemmConfig, info: GroupInfo, device: torch.device, show_progress: bool):
    """Check, then time every case on this GPU. Returns (rows, notes)."""
    rows = []
    bar = progress_bar(len(config.cases) * config.protocol.rounds, "round", show_progress)
    try:
        for i, case in enumerate(config.cases, 1):
            describe_bar(bar, f"{i}/{len(config.cases)} {case.label()}")
            prepared = case_runs(case, device)
            variants = [Variant(name, (graphed(launch),)) for name, launch in prepared.runs.items()]
            timings = measure_rounds(variants, config.protocol, info, device, lambda: bar.update(1))
            low, _, high = timings.ratio_quartiles("fused", "cublas")
            ms = {name: round(t, 4) for name, t in timings.ms.items()}
            rows.append({
                **dataclasses.asdict(case),
                "ms": ms,
                "tflops": {name: round(case.flops / t / 1e9, 1) for name, t in ms.items()},
                "fused_vs_cublas": round(ms["fused"] / ms["cublas"], 4),
                "fused_vs_cublas_iqr": [round(low, 4), round(high, 4)],
                "kernel": kernel_name(prepared.config),
                "config": dataclasses.asdict(prepared.config),
            })  # fmt: skip
            del variants, prepared
            torch.cuda.empty_cache()  # the next case's operands may be larger
    finally:
        bar.close()
    return rows, [format_summary(rows)]


def describe(config: GemmConfig, world: int, device_type: str, width: int | None = None) -> str:
    """What the run will do, printed before it starts."""
    dtypes = ", ".join(dict.fromkeys(c.dtype + (" (fast accumulation)" if c.fast_accum else "") for c in config.cases))
    p = config.protocol
    text = (
        f"fluxtp bench gemm: {len(config.cases)} {dtypes} per-rank GEMMs on one GPU (GPU 0): each fused op's "
        f"kernel with its communication switched off against cuBLAS, checked, then timed over {p.rounds} rounds "
        f"of {p.calls_per_sample} CUDA graph replays."
    )
    return textwrap.fill(text, width or terminal_width())


def format_table(rows: list[dict], width: int | None = None) -> str:
    body = [
        [r["op"], r["M"], r["N"], r["K"], r["world"], r["dtype"] + (" fast" if r.get("fast_accum") else ""),
         f'{r["ms"]["cublas"]:.4g}', f'{r["ms"]["fused"]:.4g}', f'{r["tflops"]["fused"]:.0f}',
         f'{r["fused_vs_cublas"]:.3f} ({r["fused_vs_cublas_iqr"][0]:.3f}-{r["fused_vs_cublas_iqr"][1]:.3f})',
         r["kernel"]]
        for r in rows
    ]  # fmt: skip
    headers = ["op", "M", "N", "K", "TP", "dtype", "cuBLAS ms", "fused ms", "fused TFLOP/s",
               "fused/cuBLAS (p25-p75)", "fused kernel"]  # fmt: skip
    table = tabulate(body, headers=headers, disable_numparse=True, stralign="right")
    return textwrap.fill(LEGEND, width or terminal_width()) + "\n\n" + table


def format_summary(rows: list[dict]) -> str:
    """fused/cuBLAS per op, dtype and TP degree: geometric mean and worst case."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        dtype = r["dtype"] + (" fast" if r.get("fast_accum") else "")
        groups.setdefault((r["op"], dtype, r["world"]), []).append(r["fused_vs_cublas"])
    body = [[op, dtype, world, len(v), f"{statistics.geometric_mean(v):.3f}", f"{max(v):.3f}"]
            for (op, dtype, world), v in groups.items()]  # fmt: skip
    headers = ["op", "dtype", "TP", "cases", "fused/cuBLAS geomean", "worst"]
    return "\n" + tabulate(body, headers=headers, disable_numparse=True)


def plot(rows: list[dict], path: str, title: str) -> None:
    from fluxtp.bench.plot import plot_gemm

    plot_gemm(rows, path, title)
