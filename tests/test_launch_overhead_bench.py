"""benchmarks/launch_overhead.py on CPU: it imports and parses its arguments, and the simulated
world it runs in (fluxtp.testing) hands out the views a launcher asks for, with this rank's own
buffer in its place (the timing itself needs one GPU)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from fluxtp import symm
from fluxtp.testing import SimulatedHandle, simulated_world

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "launch_overhead.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("launch_overhead", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arguments(bench):
    args = bench.parse_args(["--shapes", "1024x28672x8192,2048x8192x8192", "--worlds", "2,8", "--what", "call"])
    assert args.shapes == [(1024, 28672, 8192), (2048, 8192, 8192)] and args.worlds == [2, 8] and args.what == {"call"}
    assert bench.parse_args([]).worlds == [2, 4, 8]
    for bad in (["--worlds", "1"], ["--what", "kernel"], ["--shapes", "1000x64x64", "--worlds", "3"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_the_simulated_handle_views_every_rank_buffer():
    buffers = [torch.zeros(64, dtype=torch.uint8) for _ in range(3)]
    handle = SimulatedHandle(buffers, 0)
    view = handle.get_buffer(2, (2, 4), torch.float16, 4)  # 4 halves in = byte 8
    view.fill_(1.0)
    assert buffers[2][8:24].view(torch.float16).eq(1.0).all() and not buffers[2][:8].any()
    handle.barrier(channel=0, timeout_ms=10)  # the stand-in marks this rank's words delivered
    assert buffers[0].view(torch.int32).eq(1).all()


def test_the_simulated_world_puts_this_rank_buffer_in_its_place():
    with simulated_world(3, rank=1) as group:
        assert group.group_name == "simulated-3-rank1"
        fake = symm._symm_mem()
        mine = fake.empty(16, torch.uint8, "cpu")
        handle = fake.rendezvous(mine, group.group_name)
        assert handle.rank == 1 and handle.buffers[1] is mine and len(handle.buffers) == 3
        assert all(b.shape == mine.shape and b is not mine for r, b in enumerate(handle.buffers) if r != 1)
    assert symm._symm_mem() is not fake  # the stand-in is gone with the world
