"""AllGather + scaled (FP8) GEMM: the column-parallel linear of sequence-parallel TP in FP8, named
and ordered as PyTorch's torch._scaled_mm and its fused_all_gather_scaled_matmul."""

from __future__ import annotations

import torch

from fluxtp import backends, fp8
from fluxtp._dist import GroupInfo, group_from_name, resolve_group
from fluxtp._plan import PlanCache, tensor_key
from fluxtp.ops._dispatch import direct, group_key
from fluxtp.ops._validate import check_backend, check_scaled_args

OP = "all_gather_scaled_matmul"
_plans = PlanCache()


def _check(x_shard, weight, scale_x, scale_w, bias, out_dtype, use_fast_accum, backend, group) -> GroupInfo:
    check_backend(backend)
    check_scaled_args(x_shard, weight, scale_x, scale_w, bias, out_dtype, use_fast_accum, "x_shard", "[m, K]", "[n, K]")
    return resolve_group(group)


def _build(x_shard, weight, scale_x, scale_w, bias, info: GroupInfo, backend, out_dtype, use_fast_accum, return_gathered):
    """The call plan: (x_shard, weight, scale_x, scale_w, bias) -> (y, (x_gathered, scales) or None)."""
    row_wise = fp8.is_row_wise(scale_x, scale_w)
    if info.world_size == 1:

        def alone(x, w, sx, sw, b):
            y = fp8.scaled_linear(x, w, sx, sw, b, out_dtype, use_fast_accum)
            if not return_gathered:
                return y, None
            return y, (x.clone(), sx.reshape(-1, 1).expand(x.shape[0], 1).clone() if row_wise else sx.clone())

        return alone
    details = {"row_wise": row_wise, "out_dtype": out_dtype, "use_fast_accum": use_fast_accum}
    name = backends.choose(OP, backend, x_shard, weight, info, return_gathered=return_gathered, **details)
    return backends.prepare(OP, name, x_shard, weight, bias, info, out_dtype, use_fast_accum, return_gathered)


def _key(x_shard, weight, scale_x, scale_w, bias, group, backend, out_dtype, use_fast_accum, return_gathered):
    tensors = tuple(map(tensor_key, (x_shard, weight, scale_x, scale_w, bias)))
    return (*tensors, group, backend, out_dtype, use_fast_accum, return_gathered)


@torch.library.custom_op("fluxtp::all_gather_scaled_matmul", mutates_args=())
def _all_gather_scaled_matmul_op(
    x_shard: torch.Tensor,
    weight: torch.Tensor,
    scale_x: torch.Tensor,
    scale_w: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
    backend: str,
    out_dtype: torch.dtype,
    use_fast_accum: bool,
    return_gathered: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    info = group_from_name(group_name)
    args = (x_shard, weight, scale_x, scale_w, bias)
    key = _key(*args, info.group, backend, out_dtype, use_fast_accum, return_gathered)
    run = _plans.get(key)
    if run is None:
        run = _plans.put(key, _build(*args, info, backend, out_dtype, use_fast_accum, return_gathered))
    y, gathered = run(*args)
    # torch.library outputs must be tensors: empty ones stand for "not asked".
    return (y, *gathered) if return_gathered else (y, x_shard.new_empty(0), scale_x.new_empty(0))


@_all_gather_scaled_matmul_op.register_fake
def _(x_shard, weight, scale_x, scale_w, bias, group_name, backend, out_dtype, use_fast_accum, return_gathered):
    world = group_from_name(group_name).world_size
    m, k = x_shard.shape
    y = x_shard.new_empty(m * world, weight.shape[0], dtype=out_dtype)
    if not return_gathered:
        return y, x_shard.new_empty(0), scale_x.new_empty(0)
    scales = scale_x.new_empty(m * world, 1) if fp8.is_row_wise(scale_x, scale_w) else torch.empty_like(scale_x)
    return y, x_shard.new_empty(m * world, k), scales


def all_gather_scaled_matmul(
    x_shard: torch.Tensor,
    weight: torch.Tensor,
    scale_x: torch.Tensor,
    scale_w: torch.Tensor,
    *,
    group=None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    use_fast_accum: bool = False,
    backend: str = "auto",
    return_gathered: bool = False,
):
    """y = all_gather(x_shard * scale_x) @ (weight * scale_w)^T + bias in out_dtype, the gather of
    the FP8 rows (and their row scales) hidden behind the GEMM; float32 accumulation, the scales
    and the bias applied to the float32 product, rounded once.

    Not differentiable itself (FP8 tensors have no gradients): fluxtp.nn's FP8 layers quantize
    and call it in their forward and backward.

    Args:
        x_shard: [m, K] float8_e4m3fn (or float8_e5m2), this rank's rows of x.
        weight: [n, K] float8, this rank's output features (nn.Linear layout).
        scale_x: float32, per tensor (one value, the scale of the whole x: the same on every
            rank) or row-wise [m, 1] (this rank's rows), as torch._scaled_mm's scale_a.
        scale_w: float32, per tensor or row-wise [1, n] (one per output feature), as
            torch._scaled_mm's scale_b; row-wise with row-wise scale_x.
        group: the tensor-parallel process group (default: the world).
        bias: [n] (bfloat16, float16 or float32) or None.
        out_dtype: bfloat16 (default), float16 or float32.
        use_fast_accum: as torch._scaled_mm's: let FP8 tensor cores accumulate in their own
            reduced precision (faster on Hopper); off, float32 accumulation.
        backend: "auto", "fused", "nccl" or "torch" (see fluxtp.backends).
        return_gathered: also return the gathered FP8 rows (an exact copy) and their scales.

    Returns:
        y [m*W, n], or (y, x_gathered [m*W, K] float8, scales) when return_gathered, scales
        being [m*W, 1] row-wise or the per-tensor scale.
    """
    args = (x_shard, weight, scale_x, scale_w, bias)
    if direct(*args):
        try:
            key = _key(*args, group_key(group), backend, out_dtype, use_fast_accum, return_gathered)
            run = _plans.get(key)
        except Exception:  # noqa: BLE001 -- not a plannable call: the checks below say what is wrong
            key = run = None
        if run is None:
            info = _check(*args, out_dtype, use_fast_accum, backend, group)
            run = _build(*args, info, backend, out_dtype, use_fast_accum, return_gathered)
            if key is not None:
                _plans.put(key, run)
        y, gathered = run(*args)
        return (y, *gathered) if return_gathered else y
    info = _check(*args, out_dtype, use_fast_accum, backend, group)
    if info.world_size == 1:
        y, gathered = _build(*args, info, backend, out_dtype, use_fast_accum, return_gathered)(*args)
        return (y, *gathered) if return_gathered else y
    out = _all_gather_scaled_matmul_op(*args, info.name, backend, out_dtype, use_fast_accum, return_gathered)
    return out if return_gathered else out[0]
