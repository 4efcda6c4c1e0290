"""`fluxtp tune --one-gpu`: the fused ops' GEMM tiling, tuned on one GPU.

What peers do not change can be tuned without them: the tile shape, pipelining depth, warps and
tile grouping of each fused op's GEMM-only mode (the op's own kernel, exactly as rank 0 of a
W-rank call launches it, every flag preset; fluxtp.bench.gemm_grid). Per case (GPU, world,
dtype, op, N, K, M bucket, weight layout; the cache's key):
1. the tilings of ONE_GPU_TILINGS that fit (fluxtp.tune.fits), and WARP_SPECIALIZED_TILINGS where
   the all-gather's warp-specialized kernel runs (FP8 cases: the warp-specialized kernels' FP8
   tilings), each with the communication knobs the heuristic gives that tiling (copy chunks; the
   reduce-scatter's transport), are checked against cuBLAS on random data and screened in one
   short interleaved measurement;
2. the three fastest and the heuristic's config are timed interleaved with cuBLAS
   (fluxtp.bench.harness; medians of the rounds). Every variant is a CUDA graph replay: the
   kernels alone are timed, not the host's launch (fluxtp.bench.harness.graphed).
3. the fastest there (the heuristic's, unless another leads it by MIN_GAIN), once it leads the
   heuristic's by MIN_GAIN again in a second interleaved measurement of the two (the fastest of
   several noisy times is partly the luckiest), is written to the cache (the same file and
   lookup as `fluxtp tune`), with "measured" {M, ms, heuristic_ms, cublas_ms, mode "gemm_only",
   date, versions, commit}.
Keys whose shipped entry was measured with communication (any mode but "gemm_only") are left
alone: a multi-GPU `fluxtp tune` measured their tiling and their communication knobs together.
Before any timing, the distinct kernels of the whole job are compiled by a pool of processes
into Triton's on-disk cache (compiling dominated a job's time when done one by one).
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import math
import multiprocessing
import os
import sys
from dataclasses import dataclass

import torch

from fluxtp._dist import GroupInfo
from fluxtp.bench.gemm_grid import (
    DTYPE_NAMES,
    GemmCase,
    bf16_output,
    case_inputs,
    cublas_reference,
    expected_rows,
    fp8_case_inputs,
    gathered,
    gemm_only_case,
    heuristic_config,
    relative_error,
    warp_specialized_runs,
)
from fluxtp.backends.fused._all_gather_matmul import routed
from fluxtp.backends.fused._matmul_reduce_scatter import reducer_fits
from fluxtp.bench.harness import Protocol, Variant, cache_bytes, graphed, input_copies, measure_rounds
from fluxtp.bench.ops import Shape
from fluxtp.configs import (
    GEMM_ONLY_MODE,
    Entry,
    Key,
    MatmulReduceScatterConfig,
    describe,
    fits,
    key_dtype,
    load,
    m_bucket,
)
from fluxtp.configs._classes import (
    GROUP_MS,
    REDUCER_FP8_WIDE_PRECISE_TILING,
    REDUCER_TILING,
    WARP_SPECIALIZED_FP8_FAST_TILING,
    WARP_SPECIALIZED_FP8_TILING,
    WARP_SPECIALIZED_FP8_WIDE_PRECISE_TILING,
    epilogue_split_for,
    fp8_tiling,
)
from fluxtp.tune import launched_space, write_entries

# (block_m, block_n, block_k, num_warps, num_stages) tried per case; the reduce-scatter's epilogue
# slices by epilogue_split_for.
ONE_GPU_TILINGS = (
    (128, 256, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (128, 128, 64, 4, 5),
    (128, 128, 64, 8, 4),
    (256, 128, 64, 8, 3),
    (128, 128, 128, 4, 3),
    (64, 256, 64, 4, 4),
    (64, 128, 64, 4, 4),  # twice the tiles of 128x128: fills the SMs where a case has under a wave of those
)
# The all-gather's warp-specialized kernel, screened beside those where a case can take it (bf16 /
# fp16 on Hopper): the same fields; num_warps names the Triton tiling of the same
# shape (the kernel runs a loader warp and two 4-warp consumers), num_stages what fits its staging.
WARP_SPECIALIZED_TILINGS = (
    (128, 256, 64, 8, 3),
    (128, 128, 64, 4, 4),
)
# FP8 GEMMs (the warp-specialized kernels): the 128x128x128 tiling at these stages (in the
# all-gather six fit beside a bf16 output's staging, in the reducer kernel what fits beside its
# partials) and row bands, and the 128x256x128 one of the call's accumulation in either band. On
# one H100 each moved single all-gather cases 10-30% either way with no rule between them
# (docs/perf-log.md).
FP8_STAGES = (4, 5, 6)
FP8_GROUP_MS = (4, 8)
FINALISTS = 3
SCREEN = Protocol(rounds=2, warmup_rounds=1, calls_per_sample=1)
FINAL_ROUNDS = 6
SAMPLE_MS = 2.0  # calls per sample: enough that one sample lasts about this long
MAX_CALLS = 10
# A tiling replaces the heuristic's only where it measured at least this much faster: a smaller
# lead is run-to-run noise, and the GEMM-only mode does not see what communication costs a tiling.
MIN_GAIN = 1.01
RELATIVE_ERROR_LIMIT = 1e-2  # bf16 operands, float32 accumulation: ~1e-3 when right, O(1) when a tile is wrong
COMPILE_WORKERS = 8


def candidates(case: GemmCase, warp_specialized: bool = False) -> list:
    """The tilings to screen for a case, each with the communication knobs of the heuristic and
    as a call launches it; warp_specialized: the GPU runs the case's warp-specialized kernel
    (warp_specialized_runs): the all-gather's, screened beside Triton's, or the reduce-scatter's
    reducer kernel, which a table's Triton tiling moves to where on_reducer_kernel says (so the
    tiling measured is the one launched) and which is screened in every band of GROUP_MS."""
    base = heuristic_config(case, warp_specialized)
    if case.fp8:
        if not warp_specialized:
            return [base]
        if case.op == "matmul_reduce_scatter":
            return [base, *_fp8_reduce_scatter_candidates(case, base)]
        (rows, k), (n, _) = case.shard_shapes
        launched = [routed(c, rows, n, k, case.world, True, scaled=bf16_output(case)) for c in _fp8_candidates(case, base)]
        return list(dict.fromkeys([base, *launched]))
    on_ag_kernel = warp_specialized and case.op == "all_gather_matmul"
    tilings = [(t, False) for t in ONE_GPU_TILINGS] + [(t, True) for t in WARP_SPECIALIZED_TILINGS if on_ag_kernel]
    out = []
    for (bm, bn, bk, warps, stages), on_warp_specialized in tilings:
        tiling = dict(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, group_m=8,
                      warp_specialized=on_warp_specialized)  # fmt: skip
        if case.op == "matmul_reduce_scatter":
            tiling["epilogue_split"] = epilogue_split_for(bn)
        else:  # not the base's stream-K: launched_space gives each tiling its own
            tiling["stream_k"] = False
        config = with_communication_heuristic(case, dataclasses.replace(base, **tiling))
        if fits(case.op, config):
            out.append(config)
    itemsize = DTYPE_NAMES[case.dtype].itemsize
    out = launched_space(case.op, out, Shape(case.M, case.N, case.K), case.world, warp_specialized, itemsize)
    if case.op == "matmul_reduce_scatter" and warp_specialized:
        tiling = MatmulReduceScatterConfig(**REDUCER_TILING, warp_specialized=True)
        reducer = [with_communication_heuristic(case, dataclasses.replace(tiling, group_m=g)) for g in GROUP_MS]
        out += [c for c in reducer if reducer_fits(c, case.N, case.world, itemsize)]
    return list(dict.fromkeys([base, *out]))


def _fp8_candidates(case: GemmCase, base) -> list:
    """An FP8 all-gather's warp-specialized tilings (FP8_STAGES, FP8_GROUP_MS; the 128x256 one of
    its accumulation), base's left out; without base's stream-K (the caller routes each)."""
    narrow = dataclasses.replace(base, **WARP_SPECIALIZED_FP8_TILING, warp_specialized=True, stream_k=False)
    out = [dataclasses.replace(narrow, num_stages=s, group_m=g) for s, g in itertools.product(FP8_STAGES, FP8_GROUP_MS)]
    wide_tiling = WARP_SPECIALIZED_FP8_FAST_TILING if case.fast_accum else WARP_SPECIALIZED_FP8_WIDE_PRECISE_TILING
    wide = dataclasses.replace(base, **wide_tiling, warp_specialized=True, stream_k=False)
    out += [dataclasses.replace(wide, group_m=g) for g in FP8_GROUP_MS]
    return [with_communication_heuristic(case, c) for c in dict.fromkeys(out) if c != base]


def _fp8_reduce_scatter_candidates(case: GemmCase, base) -> list:
    """An FP8 reduce-scatter's reducer-kernel tilings that fit beside a bf16 output's partials:
    the 128x128x128 one at FP8_STAGES and FP8_GROUP_MS, the 128x256x128 one of its accumulation in
    either band; where the heuristic keeps the Triton kernel (fast accumulation below
    REDUCER_MIN_WORLD ranks), that kernel's FP8 tilings in either band too. base's left out."""
    _, (n, _) = case.shard_shapes
    precise = not case.fast_accum
    wide = WARP_SPECIALIZED_FP8_FAST_TILING if case.fast_accum else REDUCER_FP8_WIDE_PRECISE_TILING
    tilings = [{**WARP_SPECIALIZED_FP8_TILING, "num_stages": s} for s in FP8_STAGES] + [wide]
    reducer = [MatmulReduceScatterConfig(**t, group_m=g, epilogue_split=2, warp_specialized=True)
               for t, g in itertools.product(tilings, FP8_GROUP_MS)]  # fmt: skip
    scaled = bf16_output(case)
    out = [c for c in reducer if reducer_fits(c, n, case.world, 1, scaled)]
    if not base.warp_specialized:
        for tiling in (fp8_tiling(precise, narrow=False), fp8_tiling(precise, narrow=True)):
            split = epilogue_split_for(tiling["block_n"])
            out += [MatmulReduceScatterConfig(**tiling, group_m=g, epilogue_split=split) for g in FP8_GROUP_MS]
    out = [with_communication_heuristic(case, c) for c in out]
    return [c for c in dict.fromkeys(out) if c != base]


def with_communication_heuristic(case: GemmCase, config):
    """`config`'s tiling with the communication knobs the heuristic gives it for the case."""
    (rows, _), (n, _) = case.shard_shapes
    if case.op == "all_gather_matmul":
        return config.with_communication_heuristic(rows)
    return config.with_communication_heuristic(case.M, n, case.world)


