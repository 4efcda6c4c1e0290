"""The "nccl" backend: the collective through torch.distributed, then the matmul, in sequence.

This is the semantics every other backend must reproduce. It runs wherever the group's
backend does: NCCL on CUDA tensors, gloo on CPU tensors.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fluxtp import fp8
from fluxtp._dist import GroupInfo

# torch >= 2.12 renames the *_tensor collectives (*_single); 2.11 has only these names.
warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")


def all_gather_matmul(x_shard, weight, bias, info: GroupInfo, return_gathered: bool):
    x_gathered = gather_rows(x_shard, info)
    y = F.linear(x_gathered, weight, bias)
    return y, x_gathered if return_gathered else None


def matmul_reduce_scatter(x, weight, bias, info: GroupInfo):
    partial = F.linear(x, weight)
    out = partial.new_empty(partial.shape[0] // info.world_size, partial.shape[1])
    dist.reduce_scatter_tensor(out, partial, group=info.group)
    if bias is not None:
        out += bias  # once, after the sum
    return out


def matmul_all_reduce(x, weight, bias, info: GroupInfo):
    y = F.linear(x, weight)
    dist.all_reduce(y, group=info.group)
    if bias is not None:
        y += bias
    return y


def all_reduce(x, info: GroupInfo):
    y = x.clone()
    dist.all_reduce(y, group=info.group)
    return y


# ---------------------------------------------------------------- the plain collectives (backends.COLLECTIVES)


def gather_rows(x_shard: torch.Tensor, info: GroupInfo) -> torch.Tensor:
    """[m, *] on every rank -> [m*W, *], rank r's rows at r*m."""
    x_shard = x_shard.contiguous()
    x_gathered = x_shard.new_empty(x_shard.shape[0] * info.world_size, *x_shard.shape[1:])
    if info.world_size == 1:
        return x_gathered.copy_(x_shard)
    dist.all_gather_into_tensor(x_gathered, x_shard, group=info.group)
    return x_gathered


def all_reduce_sum(t: torch.Tensor, info: GroupInfo, async_op: bool = False):
    """Sum `t` over the group in place (a contiguous tensor). With async_op, the work handle."""
    if info.world_size == 1:
        return None
    return dist.all_reduce(t, group=info.group, async_op=async_op)


# ---------------------------------------------------------------- the scaled (FP8) ops
#
# Per tensor or row-wise as torch._scaled_mm: fluxtp.fp8.scaled_linear, the float32 product of the
# FP8 values times scale_x (per row) and scale_w (per output feature), plus bias, rounded once to
# out_dtype. The reduce-scatter is NCCL-then-GEMM as a user writes it: each rank's partial in
# out_dtype (scaled_linear, no bias), one NCCL or gloo reduce-scatter of those (a fixed order for
# a fixed group; NCCL's ring rounds its running sum at every hop), then the bias.


def gather_fp8_rows(x_shard, scale_x, scale_w, info: GroupInfo):
    """(x_gathered [W*m, K], its scales): the FP8 rows as bytes (every backend of the group's
    moves bytes), row-wise scales gathered with them, a per-tensor scale as it is (one scale
    of the whole x, the same on every rank)."""
    m, k = x_shard.shape
    world = info.world_size
    x_gathered = torch.empty(m * world, k, dtype=x_shard.dtype, device=x_shard.device)
    dist.all_gather_into_tensor(x_gathered.view(torch.uint8), x_shard.contiguous().view(torch.uint8), group=info.group)
    if not fp8.is_row_wise(scale_x, scale_w):
        return x_gathered, scale_x.clone()
    scales = torch.empty(m * world, 1, dtype=torch.float32, device=x_shard.device)
    dist.all_gather_into_tensor(scales, scale_x.reshape(-1, 1).expand(m, 1).contiguous(), group=info.group)
    return x_gathered, scales


def all_gather_scaled_matmul(x_shard, weight, scale_x, scale_w, bias, info: GroupInfo, out_dtype, use_fast_accum,
                             return_gathered: bool):  # fmt: skip
    x_gathered, scales = gather_fp8_rows(x_shard, scale_x, scale_w, info)
    y = fp8.scaled_linear(x_gathered, weight, scales, scale_w, bias, out_dtype, use_fast_accum)
    return y, (x_gathered, scales) if return_gathered else None


def scaled_matmul_reduce_scatter(x, weight, scale_x, scale_w, bias, info: GroupInfo, out_dtype, use_fast_accum):
    partial = fp8.scaled_linear(x, weight, scale_x, scale_w, None, out_dtype, use_fast_accum)
    out = partial.new_empty(partial.shape[0] // info.world_size, partial.shape[1])
    dist.reduce_scatter_tensor(out, partial, group=info.group)
    return fp8.plus_bias(out, bias, out_dtype)
