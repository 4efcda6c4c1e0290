"""The per-rank GEMMs of the fused ops at the shapes tensor-parallel users run, as named grids.

A case is one layer (global MxNxK, the sizes `fluxtp bench --shapes` takes) at one TP degree:
- all_gather_matmul (column-parallel, MLP up/gate): N = ffn, K = hidden; each rank computes
  [M, K] x [N/W, K]^T from the gathered rows;
- matmul_reduce_scatter (row-parallel, MLP down): N = hidden, K = ffn; each rank computes
  [M, K/W] x [N, K/W]^T, keeps its M/W rows of the sum.
weight_layout "transposed" is the backward's W^T view (the same dims: the down projection's
input gradient is an all-gather GEMM over the down weight's transpose, and the reverse).
M is any multiple of W (the rows must split evenly over the ranks), tile multiple or not.
dtype float8_e4m3fn is a case of the scaled ops (all_gather_scaled_matmul, ...): the same per-rank
GEMM on FP8 operands with row-wise scales (fp8_case_inputs), bf16 out, the weight row-major.

`gemm_only_case` builds what one GPU can time of a case: the fused kernel exactly as rank 0 of
a W-rank call launches it, with its communication switched off (the backends' gemm_only).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from fluxtp._dist import GroupInfo
from fluxtp.bench.ops import Shape, random_weight, shard_shapes

OP_NAMES = {"ag": "all_gather_matmul", "rs": "matmul_reduce_scatter"}
# (hidden, ffn) of the models' MLPs: the widest GEMMs of a transformer layer.
MODELS = {
    "llama3-8b": (4096, 14336),
    "llama3-70b": (8192, 28672),
    "llama3-405b": (16384, 53248),
    "gpt3-175b": (12288, 49152),
}
TP_DEGREES = (2, 4, 8)
TOKENS = (1024, 2048, 4096, 8192, 16384)
DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
FP8_DTYPE_NAMES = {"float8_e4m3fn": torch.float8_e4m3fn}  # not in DTYPE_NAMES: the bf16/fp16 grids stay as they are


@dataclass(frozen=True)
class GemmCase:
    op: str  # all_gather_matmul or matmul_reduce_scatter
    M: int  # the layer's global sizes
    N: int
    K: int
    world: int
    dtype: str = "bfloat16"
    weight_layout: str = "linear"
    model: str = ""
    fast_accum: bool = False  # an FP8 case's accumulation (use_fast_accum); precise by default

    def __post_init__(self):
        if self.op not in OP_NAMES.values():
            raise ValueError(f"op must be one of {', '.join(OP_NAMES.values())}, got {self.op!r}")
        if self.dtype not in DTYPE_NAMES and self.dtype not in FP8_DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join([*DTYPE_NAMES, *FP8_DTYPE_NAMES])}, got {self.dtype!r}")
        if self.fast_accum and not self.fp8:
            raise ValueError(f"{self}: fast accumulation is an FP8 case's choice")
        if self.fp8 and self.weight_layout != "linear":
            raise ValueError(f"{self}: FP8 weights are row-major [n, k] (FP8 tensor cores read both operands K-major)")
        if self.weight_layout not in ("linear", "transposed"):
            raise ValueError(f"weight_layout must be linear or transposed, got {self.weight_layout!r}")
        if self.M % self.world:
            raise ValueError(f"{self}: M={self.M} must be divisible by the TP degree {self.world}")
        self.shard_shapes  # noqa: B018 - the other sizes must divide too (ValueError)

    @property
    def fp8(self) -> bool:
        return self.dtype in FP8_DTYPE_NAMES

    @property
    def shard_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(x, weight) as one rank holds them (fluxtp.bench.ops.shard_shapes)."""
        return shard_shapes(self.op, Shape(self.M, self.N, self.K), self.world)

    @property
    def gemm_shape(self) -> tuple[int, int, int]:
        """(m, n, k) of one rank's whole GEMM: what cuBLAS computes after the collective."""
        (_, k), (n, _) = self.shard_shapes
        return self.M, n, k

    @property
    def flops(self) -> int:
        m, n, k = self.gemm_shape
        return 2 * m * n * k

    def label(self) -> str:
        short = {v: k for k, v in OP_NAMES.items()}[self.op]
        layout = " T" if self.weight_layout == "transposed" else ""
        fast = " fast" if self.fast_accum else ""
        return f"{short} {self.M}x{self.N}x{self.K} TP{self.world} {self.dtype}{layout}{fast}"