@dataclass
class CaseResult:
    case: GemmCase
    tuned: object
    heuristic: object
    ms: dict  # cublas, heuristic, tuned (the final interleaved measurement's medians)
    screen_ms: dict  # describe(config) -> the screening's median, every working candidate
    screened: int
    failed: list  # (config, why): rejected by the compiler or the launch
    wrong: list  # (config, why): computed a wrong result


class _Case:
    """A case's inputs (rotated copies when they fit in the cache) and its reference output."""

    def __init__(self, case: GemmCase, device: torch.device, generator: torch.Generator):
        x, w, *_ = first = _inputs(case, device, generator)
        copies = input_copies(x.numel() * x.element_size() + w.numel() * w.element_size(), cache_bytes(device))
        self.case = case
        # (x, w, scale_x, scale_w): an FP8 case's row-wise scales, (None, None) otherwise
        self.inputs = [first] + [_inputs(case, device, generator) for _ in range(copies - 1)]
        self.full_inputs = [(gathered(case, x), w, sx if sx is None else gathered(case, sx), sw)
                            for x, w, sx, sw in self.inputs]  # fmt: skip
        self.reference = expected_rows(case, _cublas(case, *self.full_inputs[0]))

    def variant(self, name: str, config) -> Variant:
        return Variant(name, tuple(graphed(_gemm_only(self.case, inputs, config)) for inputs in self.inputs))

    def cublas(self) -> Variant:
        return Variant("cublas", tuple(graphed(lambda full=full: _cublas(self.case, *full)) for full in self.full_inputs))

    def check(self, config) -> tuple[str | None, bool]:
        """(why the config is dropped, whether it computed a wrong result), or (None, False)."""
        try:
            out = _gemm_only(self.case, self.inputs[0], config)()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - OutOfResources and other compiler rejections
            return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"[:200], False
        error = relative_error(out, self.reference)
        if not error <= RELATIVE_ERROR_LIMIT:
            return f"relative error {error:.3g} against cuBLAS", True
        return None, False


