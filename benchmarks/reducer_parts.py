"""What each part of the reducer kernel's hand-over and reduction costs, on one GPU (GEMM-only mode).

    python benchmarks/reducer_parts.py [--models llama3-8b,llama3-70b] [--worlds 8] [--tokens 4096,16384]
        [--dtype float8_e4m3fn] [--fast-accum] [--variants no_reducer,...] [--rounds 5] [--out FILE.json]

Per reduce-scatter case of the named models' grid (fluxtp/bench/gemm_grid.py) that a call runs
on the reducer kernel (fluxtp/kernels/_matmul_reduce_scatter_reducer.py), its GEMM-only mode
beside copies of its source with one part switched off, and cuBLAS (torch._scaled_mm for FP8
cases, row-wise scales, bf16 out), as CUDA graph replays interleaved by the benchmark harness:
- `no_reducer`: the reducer warp and the tail after it do nothing (nothing is reduced; the
  consumers still store and count every half);
- `no_reducer_no_peer_counts`: and the peers' halves are never handed to the counter warp nor
  counted;
- `no_reducer_no_counts`: and no own half is counted either (the GEMM and its partial stores alone);
- `no_sums`: the reducer warp and the tail wait for and load every unit but sum and store none
  (what their sums cost beside their waits and loads);
- `own_flag_only`: the shipped kernel whose reducers wait for their tiles' own flags only, not the
  peers' bands (one GPU: the peers' counts are preset, so it computes the op);
- `no_waits`: the shipped kernel whose reducers wait for nothing (they sum unready rows);
- `no_waits_no_done_count`: `no_waits`, and no program counts itself out at the end (the last
  one's reset of the own flags and counter for the next launch never runs): what that count's
  round trip costs, against `no_waits`;
- `relaxed_done_count`: that count relaxed, not acq_rel (its release waits for the program's
  output stores);
- `one_unit_a_wait`: the reducer's waits read one unit's flags, not the next ones' too;
- `atomic_reads`: the flags read by atomic adds of 0 (acquire), not acquire loads;
- `one_unit_atomic_reads`: both, the reducer's waits as they were before the two changes;
- `one_reducer_warp`, `two_reducer_warps`: the reducer partition of one or two warps, a unit row each
  in turn, whatever the launcher's reducer_warps asks;
- `consumer_lag_1`, `consumer_lag_2` (fast accumulation, bf16, fp16): consumer 1 starts one or two
  K blocks after consumer 0, so that each one's epilogue (scales, staging, store, count) runs
  beside the other's MMAs, not with the tensor cores idle (short K a rank: 14-28 blocks a tile).
- `units_by_pointers`: the reducer warp's units (not the tail's) loaded by pointer from L2 into
  registers and summed there, a row at a time: no shared memory (and a unit's rows one round trip
  after another, which alone may make it slower);
- `units_prefetched_to_l2`: its units' rows only prefetched into L2 (HBM to L2, nothing to the SM),
  nothing summed;
- `units_waited_only`: its units' flags waited for, nothing loaded nor summed.
Against `no_sums` (the units TMA-loaded into shared memory, nothing summed) the last three tell
which part of moving the W slots' rows costs the GEMM its time: HBM, L2 to the SM, or shared memory.
The shipped kernel and the variants that change only how it waits, sums or staggers its consumers (COMPUTES_THE_OP)
compute the op's result (checked first; the peers' partials read are zeros). Time over cuBLAS's, medians.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

import fluxtp.kernels._matmul_reduce_scatter_reducer as reducer_module
from fluxtp._dist import GroupInfo
from fluxtp.backends.fused import _matmul_reduce_scatter
from fluxtp.bench.gemm_grid import (
    FP8_DTYPE_NAMES,
    case_inputs,
    cublas_reference,
    expected_rows,
    fp8_case_inputs,
    launched_config,
    relative_error,
)
from fluxtp.bench.harness import graphed

sys.path.insert(0, str(Path(__file__).parent))
from _kernel_variants import (  # noqa: E402
    KERNELS,
    case_parser,
    cases_of,
    chosen_variants,
    report,
    time_case,
    variant_kernels,
    variant_source,
)

NO_REDUCER = [
    ("    if last_step == WORLD - 1:\n        UNIT_ROWS", "    if last_step == WORLD + 99:\n        UNIT_ROWS"),
    ("    if TAIL_UNITS > 0:\n        if last_step == WORLD - 1:\n            _tail(",
     "    if TAIL_UNITS < 0:\n        if last_step == WORLD - 1:\n            _tail("),
]
NO_PEER_COUNTS = [
    ("            if pending != 0:  # its store", "            if pending < 0:  # its store"),
    ("    if pending != 0:\n        handed =", "    if pending < 0:\n        handed ="),
    ("& (owner != RANK):\n            counter = _band_counter", "& (owner == RANK + 99):\n            counter = _band_counter"),
]
NO_OWN_COUNTS = [("                _count_own(own_flags + pid_m * tiles_n + pid_n)", "                pass")]
NO_SUMS = [  # the units still wait and load; nothing is summed or stored
    ("                _sum_unit(unit_bufs, buffer, out_ptr", "                if row0 < 0:\n                    _sum_unit(unit_bufs, buffer, out_ptr"),
    ("                _sum_unit(ring, k, out_ptr", "                if row0 < 0:\n                    _sum_unit(ring, k, out_ptr"),
]
OWN_FLAG_ONLY = [("    waited = lanes < count * WORLD\n", "    waited = (lanes < count * WORLD) & (srcs == RANK)\n")]
NO_WAITS = [("    waited = lanes < count * WORLD\n", "    waited = lanes < 0\n")]
DONE_COUNT = '        if gl.atomic_add(done, 1, sem="acq_rel", scope="gpu") == NUM_PROGRAMS - 1:\n'
NO_DONE_COUNT = [(DONE_COUNT, "        if gl.program_id(0) < 0:\n")]  # no program counts itself out (nothing reset)
RELAXED_DONE_COUNT = [(DONE_COUNT, DONE_COUNT.replace('"acq_rel"', '"relaxed"'))]
ONE_UNIT_A_WAIT = [  # the reducer's wait reads one unit's flags, not the next ones' too
    ("count = gl.minimum(gl.cdiv(last - unit, NUM_PROGRAMS), 32 // WORLD)",
     "count = gl.minimum(gl.cdiv(last - unit, NUM_PROGRAMS), 1)"),
]
ATOMIC_READS = [  # the flags read by atomic adds of 0 with acquire (the waited ones), not by acquire loads
    ("    arrived = (_acquire_read(flag_ptrs) == expected) | ~waited\n",
     "    arrived = (gl.atomic_add(flag_ptrs, gl.zeros_like(expected), mask=waited, sem='acquire', scope='sys')\n"
     "               == expected) | ~waited\n"),
    ("        arrived = arrived | (_acquire_read(flag_ptrs) == expected)\n",
     "        arrived = arrived | (gl.atomic_add(flag_ptrs, gl.zeros_like(expected), mask=waited & ~arrived,\n"
     "                                           sem='acquire', scope='sys') == expected)\n"),
]


def reducer_warps(warps: int) -> list:
    """The reducer partition of `warps` warps, whatever the launcher's reducer_warps asks."""
    return [("        [4, 1, REDUCER_WARPS, 1],\n", f"        [4, 1, {warps}, 1],\n"),
            ("HAS_BIAS, PUSH, REDUCER_WARPS)),\n", f"HAS_BIAS, PUSH, gl.constexpr({warps}))),\n")]


