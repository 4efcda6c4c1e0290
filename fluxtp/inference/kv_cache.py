"""A static KV cache: allocated once, at its largest size, so that a decode step captured in a
CUDA graph finds the cache, the position it writes and the mask it reads at the same addresses
on every replay.

Layout per layer: keys and values [max_batch, kv_heads_local, max_len, head_dim] (heads before
positions, so attention reads one (sequence, head)'s keys as one contiguous block). The number
of cached positions lives on the device (`length`, int64 [1]): a captured step reads it, writes
its token's keys at that position and may advance it, all without the host. Every sequence of
the batch has the same length (prompts of one length, see TPLlama.prefill).

Unwritten slots are zeros, not garbage: attention masks them out, but a masked NaN value would
still poison the weighted sum (0 * NaN).
"""

from __future__ import annotations

import torch

# The allocated length is rounded up to this many positions: efficient attention kernels want
# 16-byte aligned mask rows; the extra slots are masked like any other empty slot.
LENGTH_QUANTUM = 16


class StaticKVCache:
    """Keys and values of `num_layers` layers for up to `max_batch` sequences of `max_len` tokens."""

    def __init__(
        self,
        num_layers: int,
        max_batch: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ):
        if max_batch < 1 or max_len < 1:
            raise ValueError(f"a KV cache needs max_batch >= 1 and max_len >= 1, got {max_batch} and {max_len}")
        max_len = -(-max_len // LENGTH_QUANTUM) * LENGTH_QUANTUM
        shape = (max_batch, kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = torch.zeros(1, dtype=torch.long, device=device)  # positions cached so far
        self._positions = torch.arange(max_len, device=device)
        self.max_batch, self.max_len = max_batch, max_len

    def fill(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Prefill: keys/values [B, kv_heads, S, head_dim] become positions 0..S-1 of sequences 0..B-1."""
        batch, _, seq, _ = keys.shape
        self.keys[layer][:batch, :, :seq].copy_(keys)
        self.values[layer][:batch, :, :seq].copy_(values)

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode: keys/values [B, kv_heads, 1, head_dim] go to position `length`; returns the
        whole cache of sequences 0..B-1 ([B, kv_heads, max_len, head_dim] each) to attend over."""
        batch = keys.shape[0]
        cached_keys, cached_values = self.keys[layer][:batch], self.values[layer][:batch]
        cached_keys.index_copy_(2, self.length, keys)  # index on the device: no host sync
        cached_values.index_copy_(2, self.length, values)
        return cached_keys, cached_values

    def decode_mask(self) -> torch.Tensor:
        """[1, 1, 1, max_len] bool: the positions a token decoded at position `length` sees
        (every cached one and its own)."""
        return (self._positions <= self.length).view(1, 1, 1, -1)

    def advance(self) -> None:
        self.length.add_(1)

    def reset(self, length: int = 0) -> None:
        self.length.fill_(length)
