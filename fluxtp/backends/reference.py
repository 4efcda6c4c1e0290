"""The "nccl" backend: the collective through torch.distributed, then the matmul, in sequence.

This is the semantics every other backend must reproduce. It runs wherever the group's
backend does: NCCL on CUDA tensors, gloo on CPU tensors.
"""

from __future__ import annotations

import warnings

import torch.distributed as dist
import torch.nn.functional as F

from fluxtp._dist import GroupInfo

# torch >= 2.12 renames the *_tensor collectives (*_single); 2.11 has only these names.
warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")


def all_gather_matmul(x_shard, weight, bias, info: GroupInfo, return_gathered: bool):
    m, k = x_shard.shape
    x_gathered = x_shard.new_empty(m * info.world_size, k)
    dist.all_gather_into_tensor(x_gathered, x_shard.contiguous(), group=info.group)
    y = F.linear(x_gathered, weight, bias)
    return y, x_gathered if return_gathered else None


def matmul_reduce_scatter(x, weight, bias, info: GroupInfo):
    partial = F.linear(x, weight)
    out = partial.new_empty(partial.shape[0] // info.world_size, partial.shape[1])
    dist.reduce_scatter_tensor(out, partial, group=info.group)
    if bias is not None:
        out += bias  # once, after the sum
    return out


def matmul_all_reduce(x, weight, bias, info: GroupInfo):
    y = F.linear(x, weight)
    dist.all_reduce(y, group=info.group)
    if bias is not None:
        y += bias
    return y



def all_reduce(x, info: GroupInfo):
    y = x.clone()
    dist.all_reduce(y, group=info.group)
    return y
