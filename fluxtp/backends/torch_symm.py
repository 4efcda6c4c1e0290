"""The "torch" backend: PyTorch's own async-TP ops on symmetric memory (torch.ops.symm_mem).

fused_all_gather_matmul / fused_matmul_reduce_scatter split the matmul into per-rank chunks on
two streams with copy-engine transfers; for all-reduce, the matmul writes into a symmetric
buffer that the one-shot (small) or two-shot (large) symmetric-memory all-reduce then reduces.
CUDA only; no multicast is used.
"""

from __future__ import annotations

import torch

from fluxtp import symm
from fluxtp._dist import GroupInfo

# Above this many bytes the two-shot all-reduce (reduce-scatter + all-gather) moves less data.
ONE_SHOT_MAX_BYTES = 1 << 20


def unsupported_reason(op: str, x, weight, info: GroupInfo) -> str | None:
    if x.device.type != "cuda":
        return f"it needs CUDA tensors (got {x.device}) and an NCCL group with symmetric memory"
    if op in ("matmul_all_reduce", "all_reduce") and x.dtype not in (torch.bfloat16, torch.float32):
        # torch 2.11's one_shot_all_reduce raised NotImplementedError for float16 on 2xH200.
        return f"torch's symmetric-memory all-reduce takes bfloat16 and float32, got {x.dtype}"
    return symm.unsupported_reason(info)


def all_gather_matmul(x_shard, weight, bias, info: GroupInfo, return_gathered: bool):
    symm.enable_for_group(info)
    x_gathered, (y,) = torch.ops.symm_mem.fused_all_gather_matmul(
        x_shard.contiguous(), [weight.t()], 0, info.name, return_A=True
    )
    if bias is not None:
        y += bias
    return y, x_gathered if return_gathered else None


def matmul_reduce_scatter(x, weight, bias, info: GroupInfo):
    symm.enable_for_group(info)
    out = torch.ops.symm_mem.fused_matmul_reduce_scatter(x.contiguous(), weight.t(), "sum", 0, info.name)
    if bias is not None:
        out += bias
    return out


def _symm_all_reduce(info: GroupInfo, numel: int, dtype: torch.dtype, device, fill) -> torch.Tensor:
    """Sum over ranks of the `numel` values `fill(flat)` writes into a symmetric buffer (flat[:numel])."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    # The symmetric all-reduces want 16-byte sizes that split evenly over ranks: reduce a padded
    # flat buffer (its tail is ignored) and return the real values.
    quantum = info.world_size * 16 // itemsize
    padded = -(-numel // quantum) * quantum
    buf = symm.buffer(info, "torch_all_reduce", padded * itemsize, device)
    flat = buf.local(dtype, (padded,))
    fill(flat[:numel])
    if padded * itemsize <= ONE_SHOT_MAX_BYTES:
        reduced = torch.ops.symm_mem.one_shot_all_reduce(flat, "sum", info.name)
    else:
        reduced = torch.empty_like(flat)
        torch.ops.symm_mem.two_shot_all_reduce_out(flat, "sum", info.name, reduced)
    return reduced[:numel]


def matmul_all_reduce(x, weight, bias, info: GroupInfo):
    symm.enable_for_group(info)
    rows, cols = x.shape[0], weight.shape[0]
    y = _symm_all_reduce(
        info, rows * cols, x.dtype, x.device, lambda flat: torch.mm(x, weight.t(), out=flat.view(rows, cols))
    ).view(rows, cols)
    if bias is not None:
        y += bias
    return y


def all_reduce(x, info: GroupInfo):
    symm.enable_for_group(info)
    return _symm_all_reduce(info, x.numel(), x.dtype, x.device, lambda flat: flat.copy_(x.view(-1))).view(x.shape)