def model_cases(model: str, tokens=TOKENS, worlds=TP_DEGREES, dtypes=("bfloat16",), layouts=("linear",)):
    """Both ops of `model`'s MLP at every (tokens, TP degree, dtype, layout)."""
    hidden, ffn = MODELS[model]
    dims = {"all_gather_matmul": (ffn, hidden), "matmul_reduce_scatter": (hidden, ffn)}
    return [
        GemmCase(op, m, *dims[op], world, dtype, layout, model)
        for dtype, layout, op, world, m in itertools.product(dtypes, layouts, dims, worlds, tokens)
    ]


def _full() -> list[GemmCase]:
    cases = [c for model in MODELS for c in model_cases(model, dtypes=tuple(DTYPE_NAMES))]
    return cases + model_cases("llama3-70b", layouts=("transposed",))


GRIDS = {
    # Both ops, TP 2/4/8, the four models, 1024-16384 tokens, bf16 and fp16, and the backward's
    # transposed weights at llama3-70b (bf16): what the shipped GEMM tables cover.
    "full": _full,
    "bf16": lambda: [c for c in _full() if c.dtype == "bfloat16"],
    "fp16": lambda: [c for c in _full() if c.dtype == "float16"],
    # The all-gathers of "full" (the ones the warp-specialized kernel can serve).
    "all-gather": lambda: [c for c in _full() if c.op == "all_gather_matmul"],
    "llama3-70b": lambda: model_cases("llama3-70b", layouts=("linear", "transposed")),
    # The FP8 ops (row-wise scales, the layers' recipe): the "full" grid's shapes, linear weights.
    "fp8": lambda: [c for model in MODELS for c in model_cases(model, dtypes=tuple(FP8_DTYPE_NAMES))],
    # Its all-gathers: what the shipped FP8 tables cover (`fluxtp tune --one-gpu [--fast-accum]`).
    "fp8-all-gather": lambda: [c for c in grid("fp8") if c.op == "all_gather_matmul"],
    "fp8-reduce-scatter": lambda: [c for c in grid("fp8") if c.op == "matmul_reduce_scatter"],
    "fp8-smoke": lambda: model_cases("llama3-8b", tokens=(1024, 3000), worlds=(2, 8), dtypes=tuple(FP8_DTYPE_NAMES)),
    # A quick look (a few seconds of GPU time): one model, the smallest and a middle M, ragged M too.
    "smoke": lambda: model_cases("llama3-8b", tokens=(1024, 3000), worlds=(2, 8)),
}


def grid(name: str) -> list[GemmCase]:
    if name not in GRIDS:
        raise ValueError(f"unknown grid {name!r}; choose one of {', '.join(GRIDS)}")
    return GRIDS[name]()


def case_of(row: dict) -> GemmCase:
    """The case of a results row (gemm_efficiency, tune --one-gpu); fields a row of an older file
    lacks take their defaults."""
    return GemmCase(**{f: row[f] for f in GemmCase.__dataclass_fields__ if f in row})


def parse_cases(text: str, world: int, dtype: str = "bfloat16", weight_layout: str = "linear") -> list[GemmCase]:
    """`ag:MxNxK,rs:MxNxK,...` (the layers' global sizes) at one TP degree."""
    cases = []
    for spec in text.split(","):
        op, _, dims = spec.strip().partition(":")
        if op not in OP_NAMES or dims.count("x") != 2:
            raise ValueError(f"a shape is op:MxNxK with op ag or rs, got {spec!r}")
        m, n, k = map(int, dims.split("x"))
        cases.append(GemmCase(OP_NAMES[op], m, n, k, world, dtype, weight_layout))
    return cases


