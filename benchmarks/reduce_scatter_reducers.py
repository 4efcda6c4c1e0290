"""Can a few SMs reduce the reduce-scatter's partials while the others compute? One GPU, bf16.

    python benchmarks/reduce_scatter_reducers.py [--models llama3-8b,llama3-70b] [--worlds 4,8]
        [--tokens 2048,16384] [--reducers 4,8,16] [--rounds 6] [--out FILE.json]

The fused kernel's owner adds W-1 partials after its own tiles' K loops, with no MMAs beside the
reads; at TP=8 that costs 4-18% of cuBLAS's time (docs/perf-log.md). Flux and Triton-distributed
instead let the GEMM only store partials and reduce them elsewhere. This bounds that design from
above, per reduce-scatter case of the grid (rank 0's GEMM-only work, CUDA graph replays
interleaved, time over cuBLAS's F.linear of the whole per-rank GEMM):
- `fused`: the shipped kernel's GEMM-only mode; `plain`: its tiling without the fusion, one
  program per SM;
- `gemm_R`: the plain GEMM over every partial slot ([M, N]: W slots of m rows) on SMs - R programs;
- `reduce_R`: the owner's reduction alone on R programs: its own slot plus W-1 peer slots
  (random bf16), summed in float32 in a fixed order, rounded once into out [m, N];
- `split_R`: both at once, the reduction on a second stream (two branches of one CUDA graph);
- `reduce_tma_R`, `split_tma_R`: the same with the slots read by TMA through a software pipeline
  (NUM_STAGES blocks in flight in shared memory, not registers).
No flags, no waits (the reduction reads slots the GEMM may still be writing): this measures
whether the reads hide beside the MMAs, not a kernel to ship. Each output is checked first.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from fluxtp.backends.fused._launch import descriptor, num_sms
from fluxtp.bench.gemm_grid import case_inputs, launched_config, relative_error
from fluxtp.bench.harness import graphed
from fluxtp.kernels import COMPILE_OPTIONS

sys.path.insert(0, str(Path(__file__).parent))
from _kernel_variants import case_parser, cases_of, checked_triton_reduce_scatter, report, time_case  # noqa: E402
from gemm_efficiency import plain_matmul  # noqa: E402


@triton.jit
def reduce_partials_kernel(own_ptr, peers_ptr, out_ptr, m, N, WORLD: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, PROGRAMS: tl.constexpr):  # fmt: skip
    """out [m, N] = own [m, N] + peers[0] + ... + peers[W-2] ([W-1, m, N]), float32 sums in that
    order, rounded once; persistent over BLOCK_M x BLOCK_N blocks, every load of a block in flight."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    for t in range(tl.program_id(0), tl.cdiv(m, BLOCK_M) * tiles_n, PROGRAMS):
        rows = (t // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (t % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows < m)[:, None] & (cols < N)[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        acc = tl.load(own_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        for i in tl.static_range(WORLD - 1):
            acc += tl.load(peers_ptr + i * m * N + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def reduce_partials_tma_kernel(slots_desc, out_ptr, m, N, WORLD: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, PROGRAMS: tl.constexpr, NUM_STAGES: tl.constexpr):  # fmt: skip
    """The same sum, the slots read by TMA through a software pipeline over (block, slot), so
    NUM_STAGES blocks are in flight in shared memory across block boundaries. slots_desc is over
    [(2W-1) m, N]: slot 0 (rows 0..m) is own, slots W..2W-2 the peers' (1..W-1: the GEMM's other rows)."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    mine = tl.cdiv(tl.cdiv(m, BLOCK_M) * tiles_n - tl.program_id(0), PROGRAMS)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in tl.range(mine * WORLD, num_stages=NUM_STAGES):
        t = tl.program_id(0) + (it // WORLD) * PROGRAMS
        i = it % WORLD
        row0 = (t // tiles_n) * BLOCK_M
        col0 = (t % tiles_n) * BLOCK_N
        slot = i + (i > 0).to(tl.int32) * (WORLD - 1)
        part = slots_desc.load([slot * m + row0, col0]).to(tl.float32)
        acc = tl.where(i == 0, part, acc + part)
        if i == WORLD - 1:
            rows = row0 + tl.arange(0, BLOCK_M)
            cols = col0 + tl.arange(0, BLOCK_N)
            mask = (rows < m)[:, None] & (cols < N)[None, :]
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def reduction_tma(slots: torch.Tensor, world: int, programs: int, block_m: int = 64, block_n: int = 256,
                  stages: int = 4, warps: int = 8):  # fmt: skip
    """run() -> out: reduce_partials_tma_kernel on `programs` programs over slots [(2W-1) m, N]."""
    m, n = slots.shape[0] // (2 * world - 1), slots.shape[1]
    out = torch.empty(m, n, dtype=slots.dtype, device=slots.device)
    desc = descriptor(slots, [block_m, block_n])

    def run():
        reduce_partials_tma_kernel[(programs,)](desc, out, m, n, world, block_m, block_n, programs, stages,
                                                num_warps=warps, num_stages=stages, **COMPILE_OPTIONS)  # fmt: skip
        return out

    return run


def reduction(own: torch.Tensor, peers: torch.Tensor, programs: int, block_m: int = 32, block_n: int = 256):
    """run() -> out: reduce_partials_kernel on `programs` programs."""
    m, n = own.shape
    out = torch.empty_like(own)

    def run():
        reduce_partials_kernel[(programs,)](own, peers, out, m, n, peers.shape[0] + 1, block_m, block_n, programs,
                                            num_warps=8, **COMPILE_OPTIONS)  # fmt: skip
        return out

    return run


def split(gemm, reduce):
    """gemm() on the current stream and reduce() on a second one, joined: run() -> reduce's out."""
    side = torch.cuda.Stream()

    def run():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            out = reduce()
        gemm()
        main.wait_stream(side)
        return out

    return run


def checked(case, name: str, run, expected: torch.Tensor):
    """run's CUDA graph replay, once its output is within bf16 rounding of `expected`."""
    error = relative_error(run(), expected)
    if not error < 1e-2:
        raise AssertionError(f"{case.label()}: {name} computes a wrong result (relative error {error:.3g})")
    return graphed(run)


def main() -> None:
    parser = case_parser(__doc__, "llama3-8b,llama3-70b", "4,8", "2048,16384", {})
    parser.add_argument("--reducers", default="4,8,16", help="comma-separated R: SMs given to the reduction")
    parser.add_argument("--tma-blocks", default="64x256x4x8",
                        help="the TMA reduction's BMxBNxSTAGESxWARPS, comma-separated (each timed alone and split)")
    parser.add_argument("--no-pointer", action="store_true", help="leave out the pointer-load reduction")
    parser.set_defaults(rounds=6, variants="")
    args = parser.parse_args()
    reducers = [int(r) for r in args.reducers.split(",")]
    rows = []
    names = []
    for case in cases_of(args, "matmul_reduce_scatter"):
        x, w = case_inputs(case, "cuda")
        fused, full = checked_triton_reduce_scatter(case, x, w)
        m = case.M // case.world
        config = launched_config(case, x, w)
        peers = torch.randn(case.world - 1, m, full.shape[1], dtype=x.dtype, device=x.device)
        expected = full[:m].float() + peers.float().sum(0)
        runs = {"fused": graphed(fused)}
        slots = torch.empty((2 * case.world - 1) * m, full.shape[1], dtype=x.dtype, device=x.device)
        slots[case.M :] = peers.flatten(0, 1)
        for r in reducers:
            gemm = plain_matmul(x, w, config, programs=num_sms(x.device) - r, out=slots[: case.M])
            gemm()  # the own slot holds the own partial from here on (split's reads may come first)
            for spec in args.tma_blocks.split(","):
                block_m, block_n, stages, warps = (int(v) for v in spec.split("x"))
                reduce = reduction_tma(slots, case.world, r, block_m, block_n, stages, warps)
                tag = "" if spec == "64x256x4x8" else f"_{spec}"
                runs[f"reduce_tma{tag}_{r}"] = checked(case, f"reduce_tma{tag}_{r}", reduce, expected)
                runs[f"split_tma{tag}_{r}"] = checked(case, f"split_tma{tag}_{r}", split(gemm, reduce), expected)
        for r in [] if args.no_pointer else reducers:
            gemm = plain_matmul(x, w, config, programs=num_sms(x.device) - r)
            reduce = reduction(gemm()[:m], peers, r)
            both = split(gemm, reduce)
            runs[f"gemm_{r}"] = checked(case, f"gemm_{r}", gemm, full.float())
            runs[f"reduce_{r}"] = checked(case, f"reduce_{r}", reduce, expected)
            runs[f"split_{r}"] = checked(case, f"split_{r}", both, expected)
        names = list(runs)
        rows.append(time_case(case, runs, x, w, config, args.rounds, transport=config.transport))
        del runs
        torch.cuda.empty_cache()
    report("reduce_scatter_reducers", rows, [*names, "plain"], "transport", args.out)


if __name__ == "__main__":
    main()