# The reducer warp's units another way (the tail after the GEMM keeps its TMA loads): where
# loading the W slots' rows into shared memory costs an FP8 GEMM its time (HBM, L2 to the SMs, or
# shared memory), told apart by what each way moves.
_ISSUE_FIRST = "_issue_unit(units_desc, unit_bufs, j, unit_bar.index(j), row0, pid_n * BLOCK_N, WORLD, PUSH)"
_ISSUE_NEXT = ("_issue_unit(units_desc, unit_bufs, buffer, unit_bar.index(buffer), next_row0, next_n * BLOCK_N, "
               "WORLD,\n                            PUSH)  # fmt: skip")
_SUM = ("_sum_unit(unit_bufs, buffer, out_ptr, bias_ptr, row0, pid_n * BLOCK_N, rows_per_rank, N, stride_om,\n"
        "                          WORLD, HAS_BIAS, REDUCER_WARPS)  # fmt: skip")
_UNIT_WAYS = '''@gluon.jit
def _sum_unit_by_pointers(buffer_ptrs, out_ptr, bias_ptr, row0, col0, rows_per_rank, N, stride_om, RANK: gl.constexpr,
                          WORLD: gl.constexpr, PUSH: gl.constexpr, UNIT_ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                          HAS_BIAS: gl.constexpr):  # fmt: skip
    """_sum_unit with the W slots' rows (the own slot's, then the incoming ones' in rank order, in
    this rank's buffer: slots [*, m, N]) loaded from L2 into registers (no shared memory), a row at
    a time."""
    WIDTH: gl.constexpr = REDUCE_WIDTH if BLOCK_N > REDUCE_WIDTH else BLOCK_N
    layout: gl.constexpr = gl.BlockedLayout([1, WIDTH // 32], [1, 32], [1, 1], [1, 0])
    dtype: gl.constexpr = out_ptr.dtype.element_ty
    slots = gl.load(buffer_ptrs + RANK).to(gl.pointer_type(dtype))
    for r in gl.static_range(UNIT_ROWS):
        rows = row0 + r + gl.arange(0, 1, layout=gl.SliceLayout(1, layout))
        for c in gl.static_range(BLOCK_N // WIDTH):
            cols = col0 + c * WIDTH + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
            mask = gl.expand_dims(rows < rows_per_rank, 1) & gl.expand_dims(cols < N, 0)
            acc = gl.zeros((1, WIDTH), gl.float32, layout=layout)
            for i in gl.static_range(WORLD):
                slot = _own_slot(PUSH, WORLD) if i == 0 else i - 1
                offs = gl.expand_dims((slot * rows_per_rank + rows).to(gl.int64) * N, 1) + gl.expand_dims(cols, 0)
                acc += gl.load(slots + offs, mask=mask, other=0.0, cache_modifier=".cg").to(gl.float32)
            if HAS_BIAS:
                acc += gl.expand_dims(gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32), 0)
            offs = gl.expand_dims(rows.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols, 0)
            gl.store(out_ptr + offs, acc.to(dtype), mask=mask)


@gluon.jit
def _prefetch_unit_to_l2(buffer_ptrs, out_ptr, row0, col0, rows_per_rank, N, RANK: gl.constexpr, WORLD: gl.constexpr,
                         PUSH: gl.constexpr, UNIT_ROWS: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    """The W slots' rows of a unit brought into L2 (cp.async.bulk.prefetch.L2, a row's columns a
    lane), none into the SM; nothing summed."""
    gl.static_assert(WORLD * UNIT_ROWS <= 32)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lanes = gl.arange(0, 32, layout=layout)
    i = lanes // UNIT_ROWS
    slot = gl.where(i == 0, _own_slot(PUSH, WORLD), i - 1)
    rows = gl.minimum(row0 + lanes % UNIT_ROWS, rows_per_rank - 1)
    base = gl.load(buffer_ptrs + RANK).to(gl.pointer_type(out_ptr.dtype.element_ty))
    ptrs = base + (slot * rows_per_rank + rows).to(gl.int64) * N + col0
    nbytes = gl.minimum(N - col0, BLOCK_N) * (out_ptr.dtype.element_ty.primitive_bitwidth // 8) // 16 * 16
    valid = (lanes < WORLD * UNIT_ROWS) & (nbytes > 0)
    gl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; }"
                              " mov.u32 $0, 0;", "=r,l,r,r", [ptrs, valid.to(gl.int32), nbytes + lanes * 0],
                              dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _tail_first('''
