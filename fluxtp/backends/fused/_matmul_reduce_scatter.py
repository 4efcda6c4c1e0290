"""Fused GEMM+ReduceScatter launcher: one persistent GEMM whose epilogue hands tiles to their owners.

Per call, everything on the caller's stream S (no side stream, no host synchronization):
  1. zero this rank's tile flags (in its symmetric buffer);
  2. barrier over the group's buffers: every rank has zeroed its flags, and every rank's
     previous kernel on this buffer has finished (it precedes the barrier on its stream), so
     no peer still reads or writes what this call's kernels write (steps 1-2 replay as one
     recorded CUDA graph: both address only the workspace);
  3. the persistent kernel (fluxtp/kernels/_matmul_reduce_scatter.py): partial tiles of peers'
     rows go to their owners with a release flag per (source rank, tile), own rows come last
     and are reduced as the peers' flags arrive, in rank order, into a fresh output;
  4. pull only: a second barrier, because the peers read this rank's buffer during their
     kernels, and step 1 of the next call must not reset flags a peer has yet to read.
Push is safe without it: every flag and partial a peer writes into this rank's buffer is
consumed by this rank's own kernel, which precedes the next call's reset on S.
Outside graph capture a call is one launch of a recorded CUDA graph of steps 1-4 (and the copy
engine's pushes, below) whose kernel node takes the call's tensors (_launch.CallGraph).
The output is fresh memory owned by the caller; the symmetric buffer is reused. Back-to-back
calls, alternating shapes, several groups (one buffer each) and CUDA graph capture work (warm
up outside capture first: the workspace is allocated and rendezvoused on first use). The
barriers and the in-kernel waits are bounded and fail with an error instead of hanging: a wait
that gives up records the peer rank and tile in host-pinned memory and traps (the CUDA error
surfaces at the next synchronization); timeout_report() and an exit hook name them.
Scaled (FP8) calls (scaled_matmul_reduce_scatter, Plan's `scaled`): the same steps on FP8 operands,
the partial slots (and the copy engine's bands) and the output in out_dtype.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch
import triton

from fluxtp import _driver, symm
from fluxtp._dist import GroupInfo
from fluxtp._plan import PlanCache, tensor_key
from fluxtp.backends.fused import _launch, _scaled
from fluxtp.backends.fused._launch import (
    BARRIER_TIMEOUT_MS,
    CallGraph,
    MAX_SPINS_PEER,
    DescriptorLayout,
    DriverEvent,
    Launch,
    StreamReplay,
    WeightOperand,
    _tma_compatible,
    num_sms,
    tma_ready,
)
from fluxtp.configs import (  # noqa: F401
    MIN_COPY_ENGINE_TILES,
    SMEM_LIMIT_BYTES,
    SMEM_RESERVE_BYTES,
    TRANSPORTS,
    MatmulReduceScatterConfig,
    tuned_config,
)
from fluxtp.kernels._matmul_reduce_scatter import matmul_reduce_scatter_kernel

MAX_SPINS = MAX_SPINS_PEER  # system-scope reads, of local memory (push) or a peer's (pull)
_OP = "matmul_reduce_scatter"
# From this many ranks on, the owner issues the W-1 partials' loads all at once (unrolled): at
# W=8 that took 0.91-1.00x the time of one load at a time, at W=2 and 4 it was level (one H200,
# GEMM-only, benchmarks/reduce_unroll_ab.py), so smaller groups keep the fewer live registers of the loop.
REDUCE_UNROLL_MIN_WORLD = 8
REDUCER_UNIT_BYTES = 16 * 1024  # reducer_unit_rows
# reducer_units_in_flight: two took 0.96-1.00x one's time (FP8, TP 4/8); four were no faster than
# two, whether the reducer waited for a unit's flags before or after the sum ahead of it (docs/perf-log.md).
MAX_REDUCER_UNITS_IN_FLIGHT = 2


@dataclass(frozen=True)
class Layout:
    """Byte layout of one rank's buffer for one call: partial slots [m, n], then int32 flags.

    Push and pull: W-1 slots, a flag per (peer, tile). Copy engine: W-1 incoming and W-1
    outgoing slots, a flag per (peer, band) and then a tile counter per (owner, band), a band
    being band_rows rows of tiles (group_m; the reducer kernel's reducer_band_rows). A tile's
    producer adds tile_arrivals to its flag or counter (the warp-specialized kernels release each
    half of a tile on its own: 2). With own_region
    (the reducer kernel, push or copy engine): a last slot for this rank's own partial, push
    counting each peer's tiles per band (a counter per (peer, band) in place of a flag per tile),
    and at own_offset a flag per own tile and a counter, zeroed with the flags by a call, and by
    the kernel itself after a launch without that step (fluxtp/kernels/_matmul_reduce_scatter_reducer.py)."""

    rows_per_rank: int
    n: int
    tiles_m: int
    tiles_n: int
    band_rows: int  # tile rows per band (copy engine and the reducer kernel's push count by bands)
    block_m: int
    flags_offset: int
    num_flags: int
    nbytes: int
    tile_arrivals: int
    own_offset: int = 0  # 0: no own region
    slots: int = 0  # partial slots [slots, rows_per_rank, n] from the buffer's start
    counts_bands: bool = False  # push on the reducer kernel: a counter per (peer, band)

    @staticmethod
    @functools.lru_cache(maxsize=256)  # on every call's path; 8 us to build on the H200 hosts
    def of(rows_per_rank: int, n: int, itemsize: int, world: int, config: MatmulReduceScatterConfig,
           own_region: bool = False) -> Layout:  # fmt: skip
        tiles_m, tiles_n = triton.cdiv(rows_per_rank, config.block_m), triton.cdiv(n, config.block_n)
        band_rows = reducer_band_rows(config.group_m, world) if own_region else config.group_m
        slots = (2 * (world - 1) if config.copy_engine else world - 1) + own_region
        flags_offset = triton.cdiv(slots * rows_per_rank * n * itemsize, 16) * 16
        if config.copy_engine:
            num_flags = 2 * (world - 1) * triton.cdiv(tiles_m, band_rows)
        elif own_region:
            num_flags = (world - 1) * triton.cdiv(tiles_m, band_rows)
        else:
            num_flags = (world - 1) * tiles_m * tiles_n
        nbytes = flags_offset + 4 * num_flags
        own_offset = 0
        if own_region:
            own_offset = nbytes
            nbytes = own_offset + 4 * (tiles_m * tiles_n + 1)
        return Layout(
            rows_per_rank, n, tiles_m, tiles_n, band_rows, config.block_m,
            flags_offset, num_flags, nbytes, 2 if config.warp_specialized else 1, own_offset,
            slots, own_region and not config.copy_engine,
        )

    @property
    def reset_words(self) -> int:
        """int32 words from flags_offset that a call zeroes: the flags, and with an own region its
        flags and counter too (a call's kernel leaves them set: _Kernel's zeroed_per_launch)."""
        return (self.nbytes - self.flags_offset) // 4

    @property
    def bands(self) -> int:
        return triton.cdiv(self.tiles_m, self.band_rows)

    def complete_flags(self, copy_engine: bool) -> torch.Tensor:
        """int32 [num_flags]: what each flag (or counter) reads once its partials have all arrived:
        a copy-engine band's 1 (set by the copy stream), a tile's tile_arrivals, and a counted
        band's (the reducer kernel's push) tile_arrivals per tile of the band."""
        if copy_engine:
            return torch.ones(self.num_flags, dtype=torch.int32)
        if self.counts_bands:
            per_band = [self.band(b)[2] * self.tile_arrivals for b in range(self.bands)]
            return torch.tensor(per_band * (self.num_flags // self.bands), dtype=torch.int32)
        return torch.full((self.num_flags,), self.tile_arrivals, dtype=torch.int32)

    def band(self, index: int) -> tuple[int, int, int]:
        """(first row, end row, tiles) of band `index` of a segment (the kernel's pid_m // band_rows)."""
        first_tile_row = index * self.band_rows
        tile_rows = min(self.tiles_m - first_tile_row, self.band_rows)
        first = first_tile_row * self.block_m
        return first, min(first + tile_rows * self.block_m, self.rows_per_rank), tile_rows * self.tiles_n


def reducer_band_rows(group_m: int, world: int) -> int:
    """The reducer kernel's band, group_m // world tile rows (at least one): it interleaves the W
    owners tile by tile, so that one wave's tiles of all owners span group_m rows of x."""
    return max(group_m // world, 1)


def reducer_unit_rows(block_n: int, world: int, partial_size: int) -> int:
    """Rows of the reducer kernel's reduction unit: its W slots' rows take at most
    REDUCER_UNIT_BYTES of shared memory (what the 128x256 3-stage tilings leave), 4 to 8 rows, a
    power of two. With 128-wide FP8 tiles, 4-row units made the reducer warp the kernel's critical
    path (docs/perf-log.md)."""
    rows = max(REDUCER_UNIT_BYTES // (world * block_n * partial_size), 4)
    return min(1 << (rows.bit_length() - 1), 8)


def reducer_unit_box(world: int, transport: str) -> int:
    """Slots the reducer kernel's reduction unit loads with one TMA copy: push, all W (the W-1
    incoming slots and the own one are adjacent); the copy engine, one (its own slot follows the
    outgoing ones). A copy per slot cost 0.4 us of issue a unit (docs/perf-log.md)."""
    return world if transport == "push" else 1


def reducer_units_in_flight(config: MatmulReduceScatterConfig, world: int, itemsize: int, partial_size: int,
                            split: bool = False) -> int:  # fmt: skip
    """Reduction units whose rows the reducer warp has in flight at once: as many as shared memory
    holds beside the tiling (reducer_smem_bytes), up to MAX_REDUCER_UNITS_IN_FLIGHT; 0 where not
    even one fits. One unit at a time, a unit costs its loads' round trip (docs/perf-log.md)."""
    units = MAX_REDUCER_UNITS_IN_FLIGHT
    while units and reducer_smem_bytes(config, world, itemsize, partial_size, units, split) > SMEM_LIMIT_BYTES:
        units -= 1
    return units


def reducer_warps(scaled: _scaled.Scaled | None, split: bool) -> int:
    """Warps of the reducer kernel's reducer partition, each summing a unit's rows in turn (two
    fill the loader's and counter's warpgroup at no cost in registers): two for a precise FP8 call
    in 256-wide tiles (split: _scaled.split_accumulator), whose reducer's sums, rows twice as long,
    fall behind the GEMM: 0.98x the time there at TP 2, 4 and 8 (one H200, 46 grid cases, 45
    faster); one elsewhere: in 128-wide tiles two lost up to 9% at TP=4 (docs/perf-log.md)."""
    return 2 if scaled is not None and scaled.precise_acc and split else 1


def reducer_tail_units(config: MatmulReduceScatterConfig, world: int, itemsize: int, partial_size: int,
                       split: bool = False) -> int:  # fmt: skip
    """Reduction units the reducer kernel's tail loads at once into its idle weight stages after
    the consumers' last tile (the units of the own tiles of the last round of tiles, which all
    complete at the GEMM's end), 0 for no tail: only where the units otherwise go one at a time
    (reducer_units_in_flight 1), each paying a load's round trip (docs/perf-log.md)."""
    if reducer_units_in_flight(config, world, itemsize, partial_size, split) != 1:
        return 0
    unit_bytes = world * reducer_unit_rows(config.block_n, world, partial_size) * config.block_n * partial_size
    return config.num_stages * config.block_n * config.block_k * itemsize // unit_bytes


def reducer_staging_columns(block_n: int, split: bool) -> int:
    """Columns of a reducer consumer's staging buffer: a tile's, or with a split accumulator
    (_scaled.split_accumulator) a quarter of them, each column half going in two pieces: the
    room four 128-deep FP8 stages need beside the reduction units."""
    return block_n // 4 if split else block_n


def reducer_smem_bytes(config: MatmulReduceScatterConfig, world: int, itemsize: int, partial_size: int,
                       units: int, split: bool = False) -> int:  # fmt: skip
    """The reducer kernel's shared memory: the K-block stages, a consumer's staging buffer of half
    a tile's rows (reducer_staging_columns), `units` units' W slots' rows, and the reserve the
    configs' model keeps for barriers and alignment (fits())."""
    unit_rows = reducer_unit_rows(config.block_n, world, partial_size)
    staging = config.block_m * reducer_staging_columns(config.block_n, split)
    return (config.num_stages * (config.block_m + config.block_n) * config.block_k * itemsize
            + (staging + units * world * unit_rows * config.block_n) * partial_size + SMEM_RESERVE_BYTES)  # fmt: skip


def copy_plan(layout: Layout, rank: int, world: int) -> list[tuple[int, int, int, int]]:
    """Copy-engine mode: (owner, outgoing slot here, incoming slot at the owner, band) in the order
    the kernel finishes them. The Triton kernel goes owner step by owner step, bands in order; the
    reducer kernel (own region) interleaves the owners, so its bands of every owner finish together,
    band by band: in the Triton kernel's order its copy stream waited for owner 1's last band
    while the others' sat complete, and pushed them all after the GEMM."""
    steps = [(step, band) for step in range(world - 1) for band in range(layout.bands)]
    if layout.own_offset:
        steps.sort(key=lambda step_band: (step_band[1], step_band[0]))
    plan = []
    for step, band in steps:
        owner = (rank + 1 + step) % world
        plan.append((owner, owner - (owner > rank), rank - (rank > owner), band))
    return plan


@dataclass(frozen=True)
class _BandCopy:
    """One step of a copy-engine call's copy stream, its views made once per layout (slicing
    them costs host time on every call)."""

    counter: int  # index into this rank's tile counters
    count: int  # the count that says the band is complete (its tiles' arrivals)
    source: torch.Tensor  # the band in this rank's outgoing slot
    target: torch.Tensor  # its place in the owner's incoming slot
    owner_flags: torch.Tensor  # uint32 view of the owner's flags
    flag: int


@dataclass
class _Workspace:
    buffer: symm.SymmBuffer
    peers: list[torch.Tensor]  # uint8 [nbytes], every rank's buffer as this GPU addresses it
    buffer_ptrs: torch.Tensor  # int64 [W], their base addresses
    flag_views: dict = field(default_factory=dict)  # Layout -> this rank's flags as an int32 tensor
    band_copies: dict = field(default_factory=dict)  # (Layout, dtype) -> (counters, [_BandCopy])

    def flags(self, layout: Layout) -> torch.Tensor:
        """What a call zeroes in this rank's buffer for `layout`: its flags, then (with an own
        region) up to the own slot (the view made once per layout: get_buffer costs ~9 us)."""
        view = self.flag_views.get(layout)
        if view is None:
            view = self.flag_views[layout] = self.buffer.local(torch.int32, (layout.reset_words,), layout.flags_offset)
        return view

    def copy_engine_steps(self, layout: Layout, dtype: torch.dtype, rank: int, world: int):
        """(this rank's tile counters, its copy_plan as _BandCopy steps), made once per layout and dtype."""
        steps = self.band_copies.get((layout, dtype))
        if steps is None:
            slots = (world - 1, layout.rows_per_rank, layout.n)
            slot_bytes = layout.rows_per_rank * layout.n * torch.empty((), dtype=dtype).element_size()
            outgoing = self.buffer.local(dtype, slots, (world - 1) * slot_bytes)
            incoming = {r: self.buffer.peer(r, dtype, slots) for r in range(world) if r != rank}
            flags = {
                r: self.buffer.peer(r, torch.int32, (layout.num_flags,), layout.flags_offset).view(torch.uint32)
                for r in incoming
            }
            plan = []
            for owner, out_slot, in_slot, band in copy_plan(layout, rank, world):
                first, end, tiles = layout.band(band)
                plan.append(
                    _BandCopy(
                        out_slot * layout.bands + band,
                        tiles * layout.tile_arrivals,
                        outgoing[out_slot, first:end],
                        incoming[owner][in_slot, first:end],
                        flags[owner],
                        in_slot * layout.bands + band,
                    )
                )
            counters = self.flags(layout)[layout.num_flags // 2 : layout.num_flags]
            steps = self.band_copies[(layout, dtype)] = (counters, plan)
        return steps


_workspaces: dict[tuple[str, int], _Workspace] = symm.op_workspaces()


def _workspace(info: GroupInfo, device: torch.device, nbytes: int) -> _Workspace:
    buf = symm.buffer(info, _OP, nbytes, device)
    key = (info.name, torch.device(device).index or 0)
    ws = _workspaces.get(key)
    if ws is None or ws.buffer is not buf:
        peers = [buf.peer(r, torch.uint8, (buf.nbytes,)) for r in range(info.world_size)]
        ws = _Workspace(buf, peers, torch.tensor([p.data_ptr() for p in peers], dtype=torch.int64, device=device))
        _workspaces[key] = ws
    return ws


def timeout_report() -> str | None:
    """Which in-kernel wait of this op gave up in this process, if one did (readable after the trap)."""
    return _launch.timeout_report(_OP)


def _op_name(scaled) -> str:
    return "matmul_reduce_scatter" if scaled is None else "scaled_matmul_reduce_scatter"


class _Kernel:
    """The persistent kernel's launch for one call signature: grid, constexprs, scalars and
    descriptor layouts resolved once (the layouts at the first launch); a launch binds the call's
    tensors. x [M, k] TMA-ready, weight [n, k] (or a transposed view of a [k, n] tensor).
    zeroed_per_launch: the caller zeroes every flag before each launch (a call's step 1), so the
    reducer kernel leaves its own region as it ends (else it resets it: RESET_OWN)."""

    def __init__(self, x, weight, bias, out_stride, buffer_flags_offset, rank, world, config, first_step, last_step,
                 max_spins, report, scaled=None, own_offset=0, buffers=None, zeroed_per_launch=False):  # fmt: skip
        m_total, k = x.shape
        n = weight.shape[0]
        rows_per_rank = m_total // world
        sms = num_sms(x.device)
        tiles = (last_step - first_step + 1) * triton.cdiv(rows_per_rank, config.block_m) * triton.cdiv(n, config.block_n)
        self.empty = tiles <= 0
        grid = min(sms, max(tiles, 1))
        self.config = config
        self.weight = WeightOperand(weight, row_major_only=scaled is not None)
        self.layouts = None
        report = _launch.timeout_record(_OP, x.device) if report is None else report
        self.scalars = (rows_per_rank, n, k, out_stride, buffer_flags_offset, first_step, last_step, max_spins, report)
        self.gluon = config.warp_specialized
        if self.gluon:
            why = _scaled.pingpong_unsupported(x.device, scaled, x.dtype if scaled is None else None)
            if why:
                raise ValueError(f"{_op_name(scaled)}: config {config} asks for the warp-specialized kernel, but {why}")
            self._reducer_kernel(x, n, rows_per_rank, sms, rank, world, config, bias, own_offset, buffers, scaled,
                                 zeroed_per_launch)  # fmt: skip
            return
        self.launch = Launch(
            matmul_reduce_scatter_kernel,
            grid,
            RANK=rank,
            WORLD=world,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            GROUP_M=config.group_m,
            NUM_SMS=sms,
            HAS_BIAS=bias is not None,
            PUSH=config.transport != "pull",
            NUM_STAGES=config.num_stages,
            EPI_SPLIT=config.epilogue_split,
            B_KN=self.weight.kn,
            COPY_ENGINE=config.copy_engine,
            REDUCE_UNROLL=world >= REDUCE_UNROLL_MIN_WORLD,
            WORLD_POW2=triton.next_power_of_2(world),
            **_scaled.constexprs(scaled),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )

    def _reducer_kernel(self, x, n, rows_per_rank, sms, rank, world, config, bias, own_offset, buffers, scaled,
                        zeroed_per_launch):  # fmt: skip
        """The reducer kernel's launch (a warp-specialized config): its consumers TMA-store and its
        reducers TMA-load the partial slots (partial_dtype) of the group's `buffers`
        (uint8, every rank's as this GPU sees it, laid out as Layout.of(..., own_region=True)
        says; the copy engine's transport touches only this rank's): push or copy engine, rows of
        16-byte multiples."""
        from fluxtp.kernels._matmul_reduce_scatter_reducer import MAX_PUSH_WORLD, matmul_reduce_scatter_reducer_kernel

        part = partial_dtype(x, scaled)
        split = _scaled.split_accumulator(scaled, config.block_n)
        why = reducer_unsupported(config, n, world, x.element_size(), part.itemsize, split)
        if why is None and (buffers is None or len(buffers) != world):
            why = f"it reads and writes the buffers through TMA descriptors: pass all {world} (uint8)"
        if why:
            raise ValueError(f"{_op_name(scaled)}: config {config} asks for the warp-specialized kernel, but {why}")
        layout = Layout.of(rows_per_rank, n, part.itemsize, world, config, own_region=True)
        slot_count = layout.slots
        slot_bytes = slot_count * rows_per_rank * n * part.itemsize
        slots = [b[:slot_bytes].view(part).view(slot_count, rows_per_rank, n) for b in buffers]
        stores = DescriptorLayout(slots[rank], [1, config.block_m // 2, reducer_staging_columns(config.block_n, split)],
                                  gluon=True)  # fmt: skip
        unit_rows = reducer_unit_rows(config.block_n, world, part.itemsize)
        box = reducer_unit_box(world, config.transport)
        loads = DescriptorLayout(slots[rank], [box, unit_rows, config.block_n], gluon=True, swizzled=False)
        units_in_flight = reducer_units_in_flight(config, world, x.element_size(), part.itemsize, split)
        tail_units = reducer_tail_units(config, world, x.element_size(), part.itemsize, split)
        # Push: a store descriptor over every rank's slots (the copy engine's never reads them).
        peers = [stores.over(slots[r] if config.transport == "push" else slots[rank]) for r in range(world)]
        unused = peers[:1] * (MAX_PUSH_WORLD.value - world)
        descriptors = (stores.over(slots[rank]), loads.over(slots[rank]), *peers, *unused)
        # Every program's tiles (a launch of some owner steps skips the others'), one SM left
        # free: the reducers wait for tiles of other programs, which all need an SM.
        tiles_per_segment = triton.cdiv(rows_per_rank, config.block_m) * triton.cdiv(n, config.block_n)
        grid = max(1, min(sms - 1, world * tiles_per_segment))
        self.scalars += (own_offset, *descriptors)
        self.launch = Launch(
            matmul_reduce_scatter_reducer_kernel, grid, RANK=rank, WORLD=world, BAND_ROWS=layout.band_rows,
            NUM_PROGRAMS=grid, NUM_STAGES=config.num_stages, UNITS_IN_FLIGHT=units_in_flight, TAIL_UNITS=tail_units,
            HAS_BIAS=bias is not None, B_KN=self.weight.kn, PUSH=config.transport == "push", SPLIT_ACC=split,
            RESET_OWN=not zeroed_per_launch, REDUCER_WARPS=reducer_warps(scaled, split), **_scaled.constexprs(scaled),
            **_scaled.PINGPONG_WARPS,
        )  # fmt: skip

    def __call__(self, x, weight, bias, out, buffer_ptrs, scales=(None, None)):
        """scales: a scaled call's (x's, the weight's), _scaled.flat."""
        if self.empty:
            return
        launch, args = self.launch_args(x, weight, bias, out, buffer_ptrs, scales)
        launch(*args)

    def launch_args(self, x, weight, bias, out, buffer_ptrs, scales=(None, None)):
        """(the Launch, its arguments) of this call: both kernels take (x, B descriptors, out,
        bias, buffer pointers, scalars..., scales...)."""
        b = self.weight.of(weight)
        layouts = self.layouts
        if layouts is None:
            c = self.config
            layouts = self.layouts = (
                DescriptorLayout(x, [c.block_m, c.block_k], gluon=self.gluon),
                DescriptorLayout(b, self.weight.block(c), gluon=self.gluon),
            )
        args = (layouts[0].over(x), layouts[1].over(b), out, out if bias is None else bias, buffer_ptrs, *self.scalars,
                *scales)  # fmt: skip
        return self.launch, args

    def per_call_indices(self) -> tuple:
        """launch_args' arguments that change between calls of one signature (a call recorded in a
        graph), in per_call's order: x, the weight's operand, the output, the bias, the two scales
        (the buffer pointers are the workspace's)."""
        first_scale = 5 + len(self.scalars)
        return (0, 1, 2, 3, first_scale, first_scale + 1)

    def per_call(self, x, weight, bias, out, scales) -> tuple:
        """The tensors of per_call_indices' arguments for one call."""
        return (x, self.weight.of(weight), out, out if bias is None else bias, *scales)


def launch_kernel(
    x,
    weight,
    bias,
    out,
    buffer_ptrs,
    flags_offset: int,
    rank: int,
    world: int,
    config: MatmulReduceScatterConfig,
    first_step: int = 0,
    last_step: int | None = None,
    max_spins: int = MAX_SPINS,
    report: torch.Tensor | None = None,
    scaled=None,
    scales=(None, None),
    own_offset: int = 0,
    buffers: list[torch.Tensor] | None = None,
):
    """The persistent kernel alone (CPU tensors run it under TRITON_INTERPRET=1).

    x [M, k] TMA-ready, weight [n, k] (or a transposed view of a [k, n] tensor); out [M/W, n];
    buffer_ptrs int64 [W] of buffers laid out as Layout.of(...) says, their flags zero (or set
    by peers). Runs owner steps first_step..last_step (default all: 0..W-1, the last being this
    rank's own rows). A wait that gives up writes (peer rank, tile, rank) into `report`
    (default: this process's record). A scaled call passes `scaled` (_scaled.Scaled) and `scales`
    (x's, the weight's; _scaled.flat), its buffers laid out for partial_dtype's. The reducer
    kernel (uses_reducer) takes the buffers themselves (uint8, every rank's as this GPU sees it)
    and the own region's offset (Layout's).
    """
    last_step = world - 1 if last_step is None else last_step
    kernel = _Kernel(x, weight, bias, out.stride(0), flags_offset, rank, world, config, first_step, last_step, max_spins,
                     report, scaled, own_offset, buffers)  # fmt: skip
    kernel(x, weight, bias, out, buffer_ptrs, scales)


def _config_for(x, weight, world: int, config: MatmulReduceScatterConfig | None, scaled=None) -> MatmulReduceScatterConfig:
    """The caller's config, else the tuned table's for this shape (a scaled call's: its
    accumulation's entry, tuned with a bf16 output, where that runs with the call's output), else
    the heuristic; an unscaled call's entry and every heuristic on the reducer kernel where
    on_reducer_kernel says and it runs here."""
    m_total, k = x.shape
    n = weight.shape[0]
    if config is not None:
        return config
    reducer_runs = _scaled.pingpong_unsupported(x.device, scaled, x.dtype) is None
    if scaled is None:
        return routed(table_config(x, weight, world), m_total, n, k, world, x.element_size(), reducer_runs)
    tuned = tuned_config(_OP, x, weight, world, not scaled.precise_acc)
    return scaled_config(tuned, m_total, n, k, world, scaled, reducer_runs)


def routed(config: MatmulReduceScatterConfig, m_total: int, n: int, k: int, world: int, itemsize: int,
           reducer_runs: bool, scaled=None) -> MatmulReduceScatterConfig:  # fmt: skip
    """An unscaled call's table entry or heuristic, or a scaled call's heuristic, as launched: on
    the reducer kernel where on_reducer_kernel says and it fits (reducer_runs: this GPU and Triton
    run that kernel); an entry on the reducer kernel where that does not run or take it: its
    Triton twin (the same tiling)."""
    if config.warp_specialized:
        fits = reducer_runs and reducer_fits(config, n, world, itemsize, scaled)
        return config if fits else dataclasses.replace(config, warp_specialized=False)
    fp8 = () if scaled is None else (scaled.precise_acc, scaled.out_dtype.itemsize)
    reducer = config.on_reducer_kernel(world, m_total, n, k, *fp8)
    moves = reducer is not config and reducer_runs and reducer_fits(reducer, n, world, itemsize, scaled)
    return reducer if moves else config


def scaled_config(tuned: MatmulReduceScatterConfig | None, m_total: int, n: int, k: int, world: int, scaled,
                  reducer_runs: bool) -> MatmulReduceScatterConfig:  # fmt: skip
    """A scaled call's config as launched: its table entry (tuned: None for none) where that runs
    with the call's partials, else scaled_heuristic's."""
    if tuned is not None and (not tuned.warp_specialized or reducer_runs and reducer_fits(tuned, n, world, 1, scaled)):
        return tuned
    return scaled_heuristic(m_total, n, k, world, scaled, reducer_runs)


def scaled_heuristic(m_total: int, n: int, k: int, world: int, scaled, reducer_runs: bool) -> MatmulReduceScatterConfig:
    """A scaled call's config without a table entry: heuristic_fp8's, on the reducer kernel where
    on_reducer_kernel says and it fits (reducer_runs: this GPU and Triton run that kernel)."""
    config = MatmulReduceScatterConfig.heuristic_fp8(m_total, n, k, world, scaled.precise_acc)
    return routed(config, m_total, n, k, world, 1, reducer_runs, scaled)


def reducer_fits(config: MatmulReduceScatterConfig, n: int, world: int, itemsize: int, scaled=None) -> bool:
    """Whether the reducer kernel takes `config` for rows of n elements at this world size, its
    operands of itemsize bytes (a scaled call's partials in its out_dtype): reducer_unsupported."""
    partial_size = itemsize if scaled is None else scaled.out_dtype.itemsize
    split = _scaled.split_accumulator(scaled, config.block_n)
    return reducer_unsupported(config, n, world, itemsize, partial_size, split) is None


def table_config(x, weight, world: int) -> MatmulReduceScatterConfig:
    """An unscaled call's tuned table entry for this shape, else the heuristic's config (before
    the reducer kernel's rule moves it)."""
    return tuned_config(_OP, x, weight, world) or MatmulReduceScatterConfig.heuristic(x.shape[0], weight.shape[0],
                                                                                      x.shape[1], world)  # fmt: skip


def reducer_unsupported(config: MatmulReduceScatterConfig, n: int, world: int, itemsize: int,
                        partial_size: int | None = None, split: bool = False) -> str | None:  # fmt: skip
    """Why the reducer kernel cannot run `config` for rows of n elements at this world size, or None
    (itemsize: the operands', partial_size: the partial slots' (default the operands'); split:
    _scaled.split_accumulator's)."""
    from fluxtp.kernels._matmul_reduce_scatter_reducer import MAX_PUSH_WORLD

    partial_size = partial_size or itemsize
    if config.block_m != 128:
        return f"its tiles have 128 rows (two consumer warpgroups of 64), not {config.block_m}"
    if config.transport == "pull":
        return "it hands partials over by push or the copy engine, not pull"
    if config.transport == "push" and world > MAX_PUSH_WORLD.value:
        return (f"its push takes a descriptor per rank, at most {MAX_PUSH_WORLD.value} ranks, not {world}: "
                "use transport copy_engine")
    if (n * partial_size) % 16:
        return f"it needs the weight's rows n ({n}) to be a multiple of {16 // partial_size}"
    if reducer_units_in_flight(config, world, itemsize, partial_size, split) == 0:
        smem = reducer_smem_bytes(config, world, itemsize, partial_size, 1, split)
        return f"it needs {smem} bytes of shared memory there, more than {SMEM_LIMIT_BYTES}: fewer stages"
    return None


def uses_reducer(config: MatmulReduceScatterConfig) -> bool:
    """Whether the call runs the reducer kernel (a warp-specialized config), whose buffer carries
    the own region."""
    return config.warp_specialized


def partial_dtype(x, scaled) -> torch.dtype:
    """The partial slots' dtype: the output's (x's, or a scaled call's out_dtype), as NCCL-then-GEMM's
    partials are; the owner sums them in float32 and rounds once."""
    return x.dtype if scaled is None else scaled.out_dtype


def _write_value32(flags_u32, index, value):
    # The op's overload itself: no overload resolution on every call.
    torch.ops.symm_mem.stream_write_value32_.default(flags_u32, index, value)


class Plan:
    """One call signature of matmul_reduce_scatter, resolved: config, layout, workspace and its
    views (flags, copy-engine steps), the kernel's launch. prepare() is steps 1-2 of the module
    docstring, launch() steps 3-4; a call is both."""

    def __init__(self, x, weight, bias, info: GroupInfo, config: MatmulReduceScatterConfig | None = None, scaled=None):
        # The weight is left as it is: the kernel reads either of its layouts without a copy.
        self.copy_x = not _tma_compatible(x)
        self.copy_bias = bias is not None and not bias.is_contiguous()
        x = tma_ready(x)
        world, rank = info.world_size, info.rank
        self.info = info
        self.config = config = _config_for(x, weight, world, config, scaled)
        part = partial_dtype(x, scaled)
        self.layout = layout = Layout.of(x.shape[0] // world, weight.shape[0], part.itemsize, world, config,
                                         uses_reducer(config))  # fmt: skip
        self.ws = ws = _workspace(info, x.device, layout.nbytes)
        self.device, self.dtype = x.device, part  # the output's dtype is the partials'
        self.scaled = scaled
        self.out_shape = (x.shape[0] // world, weight.shape[0])
        self.flags = ws.flags(layout)
        self.barrier = ws.buffer.handle.barrier
        # Step 1 zeroes the own region too (Layout.reset_words): the reducer kernel need not.
        self.kernel = _Kernel(x, weight, bias, weight.shape[0], layout.flags_offset, rank, world, config, 0, world - 1,
                              MAX_SPINS, None, scaled, layout.own_offset, ws.peers if layout.own_offset else None,
                              zeroed_per_launch=True)  # fmt: skip
        # The copy stream records steps 1-2 (they address only the workspace) as one graph, and
        # carries the copy engine's band pushes; the CPU interpreter's plans issue steps 1-2 as they are.
        self.copy_stream = symm.copy_stream(x.device) if x.is_cuda else None
        self.reset_replay = StreamReplay(self.copy_stream) if x.is_cuda else None
        if config.copy_engine:
            self.counters, self.steps = ws.copy_engine_steps(layout, part, rank, world)
            self.band_pushes = StreamReplay(self.copy_stream)
            self.copy_handle, self.event = self.copy_stream.cuda_stream, DriverEvent(self.copy_stream)
        self.device_index = x.device.index or 0
        # Outside graph capture a call is one recorded graph launch (_launch.CallGraph).
        self.call_graph = None
        if x.is_cuda and not self.kernel.empty:
            self.call_graph = CallGraph(self.copy_stream, (self.kernel.per_call_indices(),))

    def ready(self, x, weight, bias):
        """The tensors the kernel reads: x TMA-ready, the bias contiguous (the weight as it is)."""
        if self.copy_x:
            x = tma_ready(x)
        if self.copy_bias:
            bias = bias.contiguous()
        return x, weight, bias

    def prepare(self) -> Plan:
        """Steps 1-2 on the current stream: zero this rank's flags, then barrier."""
        replay = self.reset_replay
        if replay is None:
            self._reset_and_barrier()
        else:
            capturing = torch.cuda.is_current_stream_capturing()
            replay.ready(self._reset_and_barrier, capturing)
            if replay.graph_exec is not None and not capturing:  # a driver call: less host time
                _driver.graph_launch(replay.graph_exec, torch._C._cuda_getCurrentRawStream(self.device_index))
            else:
                replay(self._reset_and_barrier, capturing)
        return self

    def _reset_and_barrier(self) -> None:
        self.flags.zero_()
        self.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)

    def launch(self, x, weight, bias, scales=(None, None)) -> torch.Tensor:
        """Steps 3-4 on the current stream (x, weight, bias as ready() gives them; a scaled call's
        scales, _scaled.flat); returns this rank's rows of the sum, [M/W, n]."""
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        copy_engine = self.config.copy_engine
        if copy_engine:
            capturing = torch.cuda.is_current_stream_capturing()
            pushes = self.band_pushes
            pushes.ready(self._issue_band_pushes, capturing)
            # Outside capture, the fork, the pushes' replay and the join are driver calls on raw
            # stream handles (as the all-gather's: less host time, no stream switch).
            direct = pushes.graph_exec is not None and not capturing
            # Fork before the kernel: forked after it, the copy stream would wait for the kernel's
            # end, and the kernel waits for the copies (the first try trapped on 2x H200).
            if direct:
                compute, copy = torch._C._cuda_getCurrentRawStream(self.device_index), self.copy_handle
                self.event.wait(copy, compute)
            else:
                compute, copy = symm.current_stream(self.device_index), self.copy_stream
                symm.stream_wait(copy, compute)
        self.kernel(x, weight, bias, out, self.ws.buffer_ptrs, scales)
        if copy_engine:
            if direct:
                _driver.graph_launch(pushes.graph_exec, copy)
                self.event.wait(compute, copy)
            else:
                self._push_bands(compute, copy, capturing)
        if self.config.transport == "pull":
            self.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
        return out

    def _push_bands(self, compute: torch.cuda.Stream, copy: torch.cuda.Stream, capturing: bool) -> None:
        """Copy-engine mode, after the kernel is queued: on the copy stream (forked from `compute`
        before the kernel), the band pushes (_issue_band_pushes), replayed as one recorded graph
        (every address is the workspace's); the caller's stream then joins the copy stream, so
        the next call's reset of the counters comes after the waits have read them."""
        _launch.on_stream(copy, lambda: self.band_pushes(self._issue_band_pushes, capturing), compute)
        symm.stream_wait(compute, copy)

    def _issue_band_pushes(self) -> None:
        """On the current stream: each finished band of peer tiles goes into its owner's buffer,
        then the owner's flag for it is set.

        The kernel goes first (symm.stream_wait_at_least: work queued behind a wait waits too).
        The waits need no bound of their own: the counters are this rank's, filled by its own
        kernel."""
        counters = self.counters
        for step in self.steps:
            symm.stream_wait_at_least(counters, step.counter, step.count)
            step.target.copy_(step.source)
            _write_value32(step.owner_flags, step.flag, 1)

    def _record_call(self, launches) -> None:
        """The recorded whole call (_launch.CallGraph), on the copy stream: steps 1-2, the kernel
        (the copy engine's band pushes on a branch beside it, forked before it as in launch()),
        and the pull transport's second barrier."""
        (launch, args), = launches
        self._reset_and_barrier()
        if self.config.copy_engine:
            _launch.launch_beside(self.device, launch, args, self._issue_band_pushes)
        else:
            launch(*args)
        if self.config.transport == "pull":
            self.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)

    def __call__(self, x, weight, bias, scales=(None, None)) -> torch.Tensor:
        x, weight, bias = self.ready(x, weight, bias)
        graph = self.call_graph
        if graph is not None and not torch._C._cuda_isCurrentStreamCapturing():
            out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
            if graph.ready(lambda: [self.kernel.launch_args(x, weight, bias, out, self.ws.buffer_ptrs, scales)],
                           self._record_call):  # fmt: skip
                stream = torch._C._cuda_getCurrentRawStream(self.device_index)
                graph((self.kernel.per_call(x, weight, bias, out, scales),), stream)
                return out
        self.prepare()
        return self.launch(x, weight, bias, scales)


Call = Plan  # prepare()'s result, launch()'s argument


_plans = PlanCache()


def plan(x, weight, bias, info: GroupInfo, config: MatmulReduceScatterConfig | None = None, scaled=None) -> Plan:
    """The cached Plan of this call signature (built on its first call)."""
    key = (tensor_key(x), tensor_key(weight), tensor_key(bias), info, config, scaled)
    found = _plans.get(key)
    return found if found is not None else _plans.put(key, Plan(x, weight, bias, info, config, scaled))


def scaled_plan(x, weight, bias, info: GroupInfo, out_dtype, use_fast_accum, config=None):
    """scaled_matmul_reduce_scatter's plan, a callable (x, weight, scale_x, scale_w, bias) ->
    [M/W, n] in out_dtype; built at the first call, whose scales decide the scaling."""
    plans = {}

    def run(x, weight, scale_x, scale_w, bias):
        scaled = _scaled.Scaled.of(scale_x, scale_w, out_dtype, use_fast_accum)
        found = plans.get(scaled)
        if found is None:
            found = plans[scaled] = plan(x, weight, bias, info, config, scaled)
        return found(x, weight, bias, (_scaled.flat(scale_x), _scaled.flat(scale_w)))

    return run


def prepare(x, weight, info: GroupInfo, config: MatmulReduceScatterConfig | None = None) -> Plan:
    """Steps 1-2 on the current stream: zero this rank's flags, then barrier (x TMA-ready)."""
    return plan(x, weight, None, info, config).prepare()


def launch(call: Plan, x, weight, bias) -> torch.Tensor:
    """Steps 3-4 on the current stream; returns this rank's rows of the sum, [M/W, n]. The
    bias decides the kernel (HAS_BIAS): its plan shares `call`'s workspace and layout."""
    bias = None if bias is None else bias.contiguous()
    with_bias = call if bias is None else plan(x, weight, bias, call.info, call.config)
    return with_bias.launch(x, weight, bias)


def matmul_reduce_scatter(x, weight, bias, info: GroupInfo, config: MatmulReduceScatterConfig | None = None):
    """[M/W, n]: rows rank*M/W .. (rank+1)*M/W - 1 of sum over ranks of x @ weight^T, plus bias."""
    return plan(x, weight, bias, info, config)(x, weight, bias)


def gemm_only(x, weight, bias, info: GroupInfo, config: MatmulReduceScatterConfig | None = None, scales=None,
              out_dtype=torch.bfloat16, use_fast_accum: bool = False):  # fmt: skip
    """The fused kernel with communication switched off, for the benchmark (scales=(scale_x,
    scale_w): scaled_matmul_reduce_scatter's kernel, with out_dtype and use_fast_accum).

    Returns a zero-argument callable that launches the kernel matmul_reduce_scatter launches for
    these inputs (the reducer kernel with its end-of-launch reset: nothing zeroes its own flags
    between these launches), with every rank's buffer address pointing at local memory: the
    partial tiles of peers' rows go to a local scratch buffer, and the own rows read zero
    partials whose flags are preset. It returns this rank's rows of its own partial plus bias.
    """
    x, bias = tma_ready(x), None if bias is None else bias.contiguous()  # the weight: read as it is
    m_total, n = x.shape[0], weight.shape[0]
    world, rank = info.world_size, info.rank
    scaled = None if scales is None else _scaled.Scaled.of(*scales, out_dtype, use_fast_accum)
    config = _config_for(x, weight, world, config, scaled)  # the same config as matmul_reduce_scatter
    part = partial_dtype(x, scaled)  # the output's dtype too
    layout = Layout.of(m_total // world, n, part.itemsize, world, config, uses_reducer(config))
    read = torch.zeros(layout.nbytes, dtype=torch.uint8, device=x.device)
    # Every peer's flag preset to its complete value: a band's 1 (set by the copy stream), a tile's
    # arrivals. The own region stays zero: the reducer kernel waits for its own tiles as in a call.
    flags = read[layout.flags_offset : layout.flags_offset + 4 * layout.num_flags].view(torch.int32)
    flags.copy_(layout.complete_flags(config.copy_engine))
    scratch = torch.zeros(layout.nbytes, dtype=torch.uint8, device=x.device)
    # push: the owner (this rank) reads its own buffer, producers write the peers'; pull: reversed.
    own, peers = (scratch, read) if config.transport == "pull" else (read, scratch)
    buffers = [own if r == rank else peers for r in range(world)]
    buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=x.device)
    out = torch.empty(m_total // world, n, dtype=part, device=x.device)
    kernel = _Kernel(x, weight, bias, out.stride(0), layout.flags_offset, rank, world, config, 0, world - 1, MAX_SPINS,
                     None, scaled, layout.own_offset, buffers)  # fmt: skip
    kernel_scales = (None, None) if scales is None else tuple(_scaled.flat(s) for s in scales)

    def run():
        kernel(x, weight, bias, out, buffer_ptrs, kernel_scales)
        return out

    run.workspace = (read, scratch)  # buffer_ptrs holds their raw addresses: keep them alive with run
    return run
