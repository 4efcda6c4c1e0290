"""The `ops` scenario: each public op, every backend, against NCCL-then-GEMM and the bare GEMM.

Shapes are given as the layer's global sizes MxNxK (M tokens, N output and K input features of
the whole layer); the op decides what each of the W ranks holds:
- all_gather_matmul (column-parallel): x_shard [M/W, K], weight [N/W, K] -> y [M, N/W];
  its bare GEMM is F.linear(x [M, K], weight [N/W, K]).
- matmul_reduce_scatter, matmul_all_reduce (row-parallel): x [M, K/W], weight [N, K/W];
  their bare GEMM is F.linear(x [M, K/W], weight [N, K/W]).
Before anything is timed, every backend's output is compared with the "nccl" reference on the
same inputs (the gathered input must be an exact copy); a disagreement stops the benchmark.
Timing follows fluxtp.bench.harness. With --cuda-graphs (GPU only; the decode setting, where
launch overhead is a real part of a call) every variant, the bare GEMM included, is captured
once per input copy into a CUDA graph after two warm-up calls, and a call is a graph replay.
"""

from __future__ import annotations

import argparse
import functools
import math
import textwrap
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from tabulate import tabulate

import fluxtp
from fluxtp import backends
from fluxtp._dist import GroupInfo, max_over_ranks
from fluxtp._terminal import terminal_width
from fluxtp.bench import BenchError
from fluxtp.bench.harness import CPU_PROTOCOL, GPU_PROTOCOL, Protocol, Variant, cache_bytes, input_copies
from fluxtp.bench.harness import format_speedup, graphed, measure_rounds, overlap_efficiency, speedup, speedup_iqr
from fluxtp.bench.progress import describe as describe_bar
from fluxtp.bench.progress import progress_bar
from fluxtp.ops import BACKENDS, OPS
from fluxtp.configs import WEIGHT_LAYOUTS
from fluxtp.fp8 import fp8_max, is_fp8, quantize_rows, scaled_linear

COLUMN_PARALLEL = "all_gather_matmul"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}
# The concrete backends, the baseline first; without --backends every one of them that can run
# a case is timed ("auto" is only an alias of one of them).
CANDIDATE_BACKENDS = ("nccl", "torch", "fused")
BASELINE = "nccl"

# Agreement with the nccl reference: max |out - ref| / max |ref| (a max-norm, so that one wrong
# tile among millions of right elements cannot hide in an average). Each output is its exact
# value rounded once or a few times (reduce-scatter sums rounded partials), a couple of unit
# roundoffs u of the largest element (measured: 1.6u between a bf16 ring sum and an fp32 sum
# for W = 2 and 8), so 8u; a zeroed or misplaced tile is off by O(1) of the largest element.
# float32 runs without TF32; cuBLAS's error is about sqrt(K) u (1e-5 at K = 28672): 1e-4.
VERIFY_TOLERANCE = {torch.bfloat16: 8 * 2**-8, torch.float16: 8 * 2**-11, torch.float32: 1e-4, torch.float64: 1e-10}

# --fp8: the scaled op of each op, float8_e4m3fn operands quantized from --dtype's random data
# (bfloat16), outputs and the gemm baseline (torch._scaled_mm) in bfloat16. Row-wise scales as
# fluxtp.nn's FP8 layers take them; per tensor, a power of two 8 standard deviations above the data.
SCALED_OPS = {"all_gather_matmul": "all_gather_scaled_matmul", "matmul_reduce_scatter": "scaled_matmul_reduce_scatter"}
FP8_SCALINGS = ("row-wise", "tensor")
FP8_DTYPE = torch.float8_e4m3fn
FP8_OUT_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Shape:
    """A layer's global sizes: M tokens, N output features, K input features."""

    M: int
    N: int
    K: int

    def __str__(self) -> str:
        return f"{self.M}x{self.N}x{self.K}"


@dataclass(frozen=True)
class Case:
    op: str
    shape: Shape


