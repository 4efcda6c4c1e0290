"""Launch helpers shared by the fused ops."""

from __future__ import annotations

import torch


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """TMA needs a unit last stride and a 16-byte aligned base and row stride."""
    if t.stride(-1) != 1 or (t.stride(0) * t.element_size()) % 16:
        t = t.contiguous()
    if t.data_ptr() % 16:
        t = t.clone()
    return t


def num_sms(device: torch.device) -> int:
    """Persistent grid size: one program per SM (a few under the CPU interpreter)."""
    if torch.device(device).type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
