"""Is warp specialization a lever for the bf16 GEMM itself? One GPU, plain GEMMs (no fusion).

    python benchmarks/warp_specialized_bf16.py [--rounds 7] [--out FILE.json]

Per-rank GEMMs of the fused ops at TP 2 and 8 (llama3-8b / llama3-70b; all-gather [M, K] x [N/W, K]^T,
reduce-scatter [M, K/W] x [N, K/W]^T), bf16, time over cuBLAS's (F.linear), CUDA graph replays
interleaved (fluxtp.bench.harness), each checked against F.linear:
- `triton_128x256` / `triton_128x128`: the fused kernels' plain twin (benchmarks/gemm_efficiency.py)
  at the all-gather heuristic's two tilings;
- `ws_128x256` / `ws_128x128`: a warp-specialized Gluon GEMM of the same tile, the structure of
  the FP8 all-gather's kernel without its promotion: a loader warp (benchmarks/fp8_promotion.py's)
  and two consumer warpgroups, each accumulating half of a tile's rows over the whole K loop
  (one wgmma in flight), storing through TMA.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

from fluxtp.backends.fused._scaled import PINGPONG_WARPS
from fluxtp.configs import AllGatherMatmulConfig
from fluxtp.kernels import COMPILE_OPTIONS
from fluxtp.kernels._pingpong import accumulate_plain, allocate_pingpong

sys.path.insert(0, str(Path(__file__).parent))
from fp8_promotion import _descriptors, _pingpong_loader, _scaled_store, _sms, _tile_origin, report, timed_row  # noqa: E402
from gemm_efficiency import plain_matmul  # noqa: E402

SHAPES = [  # (case, M, N, K) of one rank's GEMM
    ("ag llama3-8b TP8 M1024", 1024, 1792, 4096),
    ("ag llama3-8b TP8 M4096", 4096, 1792, 4096),
    ("ag llama3-8b TP8 M16384", 16384, 1792, 4096),
    ("ag llama3-70b TP8 M2048", 2048, 3584, 8192),
    ("ag llama3-70b TP8 M8192", 8192, 3584, 8192),
    ("ag llama3-70b TP2 M8192", 8192, 14336, 8192),
    ("rs llama3-8b TP8 M2048", 2048, 4096, 1792),
    ("rs llama3-70b TP8 M8192", 8192, 8192, 3584),
    ("rs llama3-70b TP2 M4096", 4096, 8192, 14336),
]


@gluon.jit
def _consumer(a_desc, b_desc, c_desc, scale_a_ptr, scale_b_ptr, M, N, K, a_bufs, b_bufs, c_bufs, ready, empty,
              NUM_PROGRAMS, C: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    HALF: gl.constexpr = BLOCK_M // 2
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    used = 0
    for tile in range(gl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS):
        off_m, off_n = _tile_origin(tile, tiles_m, tiles_n, 8, BLOCK_M, BLOCK_N)
        acc, used = accumulate_plain(a_bufs, b_bufs, ready, empty, used, K, C, layout)
        # Unit scales: the FP8 probe's scaled store, so the two probes share their epilogue.
        _scaled_store(acc, c_desc, c_bufs.index(C), scale_a_ptr, scale_b_ptr, off_m + C * HALF, off_n, M, N, layout)
    tma.store_wait(pendings=0)


@gluon.jit
def _consumer0(a_desc, b_desc, c_desc, scale_a_ptr, scale_b_ptr, M, N, K, a_bufs, b_bufs, c_bufs, ready, empty,
               NUM_PROGRAMS):  # fmt: skip
    _consumer(a_desc, b_desc, c_desc, scale_a_ptr, scale_b_ptr, M, N, K, a_bufs, b_bufs, c_bufs, ready, empty,
              NUM_PROGRAMS, 0)  # fmt: skip


@gluon.jit
def _consumer1(a_desc, b_desc, c_desc, scale_a_ptr, scale_b_ptr, M, N, K, a_bufs, b_bufs, c_bufs, ready, empty,
               NUM_PROGRAMS):  # fmt: skip
    _consumer(a_desc, b_desc, c_desc, scale_a_ptr, scale_b_ptr, M, N, K, a_bufs, b_bufs, c_bufs, ready, empty,
              NUM_PROGRAMS, 1)  # fmt: skip


@gluon.jit
def warp_specialized_kernel(a_desc, b_desc, c_desc, scale_a_ptr, scale_b_ptr, M, N, K, NUM_PROGRAMS: gl.constexpr,
                            NUM_STAGES: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    a_bufs, b_bufs, c_bufs, ready, empty = allocate_pingpong(a_desc, b_desc, c_desc, NUM_STAGES)
    args = (a_desc, b_desc, c_desc, scale_a_ptr, scale_b_ptr, M, N, K, a_bufs, b_bufs, c_bufs, ready, empty,
            NUM_PROGRAMS)  # fmt: skip
    gl.warp_specialize([(_consumer0, args), (_consumer1, args), (_pingpong_loader, args)], [4, 1], [232, 40])


def warp_specialized(a, b, block_n, stages):
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    descs = _descriptors(a, b, c, [128, 64], [block_n, 64], [64, block_n])
    ones_m, ones_n = torch.ones(m, device=a.device), torch.ones(n, device=a.device)
    programs = min(_sms(a.device), triton.cdiv(m, 128) * triton.cdiv(n, block_n))

    def run():
        warp_specialized_kernel[(programs,)](*descs, ones_m, ones_n, m, n, k, programs, stages, **PINGPONG_WARPS,
                                             **COMPILE_OPTIONS)
        return c

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    rows = []
    for case, m, n, k in SHAPES:
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, k, device=device, dtype=torch.bfloat16) * k**-0.5
        want = F.linear(a, b).float()
        runs = {
            "cublas": lambda a=a, b=b: F.linear(a, b),
            "triton_128x256": plain_matmul(a, b, AllGatherMatmulConfig()),
            "triton_128x128": plain_matmul(a, b, AllGatherMatmulConfig(block_n=128, num_warps=4, num_stages=5)),
            "ws_128x256": warp_specialized(a, b, 256, 3),  # 3 stages of 48 KiB: the most that fit
            "ws_128x128": warp_specialized(a, b, 128, 5),
        }
        for name, run in runs.items():
            error = ((run().float() - want).norm() / want.norm()).item()
            if not error < 1e-2:
                raise AssertionError(f"{case}: {name} computes a wrong result (relative error {error:.3g})")
        rows.append(timed_row(case, runs, args.rounds, device, m=m, n=n, k=k))
    report("warp_specialized_bf16", rows, args.out)


if __name__ == "__main__":
    main()
