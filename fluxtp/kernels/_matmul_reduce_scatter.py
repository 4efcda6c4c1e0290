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
  over NVLink; after its next tile's K loop, a CTA barrier and one release atomic (scope "sys")
  set the flag there.
- pull: holder = src, other = owner. The producer stores into its own buffer and sets the flag
  there; the owner waits on the flag and loads the tile over NVLink.
- copy engine (PUSH and COPY_ENGINE): the producer stores the tile into its own buffer (slot
  W-1 + other: outgoing slots follow the incoming ones) and counts it, release, into a counter
  per band of GROUP_M tile rows there (the W-1 rows of counters follow the W-1 rows of flags).
  A copy stream waits for a band's count, copies the band into the owner's buffer as push
  would have stored it, then sets the owner's flag for the band (one flag per band, not per
  tile). The SMs never write over NVLink: their stores all land at once at the end of each wave
  of tiles, and the NVLink burst held them there (docs/perf-log.md).
The owner, for each own tile after its K loop, waits (acquire, bounded) for every peer's flag, then adds the peers' partials in rank
order to its float32 accumulator (a fixed order: bitwise deterministic, and push and pull give
the same bits), adds the bias once and rounds once into out [m, N]. Flags must read 0 before
the launch (the launcher resets them).

The epilogue runs on EPI_SPLIT column slices of the tile (register pressure), and tells the
compiler that buffer bases are 16-byte aligned (addresses loaded from memory carry no
alignment), so rows with N % 8 == 0 move in 16-byte accesses.

Scaled (FP8) calls (SCALING, fluxtp/backends/fused/_scaled.py): x and w are float8; each tile's
float32 accumulator is multiplied by its scales right after its K loop (row-wise: x's scale of
each row of the whole x, w's of each column); the partial slots hold out_dtype, as NCCL-then-GEMM's
and PyTorch's scaled async-TP partials do (half float32's bytes), and the owner sums them in float32.