BY_POINTERS = [  # computes the op: the units' rows by pointer loads, no shared memory
    ("@gluon.jit\ndef _tail_first(", _UNIT_WAYS),
    (_ISSUE_FIRST, "mbarrier.arrive(unit_bar.index(j), count=1)"),
    (_ISSUE_NEXT, "mbarrier.arrive(unit_bar.index(buffer), count=1)"),
    (_SUM, "_sum_unit_by_pointers(buffer_ptrs, out_ptr, bias_ptr, row0, pid_n * BLOCK_N, rows_per_rank, N, stride_om,\n"
           "                                      RANK, WORLD, PUSH, UNIT_ROWS, BLOCK_N, HAS_BIAS)"),
]
PREFETCH_TO_L2 = [  # the units' rows into L2 only; nothing summed
    ("@gluon.jit\ndef _tail_first(", _UNIT_WAYS),
    (_ISSUE_FIRST, "mbarrier.arrive(unit_bar.index(j), count=1)"),
    (_ISSUE_NEXT, "mbarrier.arrive(unit_bar.index(buffer), count=1)"),
    (_SUM, "_prefetch_unit_to_l2(buffer_ptrs, out_ptr, row0, pid_n * BLOCK_N, rows_per_rank, N, RANK, WORLD, PUSH,\n"
           "                                     UNIT_ROWS, BLOCK_N)"),
]
WAITS_ONLY = [  # the units' flags waited for; nothing loaded nor summed
    (_ISSUE_FIRST, "mbarrier.arrive(unit_bar.index(j), count=1)"),
    (_ISSUE_NEXT, "mbarrier.arrive(unit_bar.index(buffer), count=1)"),
    (_SUM, "pass"),
]
def _lagged_loop() -> str:
    """_pingpong.accumulate_blocks, read from its source, as the kernel file's `_accumulate_lagged`:
    consumer 0 arrives on lag_bar as its running count reaches LAG (consumer 1 starts then)."""
    source = (KERNELS / "_pingpong.py").read_text()
    start = source.index("@gluon.jit\ndef accumulate_blocks(")
    loop = source[start : source.index("\n\n\n", start)]
    wait = "        mbarrier.wait(ready.index(s), (used // STAGES) & 1)\n"
    loop = variant_source(loop, "consumer_lag", [
        ("def accumulate_blocks(", "def _accumulate_lagged("),
        ("B_KN: gl.constexpr = False):", "B_KN: gl.constexpr, lag_bar, LAG: gl.constexpr):"),
        (wait, "        if C == 0:\n            mbarrier.arrive(lag_bar.index(0), count=1, pred=used == LAG)\n" + wait),
    ])  # fmt: skip
    imports = "from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait\n"
    return f"{imports}\n\n{loop}\n\n\n@gluon.jit\ndef _consumer("


