"""Persistent AllGather+GEMM for FP8 with precise accumulation, warp-specialized (Gluon, Hopper).

The same op as _all_gather_matmul's kernel for scaled calls without use_fast_accum (tiles in
data order: this rank's rows first from its shard, then the peers' segments in arrival order,
each peer tile after its chunk's signal; scales and bias in the epilogue; the last program resets
the signals), built so that the float32 promotion costs no tensor-core time. Within one
warpgroup a promotion waits for the MMAs before it (measured: issuing the next block's wgmma
first does not hide it), so the work is split over three partitions:
- a loader warp: waits for a peer tile's chunk signal (bounded; a wait that gives up records
  (rank, chunk, this rank) and traps), then TMA-loads the tile's K blocks into a ring of stages;
- two consumer warpgroups, each computing half of a BLOCK_M x BLOCK_N tile's rows: they promote
  after every two K blocks (2 * BLOCK_K products), consumer 1 one block after consumer 0, so one
  issues MMAs while the other waits for its own; each releases a stage once its MMAs retired.
docs/perf-log.md ("FP8 precise accumulation ...") has the measurements.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fluxtp.kernels._sync import RECORD_AND_TRAP_PTX

# Triton 3.6's names; later releases call them async_load / async_store.
_tma_load = getattr(tma, "async_copy_global_to_shared", None) or tma.async_load
_tma_store = getattr(tma, "async_copy_shared_to_global", None) or tma.async_store


@gluon.jit
def _tile(tile, tiles_m, tiles_n, tiles_per_segment, RANK: gl.constexpr, WORLD: gl.constexpr, GROUP_M: gl.constexpr):
    """(segment, pid_m, pid_n) of the tile-th tile: segments in arrival order from this rank's, and
    within one, GROUP_M-row bands (as fluxtp.kernels._tiles.grouped_tile)."""
    local = tile % tiles_per_segment
    in_group = GROUP_M * tiles_n
    first_m = (local // in_group) * GROUP_M
    rows = gl.minimum(tiles_m - first_m, GROUP_M)
    return (RANK + tile // tiles_per_segment) % WORLD, first_m + (local % in_group) % rows, (local % in_group) // rows


@gluon.jit
def _record_and_trap(report_ptr, segment, chunk, rank):
    """Every thread stores (segment, chunk, rank), fences it system-wide and traps: whichever thread
    traps first has made the record visible (fluxtp.kernels._sync.record_and_trap)."""
    gl.inline_asm_elementwise(
        RECORD_AND_TRAP_PTX,
        "=r,l,r,r,r",
        [report_ptr, segment, chunk, rank],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _loader(a_desc, own_desc, b_desc, a_bufs, b_bufs, ready, empty, signal_ptr, report_ptr, rows_per_rank, N, K,
            chunk_rows, chunks_per_rank, max_spins, RANK: gl.constexpr, WORLD: gl.constexpr, GROUP_M: gl.constexpr,
            NUM_PROGRAMS: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    tiles_m = gl.cdiv(rows_per_rank, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    tiles_per_segment = tiles_m * tiles_n
    k_tiles = gl.cdiv(K, BLOCK_K)
    ready_chunk = -1  # the chunk waited for last: signals only go from 0 to 1 during a launch
    loaded = 0
    for tile in range(gl.program_id(0), WORLD * tiles_per_segment, NUM_PROGRAMS):
        segment, pid_m, pid_n = _tile(tile, tiles_m, tiles_n, tiles_per_segment, RANK, WORLD, GROUP_M)
        own = tile < tiles_per_segment
        if not own:
            chunk_in_segment = pid_m * BLOCK_M // chunk_rows
            chunk = segment * chunks_per_rank + chunk_in_segment
            if chunk != ready_chunk:
                value = gl.atomic_add(signal_ptr + chunk, 0, sem="acquire", scope="gpu")
                spins = 0
                while (value != 1) & (spins < max_spins):
                    value = gl.atomic_add(signal_ptr + chunk, 0, sem="acquire", scope="gpu")
                    spins += 1
                if value != 1:
                    _record_and_trap(report_ptr, segment, chunk_in_segment, RANK)
                ready_chunk = chunk
        for ki in range(k_tiles):
            s = loaded % STAGES
            mbarrier.wait(empty.index(s), ((loaded // STAGES) & 1) ^ 1)  # both consumers released it
            mbarrier.expect(ready.index(s), nbytes)
            if own:
                _tma_load(own_desc, [pid_m * BLOCK_M, ki * BLOCK_K], ready.index(s), a_bufs.index(s))
            else:
                _tma_load(a_desc, [segment * rows_per_rank + pid_m * BLOCK_M, ki * BLOCK_K], ready.index(s),
                          a_bufs.index(s))  # fmt: skip
            _tma_load(b_desc, [pid_n * BLOCK_N, ki * BLOCK_K], ready.index(s), b_bufs.index(s))
            loaded += 1


@gluon.jit
def _blocks(a_bufs, b_bufs, ready, empty, used, part, BLOCKS: gl.constexpr, C: gl.constexpr):
    """BLOCKS K blocks of consumer C's rows into `part` (imprecise, from zero), returned once their
    MMAs retired and their stages are released."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    HALF: gl.constexpr = a_bufs.type.shape[1] // 2
    for i in gl.static_range(BLOCKS):
        s = (used + i) % STAGES
        mbarrier.wait(ready.index(s), ((used + i) // STAGES) & 1)
        part = warpgroup_mma(a_bufs.index(s).slice(C * HALF, HALF), b_bufs.index(s).permute((1, 0)), part,
                             use_acc=i > 0, is_async=True)  # fmt: skip
    part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
    for i in gl.static_range(BLOCKS):
        mbarrier.arrive(empty.index((used + i) % STAGES), count=1)
    return part


@gluon.jit
def _consumer(c_desc, c_ptr, bias_ptr, scale_a_ptr, scale_own_ptr, scale_b_ptr, a_bufs, b_bufs, c_bufs, ready, empty,
              rows_per_rank, N, K, stride_cm, C: gl.constexpr, RANK: gl.constexpr, WORLD: gl.constexpr,
              GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, HAS_BIAS: gl.constexpr, TMA_STORE: gl.constexpr,
              SCALING: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    HALF: gl.constexpr = BLOCK_M // 2
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32])
    tiles_m = gl.cdiv(rows_per_rank, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    tiles_per_segment = tiles_m * tiles_n
    k_tiles = gl.cdiv(K, BLOCK_K)
    # Consumer 0 promotes after blocks 1, 3, 5, ...; consumer 1 after 0, 2, 4, ...; either after the last.
    lead = C
    pairs = (k_tiles - lead) // 2
    tail = k_tiles - lead - 2 * pairs
    used = 0
    for tile in range(gl.program_id(0), WORLD * tiles_per_segment, NUM_PROGRAMS):
        segment, pid_m, pid_n = _tile(tile, tiles_m, tiles_n, tiles_per_segment, RANK, WORLD, GROUP_M)
        acc = gl.zeros((HALF, BLOCK_N), dtype=gl.float32, layout=layout)
        part = gl.zeros((HALF, BLOCK_N), dtype=gl.float32, layout=layout)
        if lead > 0:
            part = _blocks(a_bufs, b_bufs, ready, empty, used, part, 1, C)
            acc = acc + part
            used += 1
        for _ in range(pairs):
            part = _blocks(a_bufs, b_bufs, ready, empty, used, part, 2, C)
            acc = acc + part
            used += 2
        if tail > 0:
            part = _blocks(a_bufs, b_bufs, ready, empty, used, part, 1, C)
            acc = acc + part
            used += 1

        rows = pid_m * BLOCK_M + C * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, layout))  # in the segment
        cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        if SCALING == 1:
            acc = acc * gl.load(scale_a_ptr) * gl.load(scale_b_ptr)
        else:  # row-wise: this rank's rows' scales from its own, the peers' from the gathered ones
            if tile < tiles_per_segment:
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
        if TMA_STORE:  # whole tiles inside each segment (rows_per_rank % BLOCK_M == 0)
            c_smem = c_bufs.index(C)
            tma.store_wait(pendings=0)  # the previous tile's store has read c_smem
            c_smem.store(out)
            fence_async_shared()
            _tma_store(c_desc, [segment * rows_per_rank + pid_m * BLOCK_M + C * HALF, pid_n * BLOCK_N], c_smem)
        else:  # a tile may end past its segment: store only its rows
            offs = gl.expand_dims((segment * rows_per_rank + rows).to(gl.int64), 1) * stride_cm + gl.expand_dims(cols, 0)
            mask = gl.expand_dims(rows < rows_per_rank, 1) & gl.expand_dims(cols < N, 0)
            gl.store(c_ptr + offs, out, mask=mask)
    if TMA_STORE:
        tma.store_wait(pendings=0)


