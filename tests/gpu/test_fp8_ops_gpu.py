"""The FP8 ops on real ranks (2+ GPUs, NCCL and symmetric memory): every backend against float64
on the dequantized inputs, gathered FP8 rows and scales exact (tests/_fp8_cases.py), at shapes the
fused kernels and torch._scaled_mm take, with the torch backend's documented refusals; and the
FP8 layers through the fused backend against the nccl one."""

import dataclasses
import os
import random

import pytest
import torch

from fluxtp.testing import run_on_ranks
from tests._fp8_cases import check_all_gather_scaled, check_scaled_reduce_scatter

WORLD = int(os.environ.get("FLUXTP_TEST_WORLD", "2"))
CASES = [  # (m per rank, n, k): ragged rows, N not a tile multiple, one chunk or several
    (1000, 1000, 2048),
    (512, 2048, 1024),
    (4096, 1024, 512),
]


def _ops_body(rank, world, seed, backend, shape):
    device = torch.device("cuda", rank)
    m, n, k = shape
    case = 0
    for row_wise in (True, False):
        for out_dtype, fast in ((torch.bfloat16, False), (torch.float32, True), (torch.float16, False)):
            bias_dtype = (None, out_dtype, torch.float32)[case % 3]
            s = seed + 10 * case
            case += 1
            # The torch backend's documented refusals, the shape check first.
            ag_refusal = rs_refusal = None
            if backend == "torch":
                if n % 16:
                    ag_refusal = rs_refusal = "K and n multiples of 16"
                else:
                    ag_refusal = "row-wise scaled matmul writes only bfloat16" if row_wise and out_dtype != torch.bfloat16 else None
                    rs_refusal = ag_refusal
            args = (rank, world, s, m, n, k, device, backend, row_wise, out_dtype, bias_dtype)
            for check, refusal in ((check_all_gather_scaled, ag_refusal), (check_scaled_reduce_scatter, rs_refusal)):
                if refusal is None:
                    check(*args, fast=fast)
                else:
                    with pytest.raises(ValueError, match=refusal):
                        check(*args, fast=fast)


# A backend and shape a test: each within run_on_ranks' bound, whose first calls compile kernels.
@pytest.mark.parametrize("shape", CASES)
@pytest.mark.parametrize("backend", ["fused", "nccl", "torch", "auto"])
def test_fp8_ops_every_backend(backend, shape):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    run_on_ranks(_ops_body, WORLD, random.randrange(1 << 30), backend, shape)


def _reducer_body(rank, world, seed):
    """The FP8 reduce-scatter through whole calls on the reducer kernel: its rule (TP>=4) moved
    to this world size, its transport alternating case by case (the heuristic's rule gives push
    alone from TP=3), so both run at any world size."""
    from fluxtp.backends.fused._matmul_reduce_scatter import _config_for
    from fluxtp.backends.fused._scaled import Scaled
    from fluxtp.configs import MatmulReduceScatterConfig

    route = MatmulReduceScatterConfig.on_reducer_kernel
    device = torch.device("cuda", rank)
    transports = set()
    for i, (m, n, k) in enumerate(CASES):
        transport = ("push", "copy_engine")[i % 2]
        MatmulReduceScatterConfig.on_reducer_kernel = lambda self, _world, *shape, t=transport: dataclasses.replace(
            route(self, 8, *shape), transport=t)
        x = torch.zeros(m * world, k, device=device).to(torch.float8_e4m3fn)
        w = torch.zeros(n, k, device=device).to(torch.float8_e4m3fn)
        for row_wise, out_dtype, fast in ((True, torch.bfloat16, False), (False, torch.float32, True)):
            config = _config_for(x, w, world, None, Scaled(out_dtype, row_wise, not fast))
            assert config.warp_specialized and config.transport == transport, config
            transports.add(config.transport)
            check_scaled_reduce_scatter(rank, world, seed + 10 * i, m, n, k, device, "fused", row_wise, out_dtype,
                                        torch.float32 if i % 2 else None, fast=fast)  # fmt: skip
    assert transports == {"push", "copy_engine"}, transports


def test_fp8_reduce_scatter_on_the_reducer_kernel():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the reducer kernel needs a Hopper GPU")
    run_on_ranks(_reducer_body, WORLD, random.randrange(1 << 30))


def _stream_k_body(rank, world, seed):
    """Fast FP8 all-gathers the stream-K rule splits, against real peers: ragged rows, both
    scalings, each call against float64 with its gathered rows and scales exact."""
    from fluxtp.backends.fused import _all_gather_matmul
    from fluxtp.backends.fused._scaled import Scaled
    from tests.gpu import plan_configs, stream_k_shape

    device = torch.device("cuda", rank)
    shape = stream_k_shape(world, Scaled(torch.bfloat16, True, False))
    assert shape is not None, f"no candidate shape takes fast FP8 stream-K at world {world}: widen stream_k_shape's search"
    m, n, k = shape
    configs = plan_configs(_all_gather_matmul)
    for i, row_wise in enumerate((True, False, True)):
        check_all_gather_scaled(rank, world, seed + 10 * i, m, n, k, device, "fused", row_wise, torch.bfloat16,
                                torch.float32 if i == 2 else None, fast=True)  # fmt: skip
    assert configs and all(config.stream_k for config in configs), f"the calls did not launch stream-K: {configs}"


def test_fp8_fast_all_gather_stream_k():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("stream-K runs on the warp-specialized kernel, for Hopper")
    run_on_ranks(_stream_k_body, WORLD, random.randrange(1 << 30))


