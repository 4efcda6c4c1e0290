"""Scaled (FP8) GEMM + ReduceScatter: the row-parallel linear of sequence-parallel TP in FP8, named
and ordered as PyTorch's torch._scaled_mm and its fused_scaled_matmul_reduce_scatter."""

from __future__ import annotations

import torch

from fluxtp import backends, fp8
from fluxtp._dist import GroupInfo, group_from_name, resolve_group
from fluxtp._plan import PlanCache, tensor_key
from fluxtp.ops._dispatch import direct, group_key
from fluxtp.ops._validate import check_backend, check_scaled_args, check_scatter_rows

OP = "scaled_matmul_reduce_scatter"
_plans = PlanCache()


def _check(x, weight, scale_x, scale_w, bias, out_dtype, use_fast_accum, backend, group) -> GroupInfo:
    check_backend(backend)
    check_scaled_args(x, weight, scale_x, scale_w, bias, out_dtype, use_fast_accum, "x", "[M, k]", "[N, k]")
    info = resolve_group(group)
    check_scatter_rows(x, info.world_size)
    return info


def _build(x, weight, scale_x, scale_w, bias, info: GroupInfo, backend, out_dtype, use_fast_accum):
    """The call plan: (x, weight, scale_x, scale_w, bias) -> [M/W, N] in out_dtype."""
    if info.world_size == 1:
        return lambda x, w, sx, sw, b: fp8.scaled_linear(x, w, sx, sw, b, out_dtype, use_fast_accum)
    details = {"row_wise": fp8.is_row_wise(scale_x, scale_w), "out_dtype": out_dtype, "use_fast_accum": use_fast_accum}
    name = backends.choose(OP, backend, x, weight, info, **details)
    return backends.prepare(OP, name, x, weight, bias, info, out_dtype, use_fast_accum)


def _key(x, weight, scale_x, scale_w, bias, group, backend, out_dtype, use_fast_accum):
    return (*map(tensor_key, (x, weight, scale_x, scale_w, bias)), group, backend, out_dtype, use_fast_accum)


@torch.library.custom_op("fluxtp::scaled_matmul_reduce_scatter", mutates_args=())
def _scaled_matmul_reduce_scatter_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_x: torch.Tensor,
    scale_w: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
    backend: str,
    out_dtype: torch.dtype,
    use_fast_accum: bool,
) -> torch.Tensor:
    info = group_from_name(group_name)
    args = (x, weight, scale_x, scale_w, bias)
    key = _key(*args, info.group, backend, out_dtype, use_fast_accum)
    run = _plans.get(key)
    if run is None:
        run = _plans.put(key, _build(*args, info, backend, out_dtype, use_fast_accum))
    return run(*args)


@_scaled_matmul_reduce_scatter_op.register_fake
def _(x, weight, scale_x, scale_w, bias, group_name, backend, out_dtype, use_fast_accum):
    world = group_from_name(group_name).world_size
    return x.new_empty(x.shape[0] // world, weight.shape[0], dtype=out_dtype)


def scaled_matmul_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_x: torch.Tensor,
    scale_w: torch.Tensor,
    *,
    group=None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    use_fast_accum: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """out = reduce_scatter((x * scale_x) @ (weight * scale_w)^T) + bias in out_dtype, rows
    scattered over ranks: every rank's partial (float32 accumulation, its scales applied) is
    rounded to out_dtype, as NCCL-then-GEMM and PyTorch's async-TP hand them over (half
    float32's bytes); the fused and torch backends sum them in float32 in a fixed order
    (deterministic) and round once, the nccl backend as NCCL's reduce-scatter does (its ring
    rounds at every hop); the bias is added once, after the sum. out_dtype=torch.float32 keeps
    float32 partials (one rounding in all, at twice the bytes) for a caller who casts after.

    Not differentiable itself (FP8 tensors have no gradients): see fluxtp.nn's FP8 layers.

    Args:
        x: [M, k] float8_e4m3fn (or float8_e5m2), all M rows, this rank's slice of K.
        weight: [N, k] float8, all output features, this rank's slice of K.
        scale_x: float32, per tensor (one value) or row-wise [M, 1] (this rank's own scales of
            its slice), as torch._scaled_mm's scale_a.
        scale_w: float32, per tensor or row-wise [1, N], as torch._scaled_mm's scale_b.
        group: the tensor-parallel process group (default: the world).
        bias: [N] (bfloat16, float16 or float32) or None, added once, after the sum.
        out_dtype: bfloat16 (default), float16 or float32.
        use_fast_accum: as torch._scaled_mm's (see all_gather_scaled_matmul).
        backend: "auto", "fused", "nccl" or "torch".

    Returns:
        [M/W, N] in out_dtype: rank r gets rows r*M/W .. (r+1)*M/W - 1 of the sum.
    """
    args = (x, weight, scale_x, scale_w, bias)
    if direct(*args):
        try:
            key = _key(*args, group_key(group), backend, out_dtype, use_fast_accum)
            run = _plans.get(key)
        except Exception:  # noqa: BLE001 -- not a plannable call: the checks say what is wrong
            key = run = None
        if run is None:
            info = _check(*args, out_dtype, use_fast_accum, backend, group)
            run = _build(*args, info, backend, out_dtype, use_fast_accum)
            if key is not None:
                _plans.put(key, run)
        return run(*args)
    info = _check(*args, out_dtype, use_fast_accum, backend, group)
    if info.world_size == 1:
        return _build(*args, info, backend, out_dtype, use_fast_accum)(*args)
    return _scaled_matmul_reduce_scatter_op(*args, info.name, backend, out_dtype, use_fast_accum)
