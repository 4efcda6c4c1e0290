"""AllReduce of an already computed tensor: the sums the inference path needs without a GEMM in front."""

from __future__ import annotations

import torch

from fluxtp import backends
from fluxtp._dist import group_from_name, resolve_group
from fluxtp.ops._dispatch import direct
from fluxtp.ops._validate import SUPPORTED_DTYPES, check_backend

OP = "all_reduce"


@torch.library.custom_op("fluxtp::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, group_name: str, backend: str) -> torch.Tensor:
    return backends.implementation(OP, backend)(x, group_from_name(group_name))


@_all_reduce_op.register_fake
def _(x, group_name, backend):
    return torch.empty_like(x)


def all_reduce(x: torch.Tensor, *, group=None, backend: str = "auto") -> torch.Tensor:
    """The sum of `x` over the ranks of `group`, as a new tensor (x is not modified).

    Args:
        x: a contiguous tensor of any shape, the same shape and dtype on every rank.
        group: the process group (default: the world).
        backend: "auto", "fused" (one-shot push on symmetric memory), "nccl" or "torch".

    Returns:
        A tensor shaped like x holding the same sum on every rank (bitwise the same on every
        rank for every backend: each rank adds the same values in the same order).
    """
    check_backend(backend)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"x has unsupported dtype {x.dtype}; expected one of {names}")
    if not x.is_contiguous():
        raise ValueError(f"x must be contiguous, got shape {tuple(x.shape)} with strides {x.stride()}")
    info = resolve_group(group)
    if info.world_size == 1:
        return x.clone()
    name = backends.choose(OP, backend, x, None, info)
    if direct(x):
        return backends.implementation(OP, name)(x, info)
    return _all_reduce_op(x, info.name, name)
