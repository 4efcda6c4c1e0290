"""What the all-gather's fusion costs at each shape, on one GPU (GEMM-only mode), part by part.

    python benchmarks/all_gather_parts.py [--models llama3-8b,llama3-70b,gpt3-175b] [--worlds 2,4,8]
        [--tokens 1024,2048,4096] [--variants no_tail,...] [--rounds 8] [--out FILE.json]

Per all-gather case of the named models' grid (fluxtp/bench/gemm_grid.py), the shipped kernel's
GEMM-only mode (every chunk's signal preset) beside copies of its source with one part switched
off or one order changed (benchmarks/_kernel_variants.py), the plain TMA twin of the same tiling
(benchmarks/gemm_efficiency.py) and cuBLAS, as CUDA graph replays interleaved by the benchmark
harness. Every variant computes the op's output here and is checked against F.linear:
- `skip_empty_loops`: a program enters the own rows' or the peers' loop only with a tile in it;
- `no_tail`: no finished-programs count and no signal reset at the kernel's end (a real call
  needs them: the next call's signals must start from zero);
- `no_wait`: no chunk waits (a real call reads rows before they arrive);
- `one_loop`: this rank's rows read from the gathered input in the peers' loop (one pipelined
  loop; a real call has its own rows only in its shard);
- `segments_grouped`: one_loop, and group_m bands of row tiles counted across segments in
  arrival order instead of within each segment (concurrent tiles share the weight's tiles when a
  segment has few rows; a real call then needs more peers' rows before its first wave);
- `peers_grouped`: the shipped two loops, the peers' bands counted across their segments at
  every shape (the shipped kernel's PEER_BANDS order, which the launcher takes by a rule);
- `lean`: segments_grouped without the tail and the waits: what is left is the kernel's own cost.
Time over cuBLAS's, medians.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from fluxtp.backends.fused import _all_gather_matmul
from fluxtp.bench.gemm_grid import case_inputs, gathered, launched_config, relative_error

sys.path.insert(0, str(Path(__file__).parent))
from _kernel_variants import case_parser, cases_of, chosen_variants, graphed_runs, report, time_case, variant_kernels  # noqa: E402

SKIP_EMPTY_LOOPS = [  # a program with no tile of a phase does not enter its pipelined loop at all
    ("    _tiles(own_desc,", "    if pid < tiles_per_segment:\n        _tiles(own_desc,"),
    ("    _tiles(a_desc,", "    if first_peer_tile < num_tiles:\n        _tiles(a_desc,"),
]
NO_TAIL = [('if tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:', "if rows_per_rank < 0:")]
NO_WAIT = [("    if chunk != ready:\n", "    if chunk < -1:\n")]
ONE_LOOP = [
    ("    _tiles(own_desc, b_desc, c_desc, c_ptr, bias_ptr, signal_ptr, report_ptr, pid, tiles_per_segment,",
     "    _tiles(a_desc, b_desc, c_desc, c_ptr, bias_ptr, signal_ptr, report_ptr, pid, num_tiles,"),
    ("chunks_per_rank, max_spins, True, RANK, WORLD,", "chunks_per_rank, max_spins, False, RANK, WORLD,"),
    ("    first_peer_tile = pid + tl.maximum(tl.cdiv(tiles_per_segment - pid, NUM_SMS), 0) * NUM_SMS\n",
     "    first_peer_tile = num_tiles\n"),
]


# The peers' bands across their segments whatever the launcher's rule (the kernel's PEER_BANDS order).
PEERS_GROUPED = [("    if OWN or not PEER_BANDS:\n", "    if OWN:\n")]
# Every segment's bands counted across the segments, in one loop: that order from tile 0 and rank+0.
SEGMENTS_GROUPED = ONE_LOOP + PEERS_GROUPED + [
    ("grouped_tile(tile_id - tiles_per_segment, (WORLD - 1) * tiles_m, tiles_n, GROUP_M)",
     "grouped_tile(tile_id, WORLD * tiles_m, tiles_n, GROUP_M)"),
    ("segment = (RANK + 1 + row // tiles_m) % WORLD", "segment = (RANK + row // tiles_m) % WORLD"),
]
VARIANTS = {
    "skip_empty_loops": SKIP_EMPTY_LOOPS,
    "no_tail": NO_TAIL,
    "no_wait": NO_WAIT,
    "one_loop": ONE_LOOP,
    "segments_grouped": SEGMENTS_GROUPED,
    "peers_grouped": PEERS_GROUPED,
    "lean": SEGMENTS_GROUPED + NO_TAIL + NO_WAIT,
}


def main() -> None:
    parser = case_parser(__doc__, "llama3-8b,llama3-70b,gpt3-175b", "2,4,8", "1024,2048,4096", VARIANTS)
    args = parser.parse_args()
    cases = cases_of(args, "all_gather_matmul")
    kernel = "all_gather_matmul_kernel"
    kernels = variant_kernels(_all_gather_matmul, kernel, "_all_gather_matmul.py", chosen_variants(parser, args, VARIANTS))
    rows = []
    for case in cases:
        x, w = case_inputs(case, "cuda")
        full = gathered(case, x)
        ref = F.linear(full, w)

        def check(name, out, case=case, ref=ref):
            if not relative_error(out, ref) < 1e-2:
                raise AssertionError(f"{case.label()}: {name} computes a wrong result")

        runs = graphed_runs(_all_gather_matmul, kernel, kernels, case, x, w, check)
        config = launched_config(case, x, w)
        tiling = f"{config.block_m}x{config.block_n}x{config.block_k} w{config.num_warps} s{config.num_stages} g{config.group_m}"
        rows.append(time_case(case, runs, full, w, config, args.rounds, tiling=tiling))
        del runs
        torch.cuda.empty_cache()
    report("all_gather_parts", rows, [*kernels, "plain"], "tiling", args.out)


if __name__ == "__main__":
    main()
