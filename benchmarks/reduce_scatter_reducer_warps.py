"""Can a warp of every GEMM program reduce the reduce-scatter's partials beside the MMAs? One GPU, bf16.

    python benchmarks/reduce_scatter_reducer_warps.py [--models llama3-8b,llama3-70b] [--worlds 4,8]
        [--tokens 2048,16384] [--rounds 6] [--out FILE.json]

The fused kernel's owner reads W-1 partials after its own tiles' K loops, while its SM computes
nothing; spread over every SM and the whole kernel the same bytes are 1.5-3 GB/s per SM, far
below what one SM can take in. Here the warp-specialized GEMM (a loader warp, two consumer
warpgroups on a 128x256 tile's halves, TMA stores of every partial slot [M, N]) gets a reducer
warp that sums the owner's rows as it goes: its own slot plus W-1 peer slots (random
bf16), float32 in a fixed order, rounded once into out [m, N]. Per reduce-scatter case of the grid
(rank 0's GEMM-only work, CUDA graph replays interleaved, time over cuBLAS's):
- `fused`: the shipped kernel's GEMM-only mode; `plain`: its tiling in Triton without the fusion;
- `ws`: the warp-specialized GEMM with the reducer warp idle (the same registers);
- `ws_reduce`: the same with the reducer summing its share of the owner's rows.
No flags, no waits, no tile order: this bounds whether the reads hide beside the MMAs, not a
kernel to ship (the reducer reads the own slot as the consumers write it; the check runs a
second call). Each output is checked first.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma

from fluxtp.backends.fused._launch import DescriptorLayout, num_sms
from fluxtp.bench.gemm_grid import case_inputs, launched_config, relative_error
from fluxtp.bench.harness import graphed
from fluxtp.kernels import COMPILE_OPTIONS
from fluxtp.kernels._pingpong import accumulate_plain, allocate_pingpong, grouped_tile, load_tile, tma_store

sys.path.insert(0, str(Path(__file__).parent))
from _kernel_variants import case_parser, cases_of, checked_triton_reduce_scatter, report, time_case  # noqa: E402

REDUCE_COLUMNS = gl.constexpr(512)  # a reducer unit: one row of 512 columns, 32 bytes a lane of its one warp


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    loaded = 0
    for tile in range(gl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS):
        pid_m, pid_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
        loaded = load_tile(a_desc, pid_m * BLOCK_M, b_desc, pid_n * BLOCK_N, a_bufs, b_bufs, ready, empty, loaded, K)


@gluon.jit
def _consumer(c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, C: gl.constexpr, GROUP_M: gl.constexpr,
              NUM_PROGRAMS: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    HALF: gl.constexpr = BLOCK_M // 2
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    used = 0
    c_smem = c_bufs.index(C)
    for tile in range(gl.program_id(0), tiles_m * tiles_n, NUM_PROGRAMS):
        pid_m, pid_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
        acc, used = accumulate_plain(a_bufs, b_bufs, ready, empty, used, K, C, layout)
        tma.store_wait(pendings=0)  # the previous tile's store has read c_smem
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma_store(c_desc, [pid_m * BLOCK_M + C * HALF, pid_n * BLOCK_N], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _reducer(own_ptr, peers_ptr, out_ptr, m, N, WORLD: gl.constexpr, NUM_PROGRAMS: gl.constexpr, REDUCE: gl.constexpr):
    if REDUCE:
        layout: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [1, 1], [1, 0])
        units_n = gl.cdiv(N, REDUCE_COLUMNS)
        for unit in range(gl.program_id(0), m * units_n, NUM_PROGRAMS):
            rows = unit // units_n + gl.arange(0, 1, layout=gl.SliceLayout(1, layout))
            cols = (unit % units_n) * REDUCE_COLUMNS + gl.arange(0, REDUCE_COLUMNS, layout=gl.SliceLayout(0, layout))
            mask = gl.expand_dims(rows < m, 1) & gl.expand_dims(cols < N, 0)
            offs = gl.expand_dims(rows.to(gl.int64), 1) * N + gl.expand_dims(cols, 0)
            acc = gl.load(own_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg").to(gl.float32)
            for i in gl.static_range(WORLD - 1):
                acc += gl.load(peers_ptr + i * m * N + offs, mask=mask, other=0.0, cache_modifier=".cg").to(gl.float32)
            gl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def gemm_with_reducer_kernel(a_desc, b_desc, c_desc, own_ptr, peers_ptr, out_ptr, M, N, K, m, WORLD: gl.constexpr,
                             GROUP_M: gl.constexpr, NUM_PROGRAMS: gl.constexpr, NUM_STAGES: gl.constexpr,
                             REDUCE: gl.constexpr, CONSUMER_REGS: gl.constexpr, REDUCER_REGS: gl.constexpr,
                             num_warps: gl.constexpr):  # fmt: skip
    a_bufs, b_bufs, c_bufs, ready, empty = allocate_pingpong(a_desc, b_desc, c_desc, NUM_STAGES)
    # Partition arguments are spelled out in each tuple: constexprs keep their kind only so (Triton 3.6).
    gl.warp_specialize(
        [
            (_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, 0, GROUP_M, NUM_PROGRAMS)),
            (_consumer, (c_desc, a_bufs, b_bufs, c_bufs, ready, empty, M, N, K, 1, GROUP_M, NUM_PROGRAMS)),
            (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, N, K, GROUP_M, NUM_PROGRAMS)),
            (_reducer, (own_ptr, peers_ptr, out_ptr, m, N, WORLD, NUM_PROGRAMS, REDUCE)),
        ],
        [4, 1, 1],
        [CONSUMER_REGS, 40, REDUCER_REGS],
    )  # fmt: skip


def gemm_with_reducer(x, weight, peers, world: int, reduce: bool, stages: int = 3, group_m: int = 8,
                      consumer_regs: int = 232, reducer_regs: int = 96, maxnreg: int = 168):  # fmt: skip
    """run() -> (slots [M, N], out [m, N]): rank 0's GEMM-only work, 128x256x64 tiles."""
    m_total, k = x.shape
    n = weight.shape[0]
    m = m_total // world
    slots = torch.empty(m_total, n, dtype=x.dtype, device=x.device)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    descs = [DescriptorLayout(t, block, gluon=True).over(t) for t, block in
             ((x, [128, 64]), (weight, [256, 64]), (slots, [64, 256]))]  # fmt: skip
    programs = min(num_sms(x.device), (m_total // 128) * (n // 256))

    def run():
        gemm_with_reducer_kernel[(programs,)](*descs, slots, peers, out, m_total, n, k, m, world, group_m, programs,
                                              stages, reduce, consumer_regs, reducer_regs, num_warps=4,
                                              maxnreg=maxnreg, **COMPILE_OPTIONS)  # fmt: skip
        return slots, out

    return run


def main() -> None:
    parser = case_parser(__doc__, "llama3-8b,llama3-70b", "4,8", "2048,16384", {})
    parser.set_defaults(rounds=6, variants="")
    args = parser.parse_args()
    rows = []
    for case in cases_of(args, "matmul_reduce_scatter"):
        x, w = case_inputs(case, "cuda")
        fused, full = checked_triton_reduce_scatter(case, x, w)
        m = case.M // case.world
        peers = torch.randn(case.world - 1, m, full.shape[1], dtype=x.dtype, device=x.device)
        runs = {"fused": graphed(fused)}
        for name, reduce in (("ws", False), ("ws_reduce", True)):
            run = gemm_with_reducer(x, w, peers, case.world, reduce)
            run()
            slots, out = run()  # the second call: the reducer's own slot holds the first call's partial
            torch.cuda.synchronize()
            errors = [relative_error(slots, full.float())]
            if reduce:
                errors.append(relative_error(out, slots[:m].float() + peers.float().sum(0)))
            if not max(errors) < 1e-2:
                raise AssertionError(f"{case.label()}: {name} computes a wrong result (relative errors {errors})")
            runs[name] = graphed(run)
        config = launched_config(case, x, w)
        rows.append(time_case(case, runs, x, w, config, args.rounds, transport=config.transport))
        del runs
        torch.cuda.empty_cache()
    report("reduce_scatter_reducer_warps", rows, ["fused", "ws", "ws_reduce", "plain"], "transport", args.out)


if __name__ == "__main__":
    main()