def _llama70b_shapes():
    # LLaMA-70B MLP at TP: up/gate is column-parallel (N = 28672 intermediate, K = 8192 hidden),
    # down is row-parallel (N = 8192, K = 28672). Prefill-size M; all-reduce is the decode op,
    # so it also gets decode-size M.
    prefill = (1024, 2048, 4096, 8192)
    return {
        "all_gather_matmul": tuple(Shape(m, 28672, 8192) for m in prefill),
        "matmul_reduce_scatter": tuple(Shape(m, 8192, 28672) for m in prefill),
        "matmul_all_reduce": tuple(Shape(m, 8192, 28672) for m in (1, 128) + prefill),
    }


DEFAULT_SHAPES = {
    "cuda": _llama70b_shapes(),
    # The CPU demo: small enough that a 2-process gloo world finishes in seconds.
    "cpu": {
        "all_gather_matmul": tuple(Shape(m, 512, 256) for m in (64, 128, 256)),
        "matmul_reduce_scatter": tuple(Shape(m, 256, 512) for m in (64, 128, 256)),
        "matmul_all_reduce": tuple(Shape(m, 256, 512) for m in (64, 128, 256)),
    },
}
DEFAULT_DTYPE = {"cuda": "bfloat16", "cpu": "float32"}


@dataclass(frozen=True)
class OpsConfig:
    cases: tuple[Case, ...]
    dtype: torch.dtype
    backends: tuple[str, ...] | None  # None: every candidate that can run a case; else the baseline first
    protocol: Protocol
    cuda_graphs: bool = False
    weight_layout: str = "linear"  # or "transposed": the weight as the backward passes it
    fp8: str | None = None  # None, or the scaled ops' scaling (FP8_SCALINGS)
    use_fast_accum: bool = False  # the scaled ops' and torch._scaled_mm's

    def op_name(self, op: str) -> str:
        """The op a case of `op` calls: itself, or with --fp8 its scaled op."""
        return op if self.fp8 is None else SCALED_OPS[op]


def add_arguments(group) -> None:
    group.add_argument("--op", default="all", choices=OPS + ("all",), help="which op to benchmark (default: all three)")
    group.add_argument(
        "--shapes",
        metavar="MxNxK,...",
        help="global layer sizes: M tokens, N output and K input features of the whole layer "
        "(default on GPUs: LLaMA-70B MLP dims, M 1024..8192, and M 1 and 128 too for matmul_all_reduce; "
        "on CPU: small demo shapes, M 64..256)",
    )
    group.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="time every variant as CUDA graph replays (GPU only; how decode steps run)",
    )
    group.add_argument(
        "--calls-per-sample",
        type=int,
        metavar="N",
        help="back-to-back calls between a sample's two timestamps, CUDA events on GPUs (default: "
        f"{GPU_PROTOCOL.calls_per_sample} on GPUs, {CPU_PROTOCOL.calls_per_sample} on CPU). The GPU is idle when a "
        "sample starts, so the first call's host time is part of it: more calls measure the steady state "
        "of a model whose host runs ahead of its GPU",
    )
    group.add_argument(
        "--weight-layout",
        choices=WEIGHT_LAYOUTS,
        default="linear",
        help="linear: the weight [N, K] row-major, as nn.Linear holds it (default); transposed: a view [N, K] "
        "with strides (1, N), the W^T of a [K, N] weight that fluxtp.nn's backward passes",
    )
    group.add_argument(
        "--fp8",
        choices=FP8_SCALINGS,
        help="time the scaled (FP8) all-gather and reduce-scatter ops instead: float8_e4m3fn operands with "
        "row-wise or per-tensor scales, bfloat16 outputs, torch._scaled_mm as the gemm; train: row-wise, the "
        "layers' GEMMs in FP8 (fluxtp.nn's recipe)",
    )
    group.add_argument(
        "--fast-accum",
        action="store_true",
        help="with --fp8: use_fast_accum in the scaled ops and torch._scaled_mm (fluxtp.nn's FP8 forward)",
    )


def parse_shapes(text: str) -> tuple[Shape, ...]:
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(
                f"--shapes: {item.strip()!r} is not MxNxK with three positive integers (e.g. 4096x28672x8192)"
            )
        shapes.append(Shape(*map(int, parts)))
    return tuple(shapes)


