"""Launch helpers shared by the fused ops (host side, kept cheap: they run on every call)."""

from __future__ import annotations

import functools

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

_descriptors: dict[tuple, TensorDescriptor] = {}
_MAX_DESCRIPTORS = 256


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """TMA needs a unit last stride and a 16-byte aligned base and row stride."""
    if t.stride(-1) != 1 or (t.stride(0) * t.element_size()) % 16:
        t = t.contiguous()
    if t.data_ptr() % 16:
        t = t.clone()
    return t


def descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A host TMA descriptor for t, cached: it is a function of (address, shape, strides, block)
    only, so a hit is always valid, and the caching allocator hands out the same addresses."""
    key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, tuple(block))
    desc = _descriptors.get(key)
    if desc is None:
        if len(_descriptors) >= _MAX_DESCRIPTORS:
            _descriptors.clear()
        desc = _descriptors[key] = TensorDescriptor.from_tensor(t, block)
    return desc


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Persistent grid size: one program per SM (a few under the CPU interpreter)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 4
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
