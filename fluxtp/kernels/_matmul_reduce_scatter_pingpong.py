"""Persistent GEMM+ReduceScatter for FP8 with precise accumulation, warp-specialized (Gluon, Hopper).

The same op, workspace and tile order as _matmul_reduce_scatter's kernel for scaled calls
without use_fast_accum (owner step by owner step, this rank's own rows last; float32 partials;
push, pull and copy-engine transports), built on fluxtp.kernels._pingpong so that the float32
promotion costs no tensor-core time:
- a loader warp TMA-loads each tile's K blocks of x (the owner's rows) and w into a ring of stages;
- two consumer warpgroups each compute half of a tile's rows, scale them and hand them over: a
  peer tile's half goes to its holder's partial slot, an own tile's half waits (acquire, bounded)
  for the peers' flags, adds their partials in rank order, adds the bias and is stored into out.
Each consumer publishes its own half: a partition barrier (its stores came first), then one
release (scope "sys") that adds 1 to the tile's flag, or to the band's counter with the copy
engine. A tile is complete at TILE_ARRIVALS (2), and the owner waits for that; a copy-engine band
at TILE_ARRIVALS times its tiles, and its owner's flag is still set to 1 by the copy stream.
The halves need no handshake inside the CTA, and no consumer waits for the other.

A wait that gives up writes (source rank, tile, rank) to `report_ptr` (host-pinned) and traps.

Opt-in (MatmulReduceScatterConfig.warp_specialized_fp8): it is slower than the Triton kernel
today. Both halves of a tile reach the epilogue together, so its float32 partial traffic is not
overlapped with any MMA (docs/perf-log.md).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from fluxtp.kernels._pingpong import (
    accumulate,
    allocate_stages,
    grouped_tile,
    load_tile,
    partition_barrier,
    record_and_trap,
    wait_flags,
)

TILE_ARRIVALS = gl.constexpr(2)  # one release per consumer warpgroup
FLAG_LANES = gl.constexpr(128)  # one lane per thread of a warpgroup: the peers' flags read as one vector


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, rows_per_rank, N, K, first_step, last_step,
            RANK: gl.constexpr, WORLD: gl.constexpr, GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    tiles_m = gl.cdiv(rows_per_rank, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    tiles_per_segment = tiles_m * tiles_n
    loaded = 0
    for tile_id in range(first_step * tiles_per_segment + gl.program_id(0), (last_step + 1) * tiles_per_segment,
                         NUM_PROGRAMS):  # fmt: skip
        owner = (RANK + 1 + tile_id // tiles_per_segment) % WORLD
        pid_m, pid_n = grouped_tile(tile_id % tiles_per_segment, tiles_m, tiles_n, GROUP_M)
        loaded = load_tile(a_desc, owner * rows_per_rank + pid_m * BLOCK_M, b_desc, pid_n * BLOCK_N, a_bufs, b_bufs, ready,
                           empty, loaded, K)  # fmt: skip


@gluon.jit
def _consumer(out_ptr, bias_ptr, buffer_ptrs, report_ptr, scale_a_ptr, scale_b_ptr, a_bufs, b_bufs, ready, empty,
              rows_per_rank, N, K, stride_om, flags_offset, first_step, last_step, max_spins, C: gl.constexpr,
              RANK: gl.constexpr, WORLD: gl.constexpr, GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
              HAS_BIAS: gl.constexpr, PUSH: gl.constexpr, COPY_ENGINE: gl.constexpr, SCALING: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    HALF: gl.constexpr = BLOCK_M // 2
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32])
    gl.static_assert(WORLD <= FLAG_LANES)
    flag_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    tiles_m = gl.cdiv(rows_per_rank, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    tiles_per_segment = tiles_m * tiles_n
    bands = gl.cdiv(tiles_m, GROUP_M)
    used = 0
    for tile_id in range(first_step * tiles_per_segment + gl.program_id(0), (last_step + 1) * tiles_per_segment,
                         NUM_PROGRAMS):  # fmt: skip
        owner = (RANK + 1 + tile_id // tiles_per_segment) % WORLD
        pid_m, pid_n = grouped_tile(tile_id % tiles_per_segment, tiles_m, tiles_n, GROUP_M)
        tile = pid_m * tiles_n + pid_n
        acc, used = accumulate(a_bufs, b_bufs, ready, empty, used, K, C, layout)

        rows = pid_m * BLOCK_M + C * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, layout))  # in the segment
        cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        if SCALING == 1:
            acc = acc * gl.load(scale_a_ptr) * gl.load(scale_b_ptr)
        else:
            scale_a = gl.load(scale_a_ptr + owner * rows_per_rank + rows, mask=rows < rows_per_rank, other=0.0)
            scale_b = gl.load(scale_b_ptr + cols, mask=cols < N, other=0.0)
            acc = acc * gl.expand_dims(scale_a, 1) * gl.expand_dims(scale_b, 0)
        mask = gl.expand_dims(rows < rows_per_rank, 1) & gl.expand_dims(cols < N, 0)

        if owner == RANK:
            # Every peer's partial of this tile has arrived (acquire, all W-1 flags read at once).
            srcs = gl.arange(0, FLAG_LANES, layout=flag_layout)
            peer = (srcs < WORLD) & (srcs != RANK)
            if PUSH:
                holders = gl.full((FLAG_LANES,), RANK, gl.int32, layout=flag_layout)
                slots = srcs - (srcs > RANK).to(gl.int32)
            else:
                holders = srcs
                slots = gl.full((FLAG_LANES,), RANK, gl.int32, layout=flag_layout) - (srcs < RANK).to(gl.int32)
            if COPY_ENGINE:
                index = slots * bands + pid_m // GROUP_M
                expected = 1  # the copy stream sets a band's flag once
            else:
                index = slots * tiles_per_segment + tile
                expected = TILE_ARRIVALS
            bases = gl.load(buffer_ptrs + holders, mask=peer, other=0) + flags_offset
            flag_ptrs = bases.to(gl.pointer_type(gl.int32)) + index
            expected = gl.full((FLAG_LANES,), expected, gl.int32, layout=flag_layout)
            arrived = wait_flags(flag_ptrs, peer, expected, max_spins)
            if gl.min(arrived.to(gl.int32), 0) == 0:
                record_and_trap(report_ptr, gl.min(gl.where(arrived, FLAG_LANES, srcs), 0), tile, RANK)
            partition_barrier()  # every thread of this warpgroup loads after the acquire
            # The peers' partials in rank order (the Triton kernel's order: the same bits).
            for i in range(WORLD - 1):
                src = i + (i >= RANK).to(gl.int32)
                if PUSH:
                    holder = RANK
                    slot = i
                else:
                    holder = src
                    slot = RANK - (RANK > src).to(gl.int32)
                part_ptr = gl.load(buffer_ptrs + holder).to(gl.pointer_type(gl.float32))
                slot_rows = (slot * rows_per_rank + rows).to(gl.int64)
                part_offs = gl.expand_dims(slot_rows, 1) * N + gl.expand_dims(cols, 0)
                acc += gl.load(part_ptr + part_offs, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                bias = gl.load(bias_ptr + cols, mask=cols < N, other=0.0)
                acc = acc + gl.expand_dims(bias.to(gl.float32), 0)
            out_offs = gl.expand_dims(rows.to(gl.int64), 1) * stride_om + gl.expand_dims(cols, 0)
            gl.store(out_ptr + out_offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
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
            slot_rows = (slot * rows_per_rank + rows).to(gl.int64)
            part_offs = gl.expand_dims(slot_rows, 1) * N + gl.expand_dims(cols, 0)
            gl.store(base.to(gl.pointer_type(gl.float32)) + part_offs, acc, mask=mask)
            partition_barrier()  # every thread's stores of the half came before the release
            flags = (base + flags_offset).to(gl.pointer_type(gl.int32))
            if COPY_ENGINE:
                gl.atomic_add(flags + slot * bands + pid_m // GROUP_M, 1, sem="release", scope="sys")
            else:
                gl.atomic_add(flags + slot * tiles_per_segment + tile, 1, sem="release", scope="sys")


@gluon.jit
def matmul_reduce_scatter_pingpong_kernel(
    a_desc,  # Gluon TensorDescriptor over x [M, K] (float8), block [BLOCK_M, BLOCK_K]
    b_desc,  # over w [N, K] (float8, row-major), block [BLOCK_N, BLOCK_K]
    out_ptr,  # out [m, N] in the output dtype, this rank's rows of the sum
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
    scale_a_ptr,  # float32 scales of x's rows [M] (row-wise) or of x (per tensor)
    scale_b_ptr,  # float32 scales of w's rows [N] (row-wise) or of w
    RANK: gl.constexpr,
    WORLD: gl.constexpr,
    GROUP_M: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    PUSH: gl.constexpr,
    COPY_ENGINE: gl.constexpr,  # (with PUSH) peer tiles stay local; a copy stream pushes bands of them
    SCALING: gl.constexpr,  # 1 per tensor, 2 row-wise
    num_warps: gl.constexpr,  # 4: consumer 0 (the default partition)
):
    a_bufs, b_bufs, ready, empty = allocate_stages(a_desc, b_desc, NUM_STAGES)
    # Partition arguments are spelled out in each tuple: constexprs keep their kind only so.
    gl.warp_specialize(
        [
            (_consumer, (out_ptr, bias_ptr, buffer_ptrs, report_ptr, scale_a_ptr, scale_b_ptr, a_bufs, b_bufs, ready, empty,
                         rows_per_rank, N, K, stride_om, flags_offset, first_step, last_step, max_spins, 0, RANK, WORLD,
                         GROUP_M, NUM_PROGRAMS, HAS_BIAS, PUSH, COPY_ENGINE, SCALING)),
            (_consumer, (out_ptr, bias_ptr, buffer_ptrs, report_ptr, scale_a_ptr, scale_b_ptr, a_bufs, b_bufs, ready, empty,
                         rows_per_rank, N, K, stride_om, flags_offset, first_step, last_step, max_spins, 1, RANK, WORLD,
                         GROUP_M, NUM_PROGRAMS, HAS_BIAS, PUSH, COPY_ENGINE, SCALING)),
            (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, rows_per_rank, N, K, first_step, last_step, RANK, WORLD,
                       GROUP_M, NUM_PROGRAMS)),
        ],
        [4, 1],
        [232, 40],
    )  # fmt: skip
