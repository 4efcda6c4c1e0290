"""What the warp-specialized (Gluon, Hopper) kernels share: a loader warp feeding a ring of TMA
stages, and two consumer warpgroups that each compute half of a BLOCK_M x BLOCK_N tile's rows;
FP8 with the float32 promotion off the tensor cores' path (accumulate), bf16 and fp16 straight
(accumulate_plain).

Within one warpgroup a promotion waits for the MMAs before it (measured: issuing the next
block's wgmma first does not hide it). So each consumer promotes after every two K blocks
(2 * BLOCK_K products, as precise torch._scaled_mm), consumer 1 one block after consumer 0: one
issues MMAs while the other waits for its own. Each releases a stage once its MMAs retired; a
stage is refilled when both did. A 128x256 tile's promotion goes by column halves (SPLIT): the
registers hold its accumulator and one half's promotion buffer, not two whole ones.
docs/perf-log.md ("FP8 precise accumulation ...", "The precise all-gather in 128x256 tiles") has
the measurements.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from fluxtp.kernels._sync import RECORD_AND_TRAP_PTX

# The names of later releases (Triton 3.9 keeps the old ones as stubs that raise); Triton 3.6's otherwise.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# Triton 3.6's name; later releases call it barrier. In a partition it syncs that partition's warps.
partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
# A view of shared memory as another dtype and shape: Triton 3.6 names it _reinterpret, later releases reinterpret.
NAMED_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))


@gluon.jit
def grouped_tile(local, tiles_m, tiles_n, GROUP_M: gl.constexpr):
    """(pid_m, pid_n) of the local-th tile of a segment in GROUP_M-row bands (as
    fluxtp.kernels._tiles.grouped_tile, which a Gluon kernel cannot call)."""
    in_group = GROUP_M * tiles_n
    first_m = (local // in_group) * GROUP_M
    rows = gl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (local % in_group) % rows, (local % in_group) // rows


@gluon.jit
def fence_async_proxy():
    """Order this thread's generic-proxy accesses before (a flag's acquire) before its async-proxy
    ones after (TMA loads of the data the flag publishes), as fluxtp.kernels._sync.fence_async_proxy."""
    gl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, $1;", "=r,r", [gl.program_id(0)], dtype=gl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def stores_written():
    """Every thread of the partition past the point where its TMA stores have written their
    destinations, so that a release after it publishes their data to other programs and GPUs.
    tma.store_wait waits only until the stores have read shared memory (Triton 3.6 emits
    `cp.async.bulk.wait_group.read`): a flag released after it may arrive before the data."""
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; mov.u32 $0, $1;", "=r,r", [gl.program_id(0)],
                              dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip
    partition_barrier()


@gluon.jit
def record_and_trap(report_ptr, a, b, rank):
    """Every thread stores (a, b, rank), fences it system-wide and traps: whichever thread traps
    first has made the record visible (fluxtp.kernels._sync.record_and_trap)."""
    gl.inline_asm_elementwise(RECORD_AND_TRAP_PTX, "=r,l,r,r,r", [report_ptr, a, b, rank], dtype=gl.int32,
                              is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def wait_flag(flag_ptr, max_spins):
    """Spin until *flag_ptr == 1 (acquire, scope gpu), at most max_spins more reads; returns the last
    value read, 1 once it arrived (as fluxtp.kernels._sync.wait_flag, which a Gluon kernel cannot
    call). The caller traps on anything else, naming what it waited for."""
    value = gl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (value != 1) & (spins < max_spins):
        value = gl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    return value


@gluon.jit
def allocate_stages(a_desc, b_desc, NUM_STAGES: gl.constexpr):
    """NUM_STAGES stages of A and B tiles (B's as b_desc's block: [BLOCK_N, BLOCK_K], or
    [BLOCK_K, BLOCK_N] over a K x N weight), and per stage a `ready` barrier (the loader's TMA
    bytes) and an `empty` one (both consumers released it)."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    B_ROWS: gl.constexpr = b_desc.block_type.shape[0]
    B_COLS: gl.constexpr = b_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, B_ROWS, B_COLS], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer
    return a_bufs, b_bufs, ready, empty



