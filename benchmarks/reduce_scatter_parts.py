"""What each part of the reduce-scatter's fusion costs, on one GPU (GEMM-only mode).

    python benchmarks/reduce_scatter_parts.py [--models llama3-8b,llama3-70b] [--worlds 4,8]
        [--tokens 2048,16384] [--variants no_flags,...] [--rounds 8] [--out FILE.json]

Per reduce-scatter case of the named models' grid (fluxtp/bench/gemm_grid.py), the shipped
kernel's GEMM-only mode beside copies of its source with one part switched off, plain (the same
tiling with none of the fusion, benchmarks/gemm_efficiency.py) and cuBLAS, as CUDA graph
replays interleaved by the benchmark harness. A part is switched off by predicating it
(`mask & (N < 0)`) or removing one statement, so the rest of the kernel compiles as shipped:
- `no_partial_loads`: the owner's loads of the W-1 peers' partials (its own tiles' reduction);
- `no_peer_stores`: the producer's stores of partial tiles for their owners;
- `no_flags`: the producer's flag releases (push) or band counts (copy engine);
- `none`: all three; `none_no_wait`: and the owner's flag wait;
- `peers_only`: every tile takes the producer's path (no own tiles, nothing reduced); with
  `none_peers_only` the kernel is plain's loop with the fused kernel's bookkeeping;
- `one_read_per_tile`: a chained (ring) reduction's reads: every tile adds one partial from this
  rank's buffer before its store, an own tile one instead of W-1; `chained`: and every tile
  waits for its flags first, as a hop of the chain waits for the previous one.
Only the shipped kernel, `no_flags`, `one_read_per_tile` and `chained` compute the op's result
(checked against F.linear; the partials read are zeros); the other variants compute something
else by construction. Time over cuBLAS's, medians.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from fluxtp.backends.fused import _matmul_reduce_scatter
from fluxtp.bench.gemm_grid import case_inputs, expected_rows, launched_config, relative_error

sys.path.insert(0, str(Path(__file__).parent))
from _kernel_variants import case_parser, cases_of, chosen_variants, graphed_runs, report, time_case, variant_kernels  # noqa: E402

NO_PARTIAL_LOADS = [('mask=mask, other=0.0, cache_modifier=".cg"', 'mask=mask & (N < 0), other=0.0, cache_modifier=".cg"')]
NO_PEER_STORES = [("tl.store(part_ptr + rows[:, None] * N + offs_n[None, :], acc.to(dtype), mask=mask)",
                   "tl.store(part_ptr + rows[:, None] * N + offs_n[None, :], acc.to(dtype), mask=mask & (N < 0))")]
NO_FLAGS = [('                set_flag(pending_flag, 1, "sys")\n            pending = 0', "                pass\n            pending = 0"),
            ('tl.atomic_add(flags + slot * bands + pid_m // GROUP_M, 1, sem="release", scope="sys")', "pass")]
NO_WAIT = [('arrived = wait_flags(flag_ptrs, peer, 1, max_spins, "sys")', "arrived = peer | ~peer")]
PEERS_ONLY = [("    for own in tl.static_range(2):", "    for own in tl.static_range(1):"),
              ("        for tile_id in tl.range(start, stop, NUM_SMS", "        stop = end_tile\n        for tile_id in tl.range(start, stop, NUM_SMS")]
NONE = NO_PARTIAL_LOADS + NO_PEER_STORES + NO_FLAGS
# A chained (ring) reduction's reads: every tile adds one partial before it hands its sum on
# (the previous hop's, in this rank's buffer), so an own tile adds one, not W-1.
ONE_READ_PER_TILE = [
    ("for i in tl.static_range(WORLD - 1):", "for i in tl.static_range(1):"),
    ("for i in range(WORLD - 1):", "for i in range(1):"),
    ("        holder, slot = _handover(owner, RANK, WORLD, PUSH, COPY_ENGINE)\n        part_ptr",
     "        acc += _partial(0, buffer_ptrs, offs_m, offs_n, mask, rows_per_rank, N, dtype, RANK, PUSH)\n"
     "        holder, slot = _handover(owner, RANK, WORLD, PUSH, COPY_ENGINE)\n        part_ptr"),
]
# and every tile waits for its flags before its epilogue, as a chain's hop waits for the last.
WAIT_EVERY_TILE = [("            if own:\n                # Every peer's partial", "            if True:\n                # Every peer's partial")]

VARIANTS = {
    "no_partial_loads": NO_PARTIAL_LOADS,
    "no_peer_stores": NO_PEER_STORES,
    "no_flags": NO_FLAGS,
    "none": NONE,
    "none_no_wait": NONE + NO_WAIT,
    "peers_only": PEERS_ONLY,
    "none_peers_only": NONE + PEERS_ONLY,
    "one_read_per_tile": ONE_READ_PER_TILE,
    "chained": ONE_READ_PER_TILE + WAIT_EVERY_TILE,
}
COMPUTES_THE_OP = ("fused", "no_flags", "one_read_per_tile", "chained")


def main() -> None:
    parser = case_parser(__doc__, "llama3-8b,llama3-70b", "4,8", "2048,16384", VARIANTS)
    args = parser.parse_args()
    cases = cases_of(args, "matmul_reduce_scatter")
    kernel = "matmul_reduce_scatter_kernel"
    kernels = variant_kernels(_matmul_reduce_scatter, kernel, "_matmul_reduce_scatter.py", chosen_variants(parser, args, VARIANTS))
    rows = []
    for case in cases:
        x, w = case_inputs(case, "cuda")
        ref = expected_rows(case, F.linear(x, w))

        def check(name, out, case=case, ref=ref):
            if name in COMPUTES_THE_OP and not relative_error(out, ref) < 1e-2:
                raise AssertionError(f"{case.label()}: {name} computes a wrong result")

        runs = graphed_runs(_matmul_reduce_scatter, kernel, kernels, case, x, w, check)
        config = launched_config(case, x, w)
        rows.append(time_case(case, runs, x, w, config, args.rounds, transport=config.transport))
        del runs
        torch.cuda.empty_cache()
    report("reduce_scatter_parts", rows, [*kernels, "plain"], "transport", args.out)


if __name__ == "__main__":
    main()
