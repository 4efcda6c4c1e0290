"""The "fused" backend: Flux-style persistent Triton GEMMs that wait for, or send, each tile's
data themselves (one file per op beside this one)."""

from __future__ import annotations

import torch

from fluxtp import symm
from fluxtp._dist import GroupInfo

FUSED_DTYPES = (torch.float16, torch.bfloat16)


def unsupported_reason(op: str, x, weight, info: GroupInfo) -> str | None:
    if x.device.type != "cuda":
        return f"it needs CUDA tensors (got {x.device})"
    if x.dtype not in FUSED_DTYPES:
        return f"it supports float16 and bfloat16, got {x.dtype}"
    if x.shape[1] % 8:
        return f"K={x.shape[1]} must be a multiple of 8 (16-byte rows for the TMA descriptors)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return symm.unsupported_reason(info)
