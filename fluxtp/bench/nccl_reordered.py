"""The "nccl_reordered" backend (registered by fluxtp.bench): the nccl backend's ops with each
GEMM summed in another order, the two halves of its K dim swapped in both operands. It computes
the same function with other roundings: the train scenario's loss curves take it as the noise
reference (what rounding alone changes in a curve). The scaled (FP8) ops likewise (their scales
are per row of x and of the weight, which the swap leaves in place). Its plain collectives are
the reference's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fluxtp import fp8
from fluxtp._dist import GroupInfo
from fluxtp.backends import reference


def unsupported_reason(op: str, x, weight, info: GroupInfo, **details) -> str | None:
    return None  # runs wherever the reference does; fluxtp.backends reports the ops it lacks


def k_swapped(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [.., K] and weight [N, K] with the two halves of K swapped in both: x @ weight^T is
    the same sum of products, which a GEMM accumulates in another order (another rounding)."""
    half = x.shape[-1] // 2
    x_swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x_swapped, torch.cat((weight[:, half:], weight[:, :half]), dim=1)


def all_gather_matmul(x_shard, weight, bias, info: GroupInfo, return_gathered: bool):
    x_gathered = reference.gather_rows(x_shard, info)
    y = F.linear(*k_swapped(x_gathered, weight), bias)
    return y, x_gathered if return_gathered else None


def matmul_reduce_scatter(x, weight, bias, info: GroupInfo):
    return reference.matmul_reduce_scatter(*k_swapped(x, weight), bias, info)


def all_gather_scaled_matmul(x_shard, weight, scale_x, scale_w, bias, info: GroupInfo, out_dtype, use_fast_accum,
                             return_gathered: bool):  # fmt: skip
    x_gathered, scales = reference.gather_fp8_rows(x_shard, scale_x, scale_w, info)
    y = fp8.scaled_linear(*k_swapped(x_gathered, weight), scales, scale_w, bias, out_dtype, use_fast_accum)
    return y, (x_gathered, scales) if return_gathered else None


def scaled_matmul_reduce_scatter(x, weight, scale_x, scale_w, bias, info: GroupInfo, out_dtype, use_fast_accum):
    return reference.scaled_matmul_reduce_scatter(*k_swapped(x, weight), scale_x, scale_w, bias, info, out_dtype,
                                                  use_fast_accum)  # fmt: skip
