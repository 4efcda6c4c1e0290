"""The plain collectives the layers need beside the fused ops (re-gathering saved inputs, summing
gradients of replicated parameters). Rows are the flattened token dimension throughout."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from fluxtp._dist import GroupInfo

# torch >= 2.12 renames the *_tensor collectives (*_single); 2.11 has only these names.
warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor` is deprecated")


def gather_rows(x_shard: torch.Tensor, info: GroupInfo, async_op: bool = False):
    """[m, *] on every rank -> [m*W, *], rank r's rows at r*m. With async_op, (tensor, work)."""
    x_shard = x_shard.contiguous()
    x_gathered = x_shard.new_empty(x_shard.shape[0] * info.world_size, *x_shard.shape[1:])
    if info.world_size == 1:
        x_gathered.copy_(x_shard)
        return (x_gathered, None) if async_op else x_gathered
    work = dist.all_gather_into_tensor(x_gathered, x_shard, group=info.group, async_op=async_op)
    return (x_gathered, work) if async_op else x_gathered


def all_reduce_sum(t: torch.Tensor, info: GroupInfo, async_op: bool = False):
    """Sum `t` over the group in place (a contiguous tensor). With async_op, the work handle."""
    if info.world_size == 1:
        return None
    return dist.all_reduce(t, group=info.group, async_op=async_op)


def rows_block(x: torch.Tensor, info: GroupInfo) -> torch.Tensor:
    """Rank r's contiguous block of rows of x [M, *] (a view): rows r*M/W .. (r+1)*M/W - 1."""
    rows = x.shape[0] // info.world_size
    return x.narrow(0, info.rank * rows, rows)
