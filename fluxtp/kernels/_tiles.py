"""Tile-order and K-loop helpers shared by the fused GEMMs (and their plain twin, benchmarks/gemm_efficiency.py)."""

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


@triton.jit
def dot_k_block(a, b_desc, k0, col0, acc, B_KN: tl.constexpr, PRECISE_ACC: tl.constexpr):
    """acc + a @ the weight's block at K offset k0 and column col0. b_desc reads w [N, K]
    (nn.Linear), or with B_KN its row-major transpose [K, N] (the backward's view, not copied);
    PRECISE_ACC: FP8 products promoted to float32 after this K block (fluxtp/backends/fused/_scaled.py)."""
    if B_KN:
        acc = tl.dot(a, b_desc.load([k0, col0]), acc)
    elif PRECISE_ACC:
        acc = tl.dot(a, b_desc.load([col0, k0]).T, acc, max_num_imprecise_acc=a.shape[1])
    else:
        acc = tl.dot(a, b_desc.load([col0, k0]).T, acc)
    return acc
