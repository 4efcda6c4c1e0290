"""FP8 precise accumulation on Hopper: where the promotion's cost goes, on one GPU.

    python benchmarks/fp8_promotion.py [--rounds 7] [--out FILE.json]

torch._scaled_mm without use_fast_accum keeps a float32 accumulator beside the tensor cores'
reduced-precision one and adds ("promotes") a K interval's products into it. Per all-gather case
(llama3-8b / llama3-70b MLP up, TP 2 and 8, 2048 and 8192 tokens: the per-rank GEMM on the gathered
rows, row-wise scales, bf16 out), times over torch._scaled_mm's (precise), CUDA graph replays
interleaved (fluxtp.bench.harness), relative error against float64 on the dequantized inputs:
- `triton`: the fused all-gather's GEMM-only mode with the Triton kernel (max_num_imprecise_acc=BLOCK_K:
  every 256), the one precise calls took before the warp-specialized kernel;
- `one_late_128` / `one_256`: one Gluon partition, 8 warps, promoting every 128 (one K block late:
  the next block's wgmma is issued before the previous one is waited for) / every 256;
- `pingpong_128` / `pingpong_256`: warp-specialized Gluon, a loader warp and two consumer
  warpgroups, each computing half of a 128x128 tile's rows and promoting every two K blocks,
  consumer 1 one block after consumer 0 (so one issues MMAs while the other waits);
- `one_fast`, `cublas_fast`: fast accumulation (no promotion), for scale.
The Gluon kernels here are measurements, not product code: no fused communication.
"""

from __future__ import annotations

import argparse

import torch
import triton
from tabulate import tabulate
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fluxtp._dist import GroupInfo
from fluxtp.backends.fused._launch import DescriptorLayout
from fluxtp.backends.fused._scaled import PINGPONG_WARPS
from fluxtp.bench.gemm_grid import GemmCase, fp8_case_inputs, gathered, gemm_only_case
from fluxtp.bench.harness import Protocol, Variant, graphed, measure_rounds
from fluxtp.bench.results import command_line, envelope, write_json
from fluxtp.configs import AllGatherMatmulConfig
from fluxtp.kernels import COMPILE_OPTIONS
from fluxtp.kernels._pingpong import allocate_pingpong, tma_load, tma_store


