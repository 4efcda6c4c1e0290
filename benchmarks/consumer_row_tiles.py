"""Probe (not product): tiles of 64 x CONS rows on a persistent warp-specialized Gluon GEMM, one
consumer warpgroup per 64 rows, A staged as CONS boxes of 64 rows. Gluon tensors must have
power-of-two shapes, so 192- and 320-row tiles (cuBLAS's 192x128, 320x128 at the wave-quantized
grid shapes) exist only this way. C = A @ B^T in bf16 against cuBLAS, checked against float32.

    python benchmarks/consumer_row_tiles.py            # on the device (Triton 3.6 API names via fluxtp)
    python benchmarks/consumer_row_tiles.py --compile-only  # offline for sm_90 (Triton 3.8+: GluonASTSource)
"""

import sys

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from fluxtp.kernels._pingpong import grouped_tile, tma_load, tma_store

ROWS = 64  # rows a consumer warpgroup computes


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, CONS: gl.constexpr, GROUP_M: gl.constexpr,
            NUM_PROGRAMS: gl.constexpr):
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    S: gl.constexpr = b_bufs.type.shape[0]
    nbytes: gl.constexpr = CONS * a_desc.block_type.nbytes + b_desc.block_type.nbytes
    tiles_m = gl.cdiv(M, 64 * CONS)
    tiles_n = gl.cdiv(N, BN)
    loaded = 0
    for tile in range(gl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS):
        pid_m, pid_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
        for ki in range(gl.cdiv(K, BK)):
            s = loaded % S
            mbarrier.wait(empty.index(s), ((loaded // S) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            for c in gl.static_range(CONS):
                tma_load(a_desc, [pid_m * (64 * CONS) + 64 * c, ki * BK], ready.index(s), a_bufs.index(s * CONS + c))
            tma_load(b_desc, [pid_n * BN, ki * BK], ready.index(s), b_bufs.index(s))
            loaded += 1


@gluon.jit
def _consumer(c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, C: gl.constexpr, CONS: gl.constexpr,
              GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr):
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = b_bufs.type.shape[1]
    S: gl.constexpr = b_bufs.type.shape[0]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    tiles_m = gl.cdiv(M, 64 * CONS)
    tiles_n = gl.cdiv(N, BN)
    k_tiles = gl.cdiv(K, BK)
    used = 0
    c_smem = c_bufs.index(C)
    for tile in range(gl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS):
        pid_m, pid_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
        acc = gl.zeros((64, BN), dtype=gl.float32, layout=layout)
        previous = 0
        for ki in range(k_tiles):
            s = used % S
            mbarrier.wait(ready.index(s), (used // S) & 1)
            acc = warpgroup_mma(a_bufs.index(s * CONS + C), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index(previous), count=1, pred=ki > 0)
            previous = s
            used += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(previous), count=1, pred=k_tiles > 0)
        tma.store_wait(pendings=0)
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma_store(c_desc, [pid_m * (64 * CONS) + 64 * C, pid_n * BN], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def rows_gemm_kernel(a_desc, b_desc, c_desc, M, N, K, CONS: gl.constexpr, S: gl.constexpr, GROUP_M: gl.constexpr,
                     NUM_PROGRAMS: gl.constexpr, REGS: gl.constexpr, num_warps: gl.constexpr):
    BK: gl.constexpr = a_desc.block_type.shape[1]
    BN: gl.constexpr = b_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [S * CONS, 64, BK], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [S, BN, BK], b_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [CONS, 64, BN], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(S):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONS)
    if CONS == 2:
        gl.warp_specialize(
            [(_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, 0, CONS, GROUP_M, NUM_PROGRAMS)),
             (_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, 1, CONS, GROUP_M, NUM_PROGRAMS)),
             (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, CONS, GROUP_M, NUM_PROGRAMS))],
            [4, 1], [REGS, 40])
    elif CONS == 3:
        gl.warp_specialize(
            [(_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, 0, CONS, GROUP_M, NUM_PROGRAMS)),
             (_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, 1, CONS, GROUP_M, NUM_PROGRAMS)),
             (_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, 2, CONS, GROUP_M, NUM_PROGRAMS)),
             (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, CONS, GROUP_M, NUM_PROGRAMS))],
            [4, 4, 1], [REGS, REGS, 40])
    elif CONS == 4:
        gl.warp_specialize(
            [(_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, 0, CONS, GROUP_M, NUM_PROGRAMS)),
             (_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, 1, CONS, GROUP_M, NUM_PROGRAMS)),
             (_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, 2, CONS, GROUP_M, NUM_PROGRAMS)),
             (_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, 3, CONS, GROUP_M, NUM_PROGRAMS)),
             (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, CONS, GROUP_M, NUM_PROGRAMS))],
            [4, 4, 4, 1], [REGS, REGS, REGS, 40])
    else:
        gl.warp_specialize(
            [(_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, 0, CONS, GROUP_M, NUM_PROGRAMS)),
             (_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, 1, CONS, GROUP_M, NUM_PROGRAMS)),
             (_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, 2, CONS, GROUP_M, NUM_PROGRAMS)),
             (_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, 3, CONS, GROUP_M, NUM_PROGRAMS)),
             (_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, 4, CONS, GROUP_M, NUM_PROGRAMS)),
             (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, CONS, GROUP_M, NUM_PROGRAMS))],
            [4, 4, 4, 4, 1], [REGS, REGS, REGS, REGS, 40])


