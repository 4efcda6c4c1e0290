"""The GEMM tiling both fused ops share, and the wave-quantization rule that picks its tile width."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GemmTiling:
    """Tile shape and pipelining of a persistent TMA GEMM; every rank must launch the same one."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8  # row bands of tiles visited together (L2 reuse of the weight tiles)
    num_stages: int = 3
    num_warps: int = 8


# SMs of an H100 / H200 (SXM): the wave count the heuristic assumes when it is not told.
HOPPER_SMS = 132
# What a 128x128 tile costs relative to a 128x256 one (half the work, a little less efficient):
# the all-gather's tiles with 128x128 over 128x256 at the one-GPU grid (docs/perf-log.md).
NARROW_TILE_COST = 0.525


def narrow_tiles_win(tile_rows: int, n: int, sms: int = HOPPER_SMS) -> bool:
    """Whether 128x128 tiles finish a persistent GEMM before 128x256 ones: each takes whole waves
    of `sms` tiles, so the wide tile loses where its last wave is mostly empty (448 tiles are 3.4
    waves of 132: 4 waves, against 6.8 -> 7 waves of half the cost). tile_rows: 128-row tiles of
    the whole M (per segment, summed over segments); n: the GEMM's N."""
    wide = tile_rows * -(-n // 256)
    narrow = tile_rows * -(-n // 128)
    return -(-narrow // sms) * NARROW_TILE_COST < -(-wide // sms)
