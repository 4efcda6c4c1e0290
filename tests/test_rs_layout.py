"""The fused reduce-scatter's workspace bands and the copy engine's plan, on CPU: the copy stream
must push bands in the order the kernel completes them, or a band that is done waits behind one
that is not (the reducer kernel's owners, pushed owner by owner, all moved after its GEMM)."""

import itertools

import pytest

from fluxtp.backends.fused._matmul_reduce_scatter import (
    MAX_REDUCER_UNITS_IN_FLIGHT,
    REDUCER_UNIT_BYTES,
    Layout,
    copy_plan,
    reducer_band_rows,
    reducer_smem_bytes,
    reducer_tail_units,
    reducer_unit_box,
    reducer_unit_rows,
    reducer_units_in_flight,
    reducer_unsupported,
)
from fluxtp.configs import SMEM_LIMIT_BYTES, MatmulReduceScatterConfig
from fluxtp.configs._classes import WARP_SPECIALIZED_FP8_FAST_TILING, WARP_SPECIALIZED_FP8_TILING, reducer_fp8_tiling

FIVE_STAGES = reducer_fp8_tiling(True, 2, 1024, 4096)


def _grouped(j, tiles_m, tiles_n, group):
    """fluxtp.kernels._tiles.grouped_tile in Python: (pid_m, pid_n) of the j-th tile."""
    per_group = group * tiles_n
    first_m = (j // per_group) * group
    rows = min(tiles_m - first_m, group)
    return first_m + (j % per_group) % rows, (j % per_group) // rows


def _tile_order(layout, world, reducer):
    """(owner step, pid_m) of every tile in the order the kernel visits them: the Triton kernel
    owner step by owner step in group_m bands; the reducer kernel owners interleaved tile by
    tile, each owner's tiles in bands of layout.band_rows rows."""
    tiles = layout.tiles_m * layout.tiles_n
    order = []
    for t in range(world * tiles):
        if reducer:
            step, (pid_m, _) = t % world, _grouped(t // world, layout.tiles_m, layout.tiles_n, layout.band_rows)
        else:
            step, (pid_m, _) = t // tiles, _grouped(t % tiles, layout.tiles_m, layout.tiles_n, layout.band_rows)
        order.append((step, pid_m))
    return order


@pytest.mark.parametrize("reducer", [False, True], ids=["triton", "reducer"])
@pytest.mark.parametrize("world,rows_per_rank", [(2, 4096), (4, 1024), (4, 2048), (8, 2048), (3, 640)])
def test_copy_plan_follows_the_kernels_completion_order(world, rows_per_rank, reducer):
    config = MatmulReduceScatterConfig(transport="copy_engine", warp_specialized=reducer)
    layout = Layout.of(rows_per_rank, 8192, 2, world, config, own_region=reducer)
    assert layout.band_rows == (reducer_band_rows(config.group_m, world) if reducer else config.group_m)
    completed = {}  # (step, band) -> index of its last tile in the visiting order
    for index, (step, pid_m) in enumerate(_tile_order(layout, world, reducer)):
        completed[(step, pid_m // layout.band_rows)] = index
    for rank in range(world):
        plan = copy_plan(layout, rank, world)
        steps = [((owner - rank - 1) % world, band) for owner, _, _, band in plan]
        assert sorted(steps) == sorted(itertools.product(range(world - 1), range(layout.bands)))
        finish = [completed[step] for step in steps]
        assert finish == sorted(finish), f"rank {rank}: a band is pushed after a later one ({steps})"
        for owner, out_slot, in_slot, _ in plan:
            assert out_slot == owner - (owner > rank) and in_slot == rank - (rank > owner)


def test_the_reducer_kernel_counts_finer_bands():
    """At TP=4, 1024 rows a rank in 128-row tiles, group_m 8: one band a segment for the Triton
    kernel's order, four for the reducer kernel's (its group of two tile rows), so the copy engine
    has something to push while the GEMM runs."""
    config = MatmulReduceScatterConfig(transport="copy_engine")
    assert Layout.of(1024, 8192, 2, 4, config).bands == 1
    on_reducer = MatmulReduceScatterConfig(transport="copy_engine", warp_specialized=True)
    reducer = Layout.of(1024, 8192, 2, 4, on_reducer, own_region=True)
    assert (reducer.band_rows, reducer.bands) == (2, 4)
    assert [reducer.band(b) for b in range(4)] == [(256 * b, 256 * (b + 1), 2 * 32) for b in range(4)]
    push = Layout.of(1024, 8192, 2, 8, MatmulReduceScatterConfig(transport="push", warp_specialized=True), True)
    assert push.counts_bands and push.band_rows == 1 and push.num_flags == 7 * 8


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize(
    "tiling, itemsize, partial_size",
    [
        ({"block_m": 128, "block_n": 256, "block_k": 64, "num_stages": 3}, 2, 2),  # bf16 / fp16 (on_reducer_kernel)
        (WARP_SPECIALIZED_FP8_TILING, 1, 2),  # FP8 precise, bf16 out
        (FIVE_STAGES, 1, 2),  # FP8 precise, bf16 out, a small GEMM (reducer_fp8_tiling)
        (WARP_SPECIALIZED_FP8_TILING, 1, 4),  # FP8 precise, float32 out
        (WARP_SPECIALIZED_FP8_FAST_TILING, 1, 2),  # FP8 fast, bf16 out
    ],
)
def test_the_reducer_units_grow_within_their_bytes_and_the_tilings_still_fit(world, tiling, itemsize, partial_size):
    """Units of more rows and more units in flight, as far as shared memory goes: never past it;
    the tail's units within the weight stages."""
    config = MatmulReduceScatterConfig(**{**tiling, "num_warps": 4}, warp_specialized=True, transport="copy_engine")
    rows = reducer_unit_rows(config.block_n, world, partial_size)
    assert rows in (4, 8) and config.block_m % rows == 0  # the kernel's units tile a tile's rows
    unit_bytes = world * rows * config.block_n * partial_size
    assert unit_bytes <= REDUCER_UNIT_BYTES or rows == 4, f"{rows} rows take {unit_bytes} bytes"
    if unit_bytes * 2 <= REDUCER_UNIT_BYTES:
        assert rows == 8, "a unit that could double within its bytes stays small"
    assert reducer_unsupported(config, 8192, world, itemsize, partial_size) is None
    in_flight = reducer_units_in_flight(config, world, itemsize, partial_size)
    assert 1 <= in_flight <= MAX_REDUCER_UNITS_IN_FLIGHT
    assert reducer_smem_bytes(config, world, itemsize, partial_size, in_flight) <= SMEM_LIMIT_BYTES
    if in_flight < MAX_REDUCER_UNITS_IN_FLIGHT:
        assert reducer_smem_bytes(config, world, itemsize, partial_size, in_flight + 1) > SMEM_LIMIT_BYTES
    if tiling is WARP_SPECIALIZED_FP8_TILING or tiling is FIVE_STAGES:
        # the narrow FP8 tiling has room, its fifth stage too: the reducer is its critical path
        assert in_flight >= 2
    # One unit at a time, the tail's units go through the weight stages instead, as many as they hold.
    tail = reducer_tail_units(config, world, itemsize, partial_size)
    ring_bytes = config.num_stages * config.block_n * config.block_k * itemsize
    if in_flight == 1:
        assert 1 <= tail and tail * unit_bytes <= ring_bytes < (tail + 1) * unit_bytes
    else:
        assert tail == 0


def test_a_tiling_with_no_room_for_a_unit_is_refused():
    deep = MatmulReduceScatterConfig(block_m=128, block_n=256, block_k=64, num_stages=4, warp_specialized=True,
                                     transport="copy_engine")  # fmt: skip
    assert reducer_units_in_flight(deep, 8, 2, 2) == 0
    assert "shared memory" in reducer_unsupported(deep, 8192, 8, 2, 2)


def test_the_reducer_kernel_refuses_tiles_of_other_than_128_rows():
    """Its two consumer warpgroups take 64 rows each: a 64-row tiling is refused before it compiles."""
    short = MatmulReduceScatterConfig(block_m=64, block_n=128, warp_specialized=True, transport="push")
    assert "128 rows" in reducer_unsupported(short, 8192, 4, 2)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_a_push_unit_loads_its_adjacent_slots_in_one_copy(world):
    """Push: the W-1 incoming slots and the own one are slots 0..W-1, so one TMA box of W slots
    (at most 256 a dimension) loads a unit; the copy engine's own slot follows its outgoing ones."""
    config = MatmulReduceScatterConfig(warp_specialized=True, transport="push")
    layout = Layout.of(512, 1024, 2, world, config, own_region=True)
    assert layout.slots == world and reducer_unit_box(world, "push") == world <= 256
    assert reducer_unit_box(world, "copy_engine") == 1
