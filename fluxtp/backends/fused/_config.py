"""The GEMM tiling both fused ops share, with the tile-size rule measured on H200."""

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

    @staticmethod
    def prefers_small_tiles(m_total: int, n: int) -> bool:
        """128x128x64 with 4 stages rather than 128x256x64 with 3: on H200 the wide tile wins from
        M = 4096 on and loses at M <= 2048 or narrow N (DESIGN.md, docs/perf-log.md)."""
        return m_total <= 2048 or n <= 4096
