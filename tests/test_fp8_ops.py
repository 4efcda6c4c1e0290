"""The FP8 ops (fluxtp.all_gather_scaled_matmul, fluxtp.scaled_matmul_reduce_scatter) on CPU: every
backend that runs here against float64 on the dequantized inputs (tests/_fp8_cases.py), worlds
of 1-3 on gloo, and every validation error."""

import random

import pytest
import torch

import fluxtp
from fluxtp.testing import run_on_ranks
from tests._fp8_cases import sweep


def _sweep_body(rank, world, seed):
    sweep(rank, world, seed, "cpu", ["nccl", "auto"])


@pytest.mark.parametrize("world", [2, 3])
def test_scaled_ops_on_gloo(world):
    run_on_ranks(_sweep_body, world, random.randrange(1 << 30), backend="gloo")


def test_world_of_one_without_distributed():
    # No process group: every backend name is a plain scaled linear.
    sweep(0, 1, random.randrange(1 << 30), "cpu", ["nccl", "auto", "torch", "fused"])


def _gpu_backends_refuse_cpu(rank, world):
    from tests._fp8_cases import quantize

    xq, sx = quantize(torch.randn(4, 16, dtype=torch.float64), True)
    wq, sw = quantize(torch.randn(6, 16, dtype=torch.float64), True)
    for backend in ("torch", "fused"):
        with pytest.raises(ValueError, match="CUDA"):
            fluxtp.all_gather_scaled_matmul(xq, wq, sx, sw.reshape(1, -1), backend=backend)
        with pytest.raises(ValueError, match="CUDA"):
            fluxtp.scaled_matmul_reduce_scatter(xq, wq, sx, sw.reshape(1, -1), backend=backend)
    # The reduce-scatter's rows must split over the group (checked before any backend runs).
    with pytest.raises(ValueError, match=r"x has shape \(3, 16\): its M=3 rows must be divisible by the group's world size 2"):
        fluxtp.scaled_matmul_reduce_scatter(xq[:3], wq, sx[:3], sw.reshape(1, -1))


def test_gpu_backends_refuse_cpu_tensors_and_uneven_rows():
    run_on_ranks(_gpu_backends_refuse_cpu, 2, backend="gloo")
