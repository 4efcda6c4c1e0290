"""AllGather + GEMM: the column-parallel linear of sequence-parallel TP (QKV, MLP up/gate)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fluxtp import backends
from fluxtp._dist import GroupInfo, group_from_name, resolve_group
from fluxtp._plan import PlanCache, tensor_key
from fluxtp.ops._dispatch import direct, group_key, records_grad
from fluxtp.ops._validate import check_backend, check_linear_args

OP = "all_gather_matmul"
_plans = PlanCache()


def _build(x_shard, weight, bias, info: GroupInfo, backend: str, return_gathered: bool):
    """The call plan: (x_shard, weight, bias) -> (y, x_gathered or None)."""
    if info.world_size == 1:
        return lambda x, w, b: (F.linear(x, w, b), x.clone() if return_gathered else None)
    name = backends.choose(OP, backend, x_shard, weight, info, return_gathered=return_gathered)
    return backends.prepare(OP, name, x_shard, weight, bias, info, return_gathered)


def _planned(x_shard, weight, bias, info: GroupInfo, backend: str, return_gathered: bool):
    key = (tensor_key(x_shard), tensor_key(weight), tensor_key(bias), info.group, backend, return_gathered)
    run = _plans.get(key)
    if run is None:
        run = _plans.put(key, _build(x_shard, weight, bias, info, backend, return_gathered))
    return run(x_shard, weight, bias)


@torch.library.custom_op("fluxtp::all_gather_matmul", mutates_args=())
def _all_gather_matmul_op(
    x_shard: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    group_name: str,
    backend: str,
    return_gathered: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    y, x_gathered = _planned(x_shard, weight, bias, group_from_name(group_name), backend, return_gathered)
    # torch.library outputs may not alias inputs and must be tensors: an empty one stands for "not asked".
    return y, x_gathered if return_gathered else x_shard.new_empty(0)


@_all_gather_matmul_op.register_fake
def _(x_shard, weight, bias, group_name, backend, return_gathered):
    world = group_from_name(group_name).world_size
    m, k = x_shard.shape
    y = x_shard.new_empty(m * world, weight.shape[0])
    return y, x_shard.new_empty(m * world, k) if return_gathered else x_shard.new_empty(0)


def all_gather_matmul(
    x_shard: torch.Tensor,
    weight: torch.Tensor,
    *,
    group=None,
    bias: torch.Tensor | None = None,
    backend: str = "auto",
    return_gathered: bool = False,
):
    """y = all_gather(x_shard) @ weight^T + bias, with the gather hidden behind the GEMM.

    Differentiable: the backward is a GEMM reduce-scatter of grad_y with the weight (the input
    gradient) plus the local weight gradient grad_y^T @ x_gathered (fluxtp.ops._autograd).

    Args:
        x_shard: [m, K], this rank's rows (rank r holds rows r*m .. (r+1)*m-1 of x).
        weight: [n, K], this rank's output features (nn.Linear layout).
        group: the tensor-parallel process group (default: the world).
        bias: [n] or None.
        backend: "auto", "fused", "nccl" or "torch" (see fluxtp.backends).
        return_gathered: also return the gathered input (an exact copy; the backward needs it).

    Returns:
        y [m*W, n], or (y, x_gathered [m*W, K]) when return_gathered.
    """
    if direct(x_shard, weight, bias):
        try:
            key = (tensor_key(x_shard), tensor_key(weight), tensor_key(bias), group_key(group), backend, return_gathered)
            run = _plans.get(key)
        except Exception:  # noqa: BLE001 -- not a plannable call: the checks below say what is wrong
            key = run = None
        if run is None:
            check_backend(backend)
            check_linear_args(x_shard, weight, bias, "x_shard", "[m, K]", "[n, K]")
            info = resolve_group(group)
            run = _build(x_shard, weight, bias, info, backend, return_gathered)
            if key is not None:
                _plans.put(key, run)
        y, x_gathered = run(x_shard, weight, bias)
        return (y, x_gathered) if return_gathered else y
    check_backend(backend)
    check_linear_args(x_shard, weight, bias, "x_shard", "[m, K]", "[n, K]")
    info = resolve_group(group)
    if info.world_size == 1:
        y = F.linear(x_shard, weight, bias)
        return (y, x_shard.clone()) if return_gathered else y
    # The backward needs the gathered input: asked for whenever autograd records the call.
    gathered = return_gathered or records_grad(x_shard, weight, bias)
    y, x_gathered = _all_gather_matmul_op(x_shard, weight, bias, info.name, backend, gathered)
    return (y, x_gathered) if return_gathered else y