def parse_backends(text: str | None) -> tuple[str, ...] | None:
    """The requested backends, the nccl baseline first (added when missing: every ratio needs it)."""
    if text is None:
        return None
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        if name not in BACKENDS:
            raise ValueError(f"--backends: unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
    if not names:
        raise ValueError("--backends is empty")
    ordered = [BASELINE] + [n for n in names if n != BASELINE]
    return tuple(dict.fromkeys(ordered))


def shard_shapes(op: str, shape: Shape, world: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(x, weight) shapes held by each of `world` ranks; ValueError when the sizes do not divide."""
    M, N, K = shape.M, shape.N, shape.K
    if op == COLUMN_PARALLEL:
        for name, size in (("M", M), ("N", N)):
            if size % world:
                raise ValueError(f"{op} {shape}: {name}={size} must be divisible by the world size {world}")
        return (M // world, K), (N // world, K)
    if K % world:
        raise ValueError(f"{op} {shape}: K={K} must be divisible by the world size {world}")
    if op == "matmul_reduce_scatter" and M % world:
        raise ValueError(f"{op} {shape}: M={M} must be divisible by the world size {world}")
    return (M, K // world), (N, K // world)


def gemm_shapes(op: str, shape: Shape, world: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(x, weight) of the non-split GEMM of one rank's total work (the `gemm` variant): all M rows
    against this rank's weight, i.e. [M, K] x [N/W, K] column-parallel, [M, K/W] x [N, K/W] row-parallel."""
    (_, k), (n, _) = shard_shapes(op, shape, world)
    return (shape.M, k), (n, k)


def make_config(args: argparse.Namespace, world: int, device_type: str) -> OpsConfig:
    ops = OPS if args.op == "all" else (args.op,)
    if args.shapes:
        shapes = parse_shapes(args.shapes)
        cases = tuple(Case(op, s) for op in ops for s in shapes)
    else:
        cases = tuple(Case(op, s) for op in ops for s in DEFAULT_SHAPES[device_type][op])
    for case in cases:
        shard_shapes(case.op, case.shape, world)
    dtype_name = args.dtype or DEFAULT_DTYPE[device_type]
    if dtype_name not in DTYPES:
        raise ValueError(f"--dtype: {dtype_name!r} is not one of {', '.join(DTYPES)}")
    protocol = GPU_PROTOCOL if device_type == "cuda" else CPU_PROTOCOL
    calls = getattr(args, "calls_per_sample", None)
    if calls is not None and calls < 1:
        raise ValueError(f"--calls-per-sample must be at least 1, got {calls}")
    protocol = replace(
        protocol,
        rounds=protocol.rounds if args.rounds is None else args.rounds,
        calls_per_sample=protocol.calls_per_sample if calls is None else calls,
    )
    cuda_graphs = bool(getattr(args, "cuda_graphs", False))
    if cuda_graphs and device_type != "cuda":
        raise ValueError("--cuda-graphs needs CUDA GPUs")
    weight_layout = getattr(args, "weight_layout", "linear") or "linear"
    if weight_layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"--weight-layout: {weight_layout!r} is not one of {', '.join(WEIGHT_LAYOUTS)}")
    fp8, fast_accum = getattr(args, "fp8", None), bool(getattr(args, "fast_accum", False))
    if fast_accum and fp8 is None:
        raise ValueError("--fast-accum needs --fp8 (it is the scaled ops' use_fast_accum)")
    if fp8 is not None:
        unscaled = sorted({c.op for c in cases} - set(SCALED_OPS))
        if args.op != "all" and unscaled:
            raise ValueError(f"--fp8: {unscaled[0]} has no scaled op; choose {' or '.join(SCALED_OPS)}")
        cases = tuple(c for c in cases if c.op in SCALED_OPS)
        if args.dtype not in (None, "bfloat16") or weight_layout != "linear":
            raise ValueError("--fp8 quantizes bfloat16 data with the weight in its linear layout: "
                             "leave --dtype and --weight-layout at their defaults")  # fmt: skip
        dtype_name = "bfloat16"
    return OpsConfig(cases, DTYPES[dtype_name], parse_backends(args.backends), protocol, cuda_graphs, weight_layout,
                     fp8, fast_accum)  # fmt: skip


def _random(shape, dtype, device, generator, scale=1.0) -> torch.Tensor:
    return torch.randn(shape, dtype=dtype, device=device, generator=generator).mul_(scale)


def random_weight(shape, dtype, device, generator, scale, layout: str) -> torch.Tensor:
    """A weight [N, K]: row-major, or ("transposed") the transposed view of a row-major [K, N]."""
    if layout == "transposed":
        return _random(shape[::-1], dtype, device, generator, scale).t()
    return _random(shape, dtype, device, generator, scale)


def select_backends(
    requested: tuple[str, ...] | None, probes, info: GroupInfo, what: str, **details
) -> tuple[list[str], dict[str, str]]:
    """Backends to time (baseline first) and why the others were left out.

    probes: (op, x, weight) calls a backend must be able to run to be timed (a scaled op's
    `details`: row_wise, out_dtype, use_fast_accum). Without a request
    (requested None) every candidate that can run them is taken; a requested one that cannot
    stops the benchmark with a BenchError naming `what` (what the probes stand for)."""
    chosen, skipped = [], {}
    for name in requested or CANDIDATE_BACKENDS:
        reason = None
        if name != "auto":
            for op, x, weight in probes:
                reason = reason or backends.unsupported_reason(op, name, x, weight, info, **details)
        if reason is None:
            chosen.append(name)
        elif requested is not None:
            raise BenchError(f"backend {name!r} cannot run {what} here: {reason}")
        else:
            skipped[name] = reason
    return chosen, skipped


def _per_tensor_fp8(t: torch.Tensor, std: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(t in FP8_DTYPE, its one scale): the power of two that puts 8 standard deviations at the
    format's largest value (the same on every rank, as a per-tensor scale must be)."""
    limit = fp8_max(FP8_DTYPE)
    scale = 2.0 ** math.ceil(math.log2(8 * std / limit))
    t8 = (t.float() / scale).clamp(-limit, limit).to(FP8_DTYPE)
    return t8, torch.tensor(scale, dtype=torch.float32, device=t.device)


def operands(config: OpsConfig, x_shape, w_shape, device, generator) -> tuple[torch.Tensor, ...]:
    """One call's tensors: (x, weight) of fresh random data, or with --fp8 (x, weight, scale_x,
    scale_w) quantized from it (scale_w row-wise as [1, n])."""
    w_std = w_shape[1] ** -0.5  # keeps outputs O(1), like a trained layer's
    x = _random(x_shape, config.dtype, device, generator)
    weight = random_weight(w_shape, config.dtype, device, generator, w_std, config.weight_layout)
    if config.fp8 is None:
        return x, weight
    if config.fp8 == "tensor":
        (x8, scale_x), (w8, scale_w) = _per_tensor_fp8(x, 1.0), _per_tensor_fp8(weight, w_std)
        return x8, w8, scale_x, scale_w
    (x8, scale_x), (w8, scale_w) = quantize_rows(x, FP8_DTYPE), quantize_rows(weight, FP8_DTYPE)
    return x8, w8, scale_x, scale_w.reshape(1, -1)


def op_call(config: OpsConfig, op: str, args, backend: str, info: GroupInfo, **options):
    """A zero-argument call of the case's op (config.op_name) on `args` (operands()) through
    `backend`, bound now (a timed call runs nothing else)."""
    fn = getattr(fluxtp, config.op_name(op))
    if config.fp8 is not None:
        options = {"out_dtype": FP8_OUT_DTYPE, "use_fast_accum": config.use_fast_accum, **options}
    return functools.partial(fn, *args, group=info.group, backend=backend, **options)


def gemm_call(config: OpsConfig, args):
    """A zero-argument call of the local GEMM on `args` (operands()): F.linear, or with --fp8
    torch._scaled_mm into bfloat16 (fluxtp.fp8.scaled_linear)."""
    if config.fp8 is None:
        return functools.partial(F.linear, *args)
    return functools.partial(scaled_linear, *args, None, FP8_OUT_DTYPE, config.use_fast_accum)


def _call(config: OpsConfig, op: str, args, backend: str, info: GroupInfo):
    """(output, gathered input (a tuple of tensors) or None) of one op call."""
    if op == COLUMN_PARALLEL:
        out, *gathered = op_call(config, op, args, backend, info, return_gathered=True)()
        return out, tuple(gathered)
    return op_call(config, op, args, backend, info)(), None


def _exactly_equal(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    """Bitwise equality of two tuples of tensors (FP8 ones compared as bytes)."""
    def bits(t):
        return t.view(torch.uint8) if is_fp8(t.dtype) else t

    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(bits(x), bits(y)) for x, y in zip(a, b))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| in float32; inf when out has NaN or Inf (NaN never passes)."""
    out32, ref32 = out.float(), ref.float()
    if not torch.isfinite(out32).all():
        return math.inf
    return ((out32 - ref32).abs().max() / ref32.abs().max().clamp_min(1e-30)).item()


def verify(case: Case, names: list[str], args, info: GroupInfo, config: OpsConfig | None = None) -> None:
    """Every backend in `names` against the nccl reference on `args` (operands()); BenchError on
    every rank if any differs."""
    config = config or OpsConfig((), args[0].dtype, None, GPU_PROTOCOL)
    ref, ref_gathered = _call(config, case.op, args, BASELINE, info)
    tolerance = VERIFY_TOLERANCE[ref.dtype]
    for name in names:
        out, gathered = (ref, ref_gathered) if name == BASELINE else _call(config, case.op, args, name, info)
        shape_differs = tuple(out.shape) != tuple(ref.shape) or out.dtype != ref.dtype
        error = math.inf if shape_differs else relative_error(out, ref)  # the baseline: 0, or inf on NaN
        gathered_differs = gathered is not None and not _exactly_equal(gathered, ref_gathered)
        error, gathered_differs, shape_differs = max_over_ranks(
            [error, float(gathered_differs), float(shape_differs)], info, out.device
        )
        dtype = "float8_e4m3fn" if config.fp8 else str(config.dtype).removeprefix("torch.")
        where = f"{config.op_name(case.op)} {case.shape} {dtype}"
        if shape_differs:
            raise BenchError(
                f"verification failed: backend {name!r} on {where} returned shape {tuple(out.shape)} {out.dtype}, "
                f"the nccl reference {tuple(ref.shape)} {ref.dtype}; nothing was timed"
            )
        if gathered_differs:
            raise BenchError(
                f"verification failed: backend {name!r} on {where}: the gathered input is not an exact copy of "
                "the nccl reference's on some rank; nothing was timed"
            )
        if not error <= tolerance:
            what = "NaN or Inf in the output" if math.isinf(error) else f"max-norm relative error {error:.3g}"
            raise BenchError(
                f"verification failed: backend {name!r} on {where}: {what} against the nccl reference "
                f"(worst rank), allowed {tolerance:.3g}; nothing was timed"
            )


def _gemm_only(backend: str):
    """The backend's `gemm_only(op, x, weight, bias, info) -> callable` (its fused kernel with the
    communication switched off), or None when it has none."""
    try:
        module = backends._module(backend)
    except (ImportError, KeyError):
        return None
    fn = getattr(module, "gemm_only", None)
    return fn if callable(fn) else None


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _run_case(case: Case, config: OpsConfig, info: GroupInfo, device, generator, on_round):
    world = info.world_size
    x_shape, w_shape = shard_shapes(case.op, case.shape, world)
    gx_shape, gw_shape = gemm_shapes(case.op, case.shape, world)
    itemsize = 1 if config.fp8 else torch.empty((), dtype=config.dtype).element_size()
    copies = input_copies((math.prod(x_shape) + math.prod(w_shape)) * itemsize, cache_bytes(device))
    inputs = [operands(config, x_shape, w_shape, device, generator) for _ in range(copies)]
    gemm_inputs = [operands(config, gx_shape, gw_shape, device, generator) for _ in range(copies)]
    op = config.op_name(case.op)
    details = {}
    if config.fp8:
        details = {"row_wise": config.fp8 == "row-wise", "out_dtype": FP8_OUT_DTYPE, "use_fast_accum": config.use_fast_accum}
    x0, w0 = inputs[0][:2]
    names, skipped = select_backends(config.backends, [(op, x0, w0)], info, f"{op} with {x0.dtype} on {x0.device}",
                                     **details)  # fmt: skip
    verify(case, names, inputs[0], info, config)

    variants = [Variant("gemm", tuple(gemm_call(config, args) for args in gemm_inputs))]
    for name in names:
        variants.append(Variant(name, tuple(op_call(config, case.op, args, name, info) for args in inputs)))
    for name in names:
        gemm_only = _gemm_only(name)
        if gemm_only is None:
            continue
        try:
            if config.fp8:
                calls = tuple(gemm_only(op, *args[:2], None, info, scales=args[2:], out_dtype=FP8_OUT_DTYPE,
                                        use_fast_accum=config.use_fast_accum) for args in inputs)  # fmt: skip
            else:
                calls = tuple(gemm_only(op, *args, None, info) for args in inputs)
        except (ValueError, NotImplementedError):
            continue  # no GEMM-only mode for this op (the same answer on every rank)
        variants.append(Variant(f"{name}_gemm_only", calls))
    if config.cuda_graphs:
        variants = [Variant(v.name, tuple(graphed(call) for call in v.calls)) for v in variants]
    timings = measure_rounds(variants, config.protocol, info, device, on_round)
    ms = timings.ms

    t_gemm, t_nccl = ms["gemm"], ms[BASELINE]
    row = {
        "op": case.op,
        "M": case.shape.M,
        "N": case.shape.N,
        "K": case.shape.K,
        "dtype": "float8_e4m3fn" if config.fp8 else str(config.dtype).removeprefix("torch."),
        **({"scaled_op": op, "fp8_scaling": config.fp8, "use_fast_accum": config.use_fast_accum} if config.fp8 else {}),
        "cuda_graphs": config.cuda_graphs,
        "weight_layout": config.weight_layout,
        "calls_per_sample": config.protocol.calls_per_sample,
        "ms": {k: round(v, 5) for k, v in ms.items()},
        "E_overlap": {n: _round(overlap_efficiency(ms[n], t_gemm, t_nccl), 4) for n in names},
        "speedup_vs_nccl": {n: _round(speedup(t_nccl, ms[n]), 4) for n in names},
        "speedup_vs_nccl_iqr": speedup_iqr(timings, BASELINE, names),
        # For the table only (a leading underscore: not written to the results file): the spread
        # of the ceiling T_nccl / T_gemm, the speedup with every collective hidden.
        "_ceiling_iqr": speedup_iqr(timings, BASELINE, ["gemm"]).get("gemm"),
    }
    return row, skipped


def run(config: OpsConfig, info: GroupInfo, device: torch.device, show_progress: bool):
    """Verify, then time every case; collective over the ranks of `info`. Returns (rows, notes)."""
    generator = torch.Generator(device=device).manual_seed(20261122 + info.rank)
    rows, notes = [], {}
    bar = progress_bar(len(config.cases) * config.protocol.rounds, "round", show_progress)
    try:
        for i, case in enumerate(config.cases, 1):
            describe_bar(bar, f"{i}/{len(config.cases)} {case.op} {case.shape}")
            row, skipped = _run_case(case, config, info, device, generator, lambda: bar.update(1))
            rows.append(row)
            for name, reason in skipped.items():
                notes.setdefault(f"backend {name!r} not timed: {reason}", None)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the next case's copies may be larger
    finally:
        bar.close()
    return rows, list(notes)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4g}"


REFERENCE = "the collective, then the matmul"
LEGEND = (
    f"nccl is the reference: {REFERENCE}. ceiling = nccl ms / gemm ms, the speedup if every collective were "
    "hidden behind the matmul. speedup = nccl ms / the backend's ms (above 1: faster than the reference). "
    "(p25-p75) = the middle half of the per-round speedups (docs/benchmarks.md)."
)


def describe(config: OpsConfig, world: int, device_type: str, width: int | None = None) -> str:
    """What the run will do, in two sentences wrapped to `width` (default: the terminal's); the
    CLI prints it before it starts."""
    ops = list(dict.fromkeys(config.op_name(c.op) for c in config.cases))
    what = "the 3 ops" if len(ops) == len(OPS) else ", ".join(ops)
    dtype = f"float8_e4m3fn ({config.fp8} scales)" if config.fp8 else str(config.dtype).removeprefix("torch.")
    p = config.protocol
    timing = f"{p.rounds} rounds of {p.calls_per_sample} calls" + (" (CUDA graph replays)" if config.cuda_graphs else "")
    if device_type == "cuda":
        first = f"fluxtp bench ops: {len(config.cases)} {dtype} cases of {what} on {world} GPUs, one process each."
    else:
        first = (
            f"fluxtp bench ops: no CUDA GPU here, so a demo on a {world}-process gloo group: "
            f"{len(config.cases)} small {dtype} cases of {what}."
        )
    others = None if config.backends is None else [b for b in config.backends if b != BASELINE]
    if config.backends is None and device_type != "cuda":
        second = f"Only the reference ({REFERENCE}) runs on CPU: each case times it beside the matmul alone"
    elif others == []:
        second = f"Each case times the reference ({REFERENCE}) beside the matmul alone"
    else:
        chosen = "every backend usable here" if others is None else ", ".join(others)
        second = (
            f"Each case checks {chosen} against the reference ({REFERENCE}), then times them beside the "
            "reference and the matmul alone"
        )
    second += f", over {timing}."
    width = width or terminal_width()
    return "\n".join(textwrap.fill(sentence, width) for sentence in (first, second))


def format_table(rows: list[dict], width: int | None = None) -> str:
    """The legend, then one table per op: time per call of every variant, the ceiling, then the
    speedup (with its spread) and E_overlap of each backend. `width`: the legend's, default the
    terminal's."""
    parts = [textwrap.fill(LEGEND, width or terminal_width())]
    for op in dict.fromkeys(r["op"] for r in rows):
        op_rows = [r for r in rows if r["op"] == op]
        variants = list(dict.fromkeys(k for r in op_rows for k in r["ms"]))
        compared = [b for b in dict.fromkeys(k for r in op_rows for k in r["E_overlap"]) if b != BASELINE]
        headers = ["M", "N", "K"] + [f"{v} ms" for v in variants] + ["ceiling (p25-p75)"]
        headers += [f"speedup {b} (p25-p75)" for b in compared] + [f"E_overlap {b}" for b in compared]
        body = []
        for r in op_rows:
            line = [r["M"], r["N"], r["K"]] + [_fmt(r["ms"].get(v)) for v in variants]
            line.append(format_speedup(speedup(r["ms"][BASELINE], r["ms"]["gemm"]), r.get("_ceiling_iqr")))
            line += [format_speedup(r["speedup_vs_nccl"].get(b), r["speedup_vs_nccl_iqr"].get(b)) for b in compared]
            line += [_fmt(r["E_overlap"].get(b)) for b in compared]
            body.append(line)
        first, scaling = op_rows[0], ""
        if "scaled_op" in first:
            scaling = f", {first['fp8_scaling']} scales" + (", fast accumulation" if first["use_fast_accum"] else "")
        title = f"{first.get('scaled_op', op)} ({first['dtype']}{scaling}; M, N, K are the layer's global sizes)"
        parts.append(title + "\n" + tabulate(body, headers=headers, disable_numparse=True, stralign="right"))
    return "\n\n".join(parts)


def plot(rows: list[dict], path: str, title: str) -> None:
    from fluxtp.bench.plot import plot_ops

    plot_ops(rows, path, title)