@gluon.jit
def allocate_pingpong(a_desc, b_desc, c_desc, NUM_STAGES: gl.constexpr):
    """Shared memory of a loader warp and two consumer warpgroups: NUM_STAGES stages of A and B
    tiles, each consumer's half of a C tile, and per stage a `ready` barrier (the loader's TMA
    bytes) and an `empty` one (both consumers released it)."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2, BLOCK_M // 2, BLOCK_N], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer
    return a_bufs, b_bufs, c_bufs, ready, empty


@gluon.jit
def all_gather_matmul_pingpong_kernel(
    a_desc,  # Gluon TensorDescriptor over A_gathered [W*m, K] (float8), block [BLOCK_M, BLOCK_K]
    own_desc,  # over this rank's shard [m, K], block [BLOCK_M, BLOCK_K]
    b_desc,  # over B [n, K] (float8, row-major), block [BLOCK_N, BLOCK_K]
    c_desc,  # over C [W*m, n], block [BLOCK_M // 2, BLOCK_N] (used with TMA_STORE)
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
    scale_a_ptr,  # float32 scales of A_gathered's rows (row-wise) or of A (per tensor)
    scale_own_ptr,  # float32 scales of this rank's shard's rows (row-wise) or of A
    scale_b_ptr,  # float32 scales of B's rows [n] (row-wise) or of B
    RANK: gl.constexpr,
    WORLD: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    TMA_STORE: gl.constexpr,
    SCALING: gl.constexpr,  # 1 per tensor, 2 row-wise
    num_warps: gl.constexpr,  # 4: consumer 0 (the default partition)
):
    a_bufs, b_bufs, c_bufs, ready, empty = allocate_pingpong(a_desc, b_desc, c_desc, NUM_STAGES)
    # Partition arguments are spelled out in each tuple: constexprs keep their kind only so.
    gl.warp_specialize(
        [
            (_consumer, (c_desc, c_ptr, bias_ptr, scale_a_ptr, scale_own_ptr, scale_b_ptr, a_bufs, b_bufs, c_bufs, ready,
                         empty, rows_per_rank, N, K, stride_cm, 0, RANK, WORLD, GROUP_M, NUM_PROGRAMS, HAS_BIAS,
                         TMA_STORE, SCALING)),
            (_consumer, (c_desc, c_ptr, bias_ptr, scale_a_ptr, scale_own_ptr, scale_b_ptr, a_bufs, b_bufs, c_bufs, ready,
                         empty, rows_per_rank, N, K, stride_cm, 1, RANK, WORLD, GROUP_M, NUM_PROGRAMS, HAS_BIAS,
                         TMA_STORE, SCALING)),
            (_loader, (a_desc, own_desc, b_desc, a_bufs, b_bufs, ready, empty, signal_ptr, report_ptr, rows_per_rank, N,
                       K, chunk_rows, chunks_per_rank, max_spins, RANK, WORLD, GROUP_M, NUM_PROGRAMS)),
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
