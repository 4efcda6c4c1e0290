"""Process-group helpers shared by the ops and the benchmark (no GEMM knowledge here)."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from fluxtp import _generation


@dataclass(frozen=True)
class GroupInfo:
    """What an op needs to know about its process group."""

    group: dist.ProcessGroup | None  # None: no distributed world at all (a world of one)
    rank: int
    world_size: int

    @property
    def name(self) -> str:
        return "" if self.group is None else self.group.group_name


def resolve_group(group: dist.ProcessGroup | None) -> GroupInfo:
    """The caller's rank and the world size in `group` (default: the world).

    Without an initialized torch.distributed and no group given, the world is one
    process and every op is a plain linear.
    """
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return GroupInfo(None, 0, 1)
        group = dist.group.WORLD
    if isinstance(group, int) and dist.is_initialized() and group == dist.GroupMember.NON_GROUP_MEMBER:
        # What dist.new_group returns on the ranks it leaves out (an int, not a ProcessGroup).
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of the group it was given "
            "(torch.distributed.new_group returned GroupMember.NON_GROUP_MEMBER here); call the op only on the group's ranks"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of group "
            f"{group.group_name!r}; call the op only on the group's ranks"
        )
    return GroupInfo(group, rank, dist.get_world_size(group))


def group_from_name(name: str) -> GroupInfo:
    """Inverse of GroupInfo.name, for the torch.library ops (they take strings, not groups)."""
    if name == "":
        return GroupInfo(None, 0, 1)
    return resolve_group(_resolve_process_group(name))


def backend_name(info: GroupInfo) -> str:
    """The communication backend of a group ("nccl", "gloo", ...), lower case."""
    if info.group is None:
        return "none"
    return str(dist.get_backend(info.group)).lower()


def max_over_ranks(values, info: GroupInfo, device) -> list[float]:
    """Each of `values` maximized over the ranks of info's group (float64; collective), so that
    every rank reaches the same verdict or number; the values themselves without a group."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if info.group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=info.group)
    return t.tolist()


def init_torchrun_cuda() -> tuple[torch.device, GroupInfo]:
    """In a torchrun worker: this rank's GPU (LOCAL_RANK, else RANK) and an NCCL world group."""
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=device)
    return device, resolve_group(None)


def destroy_process_group() -> None:
    """dist.destroy_process_group() after freeing what still holds captured collectives.

    A CUDA graph that captured NCCL work (a decode step, a graphed benchmark variant) kept alive
    past this point made destroy_process_group hang on 2x H200 (the ranks stayed in it until
    killed); such graphs often sit in reference cycles (a model <-> its captured steps), which
    only the cycle collector frees, so collect them first, and let queued work finish."""
    _generation.bump()  # cached call plans hold the groups (and their workspaces' views)
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    dist.destroy_process_group()
