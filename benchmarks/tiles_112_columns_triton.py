"""Probe (not product): the 128 x 112 tile in plain Triton (tl.dot), the fused all-gather's Triton
kernel's K loop with B and C in three boxes of 64 + 32 + 16 columns. Persistent, grouped order,
TMA loads and stores, as benchmarks/gemm_efficiency.py's plain twin.

    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/tiles_112_columns_triton.py --check   # CPU: against float64
"""

import sys

import torch
import triton
import triton.language as tl

from fluxtp.backends.fused._launch import descriptor, num_sms
from fluxtp.kernels import COMPILE_OPTIONS
from fluxtp.kernels._tiles import grouped_tile


@triton.jit
def n112_matmul_kernel(a_desc, b0_desc, b1_desc, b2_desc, c0_desc, c1_desc, c2_desc, M, N, K, BLOCK_M: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, NUM_STAGES: tl.constexpr):
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, 112)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_SMS, flatten=True, num_stages=NUM_STAGES):
        pid_m, pid_n = grouped_tile(tile_id, tiles_m, tiles_n, GROUP_M)
        acc0 = tl.zeros((BLOCK_M, 64), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_M, 32), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, 16), dtype=tl.float32)
        for ki in tl.range(k_tiles, num_stages=NUM_STAGES):
            a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
            acc0 = tl.dot(a, b0_desc.load([pid_n * 112, ki * BLOCK_K]).T, acc0)
            acc1 = tl.dot(a, b1_desc.load([pid_n * 112 + 64, ki * BLOCK_K]).T, acc1)
            acc2 = tl.dot(a, b2_desc.load([pid_n * 112 + 96, ki * BLOCK_K]).T, acc2)
        c0_desc.store([pid_m * BLOCK_M, pid_n * 112], acc0.to(c0_desc.dtype))
        c1_desc.store([pid_m * BLOCK_M, pid_n * 112 + 64], acc1.to(c1_desc.dtype))
        c2_desc.store([pid_m * BLOCK_M, pid_n * 112 + 96], acc2.to(c2_desc.dtype))


def n112_matmul(x, w, block_m=128, block_k=64, stages=4, warps=4, programs=None, out=None):
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    descs = (descriptor(x, [block_m, block_k]), descriptor(w, [64, block_k]), descriptor(w, [32, block_k]),
             descriptor(w, [16, block_k]), descriptor(out, [block_m, 64]), descriptor(out, [block_m, 32]),
             descriptor(out, [block_m, 16]))
    sms = programs or (num_sms(x.device) if x.is_cuda else 4)
    sms = min(sms, triton.cdiv(m, block_m) * triton.cdiv(n, 112))
    options = {} if not x.is_cuda else {"num_warps": warps, "num_stages": stages, **COMPILE_OPTIONS}

    def run():
        n112_matmul_kernel[(sms,)](*descs, m, n, k, BLOCK_M=block_m, BLOCK_K=block_k, GROUP_M=8, NUM_SMS=sms,
                                   NUM_STAGES=stages, **options)
        return out

    return run


def check():
    """Under the interpreter: ragged M, N and K against float64, a poisoned output."""
    torch.manual_seed(0)
    for m, n, k in [(256, 224, 128), (200, 248, 96), (130, 112, 64)]:
        x = torch.randn(m, k, dtype=torch.float16)  # the interpreter's bf16 tl.dot is wrong (Triton 3.8)
        w = torch.randn(n, k, dtype=torch.float16)
        out = torch.full((m, n), float("nan"), dtype=torch.float16)
        n112_matmul(x, w, block_m=64, block_k=32, stages=2, out=out)()
        want = x.double() @ w.double().t()
        err = ((out.double() - want).abs().max() / want.abs().max()).item()
        print(f"{m}x{n}x{k}: max rel err {err:.2e}")
        assert err < 1e-2


if __name__ == "__main__":
    if "--check" in sys.argv:
        check()
