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


def test_the_warp_specialized_reduce_scatter_is_opt_in_and_refused_where_it_cannot_run():
    """The FP8 heuristic never picks the warp-specialized reduce-scatter (slower than the Triton
    kernel); its own config keeps the heuristic's transport rule and counts two arrivals a tile;
    asked for on CPU tensors, it is refused with the reason before any launch."""
    from fluxtp.backends.fused._matmul_reduce_scatter import Layout, launch_kernel
    from fluxtp.backends.fused._scaled import Scaled
    from fluxtp.configs import MatmulReduceScatterConfig

    assert not MatmulReduceScatterConfig.heuristic_fp8(4096, 4096, 14336, 2, True).warp_specialized
    ws = MatmulReduceScatterConfig.warp_specialized_fp8(4096, 4096, 2)
    assert ws.warp_specialized and ws.transport == MatmulReduceScatterConfig.heuristic(4096, 4096, 14336, 2).transport
    layout = Layout.of(2048, 4096, 4, 2, ws)
    assert layout.tile_arrivals == 2 and Layout.of(2048, 4096, 4, 2, MatmulReduceScatterConfig()).tile_arrivals == 1
    x = torch.zeros(512, 64).to(torch.float8_e4m3fn)
    w = torch.zeros(128, 64).to(torch.float8_e4m3fn)
    small = Layout.of(256, 128, 4, 2, ws)
    buffers = torch.zeros(2, small.nbytes, dtype=torch.uint8)
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    with pytest.raises(ValueError, match="asks for the warp-specialized kernel, but it runs on a CUDA GPU only"):
        launch_kernel(x, w, None, torch.empty(256, 128, dtype=torch.bfloat16), ptrs, small.flags_offset, 0, 2, ws,
                      scaled=Scaled(torch.bfloat16, True, True), scales=(torch.ones(512), torch.ones(128)))  # fmt: skip