def _inputs(case: GemmCase, device, generator) -> tuple:
    """(x, weight, scale_x, scale_w) of one rank: an FP8 case's row-wise scales, else (None, None)."""
    if case.fp8:
        return fp8_case_inputs(case, device, generator)
    return (*case_inputs(case, device, generator), None, None)


def _gemm_only(case: GemmCase, inputs: tuple, config):
    x, w, scale_x, scale_w = inputs
    return gemm_only_case(case, x, w, config, None if scale_x is None else (scale_x, scale_w))


def _cublas(case: GemmCase, x, w, scale_x, scale_w):
    """cuBLAS on one rank's whole GEMM (cublas_reference), with the case's accumulation (FP8)."""
    return cublas_reference(x, w, None if scale_x is None else (scale_x, scale_w), case.fast_accum)


def _calls_per_sample(run, device) -> int:
    """Calls that make a sample of about SAMPLE_MS (one call timed after a warm one)."""
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize(device)
    return max(1, min(MAX_CALLS, math.ceil(SAMPLE_MS / max(start.elapsed_time(end), 1e-3))))


def winner_of(timed: dict[str, float], names) -> str:
    """The fastest of `names` (one of them "heuristic") by `timed` ms, unless it leads the
    heuristic's by less than MIN_GAIN: then the heuristic."""
    fastest = min(names, key=lambda n: (timed[n], n != "heuristic"))
    return fastest if timed[fastest] * MIN_GAIN <= timed["heuristic"] else "heuristic"


