"""Tile-order helpers shared by the fused GEMMs."""

import triton
import triton.language as tl


@triton.jit
def grouped_tile(local_id, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of the local_id-th tile in GROUP_M-row bands (L2 reuse of the B tiles)."""
    tiles_in_group = GROUP_M * tiles_n
    first_m = (local_id // tiles_in_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (local_id % tiles_in_group) % group_rows
    pid_n = (local_id % tiles_in_group) // group_rows
    return pid_m, pid_n
