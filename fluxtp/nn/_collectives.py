"""The plain collectives the layers need beside the fused ops (re-gathering saved inputs, summing
gradients of replicated parameters), each through the layer's backend (fluxtp.backends.collective:
the backend's own where it has one, else torch.distributed's), so that selecting a backend decides
all of a layer's communication. Rows are the flattened token dimension throughout."""

from __future__ import annotations

import torch

from fluxtp import backends
from fluxtp._dist import GroupInfo


def gather_rows(x_shard: torch.Tensor, info: GroupInfo, backend: str) -> torch.Tensor:
    """[m, *] on every rank -> [m*W, *], rank r's rows at r*m."""
    return backends.collective("gather_rows", backend)(x_shard, info)


def all_reduce_sum(t: torch.Tensor, info: GroupInfo, backend: str, async_op: bool = False):
    """Sum `t` over the group in place (a contiguous tensor). With async_op, the work handle
    (None when there is nothing to wait for)."""
    return backends.collective("all_reduce_sum", backend)(t, info, async_op)


def rows_block(x: torch.Tensor, info: GroupInfo) -> torch.Tensor:
    """Rank r's contiguous block of rows of x [M, *] (a view): rows r*M/W .. (r+1)*M/W - 1."""
    rows = x.shape[0] // info.world_size
    return x.narrow(0, info.rank * rows, rows)