def consumer_lag(blocks: int) -> list[tuple[str, str]]:
    """Consumer 1 `blocks` K blocks behind consumer 0 (not with precise accumulation nor B_KN)."""
    return [
        ("@gluon.jit\ndef _consumer(", _lagged_loop()),
        ("        mbarrier.init(counted.index(b), count=1)\n",
         "        mbarrier.init(counted.index(b), count=1)\n"
         "    lag_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())\n"
         "    mbarrier.init(lag_bar.index(0), count=1)\n"),
        ("last_step, scale_a_ptr, scale_b_ptr, 0, RANK", "last_step, scale_a_ptr, scale_b_ptr, lag_bar, 0, RANK"),
        ("last_step, scale_a_ptr, scale_b_ptr, 1, RANK", "last_step, scale_a_ptr, scale_b_ptr, lag_bar, 1, RANK"),
        ("              scale_a_ptr, scale_b_ptr, C: gl.constexpr,", "              scale_a_ptr, scale_b_ptr, lag_bar, C: gl.constexpr,"),
        ("    used = 0\n    for t in range(gl.program_id(0), WORLD * tiles_m * tiles_n, NUM_PROGRAMS):\n",
         f"    LAG: gl.constexpr = 0 if PRECISE_ACC or B_KN else {blocks}\n"
         "    if LAG > 0:\n        if C == 1:\n            mbarrier.wait(lag_bar.index(0), 0)\n"
         "    used = 0\n    for t in range(gl.program_id(0), WORLD * tiles_m * tiles_n, NUM_PROGRAMS):\n"),
        ("                acc, used = accumulate_plain(a_bufs, b_bufs, ready, empty, used, K, C, layout, B_KN)\n",
         "                if LAG > 0:\n"
         "                    acc, used = _accumulate_lagged(a_bufs, b_bufs, ready, empty, used, gl.cdiv(K, a_bufs.type.shape[2]),\n"
         "                                                   C, layout, B_KN, lag_bar, LAG)\n"
         "                else:\n"
         "                    acc, used = accumulate_plain(a_bufs, b_bufs, ready, empty, used, K, C, layout, B_KN)\n"),
        ("    if pending != 0:\n        handed = _hand_over_peer_half(stored, counted, handed)\n",
         "    if pending != 0:\n        handed = _hand_over_peer_half(stored, counted, handed)\n"
         "    if LAG > 0:  # consumer 0 never reached block LAG: consumer 1 may start now\n"
         "        if C == 0:\n            mbarrier.arrive(lag_bar.index(0), count=1, pred=used <= LAG)\n"),
    ]