@gluon.jit
def _tile_origin(tile, tiles_m, tiles_n, GROUP_M, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    in_group = GROUP_M * tiles_n
    first_m = (tile // in_group) * GROUP_M
    rows = gl.minimum(tiles_m - first_m, GROUP_M)
    return (first_m + (tile % in_group) % rows) * BLOCK_M, ((tile % in_group) // rows) * BLOCK_N


@gluon.jit
def _load_stage(a_desc, b_desc, a_bufs, b_bufs, bars, stage, off_m, off_n, k):
    mbarrier.expect(bars.index(stage), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma_load(a_desc, [off_m, k], bars.index(stage), a_bufs.index(stage))
    tma_load(b_desc, [off_n, k], bars.index(stage), b_bufs.index(stage))


@gluon.jit
def _scaled_store(acc, c_desc, c_smem, scale_a_ptr, scale_b_ptr, off_m, off_n, M, N, layout: gl.constexpr):
    rows = off_m + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    cols = off_n + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    scale_a = gl.load(scale_a_ptr + rows, mask=rows < M, other=0.0)
    scale_b = gl.load(scale_b_ptr + cols, mask=cols < N, other=0.0)
    out = acc * gl.expand_dims(scale_a, 1) * gl.expand_dims(scale_b, 0)
    tma.store_wait(pendings=0)  # the previous tile's store has read c_smem
    c_smem.store(out.to(c_desc.dtype))
    fence_async_shared()
    tma_store(c_desc, [off_m, off_n], c_smem)


@gluon.jit
def one_partition_kernel(a_desc, b_desc, c_desc, scale_a_ptr, scale_b_ptr, M, N, K, NUM_PROGRAMS: gl.constexpr,
                         NUM_STAGES: gl.constexpr, PRECISE: gl.constexpr, WARPS_M: gl.constexpr, WARPS_N: gl.constexpr,
                         INSTR_N: gl.constexpr, num_warps: gl.constexpr):
    """Persistent, software-pipelined; PRECISE: each K block into a fresh accumulator, added to the
    float32 one after the next block's wgmma is issued."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS_M, WARPS_N],
                                                     instr_shape=[16, INSTR_N, 32])
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(bars.index(i), count=1)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [BLOCK_M, BLOCK_N], c_desc.layout)
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)
    zero = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
    loaded = 0
    used = 0
    for tile in range(gl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS):
        off_m, off_n = _tile_origin(tile, tiles_m, tiles_n, 8, BLOCK_M, BLOCK_N)
        for i in gl.static_range(NUM_STAGES - 1):
            if i < k_tiles:
                _load_stage(a_desc, b_desc, a_bufs, b_bufs, bars, loaded % NUM_STAGES, off_m, off_n, i * BLOCK_K)
                loaded += 1
        acc = zero
        if PRECISE:
            s = used % NUM_STAGES
            mbarrier.wait(bars.index(s), (used // NUM_STAGES) & 1)
            pending = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
            pending = warpgroup_mma_wait(num_outstanding=1, deps=(pending,))  # still in flight: retired by the next wait
            used += 1
            for ki in range(1, k_tiles):
                if ki + NUM_STAGES - 2 < k_tiles:  # into the stage of block ki - 2, retired last iteration
                    _load_stage(a_desc, b_desc, a_bufs, b_bufs, bars, loaded % NUM_STAGES, off_m, off_n,
                                (ki + NUM_STAGES - 2) * BLOCK_K)
                    loaded += 1
                s = used % NUM_STAGES
                mbarrier.wait(bars.index(s), (used // NUM_STAGES) & 1)
                block = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), zero, use_acc=False,
                                      is_async=True)
                acc = acc + warpgroup_mma_wait(num_outstanding=1, deps=(pending,))
                pending = warpgroup_mma_wait(num_outstanding=1, deps=(block,))
                used += 1
            acc = acc + warpgroup_mma_wait(num_outstanding=0, deps=(pending,))
        else:
            for ki in range(k_tiles):
                s = used % NUM_STAGES
                mbarrier.wait(bars.index(s), (used // NUM_STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                used += 1
                if ki + NUM_STAGES - 1 < k_tiles:
                    _load_stage(a_desc, b_desc, a_bufs, b_bufs, bars, loaded % NUM_STAGES, off_m, off_n,
                                (ki + NUM_STAGES - 1) * BLOCK_K)
                    loaded += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _scaled_store(acc, c_desc, c_smem, scale_a_ptr, scale_b_ptr, off_m, off_n, M, N, layout)
    tma.store_wait(pendings=0)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _pingpong_loader(a_desc, b_desc, c_desc, scale_a_ptr, scale_b_ptr, M, N, K, a_bufs, b_bufs, c_bufs, ready, empty,
                     NUM_PROGRAMS):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    S: gl.constexpr = a_bufs.type.shape[0]
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    loaded = 0
    for tile in range(gl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS):
        off_m, off_n = _tile_origin(tile, tiles_m, tiles_n, 8, BLOCK_M, BLOCK_N)
        for ki in range(gl.cdiv(K, BLOCK_K)):
            s = loaded % S
            mbarrier.wait(empty.index(s), ((loaded // S) & 1) ^ 1)  # both consumers released it
            _load_stage(a_desc, b_desc, a_bufs, b_bufs, ready, s, off_m, off_n, ki * BLOCK_K)
            loaded += 1


@gluon.jit
def _pingpong_blocks(a_bufs, b_bufs, ready, empty, used, acc_in, BLOCKS: gl.constexpr, C: gl.constexpr,
                     HALF: gl.constexpr):
    """BLOCKS K blocks of consumer C's rows into a fresh imprecise accumulator, returned once they
    retired (their stages released to the loader)."""
    S: gl.constexpr = a_bufs.type.shape[0]
    part = acc_in
    for i in gl.static_range(BLOCKS):
        s = (used + i) % S
        mbarrier.wait(ready.index(s), ((used + i) // S) & 1)
        part = warpgroup_mma(a_bufs.index(s).slice(C * HALF, HALF), b_bufs.index(s).permute((1, 0)), part,
                             use_acc=i > 0, is_async=True)
    part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
    for i in gl.static_range(BLOCKS):
        mbarrier.arrive(empty.index((used + i) % S), count=1)
    return part


@gluon.jit
def _pingpong_consumer(a_desc, b_desc, c_desc, scale_a_ptr, scale_b_ptr, M, N, K, a_bufs, b_bufs, c_bufs, ready, empty,
                       NUM_PROGRAMS, C: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    HALF: gl.constexpr = BLOCK_M // 2
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32])
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    k_tiles = gl.cdiv(K, BLOCK_K)  # even (the launcher checks)
    used = 0
    for tile in range(gl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS):
        off_m, off_n = _tile_origin(tile, tiles_m, tiles_n, 8, BLOCK_M, BLOCK_N)
        acc = gl.zeros((HALF, BLOCK_N), dtype=gl.float32, layout=layout)
        part = gl.zeros((HALF, BLOCK_N), dtype=gl.float32, layout=layout)
        if C == 1:  # promotes after blocks 0, 2, 4, ...: one block after consumer 0
            part = _pingpong_blocks(a_bufs, b_bufs, ready, empty, used, part, 1, C, HALF)
            acc = acc + part
            used += 1
            for _ in range((k_tiles - 2) // 2):
                part = _pingpong_blocks(a_bufs, b_bufs, ready, empty, used, part, 2, C, HALF)
                acc = acc + part
                used += 2
            part = _pingpong_blocks(a_bufs, b_bufs, ready, empty, used, part, 1, C, HALF)
            acc = acc + part
            used += 1
        else:
            for _ in range(k_tiles // 2):
                part = _pingpong_blocks(a_bufs, b_bufs, ready, empty, used, part, 2, C, HALF)
                acc = acc + part
                used += 2
        _scaled_store(acc, c_desc, c_bufs.index(C), scale_a_ptr, scale_b_ptr, off_m + C * HALF, off_n, M, N, layout)
    tma.store_wait(pendings=0)


@gluon.jit
def _pingpong_consumer0(a_desc, b_desc, c_desc, scale_a_ptr, scale_b_ptr, M, N, K, a_bufs, b_bufs, c_bufs, ready,
                        empty, NUM_PROGRAMS):
    _pingpong_consumer(a_desc, b_desc, c_desc, scale_a_ptr, scale_b_ptr, M, N, K, a_bufs, b_bufs, c_bufs, ready, empty,
                       NUM_PROGRAMS, 0)


@gluon.jit
def _pingpong_consumer1(a_desc, b_desc, c_desc, scale_a_ptr, scale_b_ptr, M, N, K, a_bufs, b_bufs, c_bufs, ready,
                        empty, NUM_PROGRAMS):
    _pingpong_consumer(a_desc, b_desc, c_desc, scale_a_ptr, scale_b_ptr, M, N, K, a_bufs, b_bufs, c_bufs, ready, empty,
                       NUM_PROGRAMS, 1)


@gluon.jit
def pingpong_kernel(a_desc, b_desc, c_desc, scale_a_ptr, scale_b_ptr, M, N, K, NUM_PROGRAMS: gl.constexpr,
                    NUM_STAGES: gl.constexpr, num_warps: gl.constexpr):
    a_bufs, b_bufs, c_bufs, ready, empty = allocate_pingpong(a_desc, b_desc, c_desc, NUM_STAGES)
    args = (a_desc, b_desc, c_desc, scale_a_ptr, scale_b_ptr, M, N, K, a_bufs, b_bufs, c_bufs, ready, empty,
            NUM_PROGRAMS)
    gl.warp_specialize([(_pingpong_consumer0, args), (_pingpong_consumer1, args), (_pingpong_loader, args)],
                       [4, 1], [232, 40])


def _sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def timed_row(case: str, runs: dict, rounds: int, device, **fields) -> dict:
    """`runs` (name -> callable, "cublas" among them) as CUDA graph replays interleaved; the case's
    row (with `fields`), times over cuBLAS's (medians)."""
    variants = [Variant(name, (graphed(run),)) for name, run in runs.items()]
    ms = measure_rounds(variants, Protocol(rounds=rounds, warmup_rounds=1, calls_per_sample=5), GroupInfo(None, 0, 1),
                        device).ms  # fmt: skip
    row = {"case": case, **fields, "ms": {v: round(t, 5) for v, t in ms.items()},
           "vs_cublas": {v: round(ms[v] / ms["cublas"], 3) for v in runs}}  # fmt: skip
    print(row["case"], row["vs_cublas"], flush=True)
    return row


def report(scenario: str, rows: list[dict], out: str | None) -> None:
    """The table of every row's times over cuBLAS's, and the JSON (one GPU)."""
    names = list(rows[0]["vs_cublas"])
    print(tabulate([[r["case"], *(r["vs_cublas"][v] for v in names)] for r in rows], headers=["time / cuBLAS", *names]))
    if out:
        data = envelope(scenario, rows, device=torch.cuda.get_device_name(), gpus=1, world=1, command=command_line())
        print("wrote", write_json(data, out))


def _descriptors(a, b, c, block_a, block_b, block_c):
    """Gluon descriptors of a, b and c (the fused launchers' own: default NVMMA layouts)."""
    return tuple(DescriptorLayout(t, block, gluon=True).over(t) for t, block in ((a, block_a), (b, block_b), (c, block_c)))


def one_partition(a, b, scale_a, scale_b, block_m, block_n, block_k, stages, precise, warps=8):
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    descs = _descriptors(a, b, c, [block_m, block_k], [block_n, block_k], [block_m, block_n])
    programs = min(triton.cdiv(m, block_m) * triton.cdiv(n, block_n), _sms(a.device))
    warps_m = min(warps, block_m // 16)
    layout = (warps_m, warps // warps_m, block_n // (warps // warps_m))

    def run():
        one_partition_kernel[(programs,)](*descs, scale_a, scale_b, m, n, k, programs, stages, precise, *layout,
                                          num_warps=warps, **COMPILE_OPTIONS)
        return c

    return run


def pingpong(a, b, scale_a, scale_b, block_k, stages):
    m, k = a.shape
    n = b.shape[0]
    if (k // block_k) % 2 or k % block_k:
        raise ValueError(f"pingpong: K={k} must be an even number of {block_k}-wide blocks")
    c = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    descs = _descriptors(a, b, c, [128, block_k], [128, block_k], [64, 128])
    programs = min(triton.cdiv(m, 128) * triton.cdiv(n, 128), _sms(a.device))

    def run():
        pingpong_kernel[(programs,)](*descs, scale_a, scale_b, m, n, k, programs, stages, **PINGPONG_WARPS,
                                     **COMPILE_OPTIONS)
        return c

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    cases = [GemmCase("all_gather_matmul", m, n, k, w, "float8_e4m3fn", model=model)
             for model, (k, n) in (("llama3-8b", (4096, 14336)), ("llama3-70b", (8192, 28672)))
             for w in (2, 8) for m in (2048, 8192)]
    rows = []
    for case in cases:
        x, w, scale_x, scale_w = fp8_case_inputs(case, device)
        a = gathered(case, x).contiguous()
        scale_a = scale_x.repeat(case.world, 1)
        sa, sb = scale_a.reshape(-1).contiguous(), scale_w.reshape(-1).contiguous()
        want = (a.double() * scale_a.double()) @ (w.double() * scale_w.double().view(-1, 1)).T
        # The Triton kernel's precise tiling, not the warp-specialized kernel the op now takes here.
        triton_config = AllGatherMatmulConfig.heuristic_fp8(case.M // case.world, w.shape[0], w.shape[1], case.world, True)
        runs = {
            "cublas": lambda: torch._scaled_mm(a, w.T, scale_a, scale_w, out_dtype=torch.bfloat16),
            "cublas_fast": lambda: torch._scaled_mm(a, w.T, scale_a, scale_w, out_dtype=torch.bfloat16, use_fast_accum=True),
            "triton": gemm_only_case(case, x, w, triton_config, (scale_x, scale_w)),
            "one_late_128": one_partition(a, w, sa, sb, 128, 128, 128, 4, True),
            "one_256": one_partition(a, w, sa, sb, 128, 128, 256, 3, True),
            "pingpong_128": pingpong(a, w, sa, sb, 64, 6),
            "pingpong_256": pingpong(a, w, sa, sb, 128, 4),
            "one_fast": one_partition(a, w, sa, sb, 128, 256, 128, 3, False),
        }
        error = {}
        for name, run in runs.items():
            got = run().double()
            error[name] = float(f"{((got - want).norm() / want.norm()).item():.3g}")
        m, n, k = case.gemm_shape
        rows.append(timed_row(f"{case.model} TP{case.world} M{case.M}", runs, args.rounds, device, m=m, n=n, k=k,
                              relative_error=error))  # fmt: skip
    report("fp8_promotion", rows, args.out)
    print("relative error:", rows[-1]["relative_error"])


if __name__ == "__main__":
    main()
