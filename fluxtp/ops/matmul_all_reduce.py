"""GEMM + AllReduce: the row-parallel linear without sequence parallelism (inference, decode)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fluxtp import backends
from fluxtp._dist import group_from_name, resolve_group
from fluxtp.ops._dispatch import direct
from fluxtp.ops._validate import check_backend, check_linear_args

OP = "matmul_all_reduce"


@torch.library.custom_op("fluxtp::matmul_all_reduce", mutates_args=())
def _matmul_all_reduce_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group_name: str, backend: str
) -> torch.Tensor:
    return backends.implementation(OP, backend)(x, weight, bias, group_from_name(group_name))


@_matmul_all_reduce_op.register_fake
def _(x, weight, bias, group_name, backend):
    return x.new_empty(x.shape[0], weight.shape[0])


def matmul_all_reduce(
    x: torch.Tensor, weight: torch.Tensor, *, group=None, bias: torch.Tensor | None = None, backend: str = "auto"
) -> torch.Tensor:
    """out = all_reduce(x @ weight^T) + bias.

    Args:
        x: [M, k], this rank's slice of the input features.
        weight: [N, k], this rank's slice of the input features.
        group: the tensor-parallel process group (default: the world).
        bias: [N] or None (added once, after the sum).
        backend: "auto", "fused", "nccl" or "torch".

    Returns:
        [M, N], the same on every rank.
    """
    check_backend(backend)
    check_linear_args(x, weight, bias, "x", "[M, k]", "[N, k]")
    info = resolve_group(group)
    if info.world_size == 1:
        return F.linear(x, weight, bias)
    name = backends.choose(OP, backend, x, weight, info)
    if direct(x, weight, bias):
        return backends.implementation(OP, name)(x, weight, bias, info)
    return _matmul_all_reduce_op(x, weight, bias, info.name, name)