def confirmed(timed: dict[str, float], winner: str) -> bool:
    """Whether `winner` still leads the heuristic's time by MIN_GAIN in `timed` (ms)."""
    return winner == "heuristic" or timed[winner] * MIN_GAIN <= timed["heuristic"]


def tune_case(case: GemmCase, device: torch.device, generator: torch.Generator) -> CaseResult:
    state = _Case(case, device, generator)
    info = GroupInfo(None, 0, 1)
    cublas = state.cublas()
    calls = _calls_per_sample(cublas.calls[0], device)
    warp_specialized = warp_specialized_runs(case, device)
    base = heuristic_config(case, warp_specialized)
    failed, wrong = [], []

    def working(configs) -> list:
        """The configs that compile, launch and compute the right result; the rest recorded."""
        ok = []
        for config in configs:
            why, is_wrong = state.check(config)
            if why is None:
                ok.append(config)
            else:
                (wrong if is_wrong else failed).append((config, why))
        return ok

    screened = working(candidates(case, warp_specialized))
    if base not in screened:
        raise RuntimeError(f"{case.label()}: the heuristic config {describe(base)} fails: {(failed + wrong)[0][1]}")
    names = {f"c{i}": c for i, c in enumerate(screened)}
    screen = dataclasses.replace(SCREEN, calls_per_sample=calls)
    ms_screen = measure_rounds([state.variant(n, c) for n, c in names.items()], screen, info, device).ms
    best = [names[n] for n in sorted(names, key=lambda n: ms_screen[n])[:FINALISTS]]
    finalists = list(dict.fromkeys([base, *best]))
    final_names = {("heuristic" if c == base else f"f{i}"): c for i, c in enumerate(finalists)}
    final = Protocol(rounds=FINAL_ROUNDS, warmup_rounds=1, calls_per_sample=calls)
    variants = [cublas] + [state.variant(n, c) for n, c in final_names.items()]
    timed = measure_rounds(variants, final, info, device).ms
    winner = winner_of(timed, final_names)
    if winner != "heuristic":
        # The fastest of several noisy finalists is partly the luckiest: its lead must hold in a
        # second interleaved measurement of the two alone, whose times are the ones recorded.
        pair = {"heuristic": base, winner: final_names[winner]}
        timed = measure_rounds([cublas] + [state.variant(n, c) for n, c in pair.items()], final, info, device).ms
        winner = winner if confirmed(timed, winner) else "heuristic"
    ms = {"cublas": timed["cublas"], "heuristic": timed["heuristic"], "tuned": timed[winner]}
    screen_ms = {describe(c): ms_screen[n] for n, c in names.items()}
    return CaseResult(case, final_names[winner], base, ms, screen_ms, len(screened), failed, wrong)