def case_inputs(case: GemmCase, device, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (x, weight) of one rank, never zeros; the weight in the case's layout."""
    dtype = DTYPE_NAMES[case.dtype]
    x_shape, w_shape = case.shard_shapes
    x = torch.randn(x_shape, dtype=dtype, device=device, generator=generator)
    return x, random_weight(w_shape, dtype, device, generator, w_shape[1] ** -0.5, case.weight_layout)


def fp8_case_inputs(case: GemmCase, device, generator=None):
    """Random (x, weight, scale_x [rows, 1], scale_w [1, n]) of one rank, FP8 with row-wise scales."""
    from fluxtp.fp8 import quantize_rows

    x_shape, w_shape = case.shard_shapes
    dtype = FP8_DTYPE_NAMES[case.dtype]
    x, scale_x = quantize_rows(torch.randn(x_shape, device=device, generator=generator), dtype)
    weight, scale_w = quantize_rows(torch.randn(w_shape, device=device, generator=generator) * w_shape[1] ** -0.5, dtype)
    return x, weight, scale_x, scale_w.view(1, -1)


def gathered(case: GemmCase, x: torch.Tensor) -> torch.Tensor:
    """The input of one rank's whole GEMM: the all-gather's W copies of the shard (what its
    GEMM-only mode reads), or x itself for the reduce-scatter."""
    return x.repeat(case.world, 1) if case.op == "all_gather_matmul" else x


def expected_rows(case: GemmCase, full: torch.Tensor) -> torch.Tensor:
    """The rows of one rank's whole GEMM that its GEMM-only mode returns (rank 0's, reduce-scatter)."""
    return full if case.op == "all_gather_matmul" else full[: case.M // case.world]


def heuristic_config(case: GemmCase, warp_specialized: bool = False):
    """The config the launcher takes when no table has an entry for the case (an FP8 one: with
    its accumulation and a bf16 output); warp_specialized: on a GPU where the case may take a
    warp-specialized kernel (warp_specialized_runs: the reduce-scatter's reducer kernel too)."""
    from fluxtp.backends.fused import _all_gather_matmul
    from fluxtp.backends.fused._matmul_reduce_scatter import routed, scaled_heuristic
    from fluxtp.configs import AllGatherMatmulConfig, MatmulReduceScatterConfig

    (rows, k), (n, _) = case.shard_shapes
    if case.fp8:
        precise = not case.fast_accum
        if case.op == "all_gather_matmul":
            config = AllGatherMatmulConfig.heuristic_fp8(rows, n, k, case.world, precise, warp_specialized=warp_specialized)
            return _all_gather_matmul.routed(config, rows, n, k, case.world, warp_specialized, scaled=bf16_output(case))
        return scaled_heuristic(case.M, n, k, case.world, bf16_output(case), warp_specialized)
    if case.op == "all_gather_matmul":
        config = AllGatherMatmulConfig.heuristic(rows, n, k, case.world, warp_specialized=warp_specialized)
        return _all_gather_matmul.routed(config, rows, n, k, case.world, warp_specialized)
    config = MatmulReduceScatterConfig.heuristic(case.M, n, k, case.world)
    return routed(config, case.M, n, k, case.world, DTYPE_NAMES[case.dtype].itemsize, warp_specialized)


def launched_config(case: GemmCase, x: torch.Tensor, weight: torch.Tensor, scales=None):
    """The config a call of the case launches now (the user's cache, the shipped table, or the
    heuristic; FP8 cases (scales given): with the case's accumulation)."""
    from fluxtp.backends.fused import _all_gather_matmul, _matmul_reduce_scatter
    from fluxtp.backends.fused._scaled import Scaled

    module = _all_gather_matmul if case.op == "all_gather_matmul" else _matmul_reduce_scatter
    scaled = None if scales is None else Scaled.of(*scales, torch.bfloat16, case.fast_accum)
    return module._config_for(x, weight, case.world, None, scaled)


def warp_specialized_runs(case: GemmCase, device) -> bool:
    """Whether the case may take a warp-specialized kernel on `device` (on Hopper), as the launcher
    decides: the all-gather's, or the reduce-scatter's reducer kernel."""
    from fluxtp.backends.fused import _scaled

    if case.fp8:
        return _scaled.pingpong_unsupported(device, bf16_output(case)) is None
    return _scaled.pingpong_unsupported(device, None, DTYPE_NAMES[case.dtype]) is None


def bf16_output(case: GemmCase):
    """An FP8 case's scaled call (fluxtp.backends.fused._scaled.Scaled): row-wise scales, a bf16
    output, the case's accumulation."""
    from fluxtp.backends.fused import _scaled

    return _scaled.Scaled(torch.bfloat16, True, not case.fast_accum)


def gemm_only_case(case: GemmCase, x: torch.Tensor, weight: torch.Tensor, config=None, scales=None):
    """A zero-argument callable launching the fused kernel of rank 0 of the case with
    communication switched off, with `config` (default: the one a call would launch); an FP8
    case passes its scales (the scaled op's kernel, bf16 out, the case's accumulation)."""
    from fluxtp.backends.fused import _all_gather_matmul, _matmul_reduce_scatter

    module = _all_gather_matmul if case.op == "all_gather_matmul" else _matmul_reduce_scatter
    if scales is None:
        return module.gemm_only(x, weight, None, GroupInfo(None, 0, case.world), config=config)
    return module.gemm_only(x, weight, None, GroupInfo(None, 0, case.world), config=config, scales=scales,
                            use_fast_accum=case.fast_accum)  # fmt: skip


def cublas_reference(x: torch.Tensor, weight: torch.Tensor, scales=None, use_fast_accum: bool = False) -> torch.Tensor:
    """What the fused GEMM-only modes are timed against: x @ weight^T by F.linear, or, with FP8
    scales, torch._scaled_mm into bf16 with that accumulation. Called directly, not through
    fluxtp.fp8.scaled_linear, which falls back to a dequantized product where _scaled_mm does not run."""
    if scales is None:
        return torch.nn.functional.linear(x, weight)
    return torch._scaled_mm(x, weight.t(), scales[0], scales[1], out_dtype=torch.bfloat16, use_fast_accum=use_fast_accum)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float32 (NaN compares as an error of inf)."""
    got, want = got.float(), want.float()
    err = ((got - want).norm() / want.norm()).item()
    return err if math.isfinite(err) else math.inf


# The fused output's largest relative error against cuBLAS's (float32 sums in another order,
# rounded once to 16 bits either way: errors run to about 1e-3).
CHECK_TOLERANCE = 1e-2


def check_close(case: GemmCase, name: str, out: torch.Tensor, want: torch.Tensor) -> None:
    """AssertionError naming the case and `name` where out is not want within CHECK_TOLERANCE."""
    err = relative_error(out, want)
    if not err < CHECK_TOLERANCE:
        raise AssertionError(f"{case.label()}: {name} differs from cuBLAS (relative error {err:.2e})")


@dataclass
class CaseRuns:
    """One case ready to time on one GPU: `runs` holds zero-argument launches of cuBLAS's GEMM
    ("cublas": F.linear of the whole per-rank operands, torch._scaled_mm for FP8) and of the fused
    op's GEMM-only mode ("fused"), whose output was checked against cuBLAS's."""

    runs: dict
    x: torch.Tensor  # this rank's operands (FP8: and their row-wise scales)
    weight: torch.Tensor
    scales: tuple | None
    config: object  # the config the fused op launches for the case
    reference: torch.Tensor  # cuBLAS's output in float32, for checking further variants


def case_runs(case: GemmCase, device) -> CaseRuns:
    """The case's cuBLAS and fused GEMM-only launches on fresh random operands, the fused output
    checked (check_close)."""
    scales = None
    if case.fp8:
        x, weight, scale_x, scale_w = fp8_case_inputs(case, device)
        scales = (scale_x, scale_w)
        full, full_scales = gathered(case, x), gathered(case, scale_x)  # the row scales travel with the rows
        cublas = lambda: cublas_reference(full, weight, (full_scales, scale_w), case.fast_accum)  # noqa: E731
    else:
        x, weight = case_inputs(case, device)
        full = gathered(case, x)  # what cuBLAS multiplies after the collective
        cublas = lambda: cublas_reference(full, weight)  # noqa: E731
    fused = gemm_only_case(case, x, weight, scales=scales)
    reference = cublas().float()
    check_close(case, "fused", fused(), expected_rows(case, reference))
    return CaseRuns({"cublas": cublas, "fused": fused}, x, weight, scales, launched_config(case, x, weight, scales),
                    reference)  # fmt: skip