A wait that gives up writes (source rank, tile, this rank) to `report_ptr` (host-pinned memory,
still readable after the trap; the launcher reports it) and traps. No device_print: a printf
call, even in a branch never taken, slowed a fused kernel here by 25% (docs/perf-log.md).
"""

import triton
import triton.language as tl

from fluxtp.kernels._sync import give_up, set_flag, wait_flags
from fluxtp.kernels._tiles import dot_k_block, grouped_tile


@triton.jit
def _halves(x, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """Columns [0, WIDTH/2) and [WIDTH/2, WIDTH) of x [BLOCK_M, WIDTH], as two register tensors."""
    x = tl.permute(tl.reshape(x, (BLOCK_M, 2, WIDTH // 2)), (0, 2, 1))
    return tl.split(x)


@triton.jit
def _handover(owner, RANK: tl.constexpr, WORLD: tl.constexpr, PUSH: tl.constexpr, COPY_ENGINE: tl.constexpr):
    """(holder, slot): the buffer and partial slot where this rank's tile of `owner`'s rows goes;
    the flag (or, copy engine, the band counter) of that slot is in the same buffer."""
    if COPY_ENGINE:  # this rank's outgoing slots follow its W-1 incoming ones
        holder = RANK
        slot = (WORLD - 1) + owner - (owner > RANK).to(tl.int32)
    elif PUSH:
        holder = owner
        slot = RANK - (owner < RANK).to(tl.int32)
    else:
        holder = RANK
        slot = owner - (owner > RANK).to(tl.int32)
    return holder, slot


@triton.jit
def _partial(i, buffer_ptrs, offs_m, offs_n, mask, rows_per_rank, N, dtype: tl.constexpr, RANK: tl.constexpr,
             PUSH: tl.constexpr):
    """The i-th peer's (in rank order) partial of this rank's tile slice, as float32."""
    src = tl.where(i >= RANK, i + 1, i)
    if PUSH:
        holder = RANK
        slot = i
    else:
        holder = src
        slot = tl.where(RANK > src, RANK - 1, RANK)
    # Buffers are 16-byte aligned: the hint lets N % 8 == 0 rows use 16-byte accesses.
    part_ptr = tl.multiple_of(tl.load(buffer_ptrs + holder).to(tl.pointer_type(dtype)), 16)
    rows = (slot * rows_per_rank + offs_m).to(tl.int64)
    # .cg: from L2, where the peers' stores land, never from a stale L1 line.
    part = tl.load(part_ptr + rows[:, None] * N + offs_n[None, :], mask=mask, other=0.0, cache_modifier=".cg")
    return part.to(tl.float32)


@triton.jit
def _epilogue(
    acc,  # float32 [BLOCK_M, width]: columns col.. of the tile
    own,  # this rank owns the tile's rows: reduce and write out; else hand the partial over
    owner,
    row_in_segment,
    col,
    buffer_ptrs,
    out_ptr,
    bias_ptr,
    rows_per_rank,
    N,
    stride_om,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PUSH: tl.constexpr,
    COPY_ENGINE: tl.constexpr,
    REDUCE_UNROLL: tl.constexpr,
):
    BLOCK_M: tl.constexpr = acc.shape[0]
    WIDTH: tl.constexpr = acc.shape[1]
    dtype = out_ptr.dtype.element_ty  # the partial slots' too
    offs_m = row_in_segment + tl.arange(0, BLOCK_M)
    offs_n = col + tl.arange(0, WIDTH)
    mask = (offs_m < rows_per_rank)[:, None] & (offs_n < N)[None, :]
    if own:
        # The peers' partials (their flags were acquired), in rank order, onto the accumulator.
        # Unrolled, the loads of every peer can be in flight at once (W-1 round trips to memory
        # otherwise wait one after the other); rolled, one peer's slice at a time is live.
        if REDUCE_UNROLL:
            for i in tl.static_range(WORLD - 1):
                acc += _partial(i, buffer_ptrs, offs_m, offs_n, mask, rows_per_rank, N, dtype, RANK, PUSH)
        else:
            for i in range(WORLD - 1):
                acc += _partial(i, buffer_ptrs, offs_m, offs_n, mask, rows_per_rank, N, dtype, RANK, PUSH)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], acc.to(dtype), mask=mask)
    else:
        holder, slot = _handover(owner, RANK, WORLD, PUSH, COPY_ENGINE)
        part_ptr = tl.multiple_of(tl.load(buffer_ptrs + holder).to(tl.pointer_type(dtype)), 16)
        rows = (slot * rows_per_rank + offs_m).to(tl.int64)
        tl.store(part_ptr + rows[:, None] * N + offs_n[None, :], acc.to(dtype), mask=mask)


@triton.jit
def matmul_reduce_scatter_kernel(
    a_desc,  # TensorDescriptor over x [M, K], block [BLOCK_M, BLOCK_K]
    b_desc,  # over w [N, K] (nn.Linear weight), block [BLOCK_N, BLOCK_K]; with B_KN over w^T [K, N], block [BLOCK_K, BLOCK_N]
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
    report_ptr,  # int32 [3]: where a timed-out wait records (source rank, tile, rank)
    scale_a_ptr,  # scaled calls: float32 scales of x's rows [M] (row-wise) or of x (per tensor); else None
    scale_b_ptr,  # scaled calls: float32 scales of w's rows [N] (row-wise) or of w; else None
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
    EPI_SPLIT: tl.constexpr,  # the epilogue works on 1, 2 or 4 column slices (fewer live registers)
    B_KN: tl.constexpr,  # b_desc reads the weight's row-major transpose [K, N] (backward: no copy)
    COPY_ENGINE: tl.constexpr,  # (with PUSH) peer tiles stay local; a copy stream pushes bands of them
    REDUCE_UNROLL: tl.constexpr,  # the owner's W-1 partial loads unrolled (all in flight) or one at a time
    WORLD_POW2: tl.constexpr,  # the next power of two >= WORLD (the owner reads its peers' flags as one vector)
    SCALING: tl.constexpr,  # 0 unscaled, 1 per tensor, 2 row-wise (FP8 operands)
    PRECISE_ACC: tl.constexpr,  # FP8 products promoted to float32 after each K block (not use_fast_accum)
):
    tl.static_assert((EPI_SPLIT == 1) | (EPI_SPLIT == 2) | (EPI_SPLIT == 4))
    tiles_m = tl.cdiv(rows_per_rank, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_per_segment = tiles_m * tiles_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    bands = tl.cdiv(tiles_m, GROUP_M)  # copy-engine mode: one flag per GROUP_M rows of tiles
    first_tile = first_step * tiles_per_segment + tl.program_id(0)
    end_tile = (last_step + 1) * tiles_per_segment
    # A peer tile's flag is released only after the next tile's K loop (or after the last tile),
    # when its stores are long complete: released right after them, the fence held every SM for
    # their NVLink round trip (2% of the whole kernel at 4096x8192x28672, docs/perf-log.md). Each
    # program releases what it holds before it waits for anything, so no wait can close a cycle.
    pending = 0
    pending_flag = (tl.load(buffer_ptrs + RANK) + flags_offset).to(tl.pointer_type(tl.int32))

    # Two loops, the peer steps' tiles and then the own step's, each compiled without the other's
    # epilogue (`own` is a constant in each): a loop holding both paths ran 1-2% slower at W = 4
    # and 8. A program visits its tiles in the same order either way.
    own_first = (WORLD - 1) * tiles_per_segment  # the own step's first tile
    for own in tl.static_range(2):  # 0: the peer steps, 1: the own step
        if own:
            start = first_tile + tl.cdiv(tl.maximum(own_first - first_tile, 0), NUM_SMS) * NUM_SMS
            stop = end_tile
        else:
            start = first_tile
            stop = tl.minimum(end_tile, own_first)
        for tile_id in tl.range(start, stop, NUM_SMS, num_stages=1):
            owner = (RANK + 1 + tile_id // tiles_per_segment) % WORLD
            pid_m, pid_n = grouped_tile(tile_id % tiles_per_segment, tiles_m, tiles_n, GROUP_M)
            tile = pid_m * tiles_n + pid_n
            row_in_segment = pid_m * BLOCK_M
            col0 = pid_n * BLOCK_N

            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in tl.range(k_tiles, num_stages=NUM_STAGES):
                a = a_desc.load([owner * rows_per_rank + row_in_segment, ki * BLOCK_K])
                acc = dot_k_block(a, b_desc, ki * BLOCK_K, col0, acc, B_KN, PRECISE_ACC)
            if SCALING == 1:
                acc = acc * tl.load(scale_a_ptr) * tl.load(scale_b_ptr)
            elif SCALING == 2:
                rows_s = row_in_segment + tl.arange(0, BLOCK_M)
                cols_s = col0 + tl.arange(0, BLOCK_N)
                scale_a = tl.load(scale_a_ptr + owner * rows_per_rank + rows_s, mask=rows_s < rows_per_rank, other=0.0)
                scale_b = tl.load(scale_b_ptr + cols_s, mask=cols_s < N, other=0.0)
                acc = acc * scale_a[:, None] * scale_b[None, :]

            if pending != 0:
                tl.debug_barrier()  # every thread's stores of that tile came before this barrier
                set_flag(pending_flag, 1, "sys")
            pending = 0

            if own:
                # Every peer's partial of this tile has arrived (acquire), after the K loop (which
                # overlaps the peers' work), before any thread loads one. All W-1 flags are read at
                # once: one at a time, their round trips added up.
                srcs = tl.arange(0, WORLD_POW2)
                peer = (srcs < WORLD) & (srcs != RANK)
                if PUSH:
                    holders = tl.full((WORLD_POW2,), RANK, tl.int32)
                    slots = srcs - (srcs > RANK).to(tl.int32)
                else:
                    holders = srcs
                    slots = tl.full((WORLD_POW2,), RANK, tl.int32) - (srcs < RANK).to(tl.int32)
                bases = tl.load(buffer_ptrs + holders, mask=peer, other=0) + flags_offset
                if COPY_ENGINE:
                    index = slots * bands + pid_m // GROUP_M
                else:
                    index = slots * tiles_per_segment + tile
                flag_ptrs = bases.to(tl.pointer_type(tl.int32)) + index
                arrived = wait_flags(flag_ptrs, peer, 1, max_spins, "sys")
                if tl.min(arrived.to(tl.int32), 0) == 0:
                    late = tl.min(tl.where(arrived, WORLD_POW2, srcs), 0)
                    give_up(report_ptr, pending_flag, late, tile, RANK)
                tl.debug_barrier()

            if EPI_SPLIT == 1:
                _epilogue(acc, own, owner, row_in_segment, col0, buffer_ptrs, out_ptr, bias_ptr,
                          rows_per_rank, N, stride_om, RANK, WORLD, HAS_BIAS, PUSH, COPY_ENGINE, REDUCE_UNROLL)
            elif EPI_SPLIT == 2:
                a0, a1 = _halves(acc, BLOCK_M, BLOCK_N)
                _epilogue(a0, own, owner, row_in_segment, col0, buffer_ptrs, out_ptr, bias_ptr,
                          rows_per_rank, N, stride_om, RANK, WORLD, HAS_BIAS, PUSH, COPY_ENGINE, REDUCE_UNROLL)
                _epilogue(a1, own, owner, row_in_segment, col0 + BLOCK_N // 2, buffer_ptrs, out_ptr, bias_ptr,
                          rows_per_rank, N, stride_om, RANK, WORLD, HAS_BIAS, PUSH, COPY_ENGINE, REDUCE_UNROLL)
            else:
                a0, a1 = _halves(acc, BLOCK_M, BLOCK_N)
                a00, a01 = _halves(a0, BLOCK_M, BLOCK_N // 2)
                a10, a11 = _halves(a1, BLOCK_M, BLOCK_N // 2)
                _epilogue(a00, own, owner, row_in_segment, col0, buffer_ptrs, out_ptr, bias_ptr,
                          rows_per_rank, N, stride_om, RANK, WORLD, HAS_BIAS, PUSH, COPY_ENGINE, REDUCE_UNROLL)
                _epilogue(a01, own, owner, row_in_segment, col0 + BLOCK_N // 4, buffer_ptrs, out_ptr, bias_ptr,
                          rows_per_rank, N, stride_om, RANK, WORLD, HAS_BIAS, PUSH, COPY_ENGINE, REDUCE_UNROLL)
                _epilogue(a10, own, owner, row_in_segment, col0 + BLOCK_N // 2, buffer_ptrs, out_ptr, bias_ptr,
                          rows_per_rank, N, stride_om, RANK, WORLD, HAS_BIAS, PUSH, COPY_ENGINE, REDUCE_UNROLL)
                _epilogue(a11, own, owner, row_in_segment, col0 + 3 * BLOCK_N // 4, buffer_ptrs, out_ptr, bias_ptr,
                          rows_per_rank, N, stride_om, RANK, WORLD, HAS_BIAS, PUSH, COPY_ENGINE, REDUCE_UNROLL)

            if not own:
                holder, slot = _handover(owner, RANK, WORLD, PUSH, COPY_ENGINE)
                flags = (tl.load(buffer_ptrs + holder) + flags_offset).to(tl.pointer_type(tl.int32))
                if COPY_ENGINE:
                    # Count the tile into its band, in this rank's memory, where the copy stream waits
                    # for the band to fill. At once: the fence waits only for local stores, and a late
                    # count would hold the last band's copy back by a whole tile.
                    tl.debug_barrier()
                    tl.atomic_add(flags + slot * bands + pid_m // GROUP_M, 1, sem="release", scope="sys")
                else:
                    # The tile's flag, released after the next tile's K loop (above) or after the loop.
                    pending_flag = flags + slot * tiles_per_segment + tile
                    pending = 1

    if pending != 0:
        tl.debug_barrier()
        set_flag(pending_flag, 1, "sys")
