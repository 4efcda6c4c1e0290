"""Persistent AllGather+GEMM, warp-specialized (Gluon, Hopper): the FP8 and bf16 / fp16 calls
whose config asks for it.

The same op as _all_gather_matmul's kernel for scaled calls and for plain calls (these in either
weight layout): tiles in data order, this rank's rows first from its shard, then the peers'
segments in arrival order, each peer tile after its chunk's signal; scales and bias in the
epilogue; the last program resets the signals. SEGMENT_BANDS counts the GROUP_M-row bands across
the segments (same arrival order) instead of within each, so that a wave's tiles share the
weight's columns where a segment has few row tiles; a call's first wave then needs more peers'
rows (the launcher's rule: _all_gather_matmul.segment_bands). PEER_BANDS counts them across the
peers' segments only, after this rank's (as the Triton kernel may; _all_gather_matmul.peer_bands).
Built on fluxtp.kernels._pingpong so that an FP8 call's float32 promotion (PRECISE_ACC) costs no
tensor-core time; fast accumulation (FP8 without PRECISE_ACC) and plain calls (SCALING 0)
accumulate in the MMAs alone:
- a loader warp: waits for a peer tile's chunk signal (bounded; a wait that gives up records
  (rank, chunk, this rank) and traps), then TMA-loads the tile's K blocks into a ring of stages;
- two consumer warpgroups, each computing and storing half of a tile's rows.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma

from fluxtp.kernels._pingpong import (
    accumulate,
    accumulate_plain,
    allocate_pingpong,
    grouped_tile,
    load_tile,
    record_and_trap,
    tma_store,
)


@gluon.jit
def _tile_of(tile, tiles_m, tiles_n, RANK: gl.constexpr, WORLD: gl.constexpr, GROUP_M: gl.constexpr,
             SEGMENT_BANDS: gl.constexpr, PEER_BANDS: gl.constexpr):  # fmt: skip
    """(segment, pid_m, pid_n) of the tile-th tile in the kernel's order (module docstring)."""
    tiles_per_segment = tiles_m * tiles_n
    if SEGMENT_BANDS:
        row, pid_n = grouped_tile(tile, WORLD * tiles_m, tiles_n, GROUP_M)
        segment = (RANK + row // tiles_m) % WORLD
        pid_m = row % tiles_m
    elif PEER_BANDS:  # this rank's segment, then bands across the peers' (1 for a peer's tile)
        peer = (tile >= tiles_per_segment).to(gl.int32)
        row, pid_n = grouped_tile(tile - peer * tiles_per_segment, tiles_m + peer * (WORLD - 2) * tiles_m, tiles_n,
                                  GROUP_M)  # fmt: skip
        segment = (RANK + peer * (1 + row // tiles_m)) % WORLD
        pid_m = row % tiles_m
    else:
        pid_m, pid_n = grouped_tile(tile % tiles_per_segment, tiles_m, tiles_n, GROUP_M)
        segment = (RANK + tile // tiles_per_segment) % WORLD
    return segment, pid_m, pid_n


@gluon.jit
def _loader(a_desc, own_desc, b_desc, a_bufs, b_bufs, ready, empty, signal_ptr, report_ptr, rows_per_rank, N, K,
            chunk_rows, chunks_per_rank, max_spins, RANK: gl.constexpr, WORLD: gl.constexpr, GROUP_M: gl.constexpr,
            NUM_PROGRAMS: gl.constexpr, B_KN: gl.constexpr, SEGMENT_BANDS: gl.constexpr, PEER_BANDS: gl.constexpr,
            SPLIT_ACC: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1] if B_KN else b_desc.block_type.shape[0]
    tiles_m = gl.cdiv(rows_per_rank, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    tiles_per_segment = tiles_m * tiles_n
    ready_chunk = -1  # the chunk waited for last: signals only go from 0 to 1 during a launch
    loaded = 0
    for tile in range(gl.program_id(0), WORLD * tiles_per_segment, NUM_PROGRAMS):
        segment, pid_m, pid_n = _tile_of(tile, tiles_m, tiles_n, RANK, WORLD, GROUP_M, SEGMENT_BANDS, PEER_BANDS)
        if segment == RANK:  # this rank's rows, from its shard
            loaded = load_tile(own_desc, pid_m * BLOCK_M, b_desc, pid_n * BLOCK_N, a_bufs, b_bufs, ready, empty, loaded, K,
                               B_KN, SPLIT_ACC)  # fmt: skip
        else:
            chunk_in_segment = pid_m * BLOCK_M // chunk_rows
            chunk = segment * chunks_per_rank + chunk_in_segment
            if chunk != ready_chunk:
                value = gl.atomic_add(signal_ptr + chunk, 0, sem="acquire", scope="gpu")
                spins = 0
                while (value != 1) & (spins < max_spins):
                    value = gl.atomic_add(signal_ptr + chunk, 0, sem="acquire", scope="gpu")
                    spins += 1
                if value != 1:
                    record_and_trap(report_ptr, segment, chunk_in_segment, RANK)
                ready_chunk = chunk
            loaded = load_tile(a_desc, segment * rows_per_rank + pid_m * BLOCK_M, b_desc, pid_n * BLOCK_N, a_bufs, b_bufs,
                               ready, empty, loaded, K, B_KN, SPLIT_ACC)  # fmt: skip


@gluon.jit
def _epilogue(acc, c_desc, c_smem, c_ptr, bias_ptr, scale_a_ptr, scale_own_ptr, scale_b_ptr, segment, pid_m, col,
              rows_per_rank, N, stride_cm, layout: gl.constexpr, C: gl.constexpr, RANK: gl.constexpr,
              HAS_BIAS: gl.constexpr, TMA_STORE: gl.constexpr, SCALING: gl.constexpr):  # fmt: skip
    """Consumer C's rows of a tile's columns col.. (acc: float32 [BLOCK_M // 2, width] in layout)
    scaled, biased and stored (through c_smem, once its last store has read it)."""
    HALF: gl.constexpr = acc.shape[0]
    WIDTH: gl.constexpr = acc.shape[1]
    rows = pid_m * (2 * HALF) + C * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, layout))  # in the segment
    cols = col + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    if SCALING == 1:
        acc = acc * gl.load(scale_a_ptr) * gl.load(scale_b_ptr)
    elif SCALING == 2:  # row-wise: this rank's rows' scales from its own, the peers' from the gathered
        if segment == RANK:
            row_scales = scale_own_ptr + rows
        else:
            row_scales = scale_a_ptr + segment * rows_per_rank + rows
        scale_a = gl.load(row_scales, mask=rows < rows_per_rank, other=0.0)
        scale_b = gl.load(scale_b_ptr + cols, mask=cols < N, other=0.0)
        acc = acc * gl.expand_dims(scale_a, 1) * gl.expand_dims(scale_b, 0)
    if HAS_BIAS:
        bias = gl.load(bias_ptr + cols, mask=cols < N, other=0.0)
        acc = acc + gl.expand_dims(bias.to(gl.float32), 0)
    out = acc.to(c_ptr.dtype.element_ty)
    if TMA_STORE:  # rows past the segment's end are clipped by the descriptor's bound (C as [W, m, n])
        tma.store_wait(pendings=0)  # the last store from c_smem has read it
        c_smem.reshape([HALF, WIDTH]).store(out)
        fence_async_shared()
        tma_store(c_desc, [segment, pid_m * (2 * HALF) + C * HALF, col], c_smem)
    else:  # output rows TMA cannot store (not 16-byte multiples): only the segment's rows, by pointers
        offs = gl.expand_dims((segment * rows_per_rank + rows).to(gl.int64), 1) * stride_cm + gl.expand_dims(cols, 0)
        mask = gl.expand_dims(rows < rows_per_rank, 1) & gl.expand_dims(cols < N, 0)
        gl.store(c_ptr + offs, out, mask=mask)


@gluon.jit
def _consumer(c_desc, c_ptr, bias_ptr, scale_a_ptr, scale_own_ptr, scale_b_ptr, a_bufs, b_bufs, c_bufs, ready, empty,
              rows_per_rank, N, K, stride_cm, C: gl.constexpr, RANK: gl.constexpr, WORLD: gl.constexpr,
              GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, HAS_BIAS: gl.constexpr, TMA_STORE: gl.constexpr,
              SCALING: gl.constexpr, PRECISE_ACC: gl.constexpr, B_KN: gl.constexpr, SEGMENT_BANDS: gl.constexpr,
              PEER_BANDS: gl.constexpr, SPLIT_ACC: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2] if B_KN else b_bufs.type.shape[1]
    INSTR_K: gl.constexpr = 256 // a_bufs.dtype.primitive_bitwidth  # a wgmma's K: 32 bytes of operand
    ACC_N: gl.constexpr = BLOCK_N // 2 if SPLIT_ACC else BLOCK_N
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, ACC_N, INSTR_K])  # fmt: skip
    tiles_m = gl.cdiv(rows_per_rank, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    tiles_per_segment = tiles_m * tiles_n
    used = 0
    for tile in range(gl.program_id(0), WORLD * tiles_per_segment, NUM_PROGRAMS):
        segment, pid_m, pid_n = _tile_of(tile, tiles_m, tiles_n, RANK, WORLD, GROUP_M, SEGMENT_BANDS, PEER_BANDS)
        if PRECISE_ACC:
            acc, acc_hi, used = accumulate(a_bufs, b_bufs, ready, empty, used, K, C, layout, SPLIT_ACC)
        else:
            acc, used = accumulate_plain(a_bufs, b_bufs, ready, empty, used, K, C, layout, B_KN)
        c_smem = c_bufs.index(C)
        _epilogue(acc, c_desc, c_smem, c_ptr, bias_ptr, scale_a_ptr, scale_own_ptr, scale_b_ptr, segment, pid_m,
                  pid_n * BLOCK_N, rows_per_rank, N, stride_cm, layout, C, RANK, HAS_BIAS, TMA_STORE, SCALING)  # fmt: skip
        if SPLIT_ACC:  # the columns' second half, through the same staging buffer
            _epilogue(acc_hi, c_desc, c_smem, c_ptr, bias_ptr, scale_a_ptr, scale_own_ptr, scale_b_ptr, segment, pid_m,
                      pid_n * BLOCK_N + ACC_N, rows_per_rank, N, stride_cm, layout, C, RANK, HAS_BIAS, TMA_STORE,
                      SCALING)  # fmt: skip
    if TMA_STORE:
        tma.store_wait(pendings=0)


@gluon.jit
def all_gather_matmul_pingpong_kernel(
    a_desc,  # Gluon TensorDescriptor over A_gathered [W*m, K] (float8, bf16, fp16), block [BLOCK_M, BLOCK_K]
    own_desc,  # over this rank's shard [m, K], block [BLOCK_M, BLOCK_K]
    b_desc,  # over B [n, K] (row-major), block [BLOCK_N, BLOCK_K]; with B_KN over B^T [K, n], block [BLOCK_K, BLOCK_N]
    c_desc,  # over C as [W, m, n], block [1, BLOCK_M // 2, BLOCK_N] (used with TMA_STORE; else it types the staging)
    c_ptr,  # C [W*m, n] in the output dtype
    bias_ptr,  # [n] or a dummy when HAS_BIAS is False
    signal_ptr,  # int32 [W * chunks_per_rank]
    done_ptr,  # int32 [1], 0 at launch
    rows_per_rank,
    N,
    K,
    stride_cm,
    chunk_rows,  # a multiple of BLOCK_M
    chunks_per_rank,
    max_spins,
    signal_reset,  # what the last program writes into the signals: 0 (a call), 1 (GEMM-only mode)
    report_ptr,  # int32 [3], host-readable: where a wait that gives up records (rank, chunk, this rank)
    scale_a_ptr,  # float32 scales of A_gathered's rows (row-wise) or of A (per tensor); None unscaled
    scale_own_ptr,  # float32 scales of this rank's shard's rows (row-wise) or of A
    scale_b_ptr,  # float32 scales of B's rows [n] (row-wise) or of B
    RANK: gl.constexpr,
    WORLD: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    TMA_STORE: gl.constexpr,
    SCALING: gl.constexpr,  # 0 unscaled (bf16, fp16), 1 per tensor, 2 row-wise
    PRECISE_ACC: gl.constexpr,  # FP8 products promoted into float32 every two K blocks (not use_fast_accum)
    B_KN: gl.constexpr,  # b_desc reads the weight's row-major transpose (backward; bf16 / fp16 only)
    SEGMENT_BANDS: gl.constexpr,  # GROUP_M bands counted across the segments (module docstring)
    PEER_BANDS: gl.constexpr,  # ... across the peers' segments, after this rank's (module docstring)
    SPLIT_ACC: gl.constexpr,  # PRECISE_ACC in column halves (fluxtp.kernels._pingpong); c_desc's block half as wide
    num_warps: gl.constexpr,  # 4: consumer 0 (the default partition)
):
    a_bufs, b_bufs, c_bufs, ready, empty = allocate_pingpong(a_desc, b_desc, c_desc, NUM_STAGES)
    # Partition arguments are spelled out in each tuple: constexprs keep their kind only so.
    gl.warp_specialize(
        [
            (_consumer, (c_desc, c_ptr, bias_ptr, scale_a_ptr, scale_own_ptr, scale_b_ptr, a_bufs, b_bufs, c_bufs, ready,
                         empty, rows_per_rank, N, K, stride_cm, 0, RANK, WORLD, GROUP_M, NUM_PROGRAMS, HAS_BIAS,
                         TMA_STORE, SCALING, PRECISE_ACC, B_KN, SEGMENT_BANDS, PEER_BANDS, SPLIT_ACC)),
            (_consumer, (c_desc, c_ptr, bias_ptr, scale_a_ptr, scale_own_ptr, scale_b_ptr, a_bufs, b_bufs, c_bufs, ready,
                         empty, rows_per_rank, N, K, stride_cm, 1, RANK, WORLD, GROUP_M, NUM_PROGRAMS, HAS_BIAS,
                         TMA_STORE, SCALING, PRECISE_ACC, B_KN, SEGMENT_BANDS, PEER_BANDS, SPLIT_ACC)),
            (_loader, (a_desc, own_desc, b_desc, a_bufs, b_bufs, ready, empty, signal_ptr, report_ptr, rows_per_rank, N,
                       K, chunk_rows, chunks_per_rank, max_spins, RANK, WORLD, GROUP_M, NUM_PROGRAMS, B_KN,
                       SEGMENT_BANDS, PEER_BANDS, SPLIT_ACC)),
        ],
        [4, 1],
        [232, 40],
    )  # fmt: skip

    # Consumer 0 is past every tile, so the loader is past every wait of this program: the last
    # program in may reset the signals (and the count) for the next call.
    if gl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu") == gl.num_programs(0) - 1:
        num_signals = WORLD * chunks_per_rank
        offs = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
        for start in range(0, num_signals, 128):
            gl.store(signal_ptr + start + offs, signal_reset, mask=start + offs < num_signals)
        gl.atomic_xchg(done_ptr, 0, sem="relaxed", scope="gpu")