@gluon.jit
def allocate_pingpong(a_desc, b_desc, c_desc, NUM_STAGES: gl.constexpr):
    """allocate_stages, and a C staging buffer of half a tile's rows per consumer (for TMA stores
    through c_desc, whose block is [1, BLOCK_M // 2, width])."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    WIDTH: gl.constexpr = c_desc.block_type.shape[2]
    a_bufs, b_bufs, ready, empty = allocate_stages(a_desc, b_desc, NUM_STAGES)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2, 1, BLOCK_M // 2, WIDTH], c_desc.layout)
    return a_bufs, b_bufs, c_bufs, ready, empty


@gluon.jit
def load_tile(a_desc, a_row, b_desc, b_row, a_bufs, b_bufs, ready, empty, loaded, K, B_KN: gl.constexpr = False,
              SPANS: gl.constexpr = False):  # fmt: skip
    """The loader's part of one tile: every K block of A's rows a_row.. and B's rows b_row.. (with
    B_KN, the K x N weight's columns b_row..) into the next stages (load_blocks); returns the
    running block count. SPANS: whole spans of 256 products, the last one filled up with blocks
    past K (TMA fills them with zeros), as accumulate's SPLIT reads them."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    k_tiles = gl.cdiv(K, BLOCK_K)
    if SPANS:
        k_tiles = gl.cdiv(k_tiles, 256 // BLOCK_K) * (256 // BLOCK_K)
    return load_blocks(a_desc, a_row, b_desc, b_row, a_bufs, b_bufs, ready, empty, loaded, 0, k_tiles, B_KN)


@gluon.jit
def load_blocks(a_desc, a_row, b_desc, b_row, a_bufs, b_bufs, ready, empty, loaded, k_first, k_end,
                B_KN: gl.constexpr = False):  # fmt: skip
    """K blocks k_first..k_end - 1 of a tile (load_tile) into the next stages, each once both
    consumers released it; returns the running block count."""
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    for ki in range(k_first, k_end):
        s = loaded % STAGES
        mbarrier.wait(empty.index(s), ((loaded // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), nbytes)
        tma_load(a_desc, [a_row, ki * BLOCK_K], ready.index(s), a_bufs.index(s))
        if B_KN:
            tma_load(b_desc, [ki * BLOCK_K, b_row], ready.index(s), b_bufs.index(s))
        else:
            tma_load(b_desc, [b_row, ki * BLOCK_K], ready.index(s), b_bufs.index(s))
        loaded += 1
    return loaded


@gluon.jit
def _blocks(a_bufs, b_bufs, ready, empty, used, part, BLOCKS: gl.constexpr, C: gl.constexpr, COLUMNS: gl.constexpr = 0,
            SPLIT: gl.constexpr = False):  # fmt: skip
    """BLOCKS K blocks of consumer C's rows into `part` (imprecise, from zero), returned once their
    MMAs retired. SPLIT: only the stages' COLUMNS-th half of B's columns (0, then 1); the stages
    are released with the last half (they wait for `ready` once, with the first)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    HALF: gl.constexpr = a_bufs.type.shape[1] // 2
    WIDTH: gl.constexpr = b_bufs.type.shape[1] // 2
    for i in gl.static_range(BLOCKS):
        s = (used + i) % STAGES
        if COLUMNS == 0:
            mbarrier.wait(ready.index(s), ((used + i) // STAGES) & 1)
        b = b_bufs.index(s)
        if SPLIT:
            b = b.slice(COLUMNS * WIDTH, WIDTH)
        part = warpgroup_mma(a_bufs.index(s).slice(C * HALF, HALF), b.permute((1, 0)), part, use_acc=i > 0,
                             is_async=True)  # fmt: skip
    part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
    if (not SPLIT) or COLUMNS == 1:
        for i in gl.static_range(BLOCKS):
            mbarrier.arrive(empty.index((used + i) % STAGES), count=1)
    return part


@gluon.jit
def _promote(a_bufs, b_bufs, ready, empty, used, acc, acc_hi, part, BLOCKS: gl.constexpr, C: gl.constexpr,
             SPLIT: gl.constexpr):  # fmt: skip
    """BLOCKS K blocks' products added into the float32 accumulator(s); returns (acc, acc_hi, part)."""
    part = _blocks(a_bufs, b_bufs, ready, empty, used, part, BLOCKS, C, 0, SPLIT)
    acc = acc + part
    if SPLIT:
        part = _blocks(a_bufs, b_bufs, ready, empty, used, part, BLOCKS, C, 1, SPLIT)
        acc_hi = acc_hi + part
    return acc, acc_hi, part


@gluon.jit
def accumulate(a_bufs, b_bufs, ready, empty, used, K, C: gl.constexpr, layout: gl.constexpr, SPLIT: gl.constexpr = False):
    """Consumer C's half of one tile's rows in float32 from the next cdiv(K, BLOCK_K) stages (the
    running count `used`); returns (acc, acc_hi, used). acc is [BLOCK_M // 2, BLOCK_N] in `layout`
    and acc_hi 0. With SPLIT, acc holds B's first BLOCK_N // 2 columns and acc_hi the rest, each
    [BLOCK_M // 2, BLOCK_N // 2] in `layout` (an MMA layout that wide): a 64x256 accumulator beside
    its promotion buffer would take 256 registers a thread, two halves and one buffer 192 (of 232)."""
    HALF: gl.constexpr = a_bufs.type.shape[1] // 2
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    WIDTH: gl.constexpr = b_bufs.type.shape[1] // 2 if SPLIT else b_bufs.type.shape[1]
    k_tiles = gl.cdiv(K, BLOCK_K)
    acc = gl.zeros((HALF, WIDTH), dtype=gl.float32, layout=layout)
    part = gl.zeros((HALF, WIDTH), dtype=gl.float32, layout=layout)
    if SPLIT:
        # One half's MMAs run while the other half is promoted, within the consumer: both consumers
        # promote every 256 products, the loader padding K to that with blocks of zeros (a branch
        # for a shorter last span made ptxas spill the halves).
        SPAN: gl.constexpr = 256 // BLOCK_K
        acc_hi = gl.zeros((HALF, WIDTH), dtype=gl.float32, layout=layout)
        for _ in range(gl.cdiv(k_tiles, SPAN)):
            acc, acc_hi, part = _promote(a_bufs, b_bufs, ready, empty, used, acc, acc_hi, part, SPAN, C, SPLIT)
            used += SPAN
    else:
        acc_hi = 0
        # Consumer 0 promotes after blocks 1, 3, 5, ...; consumer 1 after 0, 2, 4, ...; either after the last.
        lead = C
        pairs = (k_tiles - lead) // 2
        tail = k_tiles - lead - 2 * pairs
        if lead > 0:
            acc, acc_hi, part = _promote(a_bufs, b_bufs, ready, empty, used, acc, acc_hi, part, 1, C, SPLIT)
            used += 1
        for _ in range(pairs):
            acc, acc_hi, part = _promote(a_bufs, b_bufs, ready, empty, used, acc, acc_hi, part, 2, C, SPLIT)
            used += 2
        if tail > 0:
            acc, acc_hi, part = _promote(a_bufs, b_bufs, ready, empty, used, acc, acc_hi, part, 1, C, SPLIT)
            used += 1
    return acc, acc_hi, used


@gluon.jit
def accumulate_plain(a_bufs, b_bufs, ready, empty, used, K, C: gl.constexpr, layout: gl.constexpr,
                     B_KN: gl.constexpr = False):  # fmt: skip
    """accumulate without promotion (bf16, fp16: the tensor cores accumulate in float32; FP8 with
    fast accumulation) over every K block of a tile (accumulate_blocks)."""
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    return accumulate_blocks(a_bufs, b_bufs, ready, empty, used, gl.cdiv(K, BLOCK_K), C, layout, B_KN)


@gluon.jit
def accumulate_blocks(a_bufs, b_bufs, ready, empty, used, k_blocks, C: gl.constexpr, layout: gl.constexpr,
                      B_KN: gl.constexpr = False):  # fmt: skip
    """Consumer C's half of k_blocks K blocks' products from the next stages, from zero, without
    promotion: one wgmma in flight, each stage released once the wgmma after it was issued and it
    retired; returns (acc, used). B_KN: B's stages are [BLOCK_K, BLOCK_N] (a K x N weight, 16-bit only)."""
    HALF: gl.constexpr = a_bufs.type.shape[1] // 2
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2] if B_KN else b_bufs.type.shape[1]
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    acc = gl.zeros((HALF, BLOCK_N), dtype=gl.float32, layout=layout)
    previous = 0
    for ki in range(k_blocks):
        s = used % STAGES
        mbarrier.wait(ready.index(s), (used // STAGES) & 1)
        b = b_bufs.index(s) if B_KN else b_bufs.index(s).permute((1, 0))
        acc = warpgroup_mma(a_bufs.index(s).slice(C * HALF, HALF), b, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(empty.index(previous), count=1, pred=ki > 0)  # the block before this one retired
        previous = s
        used += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index(previous), count=1, pred=k_blocks > 0)
    return acc, used


@gluon.jit
def accumulate_halves(a_bufs, b_bufs, ready, empty, used, k_blocks, C: gl.constexpr, layout: gl.constexpr,
                      B_KN: gl.constexpr = False):  # fmt: skip
    """accumulate_blocks into two accumulators, B's left and right column halves, each
    [HALF, BLOCK_N // 2] in `layout` (an MMA layout that wide), two wgmmas a K block: a tile's
    halves kept apart from the start, where a split of one accumulator's registers and their
    join made Triton 3.6's ptxas spill and serialize the MMAs (docs/perf-log.md)."""
    HALF: gl.constexpr = a_bufs.type.shape[1] // 2
    WIDTH: gl.constexpr = (b_bufs.type.shape[2] if B_KN else b_bufs.type.shape[1]) // 2
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    left = gl.zeros((HALF, WIDTH), dtype=gl.float32, layout=layout)
    right = gl.zeros((HALF, WIDTH), dtype=gl.float32, layout=layout)
    previous = 0
    for ki in range(k_blocks):
        s = used % STAGES
        mbarrier.wait(ready.index(s), (used // STAGES) & 1)
        a = a_bufs.index(s).slice(C * HALF, HALF)
        if B_KN:
            b_left = b_bufs.index(s).slice(0, WIDTH, dim=1)
            b_right = b_bufs.index(s).slice(WIDTH, WIDTH, dim=1)
        else:
            b_left = b_bufs.index(s).slice(0, WIDTH).permute((1, 0))
            b_right = b_bufs.index(s).slice(WIDTH, WIDTH).permute((1, 0))
        left = warpgroup_mma(a, b_left, left, is_async=True)
        right = warpgroup_mma(a, b_right, right, is_async=True)
        left, right = warpgroup_mma_wait(num_outstanding=2, deps=(left, right))
        mbarrier.arrive(empty.index(previous), count=1, pred=ki > 0)  # the block before this one retired
        previous = s
        used += 1
    left, right = warpgroup_mma_wait(num_outstanding=0, deps=(left, right))
    mbarrier.arrive(empty.index(previous), count=1, pred=k_blocks > 0)
    return left, right, used