def _layers_body(rank, world, seed):
    from torch import nn

    from fluxtp.nn import ColumnParallelLinear, RowParallelLinear
    from tests._fp8_cases import rel_error

    device = torch.device("cuda", rank)
    torch.manual_seed(seed)
    up, down = nn.Linear(1024, 4096, dtype=torch.bfloat16), nn.Linear(4096, 1024, dtype=torch.bfloat16)
    x = torch.randn(4096, 1024, dtype=torch.bfloat16)
    rows = slice(rank * 4096 // world, (rank + 1) * 4096 // world)
    results = {}
    for backend, save_memory in (("nccl", False), ("fused", False), ("fused", True)):
        col = ColumnParallelLinear.from_linear(up, fp8=True, backend=backend, save_memory=save_memory).to(device)
        row = RowParallelLinear.from_linear(down, fp8=True, backend=backend).to(device)
        x_shard = x[rows].to(device).requires_grad_(True)
        out = row(torch.nn.functional.gelu(col(x_shard)))
        out.float().square().sum().backward()
        results[backend, save_memory] = [out, x_shard.grad, col.weight.grad, row.weight.grad]
    names = ("output", "input grad", "column weight grad", "row weight grad")
    # save_memory re-gathers the FP8 rows and scales the fused all-gather moved: the same bits.
    for name, saving, keeping in zip(names, results["fused", True], results["fused", False]):
        assert torch.equal(saving, keeping), f"FP8 layers, fused, save_memory vs keeping: {name} differs"
    # The same FP8 operands in both: they differ by accumulation order and the fused all-gather's
    # fast forward accumulation only; bf16 outputs: allow 4 bf16 roundings, and the input grad's
    # two more (its reduce-scatter's partials are rounded to bf16 in both: 1.78e-2 seen on 2x H100).
    for name, fused, ref in zip(names, results["fused", False], results["nccl", False]):
        err = rel_error(fused, ref.double().cpu())
        allowed = (6 if name == "input grad" else 4) * 2**-8
        assert err <= allowed, f"FP8 layers, fused vs nccl {name}: rel err {err:.2e}"


def test_fp8_layers_fused_match_nccl():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    run_on_ranks(_layers_body, WORLD, random.randrange(1 << 30))


def _tuned_body(rank, world, seed, cache_dir):
    """scaled_matmul_reduce_scatter launches its accumulation's table entry (a user cache holding a
    reducer-kernel tiling other than the heuristic's, in bands of 4; fast at TP=2 the heuristic's
    is the Triton kernel), and its result is right; a
    float32 output, whose partials leave that tiling no room, launches the heuristic."""
    from fluxtp import configs, tune
    from fluxtp.backends.fused import _matmul_reduce_scatter
    from fluxtp.backends.fused._scaled import Scaled
    from fluxtp.configs import MatmulReduceScatterConfig
    from fluxtp.configs._classes import REDUCER_FP8_WIDE_PRECISE_TILING, WARP_SPECIALIZED_FP8_TILING
    from tests.gpu import plan_configs

    os.environ["FLUXTP_CACHE_DIR"] = cache_dir
    configs.reload()
    device = torch.device("cuda", rank)
    m, n, k_local = 512, 2048, 1024
    seen = plan_configs(_matmul_reduce_scatter)
    x = torch.zeros(m * world, k_local, device=device).to(torch.float8_e4m3fn)
    w = torch.zeros(n, k_local, device=device).to(torch.float8_e4m3fn)
    for fast in (False, True):  # precise: 128x256 tiles where 128x128 ones at five stages are the heuristic's
        tiling = WARP_SPECIALIZED_FP8_TILING if fast else REDUCER_FP8_WIDE_PRECISE_TILING
        entry = MatmulReduceScatterConfig(**tiling, group_m=4, epilogue_split=2, warp_specialized=True)
        expected = entry.with_communication_heuristic(m * world, n, world)
        heuristic = _matmul_reduce_scatter.scaled_heuristic(m * world, n, k_local, world, Scaled(torch.bfloat16, True, not fast), True)
        assert heuristic != expected, heuristic
        key = configs.Key(torch.cuda.get_device_name(device), world, configs.key_dtype("float8_e4m3fn", fast),
                          "matmul_reduce_scatter", n, k_local * world, configs.m_bucket(m * world), "linear")  # fmt: skip
        if rank == 0:
            tune.write_entries([configs.Entry(key, entry, {"M": m * world, "mode": configs.GEMM_ONLY_MODE})])
        torch.distributed.barrier()
        configs.reload()
        assert _matmul_reduce_scatter._config_for(x, w, world, None, Scaled(torch.bfloat16, True, not fast)) == expected
        seen.clear()
        check_scaled_reduce_scatter(rank, world, seed, m, n, k_local, device, "fused", True, torch.bfloat16, None, fast=fast)
        assert seen and seen[-1] == expected, (seen, expected)
        if not fast:
            seen.clear()
            check_scaled_reduce_scatter(rank, world, seed + 1, m, n, k_local, device, "fused", True, torch.float32, None)
            assert seen and seen[-1].block_n == 128, seen


def test_fp8_reduce_scatter_launches_its_tuned_entry(tmp_path):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the reducer kernel needs a Hopper GPU")
    run_on_ranks(_tuned_body, WORLD, random.randrange(1 << 30), str(tmp_path / "cache"))
