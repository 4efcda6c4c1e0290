"""Persistent AllGather+GEMM (Flux prologue fusion): C = A_gathered @ B^T, tiles in data order.

C's rows are W segments of m rows, segment s being rank s's shard times B^T. This rank's own
segment is computed first, straight from its shard (own_desc over x_shard [m, K]): nothing to
wait for, and no copy before the GEMM can start. The peers' segments are read from A_gathered
[W*m, K], which the copy stream fills: segment s arrives in chunks of `chunk_rows` rows, and
chunk c of segment s is ready once signals[s * chunks_per_rank + c] == 1 (the copy stream writes
the 1s; the last program to finish resets them to `signal_reset`, 0 in a real call, so the next
call and every CUDA graph replay start from zero without a host-side reset). Peer segments are
visited in arrival order (rank+1, rank+2, ...), in GROUP_M-row bands within each segment or, with
PEER_BANDS, counted across the peers' segments (where a segment has few row tiles, a wave's
tiles then share the weight's columns: it is read once for the peers, not once a peer; the
launcher's rule: fluxtp.backends.fused._all_gather_matmul.peer_bands). Each tile waits for the
chunk its rows lie in BEFORE its K loop, so the pipelined K loop never runs ahead of the data
(or, with FLATTEN, one tile ahead: see _tiles); a program skips the wait when the tile's chunk is
the one it waited for last. chunk_rows is a multiple of BLOCK_M, so a tile lies in one chunk.
The two phases are two loops (the same round-robin of tiles over programs as one loop would
give), so the flattened pipeline of each has no branch between descriptors.
A tile never spans two segments (m need not be a multiple of BLOCK_M): rows past the segment
end are loaded (another segment's rows, or TMA's zero padding) but never stored.

Scaled (FP8) calls (SCALING, fluxtp/backends/fused/_scaled.py): A and B are float8, the float32
accumulator is multiplied by the scales in the epilogue (per tensor; or row-wise, A's from
scale_own_ptr for this rank's rows and from scale_a_ptr for the peers', which the copy stream
gathered before any chunk's signal), then the bias is added and C (out_dtype) rounded once.
"""

import triton
import triton.language as tl

from fluxtp.kernels._sync import fence_async_proxy, record_and_trap, wait_flag
from fluxtp.kernels._tiles import dot_k_block, grouped_tile


