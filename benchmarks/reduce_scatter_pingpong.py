"""Does a true ping-pong hide the reduce-scatter owner's W-1 partial reads? One GPU, bf16.

    python benchmarks/reduce_scatter_pingpong.py [--models llama3-8b,llama3-70b] [--worlds 4,8]
        [--tokens 2048,16384] [--rounds 6] [--out FILE.json]

At TP=8 the fused reduce-scatter's GEMM-only mode reads 1.14-1.37x cuBLAS while its plain twin is
level: the owner's tiles read W-1 partials after their K loops, and nothing computes meanwhile
(docs/perf-log.md, "The reduction at TP=8, part by part"). In a ping-pong kernel (a loader warp
and two consumer warpgroups, each computing whole tiles, the two alternating) one consumer's
epilogue runs while the other's MMAs do. Per reduce-scatter case of the grid, rank 0's GEMM-only
work, CUDA graph replays interleaved, time over cuBLAS's (F.linear on the whole per-rank GEMM):
- `fused`: the shipped Triton kernel's GEMM-only mode; `plain`: its tiling without the fusion;
- `pp_plain_BMxBN`: the ping-pong GEMM of BMxBN tiles per consumer, no fusion (bf16 out);
- `pp_rs_BMxBN`: the same tiles in the fused kernel's order (owner step by owner step, own rows
  last) doing its epilogues' memory work: a peer tile stores its bf16 partial (TMA), an own tile
  adds W-1 bf16 partials (one at a time, in the accumulator's layout) and stores (TMA);
- `pp_rs_BMxBN_bands_B`: the same work in another order: the peers' tiles of a band of B tile
  rows, then this rank's own tiles of the band before (spread through the kernel, so that every
  own tile's reads have a peer tile's MMAs beside them).
No flags, no waits: this measures whether the reads hide, not a kernel to ship. Every variant is
checked (the pp_rs ones: own rows plus the W-1 partials they read) before it is timed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fluxtp.backends.fused._launch import DescriptorLayout, num_sms
from fluxtp.backends.fused._scaled import PINGPONG_WARPS
from fluxtp.bench.gemm_grid import case_inputs, launched_config, relative_error
from fluxtp.bench.harness import graphed
from fluxtp.kernels import COMPILE_OPTIONS
from fluxtp.kernels._pingpong import grouped_tile, load_tile, tma_store

sys.path.insert(0, str(Path(__file__).parent))
from _kernel_variants import case_parser, cases_of, checked_triton_reduce_scatter, report, time_case  # noqa: E402


@gluon.jit
def _tile_of(tile_id, tiles_m, tiles_n, WORLD: gl.constexpr, band):
    """(owner step, pid_m, pid_n) of a program's tile. band 0: the fused kernel's order, owner step
    by owner step (own rows last), GROUP_M 8 bands within a step. band b > 0: interleaved in bands
    of b tile rows: the peers' tiles of band g, then this rank's own tiles of band g - 1 (a band
    late, so that in a real call the peers' partials of band g - 1 had a band's time to land)."""
    per_segment = tiles_m * tiles_n
    if band == 0:
        step = tile_id // per_segment
        pid_m, pid_n = grouped_tile(tile_id % per_segment, tiles_m, tiles_n, 8)
    else:
        in_band = band * tiles_n  # tiles of one band of one segment
        peers = (WORLD - 1) * in_band
        if tile_id < peers:  # band 0's peer tiles
            g = 0
            r = tile_id + in_band
        else:
            g = 1 + (tile_id - peers) // (WORLD * in_band)
            r = (tile_id - peers) % (WORLD * in_band)
        if r < in_band:  # own rows of band g - 1
            step = WORLD - 1
            pid_m = (g - 1) * band + r % band  # a band column by column
            pid_n = r // band
        else:
            step = (r - in_band) // in_band
            pid_m = g * band + (r - in_band) % in_band % band
            pid_n = (r - in_band) % in_band // band
    return step, pid_m, pid_n


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, m, N, K, band, WORLD: gl.constexpr,
            NUM_PROGRAMS: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    tiles_m = gl.cdiv(m, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    per_segment = tiles_m * tiles_n
    loaded = 0
    for tile_id in range(gl.program_id(0), WORLD * per_segment, NUM_PROGRAMS):
        step, pid_m, pid_n = _tile_of(tile_id, tiles_m, tiles_n, WORLD, band)
        owner = (1 + step) % WORLD
        loaded = load_tile(a_desc, owner * m + pid_m * BLOCK_M, b_desc, pid_n * BLOCK_N, a_bufs, b_bufs, ready, empty,
                           loaded, K)  # fmt: skip


@gluon.jit
def _consumer(a_desc, b_desc, c_desc, part_desc, read_ptr, a_bufs, b_bufs, c_bufs, ready, empty, order, m, N,
              K, band, WORLD: gl.constexpr, REDUCE: gl.constexpr, NUM_PROGRAMS: gl.constexpr, C: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    S: gl.constexpr = a_bufs.type.shape[0]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    tiles_m = gl.cdiv(m, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    per_segment = tiles_m * tiles_n
    k_tiles = gl.cdiv(K, BLOCK_K)
    c_smem = c_bufs.index(C)
    used = C * k_tiles  # the loader fills the ring tile after tile; this consumer takes every other one
    turn = C  # this program's tile count, this consumer's tiles being turn C, C + 2, ...
    for tile_id in range(gl.program_id(0) + C * NUM_PROGRAMS, WORLD * per_segment, 2 * NUM_PROGRAMS):
        step, pid_m, pid_n = _tile_of(tile_id, tiles_m, tiles_n, WORLD, band)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
        # The previous tile's consumer has waited for all its stages: a stage's `ready` is then at
        # most one phase behind this tile's wait (a parity wait cannot tell phases further apart).
        if turn > 0:
            mbarrier.wait(order.index(0), (turn - 1) & 1)
        previous = 0
        for ki in range(k_tiles):
            s = used % S
            mbarrier.wait(ready.index(s), (used // S) & 1)
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(empty.index(previous), count=1, pred=ki > 0)  # the block before this one retired
            previous = s
            used += 1
        mbarrier.arrive(order.index(0), count=1)  # the other consumer's turn
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(previous), count=1)
        used += k_tiles  # the other consumer's tile
        turn += 2
        row = pid_m * BLOCK_M
        col = pid_n * BLOCK_N
        if REDUCE:
            if step == WORLD - 1:  # own rows: add the W-1 partials, one at a time
                rows = row + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
                cols = col + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
                offs = gl.expand_dims(rows.to(gl.int64), 1) * N + gl.expand_dims(cols, 0)
                for i in range(WORLD - 1):
                    acc += gl.load(read_ptr + i * m * N + offs, cache_modifier=".cg").to(gl.float32)
                tma.store_wait(pendings=0)
                c_smem.store(acc.to(c_desc.dtype))
                fence_async_shared()
                tma_store(c_desc, [row, col], c_smem)
            else:
                tma.store_wait(pendings=0)
                c_smem.store(acc.to(c_desc.dtype))
                fence_async_shared()
                tma_store(part_desc, [step * m + row, col], c_smem)
        else:
            owner = (1 + step) % WORLD
            tma.store_wait(pendings=0)
            c_smem.store(acc.to(c_desc.dtype))
            fence_async_shared()
            tma_store(c_desc, [owner * m + row, col], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def pingpong_kernel(a_desc, b_desc, c_desc, part_desc, read_ptr, m, N, K, band, WORLD: gl.constexpr,
                    REDUCE: gl.constexpr, NUM_PROGRAMS: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [2, BLOCK_M, BLOCK_N], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    order = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(order.index(0), count=1)  # one arrival per tile: its consumer has issued its MMAs
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)  # a stage belongs to one consumer's tile
    # Spelled out in each tuple: constexprs keep their kind only so (Triton 3.6).
    gl.warp_specialize(
        [
            (_consumer, (a_desc, b_desc, c_desc, part_desc, read_ptr, a_bufs, b_bufs, c_bufs, ready, empty, order, m, N, K,
                         band, WORLD, REDUCE, NUM_PROGRAMS, 0)),
            (_consumer, (a_desc, b_desc, c_desc, part_desc, read_ptr, a_bufs, b_bufs, c_bufs, ready, empty, order, m, N, K,
                         band, WORLD, REDUCE, NUM_PROGRAMS, 1)),
            (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, m, N, K, band, WORLD, NUM_PROGRAMS)),
        ],
        [4, 1],
        [232, 40],
    )  # fmt: skip


def pingpong(x, weight, world: int, block_m: int, block_n: int, stages: int, reduce: bool, band: int):
    """Rank 0's GEMM-only work in ping-pong tiles: (run, expected) where run() returns out."""
    m_total, k = x.shape
    n = weight.shape[0]
    m = m_total // world
    if m % block_m or (band and (m // block_m) % band):
        raise SystemExit(f"rows per rank {m} are not whole bands of {band or 1} x {block_m}: this probe stores whole tiles")
    out = torch.empty(m if reduce else m_total, n, dtype=x.dtype, device=x.device)
    read = torch.randn(world - 1, m, n, dtype=x.dtype, device=x.device)  # the peers' partials, read by own tiles
    scratch = torch.empty((world - 1) * m, n, dtype=x.dtype, device=x.device)  # where peer tiles' partials go
    descs = [DescriptorLayout(t, block, gluon=True).over(t) for t, block in
             ((x, [block_m, 64]), (weight, [block_n, 64]), (out, [block_m, block_n]), (scratch, [block_m, block_n]))]  # fmt: skip
    programs = min(num_sms(x.device), world * (m // block_m) * triton.cdiv(n, block_n))

    def run():
        pingpong_kernel[(programs,)](*descs, read, m, n, k, band, world, reduce, programs, stages, **PINGPONG_WARPS,
                                     **COMPILE_OPTIONS)
        return out

    full = F.linear(x, weight).float()
    if reduce:
        expected = full[:m] + read.float().sum(0)
    else:
        expected = full
    run.keep = (read, scratch)
    return run, expected


VARIANTS = {  # name -> (block_m, block_n, stages, reduce, band)
    "pp_plain_128x128": (128, 128, 4, False, 0),
    "pp_rs_128x128": (128, 128, 4, True, 0),
    "pp_rs_64x256": (64, 256, 4, True, 0),
    "pp_rs_128x128_bands_1": (128, 128, 4, True, 1),
    "pp_rs_128x128_bands_2": (128, 128, 4, True, 2),
}


def main() -> None:
    parser = case_parser(__doc__, "llama3-8b,llama3-70b", "4,8", "2048,16384", VARIANTS)
    parser.set_defaults(rounds=6)
    args = parser.parse_args()
    names = args.variants.split(",")
    rows = []
    for case in cases_of(args, "matmul_reduce_scatter"):
        x, w = case_inputs(case, "cuda")
        fused, _ = checked_triton_reduce_scatter(case, x, w)
        runs = {"fused": graphed(fused)}
        for name in names:
            run, expected = pingpong(x, w, case.world, *VARIANTS[name])
            error = relative_error(run(), expected)
            if not error < 1e-2:
                raise AssertionError(f"{case.label()}: {name} computes a wrong result (relative error {error:.3g})")
            runs[name] = graphed(run)
        config = launched_config(case, x, w)
        rows.append(time_case(case, runs, x, w, config, args.rounds, transport=config.transport))
        del runs
        torch.cuda.empty_cache()
    report("reduce_scatter_pingpong", rows, ["fused", *names, "plain"], "transport", args.out)


if __name__ == "__main__":
    main()