# ---------------------------------------------------------------- compiling ahead, in parallel


def _compile_jobs(cases: list[GemmCase], device=None) -> list[tuple[GemmCase, object]]:
    """One (case, config) per distinct kernel the job will launch on `device` (None: no GPU's
    own kernels), on the smallest case that launches it: shapes are runtime arguments,
    specialized only by divisibility (by 16, and the all-gather's TMA store by block_m), and the
    all-gather's chunk_rows is a runtime argument."""
    jobs = {}
    for case in sorted(cases, key=lambda c: c.M):
        (rows, _), _ = case.shard_shapes
        for config in candidates(case, device is not None and warp_specialized_runs(case, device)):
            fields = dataclasses.asdict(config)
            fields.pop("chunk_rows", None)
            spec = (rows % 16 == 0, rows % config.block_m == 0)
            key = (case.op, case.world, case.dtype, case.fast_accum, case.weight_layout, spec, tuple(fields.items()))
            jobs.setdefault(key, (case, config))
    return list(jobs.values())


def _compile_worker(jobs: list[tuple[GemmCase, object]]) -> int:
    torch.cuda.set_device(0)
    compiled = 0
    for case, config in jobs:
        try:
            _gemm_only(case, _inputs(case, "cuda", None), config)()
            compiled += 1
        except Exception:  # noqa: BLE001 - the tuner reports rejections itself
            pass
    torch.cuda.synchronize()
    return compiled


