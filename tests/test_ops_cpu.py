"""Every backend that runs on CPU (gloo) against float64, for worlds of 1, 2 and 3."""

import random

import pytest
import torch

import fluxtp
from fluxtp.testing import run_on_ranks
from tests._cases import sweep

DTYPES = [torch.float32, torch.bfloat16]


def _sweep_body(rank, world, seed):
    sweep(rank, world, seed, "cpu", ["nccl", "auto"], DTYPES)


@pytest.mark.parametrize("world", [2, 3])
def test_reference_on_gloo(world):
    run_on_ranks(_sweep_body, world, random.randrange(1 << 30), backend="gloo")


def _large_world_body(rank, world, seed):
    from tests._cases import check_all_gather_matmul, check_all_reduce, check_matmul_reduce

    for i, (m, n, k) in enumerate([(3, 5, 16), (8, 2, 24)]):
        s = seed + 10 * i
        check_all_gather_matmul(rank, world, s, m, n, k, torch.float32, "cpu", "auto", i == 0)
        check_matmul_reduce("matmul_reduce_scatter", rank, world, s, m * world, n, k, torch.float32, "cpu", "auto", i == 1)
        check_matmul_reduce("matmul_all_reduce", rank, world, s, m, n, k, torch.float32, "cpu", "auto", i == 0)
        check_all_reduce(rank, world, s, (m, n), torch.float32, "cpu", "auto")


@pytest.mark.parametrize("world", [4, 8])
def test_tp4_and_tp8_worlds(world):
    """The code paths for the TP=4/8 layouts of the paper (issue 8), on gloo."""
    run_on_ranks(_large_world_body, world, random.randrange(1 << 30), backend="gloo")


def test_world_of_one_without_distributed():
    # No process group at all: every op is a plain linear.
    sweep(0, 1, random.randrange(1 << 30), "cpu", ["nccl", "auto", "torch", "fused"], DTYPES + [torch.float64])


def _world_one_group_body(rank, world, seed):
    sweep(rank, world, seed, "cpu", ["nccl", "auto"], DTYPES)


def test_world_of_one_group():
    run_on_ranks(_world_one_group_body, 1, random.randrange(1 << 30), backend="gloo")


def _subgroup_body(rank, world, seed):
    import torch.distributed as dist

    pair = dist.new_group([1, 2])
    if rank in (1, 2):
        sub_rank = rank - 1
        sweep(sub_rank, 2, seed, "cpu", ["nccl"], [torch.float32], group=pair)


def test_subgroup_of_three():
    """Two ranks of a three-rank world run the ops on their own group; rank 0 stays out."""
    run_on_ranks(_subgroup_body, 3, random.randrange(1 << 30), backend="gloo")


def _cpu_backend_errors(rank, world):
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    for backend in ("torch", "fused"):
        with pytest.raises(ValueError, match="CUDA"):
            fluxtp.all_gather_matmul(x, w, backend=backend)
        with pytest.raises(ValueError, match="CUDA"):
            fluxtp.matmul_reduce_scatter(x, w, backend=backend)
        with pytest.raises(ValueError, match="CUDA"):
            fluxtp.matmul_all_reduce(x, w, backend=backend)
        with pytest.raises(ValueError, match="CUDA"):
            fluxtp.all_reduce(x, backend=backend)


def test_gpu_backends_refuse_cpu_tensors():
    run_on_ranks(_cpu_backend_errors, 2, backend="gloo")
