"""Persistent GEMM+ReduceScatter for bf16 / fp16, warp-specialized, the owner's reduction beside the MMAs (Gluon, Hopper).

The same op and transports as _matmul_reduce_scatter's kernel (push, pull, copy engine; the same
partial slots and peer flags, a tile's flag counting two arrivals, one per consumer), arranged so
that reading the peers' partials costs no tensor-core time:
- a loader warp TMA-loads each tile's K blocks of x (the owner's rows) and w into a ring of stages;
- two consumer warpgroups each compute half of a tile's rows. A peer tile's half goes to its
  holder's partial slot; an own tile's half is stored in float32 into this rank's own slot (in its
  buffer at own_offset) and counted in its own-tile flag there (release);
- a reducer warp sums this rank's rows while the consumers compute: units of UNIT_ROWS rows of
  an own tile, unit u going to program u % NUM_PROGRAMS, in order; a unit waits (acquire,
  bounded) for its tile's own flag and every peer's flag, then adds the peers' partials in rank
  order to the own float32 partial (the Triton kernel's order: the same bits), adds the bias and
  rounds once into out. The consumers do not join in after their tiles: the code made ptxas
  serialize their MMAs for want of registers (docs/perf-log.md).
Tiles are interleaved across owners: tile t is the (t // W)-th tile (grouped order) of owner
(RANK + 1 + t % W) % W, so the partials of every owner's rows, own ones included, complete
progressively and the reduction runs behind the GEMM instead of after it. A launch may run only
the owner steps first_step..last_step (t % W in that range; the reducer only with the own step).

Own region (own_offset bytes into this rank's buffer): int32 own-tile flags [tiles of a segment],
a done counter, then (16-byte aligned) the float32 own slot [m, N] (own_slot_offset). The last
program out resets the flags and the counter for the next launch; they must read 0 before the
first. The peer flags keep the Triton kernel's contract (0 before the launch: the launcher
resets them).

A wait that gives up writes (rank waited for, tile, this rank) to `report_ptr` (host-pinned) and
traps; the reducers wait for tiles of other programs of this launch, so the launcher leaves one
SM free (a program that never got an SM would make them wait out their bound, not hang).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from fluxtp.kernels._pingpong import (
    accumulate_plain,
    allocate_stages,
    grouped_tile,
    load_tile,
    partition_barrier,
    record_and_trap,
)

TILE_ARRIVALS = gl.constexpr(2)  # one release per consumer warpgroup
UNIT_ROWS = gl.constexpr(8)  # rows of an own tile per reduction unit
REDUCE_WIDTH = gl.constexpr(128)  # columns a reduction step covers at most: 4 per lane (few registers)


def own_slot_offset(tiles_per_segment):
    """Bytes from the own region's start to the float32 own slot (the launcher sizes the region by it)."""
    return ((tiles_per_segment + 1) * 4 + 15) // 16 * 16


@gluon.jit
def _own_region(buffer_ptrs, own_offset, tiles_per_segment, RANK: gl.constexpr):
    """(own-tile flags, then the done counter; the float32 own slot)."""
    own = gl.load(buffer_ptrs + RANK) + own_offset
    slot = own + ((tiles_per_segment + 1) * 4 + 15) // 16 * 16
    return own.to(gl.pointer_type(gl.int32)), _aligned(slot, gl.float32)


@gluon.jit
def _aligned(address, dtype: gl.constexpr):
    """A buffer address (loaded from memory: no known alignment) as a pointer the compiler knows
    is 16-byte aligned (buffers and slots are), so rows with N % 8 == 0 move in 16-byte accesses."""
    return gl.multiple_of(address.to(gl.pointer_type(dtype)), 16)


