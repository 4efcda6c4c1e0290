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

STREAM_K (calls without PRECISE_ACC; the launcher's rule: stream_k_tiles): the last sk_tiles tiles
in that order, where whole tiles would leave the last wave part empty, are split by K over every
program: program p takes K iterations p * T // P .. (p + 1) * T // P - 1 of their T (T >= P: none
takes none), so its range begins with the end of one tile and ends with the start of another.
It runs its pieces last first, each by rising K: every program is at about the same K offset at
once, as in whole tiles, so the weight's blocks can be shared in L2 (range order would spread
the programs over the whole K; not measured apart, docs/perf-log.md). A piece
is accumulated in two column halves (a 256-wide tile's by two wgmmas a block). One that does not
end its tile is stored as float32 partials into its program's slot (`partial_desc`, through the
output staging) and flagged (release); the piece that ends the tile, its program's last, adds the
tile's other pieces in program order (deterministic) once its loader saw them all flagged
(acquire, bounded) and stores the tile half by half (`c_half_desc`), resetting their flags for
the next launch. The pieces waited for are their programs' first, so the wait is for work long
done.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from fluxtp.kernels._pingpong import (
    NAMED_REINTERPRET,
    accumulate,
    accumulate_blocks,
    accumulate_halves,
    accumulate_plain,
    allocate_pingpong,
    fence_async_proxy,
    grouped_tile,
    load_blocks,
    load_tile,
    partition_barrier,
    record_and_trap,
    stores_written,
    tma_load,
    tma_store,
    wait_flag,
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
def _stream_k_range(sk_tiles, k_tiles, NUM_PROGRAMS: gl.constexpr):
    """This program's K iterations [start, end) of the split tiles' sk_tiles * k_tiles (module docstring)."""
    total = sk_tiles * k_tiles
    pid = gl.program_id(0)
    return pid * total // NUM_PROGRAMS, (pid + 1) * total // NUM_PROGRAMS


@gluon.jit
def _stream_k_piece(it, start, k_tiles, whole_tiles, tiles_m, tiles_n, RANK: gl.constexpr, WORLD: gl.constexpr,
                    GROUP_M: gl.constexpr, SEGMENT_BANDS: gl.constexpr, PEER_BANDS: gl.constexpr):  # fmt: skip
    """The piece of this program's range (from `start`) that ends at iteration it: (the split
    tile's index among them, its first and past-last K block, its segment, pid_m, pid_n)."""
    local = (it - 1) // k_tiles
    first = local * k_tiles
    segment, pid_m, pid_n = _tile_of(whole_tiles + local, tiles_m, tiles_n, RANK, WORLD, GROUP_M, SEGMENT_BANDS,
                                     PEER_BANDS)  # fmt: skip
    return local, gl.maximum(first, start) - first, it - first, segment, pid_m, pid_n


@gluon.jit
def _wait_for_chunk(ready_chunk, segment, pid_m, signal_ptr, report_ptr, chunk_rows, chunks_per_rank, max_spins,
                    RANK: gl.constexpr, BLOCK_M: gl.constexpr):  # fmt: skip
    """A peer tile's wait for its chunk's signal (bounded: record and trap), unless it is the chunk
    waited for last (signals only go from 0 to 1 during a launch); returns that chunk."""
    chunk_in_segment = pid_m * BLOCK_M // chunk_rows
    chunk = segment * chunks_per_rank + chunk_in_segment
    if chunk != ready_chunk:
        if wait_flag(signal_ptr + chunk, max_spins) != 1:
            record_and_trap(report_ptr, segment, chunk_in_segment, RANK)
        fence_async_proxy()  # the acquire before the chunk's TMA loads
    return chunk


@gluon.jit
def _first_program(local, k_tiles, sk_tiles, NUM_PROGRAMS: gl.constexpr):
    """The program whose range holds the first K block of split tile `local` (_stream_k_range)."""
    total = sk_tiles * k_tiles
    return ((local * k_tiles + 1) * NUM_PROGRAMS + total - 1) // total - 1


@gluon.jit
def _wait_for_earlier_pieces(start, k_tiles, sk_tiles, flags_ptr, pieces_ready, report_ptr, max_spins,
                             RANK: gl.constexpr, NUM_PROGRAMS: gl.constexpr):  # fmt: skip
    """The loader's wait, once its loads are issued, for the earlier pieces of the split tile this
    program ends (its range begins inside it): every consumer's flag of each program before it that
    holds one (acquire, bounded: record (program, -1 - tile, this rank) and trap); then
    `pieces_ready` completes for the consumers. Not in the consumers: a spin-wait beside their
    accumulators made Triton 3.6's ptxas spill them and serialize the MMAs (docs/perf-log.md)."""
    if start % k_tiles > 0:
        local = start // k_tiles
        for q in range(_first_program(local, k_tiles, sk_tiles, NUM_PROGRAMS), gl.program_id(0)):
            for c in gl.static_range(2):
                if wait_flag(flags_ptr + 2 * q + c, max_spins) != 1:
                    record_and_trap(report_ptr, q, -1 - local, RANK)
        mbarrier.arrive(pieces_ready, count=1)


@gluon.jit
def _loader(a_desc, own_desc, b_desc, a_bufs, b_bufs, ready, empty, signal_ptr, report_ptr, rows_per_rank, N, K,
            chunk_rows, chunks_per_rank, max_spins, sk_tiles, sk_flags_ptr, sk_bars, RANK: gl.constexpr, WORLD: gl.constexpr,
            GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, B_KN: gl.constexpr, SEGMENT_BANDS: gl.constexpr,
            PEER_BANDS: gl.constexpr, SPLIT_ACC: gl.constexpr, STREAM_K: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1] if B_KN else b_desc.block_type.shape[0]
    tiles_m = gl.cdiv(rows_per_rank, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    tiles_per_segment = tiles_m * tiles_n
    whole_tiles = WORLD * tiles_per_segment - sk_tiles
    ready_chunk = -1
    loaded = 0
    for tile in range(gl.program_id(0), whole_tiles, NUM_PROGRAMS):
        segment, pid_m, pid_n = _tile_of(tile, tiles_m, tiles_n, RANK, WORLD, GROUP_M, SEGMENT_BANDS, PEER_BANDS)
        if segment == RANK:  # this rank's rows, from its shard
            loaded = load_tile(own_desc, pid_m * BLOCK_M, b_desc, pid_n * BLOCK_N, a_bufs, b_bufs, ready, empty, loaded, K,
                               B_KN, SPLIT_ACC)  # fmt: skip
        else:
            ready_chunk = _wait_for_chunk(ready_chunk, segment, pid_m, signal_ptr, report_ptr, chunk_rows,
                                          chunks_per_rank, max_spins, RANK, BLOCK_M)  # fmt: skip
            loaded = load_tile(a_desc, segment * rows_per_rank + pid_m * BLOCK_M, b_desc, pid_n * BLOCK_N, a_bufs, b_bufs,
                               ready, empty, loaded, K, B_KN, SPLIT_ACC)  # fmt: skip
    if STREAM_K:
        k_tiles = gl.cdiv(K, BLOCK_K)
        start, it = _stream_k_range(sk_tiles, k_tiles, NUM_PROGRAMS)
        while it > start:  # the range's pieces last first (module docstring)
            local, k0, k1, segment, pid_m, pid_n = _stream_k_piece(it, start, k_tiles, whole_tiles, tiles_m, tiles_n, RANK,
                                                                   WORLD, GROUP_M, SEGMENT_BANDS, PEER_BANDS)  # fmt: skip
            if segment == RANK:
                loaded = load_blocks(own_desc, pid_m * BLOCK_M, b_desc, pid_n * BLOCK_N, a_bufs, b_bufs, ready, empty,
                                     loaded, k0, k1, B_KN)  # fmt: skip
            else:
                ready_chunk = _wait_for_chunk(ready_chunk, segment, pid_m, signal_ptr, report_ptr, chunk_rows,
                                              chunks_per_rank, max_spins, RANK, BLOCK_M)  # fmt: skip
                loaded = load_blocks(a_desc, segment * rows_per_rank + pid_m * BLOCK_M, b_desc, pid_n * BLOCK_N, a_bufs,
                                     b_bufs, ready, empty, loaded, k0, k1, B_KN)  # fmt: skip
            it -= k1 - k0
        _wait_for_earlier_pieces(start, k_tiles, sk_tiles, sk_flags_ptr, sk_bars.index(2), report_ptr, max_spins, RANK,
                                 NUM_PROGRAMS)  # fmt: skip


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
def _column_halves(acc):
    """acc's left and right column halves (a split of each thread's registers, no data moved)."""
    HALF: gl.constexpr = acc.shape[0]
    WIDTH: gl.constexpr = acc.shape[1]
    return gl.split(acc.reshape([HALF, 2, WIDTH // 2]).permute(0, 2, 1))


@gluon.jit
def _accumulate_piece(a_bufs, b_bufs, ready, empty, used, k_blocks, C: gl.constexpr, layout: gl.constexpr,
                      half_layout: gl.constexpr, B_KN: gl.constexpr):  # fmt: skip
    """A split tile's piece as consumer C's (left, right) column halves in half_layout, and the
    running stage count: a 256-wide tile's in two accumulators (accumulate_halves), a narrower
    one's split from one (two 64-wide wgmmas would read A's stage twice as often for the same
    products)."""
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2] if B_KN else b_bufs.type.shape[1]
    if BLOCK_N > 128:
        left, right, used = accumulate_halves(a_bufs, b_bufs, ready, empty, used, k_blocks, C, half_layout, B_KN)
    else:
        acc, used = accumulate_blocks(a_bufs, b_bufs, ready, empty, used, k_blocks, C, layout, B_KN)
        left, right = _column_halves(acc)
        # The halves' registers as half_layout has them: a change of name, not of place.
        left = gl.convert_layout(left, half_layout)
        right = gl.convert_layout(right, half_layout)
    return left, right, used


@gluon.jit
def _staging_as(c_smem, desc):
    """The consumer's output staging buffer ([1, rows, columns]) seen as one block of `desc` (a
    half tile's column half, float32 or the output's dtype): the first of the blocks it holds."""
    SOURCE_BITS: gl.constexpr = c_smem.type.shape[1] * c_smem.type.shape[2] * c_smem.dtype.primitive_bitwidth
    BLOCK: gl.constexpr = desc.block_type.shape
    BLOCK_BITS: gl.constexpr = BLOCK[1] * BLOCK[2] * desc.dtype.primitive_bitwidth
    gl.static_assert(SOURCE_BITS % BLOCK_BITS == 0)
    SHAPE: gl.constexpr = [SOURCE_BITS // BLOCK_BITS, BLOCK[0], BLOCK[1], BLOCK[2]]
    if NAMED_REINTERPRET:  # an else, not an early return: Triton 3.9 compiles the code after one too
        view = c_smem.reinterpret(desc.dtype, SHAPE, desc.layout)
    else:
        view = c_smem._reinterpret(desc.dtype, SHAPE, desc.layout)
    return view.index(0)


@gluon.jit
def _store_staged(piece, staging, partial_desc, coord):
    """piece TMA-stored at coord of the partials through the staging buffer, once its last store read it."""
    tma.store_wait(pendings=0)
    staging.reshape(piece.shape).store(piece)
    fence_async_shared()
    tma_store(partial_desc, coord, staging)


@gluon.jit
def _publish_partial(left, right, c_smem, partial_desc, flags_ptr, C: gl.constexpr):
    """A piece of a split tile that does not end it: consumer C's column halves through its
    staging buffer, TMA-stored into this program's slot of the partials, then flagged (release,
    once the stores have written it: stores_written)."""
    staging = _staging_as(c_smem, partial_desc)
    slot = 2 * gl.program_id(0) + C
    _store_staged(left, staging, partial_desc, [slot, 0, 0])
    _store_staged(right, staging, partial_desc, [slot, 0, left.shape[1]])
    stores_written()
    gl.atomic_xchg(flags_ptr + slot, 1, sem="release", scope="gpu")


@gluon.jit
def _add_partials(left, right, c_smem, partial_desc, bars, local, k_tiles, sk_tiles, flags_ptr, C: gl.constexpr,
                  NUM_PROGRAMS: gl.constexpr):  # fmt: skip
    """The piece that ends a split tile (this program's last): consumer C's column halves plus the
    tile's earlier pieces' partials in program order (none where the tile began here), once the
    loader saw them all flagged (bars[2]), TMA-loaded half by half into the staging buffer
    (bars[C]); each flag of C's reset for the next launch."""
    staging = _staging_as(c_smem, partial_desc)
    first_program = _first_program(local, k_tiles, sk_tiles, NUM_PROGRAMS)
    if first_program < gl.program_id(0):
        mbarrier.wait(bars.index(2), 0)
        fence_async_proxy()  # the loader's acquires (seen through bars[2]) before the partials' TMA loads
    loads = 0
    tma.store_wait(pendings=0)  # the staging buffer's last store has read it
    for q in range(first_program, gl.program_id(0)):
        left = _add_staged(left, staging, partial_desc, bars.index(C), loads, [2 * q + C, 0, 0])
        right = _add_staged(right, staging, partial_desc, bars.index(C), loads + 1, [2 * q + C, 0, left.shape[1]])
        loads += 2
        gl.atomic_xchg(flags_ptr + 2 * q + C, 0, sem="relaxed", scope="gpu")
    partition_barrier()  # every thread's reads of the staging buffer before the epilogue writes it
    return left, right


@gluon.jit
def _add_staged(piece, staging, partial_desc, bar, loads, coord):
    """piece plus the float32 block of the partials at coord, TMA-loaded into the staging buffer
    once every thread of the partition read its last contents (the loads-th completion of bar)."""
    partition_barrier()
    fence_async_shared()
    mbarrier.expect(bar, partial_desc.block_type.nbytes)
    tma_load(partial_desc, coord, bar, staging)
    mbarrier.wait(bar, loads & 1)
    return piece + staging.reshape(piece.shape).load(piece.type.layout)


@gluon.jit
def _consumer(c_desc, c_ptr, bias_ptr, scale_a_ptr, scale_own_ptr, scale_b_ptr, a_bufs, b_bufs, c_bufs, ready, empty,
              rows_per_rank, N, K, stride_cm, sk_tiles, partial_desc, sk_bars, flags_ptr, c_half_desc, C: gl.constexpr,
              RANK: gl.constexpr, WORLD: gl.constexpr, GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
              HAS_BIAS: gl.constexpr, TMA_STORE: gl.constexpr, SCALING: gl.constexpr, PRECISE_ACC: gl.constexpr,
              B_KN: gl.constexpr, SEGMENT_BANDS: gl.constexpr, PEER_BANDS: gl.constexpr, SPLIT_ACC: gl.constexpr,
              STREAM_K: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2] if B_KN else b_bufs.type.shape[1]
    INSTR_K: gl.constexpr = 256 // a_bufs.dtype.primitive_bitwidth  # a wgmma's K: 32 bytes of operand
    ACC_N: gl.constexpr = BLOCK_N // 2 if SPLIT_ACC else BLOCK_N
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, ACC_N, INSTR_K])  # fmt: skip
    tiles_m = gl.cdiv(rows_per_rank, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    tiles_per_segment = tiles_m * tiles_n
    whole_tiles = WORLD * tiles_per_segment - sk_tiles
    used = 0
    for tile in range(gl.program_id(0), whole_tiles, NUM_PROGRAMS):
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
    if STREAM_K:
        gl.static_assert(not PRECISE_ACC)
        BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
        half_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, BLOCK_N // 2, INSTR_K])  # fmt: skip
        c_half = _staging_as(c_bufs.index(C), c_half_desc)
        k_tiles = gl.cdiv(K, BLOCK_K)
        start, it = _stream_k_range(sk_tiles, k_tiles, NUM_PROGRAMS)
        while it > start:  # the range's pieces last first (module docstring)
            local, k0, k1, segment, pid_m, pid_n = _stream_k_piece(it, start, k_tiles, whole_tiles, tiles_m, tiles_n, RANK,
                                                                   WORLD, GROUP_M, SEGMENT_BANDS, PEER_BANDS)  # fmt: skip
            left, right, used = _accumulate_piece(a_bufs, b_bufs, ready, empty, used, k1 - k0, C, layout, half_layout,
                                                  B_KN)  # fmt: skip
            if k1 < k_tiles:
                _publish_partial(left, right, c_bufs.index(C), partial_desc, flags_ptr, C)
            else:
                # A tile begun here has no earlier pieces: the sum then adds none.
                left, right = _add_partials(left, right, c_bufs.index(C), partial_desc, sk_bars, local, k_tiles, sk_tiles,
                                            flags_ptr, C, NUM_PROGRAMS)  # fmt: skip
                # Each column half through the staging buffer's half view.
                _epilogue(left, c_half_desc, c_half, c_ptr, bias_ptr, scale_a_ptr, scale_own_ptr, scale_b_ptr, segment,
                          pid_m, pid_n * BLOCK_N, rows_per_rank, N, stride_cm, half_layout, C, RANK, HAS_BIAS, TMA_STORE,
                          SCALING)  # fmt: skip
                _epilogue(right, c_half_desc, c_half, c_ptr, bias_ptr, scale_a_ptr, scale_own_ptr, scale_b_ptr, segment,
                          pid_m, pid_n * BLOCK_N + BLOCK_N // 2, rows_per_rank, N, stride_cm, half_layout, C, RANK,
                          HAS_BIAS, TMA_STORE, SCALING)  # fmt: skip
            it -= k1 - k0
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
    sk_tiles,  # STREAM_K: how many of the last tiles are split by K (module docstring); else 0
    partial_desc,  # STREAM_K: over float32 [2 * NUM_PROGRAMS, BLOCK_M // 2, BLOCK_N] (a slot a program and
    #   consumer: the later pieces' partials), block [1, BLOCK_M // 2, BLOCK_N // 2]; else over any such block
    sk_flags_ptr,  # STREAM_K: int32 [2 * NUM_PROGRAMS], 0 at launch (and left 0): a flag per program and consumer
    c_half_desc,  # STREAM_K: as c_desc, its block half as wide (a split tile's column halves); else any descriptor
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
    STREAM_K: gl.constexpr,  # the last sk_tiles tiles split by K over every program (module docstring)
    num_warps: gl.constexpr,  # 4: consumer 0 (the default partition)
):
    a_bufs, b_bufs, c_bufs, ready, empty = allocate_pingpong(a_desc, b_desc, c_desc, NUM_STAGES)
    # STREAM_K: a barrier a consumer for its TMA loads of the partials, and one for the earlier
    # pieces of the tile this program ends (the loader saw them flagged).
    sk_bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(3):
        mbarrier.init(sk_bars.index(i), count=1)
    # Partition arguments are spelled out in each tuple: constexprs keep their kind only so.
    gl.warp_specialize(
        [
            (_consumer, (c_desc, c_ptr, bias_ptr, scale_a_ptr, scale_own_ptr, scale_b_ptr, a_bufs, b_bufs, c_bufs, ready,
                         empty, rows_per_rank, N, K, stride_cm, sk_tiles, partial_desc, sk_bars, sk_flags_ptr, c_half_desc,
                         0, RANK, WORLD, GROUP_M, NUM_PROGRAMS, HAS_BIAS, TMA_STORE, SCALING, PRECISE_ACC, B_KN,
                         SEGMENT_BANDS, PEER_BANDS, SPLIT_ACC, STREAM_K)),
            (_consumer, (c_desc, c_ptr, bias_ptr, scale_a_ptr, scale_own_ptr, scale_b_ptr, a_bufs, b_bufs, c_bufs, ready,
                         empty, rows_per_rank, N, K, stride_cm, sk_tiles, partial_desc, sk_bars, sk_flags_ptr, c_half_desc,
                         1, RANK, WORLD, GROUP_M, NUM_PROGRAMS, HAS_BIAS, TMA_STORE, SCALING, PRECISE_ACC, B_KN,
                         SEGMENT_BANDS, PEER_BANDS, SPLIT_ACC, STREAM_K)),
            (_loader, (a_desc, own_desc, b_desc, a_bufs, b_bufs, ready, empty, signal_ptr, report_ptr, rows_per_rank, N,
                       K, chunk_rows, chunks_per_rank, max_spins, sk_tiles, sk_flags_ptr, sk_bars, RANK, WORLD, GROUP_M,
                       NUM_PROGRAMS, B_KN, SEGMENT_BANDS, PEER_BANDS, SPLIT_ACC, STREAM_K)),
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
