"""Probe (not product): 128 x 112 tiles, the width cuBLAS picks where N is a multiple of 112
(1792 = 16 x 112, 3584 = 32 x 112): a wave of 128 tiles where 128-wide tiles leave 112 (0.85 wave)
or 1.7 waves. Gluon shapes must be powers of two, so the 112 columns are three accumulators of
64 + 32 + 16 columns, B staged as three boxes, three wgmmas a K step sharing A's stage.
Two consumer warpgroups of 64 rows and a loader warp, as benchmarks/consumer_row_tiles.py.

    PYTHONPATH=$PWD python benchmarks/tiles_112_columns.py                # on the device
    PYTHONPATH=$PWD python benchmarks/tiles_112_columns.py --compile-only # offline for sm_90 (Triton 3.8+)
"""

import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from fluxtp.kernels._pingpong import grouped_tile, tma_load, tma_store

sys.path[:0] = ["benchmarks"]
from consumer_row_tiles import (  # noqa: E402
    layouts as square_layouts,
    print_times,
    regs,
    rows_gemm_kernel,
    shape_inputs,
)

BN = 112
CONS = 2


@gluon.jit
def _loader(a_desc, b0_desc, b1_desc, b2_desc, a_bufs, b0_bufs, b1_bufs, b2_bufs, ready, empty, M, N, K,
            GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr):
    BK: gl.constexpr = a_desc.block_type.shape[1]
    S: gl.constexpr = b0_bufs.type.shape[0]
    nbytes: gl.constexpr = (2 * a_desc.block_type.nbytes + b0_desc.block_type.nbytes + b1_desc.block_type.nbytes
                            + b2_desc.block_type.nbytes)
    tiles_m = gl.cdiv(M, 128)
    tiles_n = gl.cdiv(N, 112)
    loaded = 0
    for tile in range(gl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS):
        pid_m, pid_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
        for ki in range(gl.cdiv(K, BK)):
            s = loaded % S
            mbarrier.wait(empty.index(s), ((loaded // S) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma_load(a_desc, [pid_m * 128, ki * BK], ready.index(s), a_bufs.index(2 * s))
            tma_load(a_desc, [pid_m * 128 + 64, ki * BK], ready.index(s), a_bufs.index(2 * s + 1))
            tma_load(b0_desc, [pid_n * 112, ki * BK], ready.index(s), b0_bufs.index(s))
            tma_load(b1_desc, [pid_n * 112 + 64, ki * BK], ready.index(s), b1_bufs.index(s))
            tma_load(b2_desc, [pid_n * 112 + 96, ki * BK], ready.index(s), b2_bufs.index(s))
            loaded += 1


@gluon.jit
def _consumer(c0_desc, c1_desc, c2_desc, a_bufs, b0_bufs, b1_bufs, b2_bufs, c0_bufs, c1_bufs, c2_bufs, ready, empty,
              M, N, K, C: gl.constexpr, GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr):
    BK: gl.constexpr = a_bufs.type.shape[2]
    S: gl.constexpr = b0_bufs.type.shape[0]
    l0: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    l1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 16])
    l2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
    tiles_m = gl.cdiv(M, 128)
    tiles_n = gl.cdiv(N, 112)
    k_tiles = gl.cdiv(K, BK)
    used = 0
    c0_smem = c0_bufs.index(C)
    c1_smem = c1_bufs.index(C)
    c2_smem = c2_bufs.index(C)
    for tile in range(gl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS):
        pid_m, pid_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
        acc0 = gl.zeros((64, 64), dtype=gl.float32, layout=l0)
        acc1 = gl.zeros((64, 32), dtype=gl.float32, layout=l1)
        acc2 = gl.zeros((64, 16), dtype=gl.float32, layout=l2)
        previous = 0
        for ki in range(k_tiles):
            s = used % S
            mbarrier.wait(ready.index(s), (used // S) & 1)
            a = a_bufs.index(2 * s + C)
            acc0 = warpgroup_mma(a, b0_bufs.index(s).permute((1, 0)), acc0, is_async=True)
            acc1 = warpgroup_mma(a, b1_bufs.index(s).permute((1, 0)), acc1, is_async=True)
            acc2 = warpgroup_mma(a, b2_bufs.index(s).permute((1, 0)), acc2, is_async=True)
            acc0, acc1, acc2 = warpgroup_mma_wait(num_outstanding=3, deps=(acc0, acc1, acc2))
            mbarrier.arrive(empty.index(previous), count=1, pred=ki > 0)
            previous = s
            used += 1
        acc0, acc1, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, acc2))
        mbarrier.arrive(empty.index(previous), count=1, pred=k_tiles > 0)
        tma.store_wait(pendings=0)
        c0_smem.store(acc0.to(c0_desc.dtype))
        c1_smem.store(acc1.to(c1_desc.dtype))
        c2_smem.store(acc2.to(c2_desc.dtype))
        fence_async_shared()
        row = pid_m * 128 + 64 * C
        tma_store(c0_desc, [row, pid_n * 112], c0_smem)
        tma_store(c1_desc, [row, pid_n * 112 + 64], c1_smem)
        tma_store(c2_desc, [row, pid_n * 112 + 96], c2_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def n112_gemm_kernel(a_desc, b0_desc, b1_desc, b2_desc, c0_desc, c1_desc, c2_desc, M, N, K, S: gl.constexpr,
                     GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, REGS: gl.constexpr, num_warps: gl.constexpr):
    BK: gl.constexpr = a_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [S * 2, 64, BK], a_desc.layout)
    b0_bufs = gl.allocate_shared_memory(b0_desc.dtype, [S, 64, BK], b0_desc.layout)
    b1_bufs = gl.allocate_shared_memory(b1_desc.dtype, [S, 32, BK], b1_desc.layout)
    b2_bufs = gl.allocate_shared_memory(b2_desc.dtype, [S, 16, BK], b2_desc.layout)
    c0_bufs = gl.allocate_shared_memory(c0_desc.dtype, [2, 64, 64], c0_desc.layout)
    c1_bufs = gl.allocate_shared_memory(c1_desc.dtype, [2, 64, 32], c1_desc.layout)
    c2_bufs = gl.allocate_shared_memory(c2_desc.dtype, [2, 64, 16], c2_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(S):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    gl.warp_specialize(
        [(_consumer, (c0_desc, c1_desc, c2_desc, a_bufs, b0_bufs, b1_bufs, b2_bufs, c0_bufs, c1_bufs, c2_bufs, ready, empty,
                      M, N, K, 0, GROUP_M, NUM_PROGRAMS)),
         (_consumer, (c0_desc, c1_desc, c2_desc, a_bufs, b0_bufs, b1_bufs, b2_bufs, c0_bufs, c1_bufs, c2_bufs, ready, empty,
                      M, N, K, 1, GROUP_M, NUM_PROGRAMS)),
         (_loader, (a_desc, b0_desc, b1_desc, b2_desc, a_bufs, b0_bufs, b1_bufs, b2_bufs, ready, empty, M, N, K, GROUP_M,
                    NUM_PROGRAMS))],
        [4, 1], [REGS, 40])


BK = 64
STAGES = 6  # 30 KB a stage (A 2 x 64 x 64, B 112 x 64) + 28 KB of C staging


def layout(cols):
    return gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * cols), element_bitwidth=16, rank=2)


