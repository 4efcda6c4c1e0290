"""AllReduce of an already computed tensor: the sums the inference path needs without a GEMM in front."""

from __future__ import annotations

import torch

from fluxtp import backends
from fluxtp._dist import GroupInfo, group_from_name, resolve_group
from fluxtp._plan import PlanCache, tensor_key
from fluxtp.ops._dispatch import direct, group_key
from fluxtp.ops._validate import SUPPORTED_DTYPES, check_backend

OP = "all_reduce"
_plans = PlanCache()


def _check(x, backend, group) -> GroupInfo:
    check_backend(backend)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"x has unsupported dtype {x.dtype}; expected one of {names}")
    if not x.is_contiguous():
        raise ValueError(f"x must be contiguous, got shape {tuple(x.shape)} with strides {x.stride()}")
    return resolve_group(group)


def _build(x, info: GroupInfo, backend: str):
    """The call plan: (x, None, None) -> the sum."""
    if info.world_size == 1:
        return lambda x, weight, bias: x.clone()
    return backends.prepare(OP, backends.choose(OP, backend, x, None, info), x, None, None, info)


def _planned(x, info: GroupInfo, backend: str):
    key = (tensor_key(x), info.group, backend)
    run = _plans.get(key)
    if run is None:
        run = _plans.put(key, _build(x, info, backend))
    return run(x, None, None)


@torch.library.custom_op("fluxtp::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, group_name: str, backend: str) -> torch.Tensor:
    return _planned(x, group_from_name(group_name), backend)


@_all_reduce_op.register_fake
def _(x, group_name, backend):
    return torch.empty_like(x)


def all_reduce(x: torch.Tensor, *, group=None, backend: str = "auto") -> torch.Tensor:
    """The sum of `x` over the ranks of `group`, as a new tensor (x is not modified).

    Differentiable (fluxtp.ops._autograd): the backward is the all-reduce of the gradient.

    Args:
        x: a contiguous tensor of any shape, the same shape and dtype on every rank.
        group: the process group (default: the world).
        backend: "auto", "fused" (one-shot push on symmetric memory), "nccl" or "torch".

    Returns:
        A tensor shaped like x holding the same sum on every rank (bitwise the same on every
        rank for every backend: each rank adds the same values in the same order).
    """
    if direct(x):
        try:
            key = (tensor_key(x), group_key(group), backend)
            run = _plans.get(key)
        except Exception:  # noqa: BLE001 -- not a plannable call: the checks say what is wrong
            key = run = None
        if run is None:
            run = _build(x, _check(x, backend, group), backend)
            if key is not None:
                _plans.put(key, run)
        return run(x, None, None)
    info = _check(x, backend, group)
    if info.world_size == 1:
        return x.clone()
    return _all_reduce_op(x, info.name, backend)
