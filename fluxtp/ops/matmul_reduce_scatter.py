"""GEMM + ReduceScatter: the row-parallel linear of sequence-parallel TP (attention out, MLP down)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fluxtp import backends
from fluxtp._dist import group_from_name, resolve_group
from fluxtp.ops._dispatch import direct
from fluxtp.ops._validate import check_backend, check_linear_args

OP = "matmul_reduce_scatter"


@torch.library.custom_op("fluxtp::matmul_reduce_scatter", mutates_args=())
def _matmul_reduce_scatter_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group_name: str, backend: str
) -> torch.Tensor:
    return backends.implementation(OP, backend)(x, weight, bias, group_from_name(group_name))


@_matmul_reduce_scatter_op.register_fake
def _(x, weight, bias, group_name, backend):
    world = group_from_name(group_name).world_size
    return x.new_empty(x.shape[0] // world, weight.shape[0])


def matmul_reduce_scatter(
    x: torch.Tensor, weight: torch.Tensor, *, group=None, bias: torch.Tensor | None = None, backend: str = "auto"
) -> torch.Tensor:
    """out = reduce_scatter(x @ weight^T) + bias, rows scattered over ranks.

    Args:
        x: [M, k], all M rows, this rank's slice of the input features.
        weight: [N, k], all output features, this rank's slice of the input features.
        group: the tensor-parallel process group (default: the world).
        bias: [N] or None (added once, after the sum).
        backend: "auto", "fused", "nccl" or "torch".

    Returns:
        [M/W, N]: rank r gets rows r*M/W .. (r+1)*M/W-1 of the summed product.
    """
    check_backend(backend)
    check_linear_args(x, weight, bias, "x", "[M, k]", "[N, k]")
    info = resolve_group(group)
    if info.world_size == 1:
        return F.linear(x, weight, bias)
    if x.shape[0] % info.world_size:
        raise ValueError(
            f"x has shape {tuple(x.shape)}: its M={x.shape[0]} rows must be divisible by the "
            f"group's world size {info.world_size} to be scattered"
        )
    name = backends.choose(OP, backend, x, weight, info)
    if direct(x, weight, bias):
        return backends.implementation(OP, name)(x, weight, bias, info)
    return _matmul_reduce_scatter_op(x, weight, bias, info.name, name)