def compile_only():
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    ab = layout(BK)
    sig = {"a_desc": f"tensordesc<bf16[64,{BK}],{ab!r}>", "b0_desc": f"tensordesc<bf16[64,{BK}],{ab!r}>",
           "b1_desc": f"tensordesc<bf16[32,{BK}],{ab!r}>", "b2_desc": f"tensordesc<bf16[16,{BK}],{ab!r}>",
           "c0_desc": f"tensordesc<bf16[64,64],{layout(64)!r}>", "c1_desc": f"tensordesc<bf16[64,32],{layout(32)!r}>",
           "c2_desc": f"tensordesc<bf16[64,16],{layout(16)!r}>", "M": "i32", "N": "i32", "K": "i32", "S": "constexpr",
           "GROUP_M": "constexpr", "NUM_PROGRAMS": "constexpr", "REGS": "constexpr", "num_warps": "constexpr"}
    for stages in (5, 6):
        src = GluonASTSource(n112_gemm_kernel, sig, constexprs={"S": stages, "GROUP_M": 8, "NUM_PROGRAMS": 132,
                                                                "REGS": regs(CONS), "num_warps": 4})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        ptx = k.asm["ptx"]
        print(f"128x112x{BK} s{stages}: shared {k.metadata.shared}, wgmma {sum('wgmma.mma_async' in l for l in ptx.splitlines())}"
              f" ({', '.join(sorted({l.split()[0] for l in ptx.splitlines() if 'wgmma.mma_async' in l}))})", flush=True)