def precompile(cases: list[GemmCase], device, workers: int = COMPILE_WORKERS) -> int:
    """Compile every kernel the job will launch, in `workers` processes, into Triton's disk cache."""
    jobs = _compile_jobs(cases, device)
    workers = max(1, min(workers, len(jobs), (os.cpu_count() or 2) - 1))
    slices = [jobs[i::workers] for i in range(workers)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        return sum(pool.map(_compile_worker, slices))


# ---------------------------------------------------------------- the job


def multi_gpu_keys() -> set[Key]:
    """Keys of the shipped table measured with communication: every entry not written by this
    one-GPU tune (a multi-GPU `fluxtp tune`'s; its early entries record no nccl_ms)."""
    entries, _ = load(shipped=True)
    return {k for k, e in entries.items() if e.measured.get("mode") != GEMM_ONLY_MODE}


def case_key(case: GemmCase, gpu: str) -> Key:
    dtype = key_dtype(case.dtype, case.fast_accum)
    return Key(gpu, case.world, dtype, case.op, case.N, case.K, m_bucket(case.M), case.weight_layout)


def entry_of(result: CaseResult, gpu: str) -> Entry:
    from fluxtp.bench.results import git_commit, triton_version

    measured = {
        "M": result.case.M,
        "ms": round(result.ms["tuned"], 5),
        "heuristic_ms": round(result.ms["heuristic"], 5),
        "cublas_ms": round(result.ms["cublas"], 5),
        "mode": GEMM_ONLY_MODE,
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": triton_version(),
        "commit": git_commit(),
    }
    return Entry(case_key(result.case, gpu), result.tuned.as_entry(), measured)


def result_row(result: CaseResult) -> dict:
    ms = result.ms
    return {
        **dataclasses.asdict(result.case),
        "ms": {k: round(v, 5) for k, v in ms.items()},
        "tuned_vs_cublas": round(ms["tuned"] / ms["cublas"], 4),
        "heuristic_vs_cublas": round(ms["heuristic"] / ms["cublas"], 4),
        "tuned_config": dataclasses.asdict(result.tuned),
        "heuristic_config": dataclasses.asdict(result.heuristic),
        "screened": result.screened,
        "screen_ms": {k: round(v, 5) for k, v in result.screen_ms.items()},
        "failed": [f"{describe(c)}: {why}" for c, why in result.failed + result.wrong],
    }


def run(cases: list[GemmCase], cache_path: str | None, out: str | None, command: str, show_progress=True) -> int:
    """Tune every case on GPU 0, write the winners into the cache at cache_path (default: the
    user's cache) and the rows into `out` (a results JSON, or a folder for the default name).
    Returns the process's exit status: 1 when a candidate computed a wrong result."""
    from tabulate import tabulate
    from tqdm import tqdm

    from fluxtp.bench.results import envelope, result_filename, write_json

    device = torch.device("cuda", 0)
    gpu = torch.cuda.get_device_name(device)
    keep = multi_gpu_keys()
    todo = [c for c in cases if case_key(c, gpu) not in keep]
    for case in cases:
        if case not in todo:
            print(f"kept {case.label()}: its shipped entry was measured with communication", flush=True)
    print(f"compiled {precompile(todo, device)} kernels ahead", flush=True)
    generator = torch.Generator(device=device).manual_seed(20261124)
    path = out
    if out and (out.endswith(("/", os.sep)) or os.path.isdir(out)):
        path = os.path.join(out, result_filename("tune_gemm", gpu, 1, datetime.date.today().isoformat()))
    results = []
    # Written after every case, so that a job cut short keeps what it measured.
    for case in tqdm(todo, disable=not show_progress, unit="case", desc="tune --one-gpu", mininterval=10):
        results.append(tune_case(case, device, generator))
        written = write_entries([entry_of(results[-1], gpu)], cache_path)
        if path:
            write_json(envelope("tune_gemm", [result_row(r) for r in results], device=gpu, gpus=1, world=1,
                                command=command), path)
        torch.cuda.empty_cache()
    if results:
        print(f"wrote {len(results)} entries to {written}" + (f" and the results to {path}" if path else ""), flush=True)
    table = [
        [r.case.label(), f"{r.ms['cublas']:.4g}", f"{r.ms['heuristic'] / r.ms['cublas']:.3f}",
         f"{r.ms['tuned'] / r.ms['cublas']:.3f}", describe(r.tuned)]
        for r in results
    ]
    print(tabulate(table, headers=["case", "cuBLAS ms", "heuristic/cuBLAS", "tuned/cuBLAS", "tuned config"]))
    wrong = [(r.case, c, why) for r in results for c, why in r.wrong]
    for case, config, why in wrong:
        print(f"fluxtp tune: {case.label()}: {describe(config)} computed a WRONG result ({why})", flush=True)
    return 1 if wrong else 0


def cmd_tune_one_gpu(args) -> int:
    """`fluxtp tune --one-gpu`: the cases of --grid, or of --op/--shapes at each of --worlds."""
    from fluxtp.bench.gemm_grid import GemmCase, grid
    from fluxtp.bench.ops import parse_shapes
    from fluxtp.tune import NO_GPU_MESSAGE

    parser = args.parser
    try:
        if args.grid:
            cases = grid(args.grid)
        elif args.op and args.shapes:
            worlds = [int(w) for w in args.worlds.split(",")]
            layout = getattr(args, "weight_layout", "linear")
            cases = [
                GemmCase(args.op, s.M, s.N, s.K, w, args.dtype, layout) for w in worlds for s in parse_shapes(args.shapes)
            ]
        else:
            parser.error("--one-gpu needs --grid, or --op and --shapes")
    except ValueError as e:
        parser.error(str(e))
    if getattr(args, "fast_accum", False):
        if not any(case.fp8 for case in cases):
            parser.error("--fast-accum: FP8 cases only (--grid fp8-all-gather, or --dtype float8_e4m3fn)")
        cases = [dataclasses.replace(case, fast_accum=True) if case.fp8 else case for case in cases]
    if not torch.cuda.is_available():
        print(NO_GPU_MESSAGE, file=sys.stderr, flush=True)
        return 2
    fp8 = [case for case in cases if case.fp8]
    if fp8 and not warp_specialized_runs(fp8[0], torch.device("cuda", 0)):
        print("fluxtp tune: FP8 GEMMs are tuned on the warp-specialized kernels, which this GPU or Triton "
              "cannot run (a Hopper GPU, sm_90)", file=sys.stderr, flush=True)  # fmt: skip
        return 2
    return run(cases, args.cache, getattr(args, "out", None), getattr(args, "command_line", "fluxtp tune --one-gpu"))