@triton.jit
def _tile_of(tile_id, tiles_m, tiles_n, tiles_per_segment, OWN: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
             GROUP_M: tl.constexpr, PEER_BANDS: tl.constexpr):  # fmt: skip
    """(segment, pid_m, pid_n) of the tile_id-th tile in the kernel's order (module docstring)."""
    if OWN or not PEER_BANDS:
        segment = (RANK + tile_id // tiles_per_segment) % WORLD
        pid_m, pid_n = grouped_tile(tile_id % tiles_per_segment, tiles_m, tiles_n, GROUP_M)
    else:
        row, pid_n = grouped_tile(tile_id - tiles_per_segment, (WORLD - 1) * tiles_m, tiles_n, GROUP_M)
        segment = (RANK + 1 + row // tiles_m) % WORLD
        pid_m = row % tiles_m
    return segment, pid_m, pid_n


@triton.jit
def _wait_for_tile(tile_id, ready, signal_ptr, report_ptr, tiles_m, tiles_n, tiles_per_segment, chunk_rows,
                   chunks_per_rank, max_spins, RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK_M: tl.constexpr,
                   GROUP_M: tl.constexpr, PEER_BANDS: tl.constexpr):  # fmt: skip
    """Acquire-wait for the one chunk holding this (peer) tile's rows (chunk_rows is a BLOCK_M
    multiple), unless it is `ready`, the chunk this program waited for last (signals only go from 0
    to 1 during a launch, so a chunk once seen stays ready). Returns the tile's chunk."""
    segment, pid_m, _ = _tile_of(tile_id, tiles_m, tiles_n, tiles_per_segment, False, RANK, WORLD, GROUP_M, PEER_BANDS)
    chunk_in_segment = pid_m * BLOCK_M // chunk_rows
    chunk = segment * chunks_per_rank + chunk_in_segment
    if chunk != ready:
        # A chunk that never arrives records (rank, chunk, this rank) and traps, without give_up's
        # CTA barrier: a barrier in this branch of the flattened loop made the GEMM-only mode
        # 2.4-5x slower (one H200), and device_print slows the whole kernel (docs/perf-log.md).
        if not wait_flag(signal_ptr + chunk, 1, max_spins, "gpu"):
            record_and_trap(report_ptr, segment, chunk_in_segment, RANK)
        fence_async_proxy()  # the acquire before the chunk's TMA loads
    return chunk


@triton.jit
def _tiles(
    a_desc, b_desc, c_desc, c_ptr, bias_ptr, signal_ptr, report_ptr, first_tile, end_tile, rows_per_rank, N, k_tiles, stride_cm,
    tiles_m, tiles_n, tiles_per_segment, chunk_rows, chunks_per_rank, max_spins,
    OWN: tl.constexpr,  # this rank's segment, A from its shard (row 0 = its first row), no waits
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, HAS_BIAS: tl.constexpr, NUM_STAGES: tl.constexpr,
    FLATTEN: tl.constexpr, TMA_STORE: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr, B_KN: tl.constexpr,
    scale_a_ptr=None, scale_b_ptr=None, SCALING: tl.constexpr = 0, PRECISE_ACC: tl.constexpr = False,
    PEER_BANDS: tl.constexpr = False,
):
    """Tiles first_tile, first_tile + NUM_SMS, ... below end_tile: K loop, bias, store into C."""
    dtype = c_ptr.dtype.element_ty
    ready = -1  # the chunk this program waited for last: tiles of the same chunk skip the wait
    if not OWN:
        if FLATTEN:
            # The flattened loop prefetches the next tile's first K blocks during this tile's last
            # ones (NUM_STAGES - 1 < k_tiles, the launcher checks): so wait one tile ahead, at the
            # start of the previous tile, and for the first tile before the loop.
            if first_tile < end_tile:
                ready = _wait_for_tile(first_tile, ready, signal_ptr, report_ptr, tiles_m, tiles_n, tiles_per_segment, chunk_rows,
                                       chunks_per_rank, max_spins, RANK, WORLD, BLOCK_M, GROUP_M, PEER_BANDS)
    # The epilogue recomputes its tile from its own counter instead of reusing the prologue's
    # values: that keeps the flattened loop's pipelining free of prologue-to-epilogue dependencies.
    tile_id_c = first_tile - NUM_SMS
    for tile_id in tl.range(first_tile, end_tile, NUM_SMS, flatten=FLATTEN, num_stages=NUM_STAGES if FLATTEN else 1):
        if not OWN:
            if FLATTEN:
                if tile_id + NUM_SMS < end_tile:
                    ready = _wait_for_tile(tile_id + NUM_SMS, ready, signal_ptr, report_ptr, tiles_m, tiles_n, tiles_per_segment,
                                           chunk_rows, chunks_per_rank, max_spins, RANK, WORLD, BLOCK_M, GROUP_M, PEER_BANDS)
            else:
                # Wait before the K loop, never inside it, so its pipelining cannot run ahead of the data.
                ready = _wait_for_tile(tile_id, ready, signal_ptr, report_ptr, tiles_m, tiles_n, tiles_per_segment, chunk_rows,
                                       chunks_per_rank, max_spins, RANK, WORLD, BLOCK_M, GROUP_M, PEER_BANDS)
        segment, pid_m, pid_n = _tile_of(tile_id, tiles_m, tiles_n, tiles_per_segment, OWN, RANK, WORLD, GROUP_M,
                                         PEER_BANDS)  # fmt: skip
        if OWN:
            row0 = pid_m * BLOCK_M
        else:
            row0 = segment * rows_per_rank + pid_m * BLOCK_M
        col0 = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in tl.range(k_tiles, num_stages=NUM_STAGES):
            a = a_desc.load([row0, ki * BLOCK_K])
            acc = dot_k_block(a, b_desc, ki * BLOCK_K, col0, acc, B_KN, PRECISE_ACC)

        tile_id_c += NUM_SMS
        segment_c, pid_m_c, pid_n_c = _tile_of(tile_id_c, tiles_m, tiles_n, tiles_per_segment, OWN, RANK, WORLD, GROUP_M,
                                               PEER_BANDS)  # fmt: skip
        row_in_segment_c = pid_m_c * BLOCK_M
        offs_n = pid_n_c * BLOCK_N + tl.arange(0, BLOCK_N)
        if SCALING == 1:
            acc = acc * tl.load(scale_a_ptr) * tl.load(scale_b_ptr)
        elif SCALING == 2:  # this rank's rows: scales indexed from its shard's first row, as A is
            rows_s = row_in_segment_c + tl.arange(0, BLOCK_M)
            first_s = 0 if OWN else segment_c * rows_per_rank
            scale_a = tl.load(scale_a_ptr + first_s + rows_s, mask=rows_s < rows_per_rank, other=0.0)
            scale_b = tl.load(scale_b_ptr + offs_n, mask=offs_n < N, other=0.0)
            acc = acc * scale_a[:, None] * scale_b[None, :]
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        if TMA_STORE:  # C as [W, m, n]: a tile past its segment's end (or N) is clipped by the descriptor
            if EPILOGUE_SUBTILE:  # two half-width stores: less shared memory and registers at once
                acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
                c_desc.store([segment_c, row_in_segment_c, pid_n_c * BLOCK_N],
                             tl.reshape(acc0.to(dtype), (1, BLOCK_M, BLOCK_N // 2)))
                c_desc.store([segment_c, row_in_segment_c, pid_n_c * BLOCK_N + BLOCK_N // 2],
                             tl.reshape(acc1.to(dtype), (1, BLOCK_M, BLOCK_N // 2)))
            else:
                c_desc.store([segment_c, row_in_segment_c, pid_n_c * BLOCK_N],
                             tl.reshape(acc.to(dtype), (1, BLOCK_M, BLOCK_N)))
        else:  # output rows TMA cannot store (not 16-byte multiples): only the segment's rows, by pointers
            offs_m = row_in_segment_c + tl.arange(0, BLOCK_M)
            rows = (segment_c * rows_per_rank + offs_m).to(tl.int64)
            mask = (offs_m < rows_per_rank)[:, None] & (offs_n < N)[None, :]
            tl.store(c_ptr + rows[:, None] * stride_cm + offs_n[None, :], acc.to(dtype), mask=mask)


@triton.jit(do_not_specialize=["signal_reset"])  # 0 in a call, 1 in GEMM-only mode: one binary for both
def all_gather_matmul_kernel(
    a_desc,  # TensorDescriptor over A_gathered [W*m, K], block [BLOCK_M, BLOCK_K] (the peers' rows are read)
    own_desc,  # TensorDescriptor over this rank's shard [m, K], block [BLOCK_M, BLOCK_K]
    b_desc,  # over B [n, K] (nn.Linear weight), block [BLOCK_N, BLOCK_K]; with B_KN over B^T [K, n], block [BLOCK_K, BLOCK_N]
    c_desc,  # TensorDescriptor over C as [W, m, n], block [1, BLOCK_M, BLOCK_N (/2 with EPILOGUE_SUBTILE)], or None
    c_ptr,  # C [W*m, n]
    bias_ptr,  # [n] or a dummy when HAS_BIAS is False
    signal_ptr,  # int32 [W * chunks_per_rank]
    done_ptr,  # int32 [1], 0 at launch: how many programs have finished (the last one resets it)
    rows_per_rank,
    N,
    K,
    stride_cm,
    chunk_rows,
    chunks_per_rank,
    max_spins,
    signal_reset,  # what the last program writes into the signals: 0 (a call), 1 (GEMM-only mode)
    report_ptr,  # int32 [3], host-readable: where a wait that gives up records (rank, chunk, this rank)
    scale_a_ptr,  # scaled calls: float32 scales of A_gathered's rows (row-wise) or of A (per tensor); else None
    scale_own_ptr,  # scaled calls: float32 scales of this rank's shard's rows (row-wise) or of A; else None
    scale_b_ptr,  # scaled calls: float32 scales of B's rows [n] (row-wise) or of B; else None
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    FLATTEN: tl.constexpr,
    TMA_STORE: tl.constexpr,
    EPILOGUE_SUBTILE: tl.constexpr,
    B_KN: tl.constexpr,  # b_desc reads the weight's row-major transpose [K, n] (backward: no copy)
    SCALING: tl.constexpr,  # 0 unscaled, 1 per tensor, 2 row-wise (FP8 operands; module docstring)
    PRECISE_ACC: tl.constexpr,  # FP8 products promoted to float32 after each K block (not use_fast_accum)
    PEER_BANDS: tl.constexpr,  # the peers' tiles in bands across their segments (module docstring)
):
    tiles_m = tl.cdiv(rows_per_rank, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_per_segment = tiles_m * tiles_n
    num_tiles = WORLD * tiles_per_segment
    k_tiles = tl.cdiv(K, BLOCK_K)
    pid = tl.program_id(0)
    # Tile t (0 .. num_tiles - 1, own segment first) goes to program t % NUM_SMS, as in one loop.
    _tiles(own_desc, b_desc, c_desc, c_ptr, bias_ptr, signal_ptr, report_ptr, pid, tiles_per_segment, rows_per_rank, N, k_tiles,
           stride_cm, tiles_m, tiles_n, tiles_per_segment, chunk_rows, chunks_per_rank, max_spins, True, RANK, WORLD,
           BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_SMS, HAS_BIAS, NUM_STAGES, FLATTEN, TMA_STORE, EPILOGUE_SUBTILE, B_KN,
           scale_own_ptr, scale_b_ptr, SCALING, PRECISE_ACC)
    first_peer_tile = pid + tl.maximum(tl.cdiv(tiles_per_segment - pid, NUM_SMS), 0) * NUM_SMS
    _tiles(a_desc, b_desc, c_desc, c_ptr, bias_ptr, signal_ptr, report_ptr, first_peer_tile, num_tiles, rows_per_rank, N, k_tiles,
           stride_cm, tiles_m, tiles_n, tiles_per_segment, chunk_rows, chunks_per_rank, max_spins, False, RANK, WORLD,
           BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_SMS, HAS_BIAS, NUM_STAGES, FLATTEN, TMA_STORE, EPILOGUE_SUBTILE, B_KN,
           scale_a_ptr, scale_b_ptr, SCALING, PRECISE_ACC, PEER_BANDS)

    # Every program's waits precede its increment, so the last one in reads no signal any more and
    # may reset them all (and the counter) for the next call. The next call's copy stream writes
    # signals only after this kernel has finished (the launcher forks it from this stream), and
    # so does every CUDA graph replay: no reset on the host, no extra launch.
    if tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        num_signals = WORLD * chunks_per_rank
        offs = tl.arange(0, 128)
        for start in range(0, num_signals, 128):
            tl.store(signal_ptr + start + offs, signal_reset, mask=start + offs < num_signals)
        tl.atomic_xchg(done_ptr, 0, sem="relaxed", scope="gpu")