def run(shapes, rounds=7):
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    for m, n, k, x, w, ref, sms in shape_inputs(shapes):
        calls = {"cublas": lambda: torch.mm(x, w.t())}
        # the same structure at 128x128 (benchmarks/consumer_row_tiles.py), 5 stages
        y128 = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        a_l, b_l, c_l = square_layouts(64)
        d128 = (TensorDescriptor.from_tensor(x, [64, 64], a_l), TensorDescriptor.from_tensor(w, [128, 64], b_l),
                TensorDescriptor.from_tensor(y128, [64, 128], c_l))
        p128 = min(sms, triton.cdiv(m, 128) * triton.cdiv(n, 128))
        calls["128x128"] = lambda: rows_gemm_kernel[(p128,)](*d128, m, n, k, CONS=2, S=5, GROUP_M=8, NUM_PROGRAMS=p128,
                                                             REGS=regs(2), num_warps=4)
        y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        ab = layout(BK)
        d112 = (TensorDescriptor.from_tensor(x, [64, BK], ab), TensorDescriptor.from_tensor(w, [64, BK], ab),
                TensorDescriptor.from_tensor(w, [32, BK], ab), TensorDescriptor.from_tensor(w, [16, BK], ab),
                TensorDescriptor.from_tensor(y, [64, 64], layout(64)), TensorDescriptor.from_tensor(y, [64, 32], layout(32)),
                TensorDescriptor.from_tensor(y, [64, 16], layout(16)))
        tiles = triton.cdiv(m, 128) * triton.cdiv(n, BN)
        p112 = min(sms, tiles)
        calls["128x112"] = lambda: n112_gemm_kernel[(p112,)](*d112, m, n, k, S=STAGES, GROUP_M=8, NUM_PROGRAMS=p112,
                                                             REGS=regs(2), num_warps=4)
        # plain Triton: the fused kernels' twin at 128x128 and the same loop at 128x112 (tiles_112_columns_triton.py)
        from gemm_efficiency import plain_matmul
        from tiles_112_columns_triton import n112_matmul

        from fluxtp.configs import AllGatherMatmulConfig
        y_t128 = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        y_t112 = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        calls["triton_128x128"] = plain_matmul(x, w, AllGatherMatmulConfig(block_n=128, num_warps=4, num_stages=5), out=y_t128)
        calls["triton_128x112"] = n112_matmul(x, w, stages=4, warps=4, out=y_t112)
        for name, out in (("128x128", y128), ("128x112", y), ("triton_128x128", y_t128), ("triton_128x112", y_t112)):
            calls[name]()
            torch.cuda.synchronize()
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            print(f"{m}x{n}x{k} {name}: max rel err {err:.2e}", flush=True)
            assert err < 2e-2, name
        print(f"{m}x{n}x{k}: tiles 128x128 {triton.cdiv(m, 128) * triton.cdiv(n, 128) / sms:.2f} waves, "
              f"128x112 {tiles / sms:.2f} waves", flush=True)
        print_times(f"{m}x{n}x{k}", calls, rounds)


# N a multiple of 112: llama3-8b all-gathers at TP 8 (14336/8 = 1792) and 4 (3584), llama3-70b at TP 8
# (28672/8 = 3584) and 4 (7168); a ragged N (1800) and a large M as controls
SHAPES = [(1024, 1792, 4096), (2048, 1792, 4096), (4096, 1792, 4096), (1024, 3584, 4096), (2048, 3584, 4096),
          (1024, 3584, 8192), (2048, 3584, 8192), (1024, 7168, 8192), (1000, 1800, 4096), (16384, 3584, 8192)]

if __name__ == "__main__":
    if "--compile-only" in sys.argv:
        compile_only()
    else:
        run(SHAPES)