# (consumers, BN, BK, stages): a tile of 64*consumers x BN rows and columns. 192x256 (3 consumers)
# and 320x128 (5) fail ptxas offline: the default partition gets too few registers for its wgmma.
CONFIGS = [(2, 256, 64, 3), (2, 128, 64, 5), (3, 128, 64, 4), (4, 128, 64, 3)]
SMEM = 227 * 1024


def smem(cons, bn, bk, stages):
    return stages * (cons * 64 * bk + bn * bk) * 2 + cons * 64 * bn * 2 + 2 * stages * 8


def regs(cons):
    """Registers per thread of each consumer worker: the register file less the loader's 40, over
    the consumers' threads, in multiples of 8 (setmaxnreg), at most 232."""
    return min(232, (65536 - 32 * 40) // (128 * cons) // 8 * 8)


def layouts(bk):
    """A's and B's stages (swizzled as wide as a row of BK), C's staging."""
    ab = gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * bk), element_bitwidth=16, rank=2)
    return ab, ab, gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


def compile_only():
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    for cons, bn, bk, stages in CONFIGS:
        a, b, c = layouts(bk)
        sig = {"a_desc": f"tensordesc<bf16[64,{bk}],{a!r}>", "b_desc": f"tensordesc<bf16[{bn},{bk}],{b!r}>",
               "c_desc": f"tensordesc<bf16[64,{bn}],{c!r}>", "M": "i32", "N": "i32", "K": "i32", "CONS": "constexpr",
               "S": "constexpr", "GROUP_M": "constexpr", "NUM_PROGRAMS": "constexpr", "REGS": "constexpr",
               "num_warps": "constexpr"}
        src = GluonASTSource(rows_gemm_kernel, sig, constexprs={"CONS": cons, "S": stages, "GROUP_M": 8, "NUM_PROGRAMS": 132,
                                                                 "REGS": regs(cons), "num_warps": 4})
        name = f"{64 * cons}x{bn}x{bk} s{stages} consumers {cons} regs {regs(cons)}"
        try:
            k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        except Exception as e:  # noqa: BLE001 -- a probe: report and go on
            print(f"{name}: FAILED {[l for l in str(e).splitlines() if 'fatal' in l or 'rror' in l][:1]}", flush=True)
            continue
        print(f"{name}: shared {k.metadata.shared} (estimate {smem(cons, bn, bk, stages)}, limit {SMEM}), "
              f"{sum('wgmma.mma_async' in line for line in k.asm['ptx'].splitlines())} wgmma", flush=True)


def print_times(case, calls, rounds):
    """Each call's median time over `rounds` interleaved rounds (a CUDA graph of 10 calls captured
    and replayed twice each round, the second replay timed), printed with its ratio to calls["cublas"]."""
    import statistics

    import torch
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, f in calls.items():
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(10):
                    f()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            g.replay(); start.record(); g.replay(); end.record(); torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end) / 10)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(case, "  ".join(f"{name} {v * 1000:.1f} us ({v / med['cublas']:.3f}x)" for name, v in med.items()), flush=True)


def shape_inputs(shapes):
    """After a line naming the versions and the GPU: per shape (m, n, k), bf16 x [m, k] and
    w [n, k] on the GPU, x @ w^T in float32 and the GPU's SM count (the seed fixed once)."""
    import torch
    torch.manual_seed(0)
    print(f"triton {triton.__version__} torch {torch.__version__} {torch.cuda.get_device_name()}")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m, n, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        yield m, n, k, x, w, x.float() @ w.float().t(), sms


def run(shapes, rounds=7):
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    for m, n, k, x, w, ref, sms in shape_inputs(shapes):
        calls = {"cublas": lambda: torch.mm(x, w.t())}
        for cons, bn, bk, stages in CONFIGS:
            if smem(cons, bn, bk, stages) > SMEM:
                continue
            a_l, b_l, c_l = layouts(bk)
            y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            ad = TensorDescriptor.from_tensor(x, [64, bk], a_l)
            bd = TensorDescriptor.from_tensor(w, [bn, bk], b_l)
            cd = TensorDescriptor.from_tensor(y, [64, bn], c_l)
            tiles = triton.cdiv(m, 64 * cons) * triton.cdiv(n, bn)
            programs = min(sms, tiles)
            f = lambda ad=ad, bd=bd, cd=cd, cons=cons, stages=stages, programs=programs: rows_gemm_kernel[(programs,)](
                ad, bd, cd, m, n, k, CONS=cons, S=stages, GROUP_M=8, NUM_PROGRAMS=programs, REGS=regs(cons), num_warps=4)
            f()
            torch.cuda.synchronize()
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            name = f"{64 * cons}x{bn}"
            print(f"{m}x{n}x{k} {name}: {tiles} tiles ({tiles / sms:.2f} waves), max rel err {err:.2e}", flush=True)
            assert err < 2e-2, name
            calls[name] = f
        print_times(f"{m}x{n}x{k}", calls, rounds)


# per-rank GEMMs of the grid where the kernels' own GEMM missed (perf-log "What cuBLAS runs"): the
# all-gather's [M, N/W] x K and the reduce-scatter's [M, N] x K/W
SHAPES = [(1024, 1792, 4096), (2048, 1792, 4096), (8192, 1792, 4096), (1024, 3584, 4096), (2048, 3584, 4096),
          (1024, 6144, 12288), (2048, 6656, 16384), (1024, 13312, 16384), (16384, 3584, 8192), (1024, 4096, 1792),
          (4096, 4096, 1792), (2048, 8192, 3584)]

if __name__ == "__main__":
    if "--compile-only" in sys.argv:
        compile_only()
    else:
        run(SHAPES)
