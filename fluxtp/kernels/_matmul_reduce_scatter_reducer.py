"""Persistent GEMM+ReduceScatter, warp-specialized, the owner's reduction beside the MMAs (Gluon, Hopper).

The op of _matmul_reduce_scatter's kernel with the copy engine's transport or push (the same
workspace plus an own slot and, for push, a counter per band in place of a flag per tile; every
partial moves by TMA), arranged so that neither handing partials over nor summing them costs
tensor-core time:
- a loader warp TMA-loads each tile's K blocks of x (the owner's rows) and w into a ring of stages;
- two consumer warpgroups each compute half of a tile's rows and TMA-store it (below: its dtype)
  into its slot: a peer's rows into an outgoing slot here (copy engine: the copy
  stream pushes each finished band of them to its owner) or into this rank's incoming slot in the
  owner's buffer (push: over NVLink, a descriptor per rank), its own rows into the own slot. Each
  half is counted once its store has completed: an own one into its tile's own flag at once
  (release; this rank's reducers wait for it: deferred, it held them back a whole K loop); a
  peer's, after the next tile's K loop (its store long done), handed to the counter warp;
- a counter warp counts each peer tile's two halves into its band's counter (here, or push: the
  owner's) under one system-scope fence, off the consumers (there, the fences cost 8-17% of an
  FP8 GEMM at TP=8; docs/perf-log.md);
- a reducer warp (two, a row each in turn, for precise calls in 256-wide tiles: the launcher's
  reducer_warps) sums this rank's rows while the consumers compute: units of a few rows of an
  own tile (units_desc's block: the launcher's reducer_unit_rows), unit u going to program
  u % NUM_PROGRAMS, in order. A unit waits (acquire loads, bounded) for its tile's own flag and
  its band from every peer (copy engine: the band's flag; push: the band's counter at all its
  tiles' halves), in a read that also learns which of the program's next units have arrived
  (their waits are skipped), TMA-loads the W slots' rows into shared memory (many bytes in
  flight for few registers; UNITS_IN_FLIGHT units at once, as shared memory allows), adds them in
  float32 (its own partial, then the peers' in rank order: deterministic), adds the bias and
  rounds once into out.
  The tail (the launcher's reducer_tail_units, where a unit is otherwise alone in flight): the
  units of the own tiles of the last round of tiles, which all complete at the GEMM's end, are
  left to the default partition's four warps once every partition is done (after
  warp_specialize: code in the consumers' partition made ptxas serialize their MMAs), loaded
  into the idle weight stages all at once (their flags read 32 * 4 // W units a round trip), each
  summed as it lands, a row per warp: one at a time through the reducer warp, each cost a load's
  round trip after the GEMM, and one warp's sums then led (docs/perf-log.md).
Every partial, the own one too, is rounded to the output's dtype before the sum (as
NCCL-then-GEMM rounds them); the Triton kernel keeps its own partial in float32, so the two
differ in the last bits. A scaled (FP8) call's consumers multiply each half by its scales (x's
rows', the weight's columns', or per tensor) before that rounding (SCALING, PRECISE_ACC as in the
Triton kernel; SPLIT_ACC: a precise 128x256 tile's accumulator in column halves, each stored in
two pieces through a staging buffer a quarter of the tile's width, which leaves room for four
128-deep stages). Tiles are interleaved across owners: tile t is the (t // W)-th tile of owner
(RANK + 1 + t % W) % W, in grouped order in bands of BAND_ROWS tile rows (the W owners' tiles of
one wave share the weight's columns, not x's rows), so every owner's rows complete progressively
on every rank and the reduction runs behind the GEMM instead of after it. Partials are counted
(and the copy engine pushes them) by the same bands: each is complete, and moves, as soon as its
tiles are, not when the last owner step ends (the launcher's copy plan goes band by band).
A launch may run only the owner steps first_step..last_step (t % W in that range; the reducer
only with the own step).

Workspace (fluxtp/backends/fused/_matmul_reduce_scatter.py's Layout with an own region): slots
[2W-1, m, N] (W-1 incoming, W-1 outgoing, own) with the copy engine's flags and band counters, or
(push) [W, m, N] (W-1 incoming, own) with a counter per (incoming slot, band); then at own_offset
the own-tile flags [tiles of a segment] and a done counter. Every flag must read 0 before a
launch, as for the Triton kernel: a call zeroes them all before its barrier. With RESET_OWN (a
launch without that step: the GEMM-only mode, direct launches) the last program out resets the
own-tile flags and the counter for the next launch instead (they must read 0 before the first);
a call skips that count, about 1% of its time at one or two waves (docs/perf-log.md).

A wait that gives up writes (rank waited for, tile, this rank) to `report_ptr` (host-pinned) and
traps; the reducers wait for tiles of other programs of this launch, so the launcher leaves one
SM free (a program that never got an SM would make them wait out their bound, not hang).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from fluxtp.kernels._pingpong import (
    NAMED_REINTERPRET,
    accumulate,
    accumulate_plain,
    allocate_stages,
    fence_async_proxy,
    grouped_tile,
    load_tile,
    partition_barrier,
    record_and_trap,
    stores_written,
    tma_load,
    tma_store,
)

TILE_ARRIVALS = gl.constexpr(2)  # one count per consumer warpgroup (its half of the tile)
MAX_PUSH_WORLD = gl.constexpr(8)  # push stores through a descriptor per rank, passed one by one
REDUCE_WIDTH = gl.constexpr(256)  # columns a reduction step covers at most: 8 per lane, 16-byte accesses


@gluon.jit
def _tile(t, tiles_m, tiles_n, RANK: gl.constexpr, WORLD: gl.constexpr, BAND_ROWS: gl.constexpr):
    """(owner step, owner, pid_m, pid_n) of tile t: owners interleaved tile by tile."""
    step = t % WORLD
    pid_m, pid_n = grouped_tile(t // WORLD, tiles_m, tiles_n, BAND_ROWS)
    return step, (RANK + 1 + step) % WORLD, pid_m, pid_n


@gluon.jit
def _own_flags(buffer_ptrs, own_offset, RANK: gl.constexpr):
    """This rank's own-tile flags (then the done counter)."""
    return (gl.load(buffer_ptrs + RANK) + own_offset).to(gl.pointer_type(gl.int32))


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, rows_per_rank, N, K, first_step, last_step,
            RANK: gl.constexpr, WORLD: gl.constexpr, BAND_ROWS: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
            B_KN: gl.constexpr, SPLIT_ACC: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1] if B_KN else b_desc.block_type.shape[0]
    tiles_m = gl.cdiv(rows_per_rank, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    loaded = 0
    for t in range(gl.program_id(0), WORLD * tiles_m * tiles_n, NUM_PROGRAMS):
        step, owner, pid_m, pid_n = _tile(t, tiles_m, tiles_n, RANK, WORLD, BAND_ROWS)
        if (step >= first_step) & (step <= last_step):
            loaded = load_tile(a_desc, owner * rows_per_rank + pid_m * BLOCK_M, b_desc, pid_n * BLOCK_N, a_bufs, b_bufs,
                               ready, empty, loaded, K, B_KN, SPLIT_ACC)  # fmt: skip


@gluon.jit
def _own_slot(PUSH: gl.constexpr, WORLD: gl.constexpr):
    """The own slot's index: after the W-1 incoming slots (push), or after the outgoing ones too."""
    return WORLD - 1 if PUSH else 2 * (WORLD - 1)


@gluon.jit
def _peer_slot(owner, RANK: gl.constexpr, WORLD: gl.constexpr, PUSH: gl.constexpr):
    """The slot of this rank's partial of a peer owner's rows: its incoming slot at the owner
    (push), or its outgoing slot here (copy engine: after the W-1 incoming ones)."""
    if PUSH:
        return RANK - (owner < RANK).to(gl.int32)
    else:
        return (WORLD - 1) + owner - (owner > RANK).to(gl.int32)


@gluon.jit
def _count_own(counter):
    """Count an own half in once its TMA store has written it (stores_written), one release at
    scope gpu (this GPU's reducers read it)."""
    stores_written()
    gl.atomic_add(counter, 1, sem="release", scope="gpu")


@gluon.jit
def _hand_over_peer_half(stored, counted, handed):
    """Tell the counter warp that this consumer's handed-th peer half has been stored (its TMA
    store has written it: stores_written), through ring slot handed % 2 once the counter took the
    half two back."""
    stores_written()
    slot = handed % 2
    mbarrier.wait(counted.index(slot), ((handed // 2) & 1) ^ 1)
    mbarrier.arrive(stored.index(slot), count=1)
    return handed + 1


@gluon.jit
def _band_counter(buffer_ptrs, owner, pid_m, flags_offset, bands, RANK: gl.constexpr, WORLD: gl.constexpr,
                  BAND_ROWS: gl.constexpr, PUSH: gl.constexpr):  # fmt: skip
    """The counter of a peer tile's band: at the owner, of this rank's incoming slot there (push),
    or here, of the outgoing slot (copy engine: after the W-1 incoming flags)."""
    holder = owner if PUSH else RANK
    flags = (gl.load(buffer_ptrs + holder) + flags_offset).to(gl.pointer_type(gl.int32))
    return flags + _peer_slot(owner, RANK, WORLD, PUSH) * bands + pid_m // BAND_ROWS


@gluon.jit
def _counter(buffer_ptrs, stored, counted, rows_per_rank, N, flags_offset, first_step, last_step, RANK: gl.constexpr,
             WORLD: gl.constexpr, BAND_ROWS: gl.constexpr, NUM_PROGRAMS: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, PUSH: gl.constexpr):  # fmt: skip
    """Counts this program's peer tiles into their bands' counters, in the consumers' order, each
    once both halves are stored (ring slot taken % 2): one system-scope fence and one relaxed
    add of both halves. Off the consumers: a fence there cost them 8-17% of an FP8 GEMM at TP=8
    (docs/perf-log.md)."""
    tiles_m = gl.cdiv(rows_per_rank, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    bands = gl.cdiv(tiles_m, BAND_ROWS)
    taken = 0
    for t in range(gl.program_id(0), WORLD * tiles_m * tiles_n, NUM_PROGRAMS):
        step, owner, pid_m, pid_n = _tile(t, tiles_m, tiles_n, RANK, WORLD, BAND_ROWS)
        if (step >= first_step) & (step <= last_step) & (owner != RANK):
            counter = _band_counter(buffer_ptrs, owner, pid_m, flags_offset, bands, RANK, WORLD, BAND_ROWS, PUSH)
            slot = taken % 2
            mbarrier.wait(stored.index(slot), (taken // 2) & 1)
            # The consumers' completed stores (ordered before by the barrier) before the count, system-wide.
            gl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, $1;", "=r,r", [slot], dtype=gl.int32,
                                      is_pure=False, pack=1)  # fmt: skip
            gl.atomic_add(counter, TILE_ARRIVALS, sem="relaxed", scope="sys")
            mbarrier.arrive(counted.index(slot), count=1)
            taken += 1


@gluon.jit
def _store_half(owner, coord, c_smem, slots0, slots1, slots2, slots3, slots4, slots5, slots6, slots7,
                WORLD: gl.constexpr):  # fmt: skip
    """TMA-store a half into owner's slots (push): slotsR is the descriptor over rank R's (Triton
    3.6 takes no tuple of descriptors)."""
    gl.static_assert(WORLD <= MAX_PUSH_WORLD)
    if owner == 0:
        tma_store(slots0, coord, c_smem)
    if owner == 1:
        tma_store(slots1, coord, c_smem)
    if WORLD > 2:
        if owner == 2:
            tma_store(slots2, coord, c_smem)
        if owner == 3:
            tma_store(slots3, coord, c_smem)
    if WORLD > 4:
        if owner == 4:
            tma_store(slots4, coord, c_smem)
        if owner == 5:
            tma_store(slots5, coord, c_smem)
        if owner == 6:
            tma_store(slots6, coord, c_smem)
        if owner == 7:
            tma_store(slots7, coord, c_smem)


@gluon.jit
def _scale(acc, scale_a_ptr, scale_b_ptr, owner, pid_m, col, rows_per_rank, N, layout: gl.constexpr,
           C: gl.constexpr, SCALING: gl.constexpr):  # fmt: skip
    """A scaled call's half tile (its columns col..) times its scales: x's (per tensor, or of each
    row of the whole x) and the weight's (per tensor, or of each output column)."""
    HALF: gl.constexpr = acc.shape[0]
    WIDTH: gl.constexpr = acc.shape[1]
    if SCALING == 1:
        return acc * gl.load(scale_a_ptr) * gl.load(scale_b_ptr)
    rows = pid_m * (2 * HALF) + C * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, layout))  # in the segment
    cols = col + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    scale_a = gl.load(scale_a_ptr + owner * rows_per_rank + rows, mask=rows < rows_per_rank, other=0.0)
    scale_b = gl.load(scale_b_ptr + cols, mask=cols < N, other=0.0)
    return acc * gl.expand_dims(scale_a, 1) * gl.expand_dims(scale_b, 0)


@gluon.jit
def _store_part(acc, col, owner, slot, row, pid_m, c_smem, slots_desc, slots0, slots1, slots2, slots3, slots4, slots5,
                slots6, slots7, scale_a_ptr, scale_b_ptr, rows_per_rank, N, layout: gl.constexpr, C: gl.constexpr,
                RANK: gl.constexpr, WORLD: gl.constexpr, PUSH: gl.constexpr, SCALING: gl.constexpr):  # fmt: skip
    """Consumer C's rows of the columns col.. (acc: float32 [HALF, width] in layout), scaled, rounded
    and TMA-stored into `slot` (owner's, with push) through c_smem; an accumulator twice as wide as
    c_smem in two pieces (a split of each thread's registers, no data moved)."""
    HALF: gl.constexpr = acc.shape[0]
    WIDTH: gl.constexpr = acc.shape[1]
    PIECE: gl.constexpr = c_smem.type.shape[2]
    if SCALING != 0:
        acc = _scale(acc, scale_a_ptr, scale_b_ptr, owner, pid_m, col, rows_per_rank, N, layout, C, SCALING)
    if PIECE < WIDTH:  # the left piece now, the right one below
        left, acc = gl.split(acc.reshape([HALF, 2, PIECE]).permute(0, 2, 1))
        _store_piece(left, col, owner, slot, row, c_smem, slots_desc, slots0, slots1, slots2, slots3, slots4, slots5,
                     slots6, slots7, RANK, WORLD, PUSH)  # fmt: skip
        col += PIECE
    _store_piece(acc, col, owner, slot, row, c_smem, slots_desc, slots0, slots1, slots2, slots3, slots4, slots5, slots6,
                 slots7, RANK, WORLD, PUSH)  # fmt: skip


@gluon.jit
def _store_piece(acc, col, owner, slot, row, c_smem, slots_desc, slots0, slots1, slots2, slots3, slots4, slots5, slots6,
                 slots7, RANK: gl.constexpr, WORLD: gl.constexpr, PUSH: gl.constexpr):  # fmt: skip
    """acc (float32 [HALF, c_smem's width]) rounded into c_smem once its last store has read it,
    then TMA-stored into `slot` at (row, col) (owner's, with push)."""
    HALF: gl.constexpr = acc.shape[0]
    WIDTH: gl.constexpr = acc.shape[1]
    tma.store_wait(pendings=0)  # c_smem is free again
    c_smem.reshape([HALF, WIDTH]).store(acc.to(c_smem.dtype))
    fence_async_shared()
    # Rows past the segment's end are clipped by the slot's bound (a 3-d descriptor).
    if PUSH:
        if owner == RANK:
            tma_store(slots_desc, [slot, row, col], c_smem)
        else:
            _store_half(owner, [slot, row, col], c_smem, slots0, slots1, slots2, slots3, slots4, slots5, slots6,
                        slots7, WORLD)  # fmt: skip
    else:
        tma_store(slots_desc, [slot, row, col], c_smem)


@gluon.jit
def _consumer(buffer_ptrs, slots_desc, slots0, slots1, slots2, slots3, slots4, slots5, slots6, slots7, a_bufs, b_bufs,
              c_bufs, ready, empty, stored, counted, rows_per_rank, N, K, own_offset, first_step, last_step,
              scale_a_ptr, scale_b_ptr, C: gl.constexpr, RANK: gl.constexpr, WORLD: gl.constexpr,
              BAND_ROWS: gl.constexpr, NUM_PROGRAMS: gl.constexpr, B_KN: gl.constexpr, PUSH: gl.constexpr,
              SCALING: gl.constexpr, PRECISE_ACC: gl.constexpr, SPLIT_ACC: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2] if B_KN else b_bufs.type.shape[1]
    HALF: gl.constexpr = BLOCK_M // 2
    K_INSTR: gl.constexpr = 256 // a_bufs.dtype.primitive_bitwidth  # a wgmma's K: 16 (bf16, fp16), 32 (FP8)
    ACC_N: gl.constexpr = BLOCK_N // 2 if SPLIT_ACC else BLOCK_N
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ACC_N, K_INSTR])
    tiles_m = gl.cdiv(rows_per_rank, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    own_flags = _own_flags(buffer_ptrs, own_offset, RANK)
    c_smem = c_bufs.index(C)
    pending = 0  # a peer half stored and not yet handed to the counter warp
    handed = 0
    used = 0
    for t in range(gl.program_id(0), WORLD * tiles_m * tiles_n, NUM_PROGRAMS):
        step, owner, pid_m, pid_n = _tile(t, tiles_m, tiles_n, RANK, WORLD, BAND_ROWS)
        if (step >= first_step) & (step <= last_step):
            if PRECISE_ACC:  # FP8 products promoted to float32 off the MMAs' path (with SPLIT_ACC, in column halves)
                acc, acc_hi, used = accumulate(a_bufs, b_bufs, ready, empty, used, K, C, layout, SPLIT_ACC)
            else:
                acc, used = accumulate_plain(a_bufs, b_bufs, ready, empty, used, K, C, layout, B_KN)
            if pending != 0:  # its store had this K loop to complete
                handed = _hand_over_peer_half(stored, counted, handed)
                pending = 0
            row = pid_m * BLOCK_M + C * HALF
            if owner == RANK:
                slot = owner * 0 + _own_slot(PUSH, WORLD)
            else:
                slot = _peer_slot(owner, RANK, WORLD, PUSH)
            _store_part(acc, pid_n * BLOCK_N, owner, slot, row, pid_m, c_smem, slots_desc, slots0, slots1, slots2, slots3,
                        slots4, slots5, slots6, slots7, scale_a_ptr, scale_b_ptr, rows_per_rank, N, layout, C, RANK,
                        WORLD, PUSH, SCALING)  # fmt: skip
            if SPLIT_ACC:  # the columns' second half, through the same staging buffer
                _store_part(acc_hi, pid_n * BLOCK_N + ACC_N, owner, slot, row, pid_m, c_smem, slots_desc, slots0, slots1,
                            slots2, slots3, slots4, slots5, slots6, slots7, scale_a_ptr, scale_b_ptr, rows_per_rank, N,
                            layout, C, RANK, WORLD, PUSH, SCALING)  # fmt: skip
            if owner == RANK:  # the reducers wait for it now, not after the next K loop
                _count_own(own_flags + pid_m * tiles_n + pid_n)
            else:
                pending = 1
    if pending != 0:
        handed = _hand_over_peer_half(stored, counted, handed)


@gluon.jit
def _acquire_read(flag_ptrs):
    """Each int32 flag at flag_ptrs, read with acquire at scope sys by a load: every program polls
    the same band counters, which atomics (read-modify-writes) would serialize."""
    return gl.inline_asm_elementwise("ld.acquire.sys.global.b32 $0, [$1];", "=r,l", [flag_ptrs], dtype=gl.int32,
                                     is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _wait_flags(flag_ptrs, waited, expected, lanes, needed, max_spins):
    """Read the flags of flag_ptrs (each a valid address, waited or not) all at once until every
    lane below `needed` (`lanes`: 0, 1, ...) that is `waited` reads `expected`, for at most
    max_spins rounds; returns the first lane whose flag has not arrived (lanes not waited count
    as arrived; the lane count if none): below `needed`, the caller records and traps."""
    LANES: gl.constexpr = lanes.shape[0]
    arrived = (_acquire_read(flag_ptrs) == expected) | ~waited
    missing = gl.min(gl.where(arrived, LANES, lanes), 0)
    spins = 0
    while (missing < needed) & (spins < max_spins):
        arrived = arrived | (_acquire_read(flag_ptrs) == expected)
        missing = gl.min(gl.where(arrived, LANES, lanes), 0)
        spins += 1
    return missing


@gluon.jit
def _wait_units(buffer_ptrs, own_flags, first_unit, count, needed, tiles_m, tiles_n, flags_offset, max_spins,
                RANK: gl.constexpr, WORLD: gl.constexpr, BAND_ROWS: gl.constexpr,
                NUM_PROGRAMS: gl.constexpr, BLOCK_M: gl.constexpr, UNIT_ROWS: gl.constexpr, PUSH: gl.constexpr,
                WARPS: gl.constexpr, LANES: gl.constexpr):  # fmt: skip
    """Of the `count` (at most LANES // W) units first_unit, first_unit + NUM_PROGRAMS, ...,
    how many in a row have arrived (this rank's own partial of its tile and every peer's band of
    it; acquire), waiting until the first `needed` have: every flag read at once by the calling
    WARPS warps, lane k * W + r for unit k and rank r, one round trip for them all (a reducer
    behind the GEMM learns of several ready units from one); gives up after max_spins rounds.
    LANES: 32 * WARPS (a lane a thread), or 32 (every warp reads the same flags and finds the same
    answer: with a reduction across the reducer's two warps, it read rows before they arrived;
    docs/perf-log.md). Returns the first lane whose flag has not arrived
    (count * W or more: none): below needed * W it gave up, and the caller traps (_give_up)."""
    gl.static_assert((LANES == 32) | (LANES == 32 * WARPS))
    gl.static_assert(WORLD <= LANES)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    lanes = gl.arange(0, LANES, layout=layout)
    srcs = lanes % WORLD
    pid_m, pid_n, row0 = _unit(first_unit + (lanes // WORLD) * NUM_PROGRAMS, tiles_m, tiles_n, BAND_ROWS, BLOCK_M,
                               UNIT_ROWS)  # fmt: skip
    tile = pid_m * tiles_n + pid_n
    band = pid_m // BAND_ROWS
    bands = gl.cdiv(tiles_m, BAND_ROWS)
    band_tiles = gl.minimum(tiles_m - band * BAND_ROWS, BAND_ROWS) * tiles_n
    waited = lanes < count * WORLD
    # Peer src's band of this rank's rows: incoming slot src - (src > RANK), its flag set once by
    # the copy stream, or (push) its counter at every half of the band's tiles.
    flags = (gl.load(buffer_ptrs + RANK) + flags_offset).to(gl.pointer_type(gl.int32))
    band_flags = flags + (srcs - (srcs > RANK).to(gl.int32)) * bands + band
    flag_ptrs = gl.where(srcs == RANK, own_flags + tile, band_flags)
    flag_ptrs = gl.where(waited, flag_ptrs, own_flags)  # lanes past `count` read a flag that exists
    band_complete = band_tiles * TILE_ARRIVALS if PUSH else band_tiles * 0 + 1
    expected = gl.where(srcs == RANK, TILE_ARRIVALS, band_complete)
    missing = _wait_flags(flag_ptrs, waited, expected, lanes, needed * WORLD, max_spins)
    fence_async_proxy()  # the acquires before the units' TMA loads
    return missing


@gluon.jit
def _give_up(report_ptr, missing, first_unit, tiles_m, tiles_n, RANK: gl.constexpr, WORLD: gl.constexpr,
             BAND_ROWS: gl.constexpr, NUM_PROGRAMS: gl.constexpr, BLOCK_M: gl.constexpr, UNIT_ROWS: gl.constexpr):  # fmt: skip
    """Record (rank waited for, tile, this rank) of lane `missing` of a wait from first_unit
    (_wait_units) and trap."""
    pid_m, pid_n, row0 = _unit(first_unit + (missing // WORLD) * NUM_PROGRAMS, tiles_m, tiles_n, BAND_ROWS, BLOCK_M,
                               UNIT_ROWS)  # fmt: skip
    record_and_trap(report_ptr, missing % WORLD, pid_m * tiles_n + pid_n, RANK)


@gluon.jit
def _await_unit(ready_below, unit, last, buffer_ptrs, own_flags, report_ptr, tiles_m, tiles_n, flags_offset, max_spins,
                RANK: gl.constexpr, WORLD: gl.constexpr, BAND_ROWS: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                BLOCK_M: gl.constexpr, UNIT_ROWS: gl.constexpr, PUSH: gl.constexpr,
                REDUCER_WARPS: gl.constexpr):  # fmt: skip
    """The reducer's wait for `unit` (of this program's units below `last`): none where it is below
    ready_below (this program's units below it have arrived), else one that reads the flags of
    the units after it too; returns the new ready_below."""
    if unit >= ready_below:
        count = gl.minimum(gl.cdiv(last - unit, NUM_PROGRAMS), 32 // WORLD)
        missing = _wait_units(buffer_ptrs, own_flags, unit, count, 1, tiles_m, tiles_n, flags_offset,
                              max_spins, RANK, WORLD, BAND_ROWS, NUM_PROGRAMS, BLOCK_M, UNIT_ROWS, PUSH,
                              REDUCER_WARPS, 32)  # fmt: skip
        if missing < WORLD:
            _give_up(report_ptr, missing, unit, tiles_m, tiles_n, RANK, WORLD, BAND_ROWS, NUM_PROGRAMS, BLOCK_M,
                     UNIT_ROWS)  # fmt: skip
        ready_below = unit + gl.minimum(missing // WORLD, count) * NUM_PROGRAMS
    return ready_below


@gluon.jit
def _unit(unit, tiles_m, tiles_n, BAND_ROWS: gl.constexpr, BLOCK_M: gl.constexpr, UNIT_ROWS: gl.constexpr):
    """(pid_m, pid_n, first row in the segment) of a reduction unit: own tiles in the consumers' order."""
    units_per_tile: gl.constexpr = BLOCK_M // UNIT_ROWS
    pid_m, pid_n = grouped_tile(unit // units_per_tile, tiles_m, tiles_n, BAND_ROWS)
    return pid_m, pid_n, pid_m * BLOCK_M + (unit % units_per_tile) * UNIT_ROWS


@gluon.jit
def _issue_unit(units_desc, bufs, buffer, bar, row0, col0, WORLD: gl.constexpr, PUSH: gl.constexpr):
    """TMA-load a unit's rows of the W slots into unit buffer `buffer` of bufs ([units * W, 1,
    UNIT_ROWS, BLOCK_N]), completing `bar`: bufs[buffer * W + i] the i-th peer's (rank order;
    incoming slot i), bufs[buffer * W + W - 1] the own slot's. With a box of W slots (push: the
    incoming slots and then the own one, adjacent) in one copy, else slot by slot."""
    BOX: gl.constexpr = units_desc.block_type.shape[0]
    UNIT_ROWS: gl.constexpr = units_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = units_desc.block_type.shape[2]
    fence_async_shared()  # this warp's reads of the buffer's last unit come before TMA overwrites them
    mbarrier.expect(bar, (WORLD // BOX) * units_desc.block_type.nbytes)
    if BOX == WORLD:
        gl.static_assert(PUSH)
        UNITS_SHAPE: gl.constexpr = [bufs.type.shape[0] // WORLD, WORLD, UNIT_ROWS, BLOCK_N]
        if NAMED_REINTERPRET:
            units = bufs.reinterpret(units_desc.dtype, UNITS_SHAPE, units_desc.layout)
        else:
            units = bufs._reinterpret(units_desc.dtype, UNITS_SHAPE, units_desc.layout)
        tma_load(units_desc, [0, row0, col0], bar, units.index(buffer))
    else:
        gl.static_assert(BOX == 1)
        tma_load(units_desc, [_own_slot(PUSH, WORLD), row0, col0], bar, bufs.index(buffer * WORLD + WORLD - 1))
        for i in gl.static_range(WORLD - 1):
            tma_load(units_desc, [i, row0, col0], bar, bufs.index(buffer * WORLD + i))


@gluon.jit
def _sum_unit(bufs, buffer, out_ptr, bias_ptr, row0, col0, rows_per_rank, N, stride_om, WORLD: gl.constexpr,
              HAS_BIAS: gl.constexpr, WARPS: gl.constexpr = 1):  # fmt: skip
    """out's rows row0.. (columns col0..) = the sum, in float32, of unit buffer `buffer` of bufs
    (its own slot's rows, then the peers' in rank order: deterministic) and the bias, rounded
    once; WARPS rows at a time, a row per calling warp."""
    UNIT_ROWS: gl.constexpr = bufs.type.shape[2]
    BLOCK_N: gl.constexpr = bufs.type.shape[3]
    WIDTH: gl.constexpr = REDUCE_WIDTH if BLOCK_N > REDUCE_WIDTH else BLOCK_N
    gl.static_assert(BLOCK_N % WIDTH == 0)
    gl.static_assert(UNIT_ROWS % WARPS == 0)
    layout: gl.constexpr = gl.BlockedLayout([1, WIDTH // 32], [1, 32], [WARPS, 1], [1, 0])
    for r in gl.static_range(0, UNIT_ROWS, WARPS):
        rows_out = row0 + r + gl.arange(0, WARPS, layout=gl.SliceLayout(1, layout))
        for c in gl.static_range(BLOCK_N // WIDTH):
            cols = col0 + c * WIDTH + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
            acc = gl.zeros((WARPS, WIDTH), gl.float32, layout=layout)
            for i in gl.static_range(WORLD):  # own (position W - 1), then the peers in rank order
                rows = bufs.index(buffer * WORLD + (i + WORLD - 1) % WORLD).reshape([UNIT_ROWS, BLOCK_N])
                acc += rows.slice(r, WARPS).slice(c * WIDTH, WIDTH, dim=1).load(layout).to(gl.float32)
            if HAS_BIAS:
                acc += gl.expand_dims(gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32), 0)
            mask = gl.expand_dims(rows_out < rows_per_rank, 1) & gl.expand_dims(cols < N, 0)
            offs = gl.expand_dims(rows_out.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols, 0)
            gl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _tail_first(rows_per_rank, N, WORLD: gl.constexpr, NUM_PROGRAMS: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, UNIT_ROWS: gl.constexpr):  # fmt: skip
    """This program's first unit of the tail (module docstring): the units of the own tiles in the
    last round of tiles (own tile j is tile j * W + W - 1), which all complete at the GEMM's end."""
    units_per_tile: gl.constexpr = BLOCK_M // UNIT_ROWS
    tiles_per_segment = gl.cdiv(rows_per_rank, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    units = tiles_per_segment * units_per_tile
    last_round = (gl.cdiv(WORLD * tiles_per_segment, NUM_PROGRAMS) - 1) * NUM_PROGRAMS
    tail_start = gl.minimum(gl.cdiv(gl.maximum(last_round - (WORLD - 1), 0), WORLD) * units_per_tile, units)
    pid = gl.program_id(0)
    return pid + gl.cdiv(gl.maximum(tail_start - pid, 0), NUM_PROGRAMS) * NUM_PROGRAMS


@gluon.jit
def _reducer(units_desc, unit_bufs, unit_bar, out_ptr, bias_ptr, buffer_ptrs, report_ptr, rows_per_rank, N, stride_om,
             flags_offset, own_offset, last_step, max_spins, RANK: gl.constexpr, WORLD: gl.constexpr,
             BAND_ROWS: gl.constexpr, NUM_PROGRAMS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
             UNITS_IN_FLIGHT: gl.constexpr, TAIL_UNITS: gl.constexpr, HAS_BIAS: gl.constexpr,
             PUSH: gl.constexpr, REDUCER_WARPS: gl.constexpr):  # fmt: skip
    """This program's reduction units beside the MMAs, in order (module docstring), up to the tail's,
    by REDUCER_WARPS warps, a row each in turn."""
    if last_step == WORLD - 1:
        UNIT_ROWS: gl.constexpr = units_desc.block_type.shape[1]
        gl.static_assert(BLOCK_M % UNIT_ROWS == 0)
        tiles_m = gl.cdiv(rows_per_rank, BLOCK_M)
        tiles_n = gl.cdiv(N, BLOCK_N)
        own_flags = _own_flags(buffer_ptrs, own_offset, RANK)
        units = tiles_m * tiles_n * (BLOCK_M // UNIT_ROWS)
        pid = gl.program_id(0)
        tail_first = units
        if TAIL_UNITS > 0:
            tail_first = _tail_first(rows_per_rank, N, WORLD, NUM_PROGRAMS, BLOCK_M, BLOCK_N, UNIT_ROWS)
        AHEAD: gl.constexpr = UNITS_IN_FLIGHT * NUM_PROGRAMS  # from this program's unit to the one its buffer takes next
        # Software-pipelined by UNITS_IN_FLIGHT units, the j-th of this program's units in buffer
        # j % UNITS_IN_FLIGHT: a unit's flags are waited for while units before it are on their way
        # (a wait is a round trip even when the flags are long set), its rows requested as soon as
        # its buffer's last unit is summed. With one buffer, the wait comes before that sum (it
        # overlaps the sum's loads); with more, after it (the other buffers' loads are in flight,
        # and a ready unit is not held back by a wait for one further ahead).
        last = gl.minimum(tail_first, units)
        ready_below = pid  # this program's units below it have arrived (_await_unit)
        for j in gl.static_range(UNITS_IN_FLIGHT):
            unit = pid + j * NUM_PROGRAMS
            pid_m, pid_n, row0 = _unit(unit, tiles_m, tiles_n, BAND_ROWS, BLOCK_M, UNIT_ROWS)
            if (unit < tail_first) & (row0 < rows_per_rank):
                ready_below = _await_unit(ready_below, unit, last, buffer_ptrs, own_flags, report_ptr, tiles_m, tiles_n,
                                          flags_offset, max_spins, RANK, WORLD, BAND_ROWS, NUM_PROGRAMS, BLOCK_M,
                                          UNIT_ROWS, PUSH, REDUCER_WARPS)  # fmt: skip
                _issue_unit(units_desc, unit_bufs, j, unit_bar.index(j), row0, pid_n * BLOCK_N, WORLD, PUSH)
        phases = 0  # bit b: the phase buffer b's barrier completes next
        buffer = 0
        for unit in range(pid, last, NUM_PROGRAMS):
            pid_m, pid_n, row0 = _unit(unit, tiles_m, tiles_n, BAND_ROWS, BLOCK_M, UNIT_ROWS)
            next_m, next_n, next_row0 = _unit(unit + AHEAD, tiles_m, tiles_n, BAND_ROWS, BLOCK_M, UNIT_ROWS)
            # A ragged segment's last tile: its units past the end hold no rows (nothing loaded).
            next_valid = (unit + AHEAD < tail_first) & (next_row0 < rows_per_rank)
            if UNITS_IN_FLIGHT == 1:
                if next_valid:
                    ready_below = _await_unit(ready_below, unit + AHEAD, last, buffer_ptrs, own_flags, report_ptr,
                                              tiles_m, tiles_n, flags_offset, max_spins, RANK, WORLD, BAND_ROWS,
                                              NUM_PROGRAMS, BLOCK_M, UNIT_ROWS, PUSH, REDUCER_WARPS)  # fmt: skip
            if row0 < rows_per_rank:
                mbarrier.wait(unit_bar.index(buffer), (phases >> buffer) & 1)
                phases ^= 1 << buffer
                _sum_unit(unit_bufs, buffer, out_ptr, bias_ptr, row0, pid_n * BLOCK_N, rows_per_rank, N, stride_om,
                          WORLD, HAS_BIAS, REDUCER_WARPS)  # fmt: skip
            if next_valid:
                if UNITS_IN_FLIGHT > 1:
                    ready_below = _await_unit(ready_below, unit + AHEAD, last, buffer_ptrs, own_flags, report_ptr,
                                              tiles_m, tiles_n, flags_offset, max_spins, RANK, WORLD, BAND_ROWS,
                                              NUM_PROGRAMS, BLOCK_M, UNIT_ROWS, PUSH, REDUCER_WARPS)  # fmt: skip
                if REDUCER_WARPS > 1:  # every warp is done reading the buffer before TMA overwrites it
                    partition_barrier()
                _issue_unit(units_desc, unit_bufs, buffer, unit_bar.index(buffer), next_row0, next_n * BLOCK_N, WORLD,
                            PUSH)  # fmt: skip
            buffer = (buffer + 1) % UNITS_IN_FLIGHT


@gluon.jit
def _tail(units_desc, b_bufs, tail_bar, out_ptr, bias_ptr, buffer_ptrs, report_ptr, rows_per_rank, N, stride_om,
          flags_offset, own_offset, max_spins, RANK: gl.constexpr, WORLD: gl.constexpr, BAND_ROWS: gl.constexpr,
          NUM_PROGRAMS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, TAIL_UNITS: gl.constexpr,
          HAS_BIAS: gl.constexpr, PUSH: gl.constexpr, WARPS: gl.constexpr):  # fmt: skip
    """The tail's units (module docstring), by this program's WARPS warps once every partition is
    done: TAIL_UNITS at a time in the stage ring, their flags waited for 32 * WARPS // W units a
    round trip, every load in flight, each unit summed as it lands. A wait that gives up traps
    after the tail's loop, the waits after it skipped: a trap in the loop made Triton 3.8 spill
    the consumer's registers in this partition (docs/perf-log.md)."""
    UNIT_ROWS: gl.constexpr = units_desc.block_type.shape[1]
    tiles_m = gl.cdiv(rows_per_rank, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    own_flags = _own_flags(buffer_ptrs, own_offset, RANK)
    units = tiles_m * tiles_n * (BLOCK_M // UNIT_ROWS)
    RING_SHAPE: gl.constexpr = [TAIL_UNITS * WORLD, 1, UNIT_ROWS, BLOCK_N]
    if NAMED_REINTERPRET:
        ring = b_bufs.reinterpret(units_desc.dtype, RING_SHAPE, units_desc.layout)
    else:
        ring = b_bufs._reinterpret(units_desc.dtype, RING_SHAPE, units_desc.layout)
    PER_WAIT: gl.constexpr = 32 * WARPS // WORLD
    tail_phase = 0
    gave_up_unit = -1  # the first unit of the wait that gave up; gave_up_lane its first missing lane
    gave_up_lane = 0
    first_unit = _tail_first(rows_per_rank, N, WORLD, NUM_PROGRAMS, BLOCK_M, BLOCK_N, UNIT_ROWS)
    for first in range(first_unit, units, TAIL_UNITS * NUM_PROGRAMS):
        count = gl.minimum(gl.cdiv(units - first, NUM_PROGRAMS), TAIL_UNITS)
        partition_barrier()  # every warp is done reading the ring's last units before TMA overwrites them
        for k0 in range(0, count, PER_WAIT):
            batch = gl.minimum(count - k0, PER_WAIT)
            if gave_up_unit < 0:
                missing = _wait_units(buffer_ptrs, own_flags, first + k0 * NUM_PROGRAMS, batch, batch,
                                      tiles_m, tiles_n, flags_offset, max_spins, RANK, WORLD, BAND_ROWS, NUM_PROGRAMS,
                                      BLOCK_M, UNIT_ROWS, PUSH, WARPS, 32 * WARPS)  # fmt: skip
                if missing < batch * WORLD:
                    gave_up_unit = first + k0 * NUM_PROGRAMS
                    gave_up_lane = missing
            for k in range(k0, gl.minimum(count, k0 + PER_WAIT)):
                unit = first + k * NUM_PROGRAMS
                pid_m, pid_n, row0 = _unit(unit, tiles_m, tiles_n, BAND_ROWS, BLOCK_M, UNIT_ROWS)
                if row0 < rows_per_rank:
                    _issue_unit(units_desc, ring, k, tail_bar.index(k), row0, pid_n * BLOCK_N, WORLD, PUSH)
                else:  # no rows: its barrier completes this phase all the same
                    mbarrier.arrive(tail_bar.index(k), count=1)
        for k in range(count):
            unit = first + k * NUM_PROGRAMS
            pid_m, pid_n, row0 = _unit(unit, tiles_m, tiles_n, BAND_ROWS, BLOCK_M, UNIT_ROWS)
            mbarrier.wait(tail_bar.index(k), tail_phase)
            if row0 < rows_per_rank:
                _sum_unit(ring, k, out_ptr, bias_ptr, row0, pid_n * BLOCK_N, rows_per_rank, N, stride_om, WORLD,
                          HAS_BIAS, WARPS)  # fmt: skip
        tail_phase ^= 1
    if gave_up_unit >= 0:
        _give_up(report_ptr, gave_up_lane, gave_up_unit, tiles_m, tiles_n, RANK, WORLD, BAND_ROWS, NUM_PROGRAMS,
                 BLOCK_M, UNIT_ROWS)  # fmt: skip


@gluon.jit
def matmul_reduce_scatter_reducer_kernel(
    a_desc,  # Gluon TensorDescriptor over x [M, K] (bf16 / fp16 / FP8), block [BLOCK_M, BLOCK_K]
    b_desc,  # over w [N, K], block [BLOCK_N, BLOCK_K]; with B_KN over w^T [K, N], block [BLOCK_K, BLOCK_N]
    out_ptr,  # out [m, N], this rank's rows of the sum
    bias_ptr,  # [N] or a dummy when HAS_BIAS is False
    buffer_ptrs,  # int64 [W]: base address of every rank's workspace buffer
    rows_per_rank,  # m
    N,
    K,
    stride_om,
    flags_offset,  # bytes from a buffer's base to its int32 flags (module docstring)
    first_step,  # owner steps to run: first_step..last_step (a full call: 0..W-1)
    last_step,
    max_spins,
    report_ptr,  # int32 [3]: where a timed-out wait records (rank waited for, tile, this rank)
    own_offset,  # bytes from this rank's buffer base to its own-tile flags (module docstring)
    slots_desc,  # over this rank's slots [S, m, N] (2W-1, push W), block [1, BLOCK_M // 2, BLOCK_N] (the stores;
    #   with SPLIT_ACC a quarter as wide: a half tile's column halves go in two pieces each)
    units_desc,  # over the same slots, block [W (push) or 1, unit rows, BLOCK_N], unswizzled (the reducer's loads)
    slots0,  # push: as slots_desc over rank 0's slots as this GPU sees them, ... (unused past W: any descriptor)
    slots1,
    slots2,
    slots3,
    slots4,
    slots5,
    slots6,
    slots7,
    scale_a_ptr,  # scaled calls: float32 scales of x's rows [M] (row-wise) or of x (per tensor); else None
    scale_b_ptr,  # scaled calls: float32 scales of w's rows [N] (row-wise) or of w; else None
    RANK: gl.constexpr,
    WORLD: gl.constexpr,
    BAND_ROWS: gl.constexpr,  # tile rows per band: the tile order's group and the partials' counting unit (Layout)
    NUM_PROGRAMS: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    UNITS_IN_FLIGHT: gl.constexpr,  # reduction units the reducer warp has in flight (a buffer each)
    TAIL_UNITS: gl.constexpr,  # the tail's units at once in the weight stages; 0: no tail (every unit in a buffer)
    HAS_BIAS: gl.constexpr,
    B_KN: gl.constexpr,  # b_desc reads the weight's row-major transpose [K, N] (backward: no copy)
    PUSH: gl.constexpr,  # peers' rows into their owners' buffers (else the copy engine's outgoing slots here)
    SCALING: gl.constexpr,  # 0 unscaled (bf16 / fp16), 1 per tensor, 2 row-wise (FP8 operands)
    PRECISE_ACC: gl.constexpr,  # FP8 products promoted to float32 after each two K blocks (not use_fast_accum)
    SPLIT_ACC: gl.constexpr,  # PRECISE_ACC in column halves (fluxtp.kernels._pingpong); slots_desc's block a quarter as wide
    RESET_OWN: gl.constexpr,  # the last program out zeroes the own region for the next launch (module docstring)
    REDUCER_WARPS: gl.constexpr,  # the reducer partition's warps, a unit row each in turn (reducer_warps)
    num_warps: gl.constexpr,  # 4: consumer 0 (the default partition)
):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1] if B_KN else b_desc.block_type.shape[0]
    a_bufs, b_bufs, ready, empty = allocate_stages(a_desc, b_desc, NUM_STAGES)
    c_bufs = gl.allocate_shared_memory(slots_desc.dtype, [2, 1, BLOCK_M // 2, slots_desc.block_type.shape[2]],
                                       slots_desc.layout)  # fmt: skip
    UNIT_ROWS: gl.constexpr = units_desc.block_type.shape[1]
    unit_bufs = gl.allocate_shared_memory(units_desc.dtype, [UNITS_IN_FLIGHT * WORLD, 1, UNIT_ROWS, BLOCK_N],
                                          units_desc.layout)  # fmt: skip
    unit_bar = gl.allocate_shared_memory(gl.int64, [UNITS_IN_FLIGHT, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(UNITS_IN_FLIGHT):
        mbarrier.init(unit_bar.index(b), count=1)
    # The reducer's tail: its units in the weight stages, a barrier each.
    gl.static_assert(TAIL_UNITS * WORLD * UNIT_ROWS * BLOCK_N * units_desc.dtype.primitive_bitwidth
                     <= NUM_STAGES * BLOCK_N * a_desc.block_type.shape[1] * b_desc.dtype.primitive_bitwidth)
    TAIL_BARRIERS: gl.constexpr = TAIL_UNITS if TAIL_UNITS > 0 else 1
    tail_bar = gl.allocate_shared_memory(gl.int64, [TAIL_BARRIERS, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(TAIL_BARRIERS):
        mbarrier.init(tail_bar.index(b), count=1)
    # The consumers' stored peer tiles to the counter warp and back: a ring of two slots.
    stored = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    counted = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(2):
        mbarrier.init(stored.index(b), count=TILE_ARRIVALS)  # both consumers' halves
        mbarrier.init(counted.index(b), count=1)
    # Partition arguments are spelled out in each tuple: constexprs keep their kind only so.
    gl.warp_specialize(
        [
            (_consumer, (buffer_ptrs, slots_desc, slots0, slots1, slots2, slots3, slots4, slots5, slots6, slots7, a_bufs,
                         b_bufs, c_bufs, ready, empty, stored, counted, rows_per_rank, N, K, own_offset, first_step,
                         last_step, scale_a_ptr, scale_b_ptr, 0, RANK, WORLD, BAND_ROWS, NUM_PROGRAMS, B_KN, PUSH,
                         SCALING, PRECISE_ACC, SPLIT_ACC)),
            (_consumer, (buffer_ptrs, slots_desc, slots0, slots1, slots2, slots3, slots4, slots5, slots6, slots7, a_bufs,
                         b_bufs, c_bufs, ready, empty, stored, counted, rows_per_rank, N, K, own_offset, first_step,
                         last_step, scale_a_ptr, scale_b_ptr, 1, RANK, WORLD, BAND_ROWS, NUM_PROGRAMS, B_KN, PUSH,
                         SCALING, PRECISE_ACC, SPLIT_ACC)),
            (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, rows_per_rank, N, K, first_step, last_step, RANK,
                       WORLD, BAND_ROWS, NUM_PROGRAMS, B_KN, SPLIT_ACC)),
            (_reducer, (units_desc, unit_bufs, unit_bar, out_ptr, bias_ptr, buffer_ptrs, report_ptr, rows_per_rank, N,
                        stride_om, flags_offset, own_offset, last_step, max_spins, RANK, WORLD, BAND_ROWS,
                        NUM_PROGRAMS, BLOCK_M, BLOCK_N, UNITS_IN_FLIGHT, TAIL_UNITS, HAS_BIAS, PUSH, REDUCER_WARPS)),
            (_counter, (buffer_ptrs, stored, counted, rows_per_rank, N, flags_offset, first_step, last_step, RANK, WORLD,
                        BAND_ROWS, NUM_PROGRAMS, BLOCK_M, BLOCK_N, PUSH)),
        ],
        [4, 1, REDUCER_WARPS, 1],
        # The loader, reducer and counter warps share a warpgroup and its register count; what
        # they take, the consumers lose (the default partition gets the rest, 224), and with fewer
        # than that ptxas serializes the MMAs.
        [232, 40, 48, 40],
    )  # fmt: skip

    # Every partition of this program is done: the tail, in the stage ring by all four warps here
    # (one warp's sums were its critical path), then (RESET_OWN) the last program out resets the
    # own-tile flags and the counter for the next launch.
    if TAIL_UNITS > 0:
        if last_step == WORLD - 1:
            _tail(units_desc, b_bufs, tail_bar, out_ptr, bias_ptr, buffer_ptrs, report_ptr, rows_per_rank, N, stride_om,
                  flags_offset, own_offset, max_spins, RANK, WORLD, BAND_ROWS, NUM_PROGRAMS, BLOCK_M, BLOCK_N,
                  TAIL_UNITS, HAS_BIAS, PUSH, num_warps)  # fmt: skip
    if RESET_OWN:
        tiles_per_segment = gl.cdiv(rows_per_rank, BLOCK_M) * gl.cdiv(N, BLOCK_N)
        own_flags = _own_flags(buffer_ptrs, own_offset, RANK)
        done = own_flags + tiles_per_segment
        if gl.atomic_add(done, 1, sem="acq_rel", scope="gpu") == NUM_PROGRAMS - 1:
            offs = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
            for start in range(0, tiles_per_segment, 128):
                gl.store(own_flags + start + offs, 0, mask=start + offs < tiles_per_segment)
            gl.atomic_xchg(done, 0, sem="relaxed", scope="gpu")