def test_the_warp_specialized_all_gather_is_chosen_only_where_it_runs():
    """The FP8 heuristic gives a call the warp-specialized kernel's tiling for its accumulation
    when the launcher says the call can take it (a Hopper GPU, compiled); a config that asks for
    it where it cannot run is refused with the reason, before any launch."""
    from fluxtp._dist import GroupInfo
    from fluxtp.backends.fused._all_gather_matmul import _config_for, launch_gemm
    from fluxtp.backends.fused._scaled import Scaled, pingpong_unsupported
    from fluxtp.configs import AllGatherMatmulConfig
    from fluxtp.configs._classes import WARP_SPECIALIZED_FP8_FAST_TILING, WARP_SPECIALIZED_FP8_TILING

    ws = AllGatherMatmulConfig.heuristic_fp8(1024, 7168, 4096, 2, True, warp_specialized=True)
    assert ws.warp_specialized and (ws.num_stages, ws.group_m) == (6, 4)  # six stages beside a bf16 output's staging
    assert {k: getattr(ws, k) for k in WARP_SPECIALIZED_FP8_TILING} == {**WARP_SPECIALIZED_FP8_TILING, "num_stages": 6}
    f32_out = AllGatherMatmulConfig.heuristic_fp8(1024, 7168, 4096, 2, True, warp_specialized=True, out_bytes=4)
    assert {k: getattr(f32_out, k) for k in WARP_SPECIALIZED_FP8_TILING} == WARP_SPECIALIZED_FP8_TILING
    # Precise calls whose 128x256 tiles fill their waves (1792 of them) take those, their accumulator in
    # column halves; a float32 output's staging leaves them no room.
    wide = AllGatherMatmulConfig.heuristic_fp8(4096, 7168, 4096, 2, True, warp_specialized=True)
    assert wide.warp_specialized and (wide.block_n, wide.block_k, wide.num_stages, wide.group_m) == (256, 128, 4, 4)
    assert wide.with_fp8_output(4) is None
    wide_f32 = AllGatherMatmulConfig.heuristic_fp8(4096, 7168, 4096, 2, True, warp_specialized=True, out_bytes=4)
    assert {k: getattr(wide_f32, k) for k in WARP_SPECIALIZED_FP8_TILING} == WARP_SPECIALIZED_FP8_TILING
    assert ws.chunk_rows % ws.block_m == 0
    fast_ws = AllGatherMatmulConfig.heuristic_fp8(4096, 7168, 4096, 2, False, warp_specialized=True)
    assert fast_ws.warp_specialized
    assert {k: getattr(fast_ws, k) for k in WARP_SPECIALIZED_FP8_FAST_TILING} == WARP_SPECIALIZED_FP8_FAST_TILING
    # A fast call whose narrow tiles win takes them there, six stages in bands of four beside a bf16
    # output (56 wide tiles, 112 narrow ones: one wave either way)...
    sparse = AllGatherMatmulConfig.heuristic_fp8(128, 1792, 4096, 8, False, warp_specialized=True)
    assert sparse.warp_specialized and (sparse.block_n, sparse.num_stages, sparse.group_m) == (128, 6, 4)
    assert AllGatherMatmulConfig.heuristic_fp8(1024, 7168, 4096, 2, False, warp_specialized=True) == ws  # 448 wide tiles
    # ...and one whose wide tiles do not fill one wave, where its narrow ones do not win, or with a
    # float32 output, stays on Triton (72 wide tiles, 144 narrow ones).
    between = AllGatherMatmulConfig.heuristic_fp8(128, 2304, 4096, 8, False, warp_specialized=True)
    assert not between.warp_specialized and between.block_n == 256
    assert not AllGatherMatmulConfig.heuristic_fp8(4096, 7168, 4096, 2, False, warp_specialized=True,
                                                   out_bytes=4).warp_specialized  # fmt: skip
    # On Triton a float32 output takes 128x128 tiles even where 128x256 ones fill the waves (their
    # float32 epilogue does not fit shared memory): 1000 rows a rank at TP=4, the multi-GPU test's case.
    for on_hopper in (False, True):
        f32_fast = AllGatherMatmulConfig.heuristic_fp8(1000, 1000, 2048, 4, False, warp_specialized=on_hopper,
                                                       out_bytes=4)  # fmt: skip
        assert not f32_fast.warp_specialized and f32_fast.block_n == 128
    assert AllGatherMatmulConfig.heuristic_fp8(1000, 1000, 2048, 4, False).block_n == 256  # a bf16 output keeps them
    assert not AllGatherMatmulConfig.heuristic_fp8(1024, 7168, 4096, 2, True).warp_specialized

    precise, fast = Scaled(torch.bfloat16, True, True), Scaled(torch.bfloat16, True, False)
    assert "CUDA GPU" in pingpong_unsupported("cpu", fast)
    assert "CUDA GPU" in pingpong_unsupported("cpu", precise)
    x = torch.zeros(256, 64).to(torch.float8_e4m3fn)
    w = torch.zeros(128, 64).to(torch.float8_e4m3fn)
    assert not _config_for(x, w, 2, None, precise).warp_specialized  # a CPU tensor: the Triton kernel
    with pytest.raises(ValueError, match="asks for the warp-specialized kernel, but it runs on a CUDA GPU only"):
        launch_gemm(x.repeat(2, 1), x, w, None, torch.empty(512, 128, dtype=torch.bfloat16), torch.ones(2, dtype=torch.int32),
                    torch.zeros(1, dtype=torch.int32), 256, 256, GroupInfo(None, 0, 2), ws, scaled=precise,
                    scales=(torch.ones(512), torch.ones(256), torch.ones(128)))  # fmt: skip


def test_quantization_kernel_takes_only_what_32_bit_offsets_reach():
    """Larger tensors take the eager path (fluxtp.fp8._offsets_fit_32_bits), checked on meta tensors."""
    from fluxtp.fp8 import _offsets_fit_32_bits

    assert _offsets_fit_32_bits(torch.empty(1 << 16, 1 << 15, device="meta"))  # 2^31 elements: the last at 2^31 - 1
    assert _offsets_fit_32_bits(torch.empty(1 << 16, 1 << 15, device="meta").t())
    assert not _offsets_fit_32_bits(torch.empty((1 << 16) + 1, 1 << 15, device="meta"))
    assert not _offsets_fit_32_bits(torch.empty((1 << 16) + 1, 1 << 15, device="meta").t())
    assert not _offsets_fit_32_bits(torch.empty(4, 1 << 30, device="meta")[:, :4])  # few elements, far apart