@gluon.jit
def _tile(t, tiles_m, tiles_n, RANK: gl.constexpr, WORLD: gl.constexpr, GROUP_M: gl.constexpr):
    """(owner step, owner, pid_m, pid_n) of tile t: owners interleaved, grouped order within each."""
    step = t % WORLD
    pid_m, pid_n = grouped_tile(t // WORLD, tiles_m, tiles_n, GROUP_M)
    return step, (RANK + 1 + step) % WORLD, pid_m, pid_n


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, rows_per_rank, N, K, first_step, last_step,
            RANK: gl.constexpr, WORLD: gl.constexpr, GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
            B_KN: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1] if B_KN else b_desc.block_type.shape[0]
    tiles_m = gl.cdiv(rows_per_rank, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    loaded = 0
    for t in range(gl.program_id(0), WORLD * tiles_m * tiles_n, NUM_PROGRAMS):
        step, owner, pid_m, pid_n = _tile(t, tiles_m, tiles_n, RANK, WORLD, GROUP_M)
        if (step >= first_step) & (step <= last_step):
            loaded = load_tile(a_desc, owner * rows_per_rank + pid_m * BLOCK_M, b_desc, pid_n * BLOCK_N, a_bufs, b_bufs,
                               ready, empty, loaded, K, B_KN)  # fmt: skip


@gluon.jit
def _wait_tile(buffer_ptrs, own_flags, report_ptr, tile, pid_m, tiles_per_segment, bands, flags_offset, max_spins,
               RANK: gl.constexpr, WORLD: gl.constexpr, GROUP_M: gl.constexpr, PUSH: gl.constexpr,
               COPY_ENGINE: gl.constexpr, WARPS: gl.constexpr):  # fmt: skip
    """Until this rank's own partial of `tile` and every peer's have arrived (acquire; every
    flag read at once, lane r for rank r); gives up after max_spins rounds (record and trap)."""
    LANES: gl.constexpr = 32 * WARPS
    gl.static_assert(WORLD <= LANES)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    srcs = gl.arange(0, LANES, layout=layout)
    peer = (srcs < WORLD) & (srcs != RANK)
    if PUSH:
        holders = gl.full((LANES,), RANK, gl.int32, layout=layout)
        slots = srcs - (srcs > RANK).to(gl.int32)
    else:
        holders = srcs
        slots = gl.full((LANES,), RANK, gl.int32, layout=layout) - (srcs < RANK).to(gl.int32)
    if COPY_ENGINE:
        index = slots * bands + pid_m // GROUP_M
        expected = gl.where(peer, 1, TILE_ARRIVALS)  # the copy stream sets a band's flag once
    else:
        index = slots * tiles_per_segment + tile
        expected = gl.full((LANES,), TILE_ARRIVALS, gl.int32, layout=layout)
    bases = gl.load(buffer_ptrs + holders, mask=peer, other=0) + flags_offset
    # Lane RANK reads this rank's own-tile flag (a local one, scope gpu would do; sys is a superset).
    flag_ptrs = gl.where(srcs == RANK, own_flags + (tile + srcs * 0), bases.to(gl.pointer_type(gl.int32)) + index)
    waited = srcs < WORLD
    zero = gl.full((LANES,), 0, gl.int32, layout=layout)  # (Gluon 3.6: no scalar operand)
    values = gl.atomic_add(flag_ptrs, zero, mask=waited, sem="acquire", scope="sys")
    arrived = (values == expected) | ~waited
    spins = 0
    while (gl.min(arrived.to(gl.int32), 0) == 0) & (spins < max_spins):
        values = gl.atomic_add(flag_ptrs, zero, mask=waited & ~arrived, sem="acquire", scope="sys")
        arrived = arrived | (waited & (values == expected))
        spins += 1
    if gl.min(arrived.to(gl.int32), 0) == 0:
        record_and_trap(report_ptr, gl.min(gl.where(arrived, LANES, srcs), 0), tile, RANK)
    partition_barrier()  # every thread of this partition loads after the acquire


@gluon.jit
def _reduce(out_ptr, bias_ptr, buffer_ptrs, report_ptr, rows_per_rank, N, stride_om, flags_offset, own_offset,
            max_spins, RANK: gl.constexpr, WORLD: gl.constexpr, GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_BIAS: gl.constexpr, PUSH: gl.constexpr,
            COPY_ENGINE: gl.constexpr, WARPS: gl.constexpr):  # fmt: skip
    """This program's reduction units, in order, each WARPS rows at a time."""
    WIDTH: gl.constexpr = REDUCE_WIDTH if BLOCK_N > REDUCE_WIDTH else BLOCK_N
    gl.static_assert(BLOCK_M % UNIT_ROWS == 0)
    gl.static_assert(BLOCK_N % WIDTH == 0)
    gl.static_assert(UNIT_ROWS % WARPS == 0)
    layout: gl.constexpr = gl.BlockedLayout([1, WIDTH // 32], [1, 32], [WARPS, 1], [1, 0])
    dtype = out_ptr.dtype.element_ty
    tiles_m = gl.cdiv(rows_per_rank, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    tiles_per_segment = tiles_m * tiles_n
    bands = gl.cdiv(tiles_m, GROUP_M)
    own_flags, own_slot = _own_region(buffer_ptrs, own_offset, tiles_per_segment, RANK)
    units_per_tile: gl.constexpr = BLOCK_M // UNIT_ROWS
    for unit in range(gl.program_id(0), tiles_per_segment * units_per_tile, NUM_PROGRAMS):
        pid_m, pid_n = grouped_tile(unit // units_per_tile, tiles_m, tiles_n, GROUP_M)
        row0 = pid_m * BLOCK_M + (unit % units_per_tile) * UNIT_ROWS
        if row0 < rows_per_rank:  # a ragged segment's last tile: its units past the end hold no rows
            tile = pid_m * tiles_n + pid_n
            _wait_tile(buffer_ptrs, own_flags, report_ptr, tile, pid_m, tiles_per_segment, bands, flags_offset, max_spins,
                       RANK, WORLD, GROUP_M, PUSH, COPY_ENGINE, WARPS)  # fmt: skip
            for r in range(0, UNIT_ROWS, WARPS):
                rows = row0 + r + gl.arange(0, WARPS, layout=gl.SliceLayout(1, layout))
                for c in gl.static_range(BLOCK_N // WIDTH):
                    cols = pid_n * BLOCK_N + c * WIDTH + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
                    mask = gl.expand_dims(rows < rows_per_rank, 1) & gl.expand_dims(cols < N, 0)
                    offs = gl.expand_dims(rows.to(gl.int64), 1) * N + gl.expand_dims(cols, 0)
                    acc = gl.load(own_slot + offs, mask=mask, other=0.0, cache_modifier=".cg")
                    for i in gl.static_range(WORLD - 1):  # the peers' partials in rank order
                        src = i + (i >= RANK)
                        if PUSH:
                            holder = RANK
                            slot = i
                        else:
                            holder = src
                            slot = RANK - (RANK > src)
                        part_ptr = _aligned(gl.load(buffer_ptrs + holder), dtype)
                        part = gl.load(part_ptr + slot * rows_per_rank.to(gl.int64) * N + offs, mask=mask, other=0.0,
                                       cache_modifier=".cg")  # fmt: skip
                        acc += part.to(gl.float32)
                    if HAS_BIAS:
                        bias = gl.load(bias_ptr + cols, mask=cols < N, other=0.0)
                        acc = acc + gl.expand_dims(bias.to(gl.float32), 0)
                    out_offs = gl.expand_dims(rows.to(gl.int64), 1) * stride_om + gl.expand_dims(cols, 0)
                    gl.store(out_ptr + out_offs, acc.to(dtype), mask=mask)


@gluon.jit
def _reducer(out_ptr, bias_ptr, buffer_ptrs, report_ptr, rows_per_rank, N, stride_om, flags_offset, own_offset, last_step,
             max_spins, RANK: gl.constexpr, WORLD: gl.constexpr, GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HAS_BIAS: gl.constexpr, PUSH: gl.constexpr,
             COPY_ENGINE: gl.constexpr):  # fmt: skip
    if last_step == WORLD - 1:
        _reduce(out_ptr, bias_ptr, buffer_ptrs, report_ptr, rows_per_rank, N, stride_om, flags_offset, own_offset,
                max_spins, RANK, WORLD, GROUP_M, NUM_PROGRAMS, BLOCK_M, BLOCK_N, HAS_BIAS, PUSH, COPY_ENGINE, 1)  # fmt: skip


@gluon.jit
def _consumer(out_ptr, bias_ptr, buffer_ptrs, report_ptr, a_bufs, b_bufs, ready, empty, rows_per_rank, N, K, stride_om,
              flags_offset, own_offset, first_step, last_step, max_spins, C: gl.constexpr, RANK: gl.constexpr,
              WORLD: gl.constexpr, GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, HAS_BIAS: gl.constexpr,
              PUSH: gl.constexpr, COPY_ENGINE: gl.constexpr, B_KN: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2] if B_KN else b_bufs.type.shape[1]
    HALF: gl.constexpr = BLOCK_M // 2
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    # Halves are stored through pointers in rows of 16-byte runs (the MMA layout's 4-byte pieces
    # would need a 64-bit address per pair of values: too many registers, uncoalesced stores).
    LANES_N: gl.constexpr = 32 if BLOCK_N >= 256 else BLOCK_N // 8
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // LANES_N, LANES_N], [4, 1], [1, 0])
    dtype = out_ptr.dtype.element_ty
    tiles_m = gl.cdiv(rows_per_rank, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    tiles_per_segment = tiles_m * tiles_n
    bands = gl.cdiv(tiles_m, GROUP_M)
    own_flags, own_slot = _own_region(buffer_ptrs, own_offset, tiles_per_segment, RANK)
    used = 0
    for t in range(gl.program_id(0), WORLD * tiles_per_segment, NUM_PROGRAMS):
        step, owner, pid_m, pid_n = _tile(t, tiles_m, tiles_n, RANK, WORLD, GROUP_M)
        if (step >= first_step) & (step <= last_step):
            acc, used = accumulate_plain(a_bufs, b_bufs, ready, empty, used, K, C, layout, B_KN)
            rows = pid_m * BLOCK_M + C * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, store_layout))  # in the segment
            cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store_layout))
            mask = gl.expand_dims(rows < rows_per_rank, 1) & gl.expand_dims(cols < N, 0)
            tile = pid_m * tiles_n + pid_n
            if owner == RANK:
                offs = gl.expand_dims(rows.to(gl.int64), 1) * N + gl.expand_dims(cols, 0)
                gl.store(own_slot + offs, gl.convert_layout(acc, store_layout), mask=mask)
                partition_barrier()  # every thread's stores of the half came before the release
                gl.atomic_add(own_flags + tile, 1, sem="release", scope="gpu")
            else:
                # The half goes where _matmul_reduce_scatter._handover says, then its arrival.
                if COPY_ENGINE:  # this rank's outgoing slots follow its W-1 incoming ones
                    holder = RANK
                    slot = (WORLD - 1) + owner - (owner > RANK).to(gl.int32)
                elif PUSH:
                    holder = owner
                    slot = RANK - (owner < RANK).to(gl.int32)
                else:
                    holder = RANK
                    slot = owner - (owner > RANK).to(gl.int32)
                base = gl.load(buffer_ptrs + holder)
                offs = gl.expand_dims((slot * rows_per_rank + rows).to(gl.int64), 1) * N + gl.expand_dims(cols, 0)
                gl.store(_aligned(base, dtype) + offs, gl.convert_layout(acc.to(dtype), store_layout), mask=mask)
                partition_barrier()
                flags = (base + flags_offset).to(gl.pointer_type(gl.int32))
                if COPY_ENGINE:
                    gl.atomic_add(flags + slot * bands + pid_m // GROUP_M, 1, sem="release", scope="sys")
                else:
                    gl.atomic_add(flags + slot * tiles_per_segment + tile, 1, sem="release", scope="sys")


@gluon.jit
def matmul_reduce_scatter_reducer_kernel(
    a_desc,  # Gluon TensorDescriptor over x [M, K] (bf16 / fp16), block [BLOCK_M, BLOCK_K]
    b_desc,  # over w [N, K], block [BLOCK_N, BLOCK_K]; with B_KN over w^T [K, N], block [BLOCK_K, BLOCK_N]
    out_ptr,  # out [m, N], this rank's rows of the sum
    bias_ptr,  # [N] or a dummy when HAS_BIAS is False
    buffer_ptrs,  # int64 [W]: base address of every rank's workspace buffer
    rows_per_rank,  # m
    N,
    K,
    stride_om,
    flags_offset,  # bytes from a buffer's base to its int32 peer flags
    first_step,  # owner steps to run: first_step..last_step (a full call: 0..W-1)
    last_step,
    max_spins,
    report_ptr,  # int32 [3]: where a timed-out wait records (rank waited for, tile, this rank)
    own_offset,  # bytes from this rank's buffer base to its own region (module docstring)
    scale_a_ptr,  # None: unscaled only (the launcher's argument order, shared with the scaled kernels)
    scale_b_ptr,
    RANK: gl.constexpr,
    WORLD: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    PUSH: gl.constexpr,
    COPY_ENGINE: gl.constexpr,  # (with PUSH) peer tiles stay local; a copy stream pushes bands of them
    B_KN: gl.constexpr,  # b_desc reads the weight's row-major transpose [K, N] (backward: no copy)
    num_warps: gl.constexpr,  # 4: consumer 0 (the default partition)
):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1] if B_KN else b_desc.block_type.shape[0]
    a_bufs, b_bufs, ready, empty = allocate_stages(a_desc, b_desc, NUM_STAGES)
    # Partition arguments are spelled out in each tuple: constexprs keep their kind only so.
    gl.warp_specialize(
        [
            (_consumer, (out_ptr, bias_ptr, buffer_ptrs, report_ptr, a_bufs, b_bufs, ready, empty, rows_per_rank, N, K,
                         stride_om, flags_offset, own_offset, first_step, last_step, max_spins, 0, RANK, WORLD, GROUP_M,
                         NUM_PROGRAMS, HAS_BIAS, PUSH, COPY_ENGINE, B_KN)),
            (_consumer, (out_ptr, bias_ptr, buffer_ptrs, report_ptr, a_bufs, b_bufs, ready, empty, rows_per_rank, N, K,
                         stride_om, flags_offset, own_offset, first_step, last_step, max_spins, 1, RANK, WORLD, GROUP_M,
                         NUM_PROGRAMS, HAS_BIAS, PUSH, COPY_ENGINE, B_KN)),
            (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, rows_per_rank, N, K, first_step, last_step, RANK,
                       WORLD, GROUP_M, NUM_PROGRAMS, B_KN)),
            (_reducer, (out_ptr, bias_ptr, buffer_ptrs, report_ptr, rows_per_rank, N, stride_om, flags_offset, own_offset,
                        last_step, max_spins, RANK, WORLD, GROUP_M, NUM_PROGRAMS, BLOCK_M, BLOCK_N, HAS_BIAS, PUSH,
                        COPY_ENGINE)),
        ],
        [4, 1, 1],
        # The loader and reducer warps share a warpgroup and its register count; what they take,
        # the consumers lose (the default partition gets the rest, 224), and with fewer than
        # that ptxas serializes the MMAs.
        [232, 40, 48],
    )  # fmt: skip

    # Every partition of this program is done: the last program out resets the own-tile flags
    # and the counter for the next launch.
    tiles_per_segment = gl.cdiv(rows_per_rank, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    own_flags, _ = _own_region(buffer_ptrs, own_offset, tiles_per_segment, RANK)
    done = own_flags + tiles_per_segment
    if gl.atomic_add(done, 1, sem="acq_rel", scope="gpu") == NUM_PROGRAMS - 1:
        offs = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
        for start in range(0, tiles_per_segment, 128):
            gl.store(own_flags + start + offs, 0, mask=start + offs < tiles_per_segment)
        gl.atomic_xchg(done, 0, sem="relaxed", scope="gpu")