VARIANTS = {
    "no_reducer": NO_REDUCER,
    "no_reducer_no_peer_counts": NO_REDUCER + NO_PEER_COUNTS,
    "no_reducer_no_counts": NO_REDUCER + NO_PEER_COUNTS + NO_OWN_COUNTS,
    "no_sums": NO_SUMS,
    "own_flag_only": OWN_FLAG_ONLY,
    "no_waits": NO_WAITS,
    "no_waits_no_done_count": NO_WAITS + NO_DONE_COUNT,
    "relaxed_done_count": RELAXED_DONE_COUNT,
    "one_unit_a_wait": ONE_UNIT_A_WAIT,
    "atomic_reads": ATOMIC_READS,
    "one_unit_atomic_reads": ONE_UNIT_A_WAIT + ATOMIC_READS,
    "one_reducer_warp": reducer_warps(1),
    "two_reducer_warps": reducer_warps(2),
    "units_by_pointers": BY_POINTERS,
    "units_prefetched_to_l2": PREFETCH_TO_L2,
    "units_waited_only": WAITS_ONLY,
    "consumer_lag_1": consumer_lag(1),
    "consumer_lag_2": consumer_lag(2),
}
COMPUTES_THE_OP = ("fused", "own_flag_only", "one_unit_a_wait", "atomic_reads", "one_unit_atomic_reads",
                   "one_reducer_warp", "two_reducer_warps", "units_by_pointers", "consumer_lag_1", "consumer_lag_2")
KERNEL = "matmul_reduce_scatter_reducer_kernel"
KERNEL_FILE = "_matmul_reduce_scatter_reducer.py"


def gemm_only_with(kernel, x, w, world, config, **scaled):
    """The launcher's GEMM-only mode for rank 0, launching `kernel` in place of the shipped
    reducer kernel (the launcher imports it at each plan)."""
    shipped = getattr(reducer_module, KERNEL)
    setattr(reducer_module, KERNEL, kernel)
    try:
        return _matmul_reduce_scatter.gemm_only(x, w, None, GroupInfo(None, 0, world), config, **scaled)
    finally:
        setattr(reducer_module, KERNEL, shipped)


def reducer_case(case):
    """(x, w, the GEMM-only mode's scale arguments, the config a call launches, the cuBLAS
    reference: torch._scaled_mm for an FP8 case, row-wise scales, bf16 out, its accumulation) of a case."""
    if case.fp8:
        x, w, scale_x, scale_w = fp8_case_inputs(case, "cuda")
        scales, fast = (scale_x, scale_w), case.fast_accum
        reference = lambda: cublas_reference(x, w, scales, fast)  # noqa: E731
        return x, w, {"scales": scales, "use_fast_accum": fast}, launched_config(case, x, w, scales), reference
    x, w = case_inputs(case, "cuda")
    return x, w, {}, launched_config(case, x, w), lambda: cublas_reference(x, w)


def reducer_parser(doc: str, models: str, tokens: str, variants: dict):
    """case_parser's arguments (at 8 ranks by default) with the cases' dtype and accumulation."""
    parser = case_parser(doc, models, "8", tokens, variants)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float8_e4m3fn"))
    parser.add_argument("--fast-accum", action="store_true", help="FP8: use_fast_accum (the layers' forward)")
    parser.set_defaults(rounds=5)
    return parser


def reducer_cases(args):
    """(case, x, w, scaled, config, reference, its expected rows) of each case of reducer_parser's
    arguments that a call runs on the reducer kernel; the others are named and skipped."""
    fast = args.fast_accum and args.dtype in FP8_DTYPE_NAMES
    for case in [dataclasses.replace(c, dtype=args.dtype, fast_accum=fast) for c in cases_of(args, "matmul_reduce_scatter")]:
        x, w, scaled, config, reference = reducer_case(case)
        if not config.warp_specialized:
            print(f"{case.label()}: a call runs the Triton kernel here, not the reducer kernel; skipped", flush=True)
            continue
        yield case, x, w, scaled, config, reference, expected_rows(case, reference())


def main() -> None:
    parser = reducer_parser(__doc__, "llama3-8b,llama3-70b", "4096,16384", VARIANTS)
    args = parser.parse_args()
    kernels = variant_kernels(reducer_module, KERNEL, KERNEL_FILE, chosen_variants(parser, args, VARIANTS))
    rows = []
    for case, x, w, scaled, config, reference, want in reducer_cases(args):
        runs = {}
        for name, kernel in kernels.items():
            run = gemm_only_with(kernel, x, w, case.world, config, **scaled)
            if name in COMPUTES_THE_OP and not relative_error(run(), want) < 2e-2:
                raise AssertionError(f"{case.label()}: {name} computes a wrong result")
            runs[name] = graphed(run)
        rows.append(time_case(case, runs, x, w, config, args.rounds, reference, transport=config.transport))
        del runs
        torch.cuda.empty_cache()
    report("reducer_parts", rows, list(kernels), "transport", args.out)


if __name__ == "__main__":
    main()
