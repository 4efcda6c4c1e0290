"""Persistent GEMM+ReduceScatter (Flux epilogue fusion): out = sum over ranks of x_r @ w_r^T, rows
scattered, every rank's partial tile handed to the rank that owns its rows by the epilogue.

Rows of the partial C = x @ w^T [M, N] are W segments of m = M/W rows; segment o belongs to
rank o. Tiles never span two segments (m need not be a multiple of BLOCK_M: rows past the
segment end are computed from the next segment's or TMA's zero rows, never stored). Tiles are
visited owner step by owner step: step s covers owner (RANK + 1 + s) % W, so at any moment the
ranks write to different owners, and the last step is this rank's own rows; within a step in
grouped_tile order. A launch may run only steps first_step..last_step (the interpreter test
runs every rank's peer steps, then every rank's own step; a real call runs all of them).

Workspace: every rank has one buffer (its base address, as this GPU sees it, is
buffer_ptrs[rank]) holding W-1 partial slots [m, N] of the input dtype and, at byte
flags_offset, W-1 rows of int32 flags, one per tile (pid_m * tiles_n + pid_n) of a segment.
The pair (src, owner) lives in the buffer of its `holder` at slot `other - (other > holder)`:
- push: holder = owner, other = src. The producer stores the tile into the owner's buffer
  over NVLink, then, after a CTA barrier, one release atomic (scope "sys") sets the flag there.
- pull: holder = src, other = owner. The producer stores into its own buffer and sets the flag
  there; the owner waits on the flag and loads the tile over NVLink.
The owner, for each own tile after its K loop, waits (acquire, bounded; on timeout it prints the
source rank and tile and traps) for each peer's flag in rank order, adds that peer's partial
to its float32 accumulator (fixed order: bitwise deterministic), adds the bias once and rounds
once into out [m, N]. Flags must read 0 before the launch (the launcher resets them).
"""

import triton
import triton.language as tl

from fluxtp.kernels._sync import set_flag, trap, wait_flag
from fluxtp.kernels._tiles import grouped_tile


@triton.jit
def matmul_reduce_scatter_kernel(
    a_desc,  # TensorDescriptor over x [M, K], block [BLOCK_M, BLOCK_K]
    b_desc,  # TensorDescriptor over w [N, K] (nn.Linear weight), block [BLOCK_N, BLOCK_K]
    out_ptr,  # out [m, N], this rank's rows of the sum
    bias_ptr,  # [N] or a dummy when HAS_BIAS is False
    buffer_ptrs,  # int64 [W]: base address of every rank's workspace buffer
    rows_per_rank,  # m
    N,
    K,
    stride_om,
    flags_offset,  # bytes from a buffer's base to its int32 flags
    first_step,  # owner steps to run: first_step..last_step (a full call: 0..W-1)
    last_step,
    max_spins,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PUSH: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    tiles_m = tl.cdiv(rows_per_rank, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_per_segment = tiles_m * tiles_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    first_tile = first_step * tiles_per_segment + tl.program_id(0)
    end_tile = (last_step + 1) * tiles_per_segment

    for tile_id in tl.range(first_tile, end_tile, NUM_SMS, num_stages=1):
        owner = (RANK + 1 + tile_id // tiles_per_segment) % WORLD
        pid_m, pid_n = grouped_tile(tile_id % tiles_per_segment, tiles_m, tiles_n, GROUP_M)
        tile = pid_m * tiles_n + pid_n
        row_in_segment = pid_m * BLOCK_M
        col0 = pid_n * BLOCK_N

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in tl.range(k_tiles, num_stages=NUM_STAGES):
            a = a_desc.load([owner * rows_per_rank + row_in_segment, ki * BLOCK_K])
            b = b_desc.load([col0, ki * BLOCK_K])
            acc = tl.dot(a, b.T, acc)

        offs_m = row_in_segment + tl.arange(0, BLOCK_M)
        offs_n = col0 + tl.arange(0, BLOCK_N)
        mask = (offs_m < rows_per_rank)[:, None] & (offs_n < N)[None, :]

        if owner != RANK:
            # Hand the partial tile to its owner: store, CTA barrier (every thread's stores
            # precede the flag), one release atomic.
            if PUSH:
                holder = owner
                slot = RANK - (owner < RANK).to(tl.int32)
            else:
                holder = RANK
                slot = owner - (owner > RANK).to(tl.int32)
            base = tl.load(buffer_ptrs + holder)
            part_ptr = base.to(tl.pointer_type(dtype))
            rows = (slot * rows_per_rank + offs_m).to(tl.int64)
            tl.store(part_ptr + rows[:, None] * N + offs_n[None, :], acc.to(dtype), mask=mask)
            tl.debug_barrier()
            flag_ptr = (base + flags_offset).to(tl.pointer_type(tl.int32)) + slot * tiles_per_segment + tile
            set_flag(flag_ptr, 1, "sys")
        else:
            # Own rows: the peers' partials of this tile, in rank order, onto the accumulator.
            for src in tl.static_range(WORLD):
                if src != RANK:
                    # (compile-time: src, RANK and PUSH are constexpr)
                    if PUSH:
                        holder = RANK
                        if src > RANK:
                            slot = src - 1
                        else:
                            slot = src
                    else:
                        holder = src
                        if RANK > src:
                            slot = RANK - 1
                        else:
                            slot = RANK
                    base = tl.load(buffer_ptrs + holder)
                    flag_ptr = (base + flags_offset).to(tl.pointer_type(tl.int32)) + slot * tiles_per_segment + tile
                    if not wait_flag(flag_ptr, 1, max_spins, "sys"):
                        tl.device_print("fluxtp matmul_reduce_scatter: timed out waiting for rank/tile", src, tile)
                        trap()
                    tl.debug_barrier()  # every thread's loads after the acquire
                    part_ptr = base.to(tl.pointer_type(dtype))
                    rows = (slot * rows_per_rank + offs_m).to(tl.int64)
                    part = tl.load(
                        part_ptr + rows[:, None] * N + offs_n[None, :], mask=mask, other=0.0, cache_modifier=".cg"
                    )
                    acc += part.to(tl.float32) * (src < RANK)
            if HAS_BIAS:
                bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
                acc += bias.to(tl.float32)[None, :]
            out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
            tl.store(out_ptrs, acc.to(dtype), mask=mask)
