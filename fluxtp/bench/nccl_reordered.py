"""The "nccl_reordered" backend (registered by fluxtp.bench): the nccl backend's ops with each
GEMM summed in another order, the two halves of its K dim swapped in both operands. It computes
the same function with other roundings: the train scenario's loss curves take it as the noise
reference (what rounding alone changes in a curve). Its plain collectives are the reference's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
