"""GEMM + ReduceScatter: the row-parallel linear of sequence-parallel TP (attention out, MLP down)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fluxtp import backends
from fluxtp._dist import GroupInfo, group_from_name, resolve_group
from fluxtp._plan import PlanCache, tensor_key
from fluxtp.ops._dispatch import direct, group_key
from fluxtp.ops._validate import check_backend, check_linear_args, check_scatter_rows

OP = "matmul_reduce_scatter"
_plans = PlanCache()


def _check(x, weight, bias, backend, group) -> GroupInfo:
    check_backend(backend)
    check_linear_args(x, weight, bias, "x", "[M, k]", "[N, k]")
    info = resolve_group(group)
    check_scatter_rows(x, info.world_size)
    return info


def _build(x, weight, bias, info: GroupInfo, backend: str):
    """The call plan: (x, weight, bias) -> [M/W, N]."""
    if info.world_size == 1:
        return F.linear
    return backends.prepare(OP, backends.choose(OP, backend, x, weight, info), x, weight, bias, info)


def _planned(x, weight, bias, info: GroupInfo, backend: str):
    key = (tensor_key(x), tensor_key(weight), tensor_key(bias), info.group, backend)
    run = _plans.get(key)
    if run is None:
        run = _plans.put(key, _build(x, weight, bias, info, backend))
    return run(x, weight, bias)


@torch.library.custom_op("fluxtp::matmul_reduce_scatter", mutates_args=())
def _matmul_reduce_scatter_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group_name: str, backend: str
) -> torch.Tensor:
    return _planned(x, weight, bias, group_from_name(group_name), backend)


@_matmul_reduce_scatter_op.register_fake
def _(x, weight, bias, group_name, backend):
    world = group_from_name(group_name).world_size
    return x.new_empty(x.shape[0] // world, weight.shape[0])


def matmul_reduce_scatter(
    x: torch.Tensor, weight: torch.Tensor, *, group=None, bias: torch.Tensor | None = None, backend: str = "auto"
) -> torch.Tensor:
    """out = reduce_scatter(x @ weight^T) + bias, rows scattered over ranks.

    Differentiable: the backward all-gathers grad_out into a GEMM with the weight (the input
    gradient) and takes the local weight gradient from the gathered grad_out (fluxtp.ops._autograd).

    Args:
        x: [M, k], all M rows, this rank's slice of the input features.
        weight: [N, k], all output features, this rank's slice of the input features.
        group: the tensor-parallel process group (default: the world).
        bias: [N] or None (added once, after the sum).
        backend: "auto", "fused", "nccl" or "torch".

    Returns:
        [M/W, N]: rank r gets rows r*M/W .. (r+1)*M/W - 1 of the summed product.
    """
    if direct(x, weight, bias):
        try:
            key = (tensor_key(x), tensor_key(weight), tensor_key(bias), group_key(group), backend)
            run = _plans.get(key)
        except Exception:  # noqa: BLE001 -- not a plannable call: the checks say what is wrong
            key = run = None
        if run is None:
            info = _check(x, weight, bias, backend, group)
            run = _build(x, weight, bias, info, backend)
            if key is not None:
                _plans.put(key, run)
        return run(x, weight, bias)
    info = _check(x, weight, bias, backend, group)
    if info.world_size == 1:
        return F.linear(x, weight, bias)
    return _matmul_reduce_scatter_op(x, weight, bias, info.name, backend)
