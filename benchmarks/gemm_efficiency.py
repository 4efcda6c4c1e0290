"""Where the fused GEMMs stand against cuBLAS, on one GPU: the fusion's cost apart from Triton's.

    python benchmarks/gemm_efficiency.py [--shapes ag:1024x28672x8192,rs:1024x8192x28672,...]
        [--world 2] [--dtype bfloat16] [--weight-layout linear] [--rounds 10] [--out FILE.json]
    python benchmarks/gemm_efficiency.py --grid full [--rounds 6] [--out FILE.json]
    python benchmarks/gemm_efficiency.py --grid fp8 [--fast-accum] [--out FILE.json]

Per case (a layer's global MxNxK at one TP degree, as `fluxtp bench` takes it; --grid names a
grid of fluxtp/bench/gemm_grid.py: both ops, TP 2/4/8, four models' MLP dims, 1024-16384
tokens, bf16 and fp16, the backward's transposed weights), kernels computing the same per-rank
GEMM are timed interleaved by the benchmark harness as CUDA graph replays (one GPU, no peers;
graphs, so that small GEMMs are timed by the GPU, not by the host's launch):
- `cublas`: F.linear of the whole per-rank operands (what NCCL-then-GEMM runs after the collective);
- `fused`: the fused op's GEMM-only mode (every flag preset, exactly the kernel and config the op
  launches as rank 0: the user's cache, the shipped table or the heuristic);
- `plain`: a persistent TMA GEMM with the same tiling, stages, warps and tile grouping, and none
  of the fusion (no segments, waits, flags or partial hand-over): the fused kernel minus its
  fusion, so fused/plain is what the fusion costs and plain/cublas what Triton's code costs;
- `plain_ptr_epilogue` (--pointer-epilogue): `plain` storing its tiles with pointer stores in the
  reduce-scatter's column slices (its epilogue_split; 2 for the all-gather) instead of TMA
  stores, as the reduce-scatter's epilogue must (it writes partial tiles through buffer addresses).
FP8 cases (--dtype float8_e4m3fn, --grid fp8 / fp8-smoke): the scaled ops' kernels, row-wise scales,
bf16 out, against `cublas` = torch._scaled_mm of the same per-rank operands and scales (its
use_fast_accum as --fast-accum, as the fused kernel's); `plain` has no FP8 form and is left out.
`--vary FIELD` adds `fused_<FIELD>=<value>`: the fused GEMM-only mode with that boolean field of
the config negated (an A/B of one knob, interleaved with the rest); `--vary FIELD=INT` (or
`=true`/`=false`) sets a field instead (e.g. `num_stages=4`), `--vary A=1,B=true` several at
once; repeat it for more variants (a case that cannot run a variant, e.g. for shared memory,
shows "-" and the reason). Every output is checked against cuBLAS's before timing, and each
varied kernel's bitwise against the fused one's (so only knobs that keep the order of the sums
can be varied, unless --any-bits). The table ends with fused/cuBLAS per op and TP degree:
geometric mean and worst case.

`--sustained SECONDS [--spells 3]` then times `cublas` and `fused` each alone for SECONDS at a
time, alternating (the harness's sustained spells), with the SM clock and power nvidia-smi reads
meanwhile. The interleaved rounds share one clock and so compare work per cycle; a power-capped GPU
gives each kernel alone the clock its own power draw allows, as it would a stream of like calls.
The rows keep both.

    python benchmarks/gemm_efficiency.py --report FILE.json [FILE.json ...]

reads result files instead (a case in several: the last file's row) and prints them against the
GEMM-parity targets (TARGETS): per op, dtype and TP degree the geometric mean and worst case, then
every case over its target with what its kernel's GEMM costs (plain/cuBLAS), what the fusion
costs (fused/plain) and its launched tiles in waves of the SMs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources
from tabulate import tabulate
from tqdm import tqdm

from fluxtp._dist import GroupInfo
from fluxtp.backends.fused._launch import descriptor, num_sms, weight_operand
from fluxtp.bench.gemm_grid import (
    GRIDS,
    GemmCase,
    case_of,
    case_runs,
    check_close,
    expected_rows,
    gathered,
    gemm_only_case,
    grid,
    parse_cases,
)
from fluxtp.bench import gpu_state
from fluxtp.bench.harness import GPU_PROTOCOL, Protocol, Variant, graphed, measure_rounds, measure_sustained
from fluxtp.bench.results import command_line, envelope, write_json
from fluxtp.configs import HOPPER_SMS, cdiv
from fluxtp.configs._classes import triton_warps
from fluxtp.kernels import COMPILE_OPTIONS
from fluxtp.kernels._matmul_reduce_scatter import _halves
from fluxtp.kernels._tiles import dot_k_block, grouped_tile

# The GEMM-parity targets, fused / cuBLAS (or torch._scaled_mm): (geometric mean over a grid,
# every case) per op, and the FP8 ops' for either; the reduce-scatter's every-case bound is
# RS_CASE_TARGET_TP8 from 8 ranks on (its owner sums the most partials there).
TARGETS = {"all_gather_matmul": (1.00, 1.02), "matmul_reduce_scatter": (1.02, 1.05), "fp8": (1.00, 1.03)}
RS_CASE_TARGET_TP8 = 1.08

# The issues' shapes at TP=2 (LLaMA-70B and GPT-3-175B layer dims), both ops.
DEFAULT_SHAPES = ",".join(
    [f"ag:{m}x28672x8192" for m in (1024, 2048, 4096, 8192, 16384)]
    + [f"ag:{m}x49152x12288" for m in (1024, 4096, 16384)]
    + [f"rs:{m}x8192x28672" for m in (1024, 2048, 4096, 8192, 16384)]
    + [f"rs:{m}x12288x49152" for m in (1024, 4096, 16384)]
)


@triton.jit
def _store(c_ptr, acc, row0, col0, M, N):
    """Pointer stores of acc [BM, W] at (row0, col0) of C [M, N] (row-major), as the reduce-scatter stores."""
    offs_m = row0 + tl.arange(0, acc.shape[0])
    offs_n = col0 + tl.arange(0, acc.shape[1])
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(c_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def plain_matmul_kernel(a_desc, b_desc, c_desc, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr,
                        NUM_STAGES: tl.constexpr, EPILOGUE_SUBTILE: tl.constexpr, POINTER_SPLIT: tl.constexpr,
                        B_KN: tl.constexpr):
    """C = A @ B^T, persistent over tiles in grouped order, the fused kernels' K loop and epilogue."""
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    tile_id_c = tl.program_id(0) - NUM_SMS
    for tile_id in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_SMS, flatten=True, num_stages=NUM_STAGES):
        pid_m, pid_n = grouped_tile(tile_id, tiles_m, tiles_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in tl.range(k_tiles, num_stages=NUM_STAGES):
            a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
            acc = dot_k_block(a, b_desc, ki * BLOCK_K, pid_n * BLOCK_N, acc, B_KN, False)
        tile_id_c += NUM_SMS  # the epilogue's own counter, as in the fused kernels (no loop-carried tile)
        pid_m_c, pid_n_c = grouped_tile(tile_id_c, tiles_m, tiles_n, GROUP_M)
        if POINTER_SPLIT == 1:
            _store(c_ptr, acc, pid_m_c * BLOCK_M, pid_n_c * BLOCK_N, M, N)
        elif POINTER_SPLIT == 2:
            a0, a1 = _halves(acc, BLOCK_M, BLOCK_N)
            _store(c_ptr, a0, pid_m_c * BLOCK_M, pid_n_c * BLOCK_N, M, N)
            _store(c_ptr, a1, pid_m_c * BLOCK_M, pid_n_c * BLOCK_N + BLOCK_N // 2, M, N)
        elif POINTER_SPLIT == 4:
            a0, a1 = _halves(acc, BLOCK_M, BLOCK_N)
            a00, a01 = _halves(a0, BLOCK_M, BLOCK_N // 2)
            a10, a11 = _halves(a1, BLOCK_M, BLOCK_N // 2)
            _store(c_ptr, a00, pid_m_c * BLOCK_M, pid_n_c * BLOCK_N, M, N)
            _store(c_ptr, a01, pid_m_c * BLOCK_M, pid_n_c * BLOCK_N + BLOCK_N // 4, M, N)
            _store(c_ptr, a10, pid_m_c * BLOCK_M, pid_n_c * BLOCK_N + BLOCK_N // 2, M, N)
            _store(c_ptr, a11, pid_m_c * BLOCK_M, pid_n_c * BLOCK_N + 3 * BLOCK_N // 4, M, N)
        elif EPILOGUE_SUBTILE:
            acc0, acc1 = _halves(acc, BLOCK_M, BLOCK_N)
            c_desc.store([pid_m_c * BLOCK_M, pid_n_c * BLOCK_N], acc0.to(c_desc.dtype))
            c_desc.store([pid_m_c * BLOCK_M, pid_n_c * BLOCK_N + BLOCK_N // 2], acc1.to(c_desc.dtype))
        else:
            c_desc.store([pid_m_c * BLOCK_M, pid_n_c * BLOCK_N], acc.to(c_desc.dtype))


def plain_matmul(x: torch.Tensor, weight: torch.Tensor, config, pointer_split: int = 0, programs: int | None = None,
                 out: torch.Tensor | None = None):  # fmt: skip
    """A launcher of plain_matmul_kernel for x [M, K] @ weight[N, K]^T with a fused op's tiling
    (pointer_split > 0: pointer stores in that many column slices instead of TMA stores;
    programs: how many persistent programs, one per SM unless given; out: where, [M, N])."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    subtile = getattr(config, "epilogue_subtile", True)
    store_n = config.block_n // 2 if subtile else config.block_n
    a_desc = descriptor(x, [config.block_m, config.block_k])
    b, b_kn = weight_operand(weight)
    b_desc = descriptor(b, [config.block_k, config.block_n] if b_kn else [config.block_n, config.block_k])
    c_desc = descriptor(out, [config.block_m, store_n])
    sms = min(programs or num_sms(x.device), triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n))
    warps = triton_warps(config)

    def run():
        plain_matmul_kernel[(sms,)](
            a_desc, b_desc, c_desc, out, m, n, k, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            GROUP_M=config.group_m, NUM_SMS=sms, NUM_STAGES=config.num_stages, EPILOGUE_SUBTILE=subtile,
            POINTER_SPLIT=pointer_split, B_KN=b_kn,
            num_warps=warps, num_stages=config.num_stages, **COMPILE_OPTIONS,  # as the fused kernels
        )
        return out

    return run


def case_variants(case: GemmCase, vary: tuple[str, ...] = (), pointer_epilogue: bool = False, any_bits: bool = False):
    """(the variants of one case, the config used, {varied label: why it cannot run here}): each
    output checked against cuBLAS's (and each varied one against the fused kernel's bits, unless
    any_bits); a varied config that does not fit this case (shared memory, a kernel's refusal) is
    left out with its reason, not the run."""
    prepared = case_runs(case, "cuda")  # cuBLAS and the fused GEMM-only mode, the latter checked
    runs, config, ref = dict(prepared.runs), prepared.config, prepared.reference
    x, weight, scales = prepared.x, prepared.weight, prepared.scales
    if not case.fp8:  # the plain twins have no FP8 form
        full = gathered(case, x)
        runs["plain"] = plain_matmul(full, weight, config)
        if pointer_epilogue:
            runs["plain_ptr_epilogue"] = plain_matmul(full, weight, config,
                                                      pointer_split=getattr(config, "epilogue_split", 2))  # fmt: skip
        for name in runs.keys() - {"cublas", "fused"}:
            check_close(case, name, runs[name](), ref)
    fused = runs["fused"]
    variants = [Variant(name, (graphed(run),)) for name, run in runs.items()]
    skipped = {}
    for spec in vary:
        changes = varied_fields(config, spec)
        label = ",".join(f"{name}={value}" for name, value in changes.items())
        try:
            varied = gemm_only_case(case, x, weight, dataclasses.replace(config, **changes), scales)
            out = varied()
        except (OutOfResources, ValueError) as error:
            skipped[label] = f"{type(error).__name__}: {error}"
            continue
        check_close(case, label, out, expected_rows(case, ref))
        if not any_bits and not torch.equal(out, fused()):
            raise AssertionError(f"{case.label()}: {label} changes the fused kernel's output bits")
        variants.append(Variant(f"fused_{label}", (graphed(varied),)))
    return variants, config, skipped


def varied_fields(config, spec: str) -> dict:
    """`--vary`'s FIELD[=VALUE][,FIELD[=VALUE]...] as field values: a bare FIELD negates a boolean,
    VALUE is an integer, true, false or a word (transport=push)."""
    changes = {}
    for item in spec.split(","):
        name, _, text = item.strip().partition("=")
        if not hasattr(config, name):
            raise ValueError(f"--vary {spec!r}: {type(config).__name__} has no field {name!r}")
        if not text:
            changes[name] = not getattr(config, name)
        elif text.lower() in ("true", "false"):
            changes[name] = text.lower() == "true"
        else:
            changes[name] = int(text) if text.lstrip("-").isdigit() else text
    return changes


def varied_keys(rows: list[dict]) -> list[str]:
    """The varied variants' ratio keys over all rows, in first-seen order (a row lacks those it skipped)."""
    keys = (key for row in rows for key in row if key.startswith("fused_") and key.endswith("_vs_fused"))
    return list(dict.fromkeys(keys))


def sustained_row(variants: list[Variant], seconds: float, spells: int, device, gpu) -> dict:
    """`--sustained`: cuBLAS and the fused kernel each alone for `seconds`, `spells` times
    (harness.measure_sustained): per variant the median ms, SM clock and power of its spells, and
    fused_vs_cublas the ratio of those times. No time per cycle: nvidia-smi's clock is a sample,
    and a kernel's memory stalls take fewer cycles at a lower clock."""
    pair = [v for v in variants if v.name in ("cublas", "fused")]
    spelled = measure_sustained(pair, seconds, spells, device, gpu)

    def median(values):
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 1) if values else None

    out = {"seconds": seconds, "spells": spells}
    for name, runs in spelled.items():
        out[name] = {"ms": round(statistics.median(r.ms for r in runs), 4), "sm_mhz": median(r.sm_mhz for r in runs),
                     "watts": median(r.watts for r in runs)}  # fmt: skip
    cublas, fused = out["cublas"], out["fused"]
    out["fused_vs_cublas"] = round(fused["ms"] / cublas["ms"], 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cases = parser.add_mutually_exclusive_group()
    cases.add_argument("--shapes", default=DEFAULT_SHAPES, help="op:MxNxK,... (op ag or rs; the layer's global sizes)")
    cases.add_argument("--grid", choices=tuple(GRIDS), help="a named grid of cases (fluxtp/bench/gemm_grid.py) instead")
    parser.add_argument("--world", type=int, default=2, help="with --shapes: the TP degree whose per-rank GEMM is timed")
    parser.add_argument("--rounds", type=int, default=GPU_PROTOCOL.rounds)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float8_e4m3fn"), help="with --shapes")
    parser.add_argument("--fast-accum", action="store_true",
                        help="FP8 cases: use_fast_accum in both torch._scaled_mm and the fused kernel")
    parser.add_argument("--weight-layout", default="linear", choices=("linear", "transposed"), help="with --shapes")
    parser.add_argument("--pointer-epilogue", action="store_true",
                        help="also time the plain kernel storing through pointers in the reduce-scatter's column slices")
    parser.add_argument("--vary", action="append", default=[],
                        help="time the fused mode with a boolean config field negated (FIELD) or an integer one set "
                             "(FIELD=INT) as well; repeatable")
    parser.add_argument("--any-bits", action="store_true",
                        help="--vary may change the output bits (knobs that reorder the sums, e.g. block_k): "
                             "varied kernels are checked against cuBLAS only")
    parser.add_argument("--sustained", type=float, metavar="SECONDS",
                        help="also time cuBLAS and the fused kernel each alone for SECONDS at a time (--spells times), "
                             "with the SM clock and power read meanwhile: what a power-capped GPU gives a stream "
                             "of like calls (the interleaved rounds share one clock)")
    parser.add_argument("--spells", type=int, default=3, help="with --sustained: spells of each")
    parser.add_argument("--out")
    parser.add_argument("--report", nargs="+", metavar="FILE",
                        help="print result files against the targets instead of timing (no GPU needed)")
    args = parser.parse_args()
    if args.report:
        print(format_targets(report_rows(args.report)))
        return
    if args.grid:
        todo = grid(args.grid)
    else:
        todo = parse_cases(args.shapes, args.world, args.dtype, args.weight_layout)
    if args.fast_accum:
        todo = [dataclasses.replace(c, fast_accum=True) if c.fp8 else c for c in todo]
    protocol = Protocol(rounds=args.rounds, warmup_rounds=GPU_PROTOCOL.warmup_rounds,
                        calls_per_sample=GPU_PROTOCOL.calls_per_sample)
    device = torch.device("cuda", torch.cuda.current_device())
    gpu = gpu_state.smi_id(device)
    state = {"before": gpu_state.snapshot(gpu)}
    print("GPU before:", state["before"])
    rows = []
    for case in tqdm(todo, unit="case", mininterval=10):
        variants, config, skipped = case_variants(case, tuple(args.vary), args.pointer_epilogue, args.any_bits)
        timings = measure_rounds(variants, protocol, GroupInfo(None, 0, 1), device)
        ms = {name: round(t, 4) for name, t in timings.ms.items()}

        def ratio(a: str, b: str) -> dict:
            """{a}_vs_{b}: time over time; {a}_vs_{b}_iqr: the middle half of the per-round ratios
            (paired within a round: drift cancels)."""
            return {f"{a}_vs_{b}": round(ms[a] / ms[b], 4),
                    f"{a}_vs_{b}_iqr": [round(q, 4) for q in timings.ratio_quartiles(a, b)[::2]]}

        pointer = ratio("plain_ptr_epilogue", "plain") if "plain_ptr_epilogue" in ms else {}
        plain = {**ratio("plain", "cublas"), **ratio("fused", "plain")} if "plain" in ms else {}
        rows.append({
            **dataclasses.asdict(case), "ms": ms,
            **ratio("fused", "cublas"), **plain, **pointer,
            **{key: v for name in ms if name.startswith("fused_") for key, v in ratio(name, "fused").items()},
            "config": dataclasses.asdict(config), **({"skipped_variants": skipped} if skipped else {}),
        })
        if args.sustained:
            rows[-1]["sustained"] = sustained_row(variants, args.sustained, args.spells, device, gpu)
        del variants
        torch.cuda.empty_cache()
    state["after"] = gpu_state.snapshot(gpu)
    print("GPU after:", state["after"])
    device_name = torch.cuda.get_device_name()
    print(f"{device_name}, per-rank GEMMs, ms (median of {args.rounds} interleaved rounds); ratios are time over time "
          "(above 1: slower than the reference)")
    print(format_table(rows))
    print(format_summary(rows))
    if args.sustained:
        print(f"Each alone for {args.sustained:g} s, median of {args.spells} spells:")
        print(format_sustained(rows))
    for r in rows:
        for label, why in r.get("skipped_variants", {}).items():
            print(f"not run: {case_of(r).label()} {label}: {why}")
    if args.out:
        worlds = sorted({r["world"] for r in rows})
        data = envelope("gemm_efficiency", rows, device=device_name, gpus=1, world=worlds[0] if len(worlds) == 1 else 0,
                        command=command_line())
        # A power-capped GPU's clocks move between runs and cases: the state read beside the ratios.
        data["gpu_state"] = {"fields": gpu_state.SNAPSHOT_FIELDS, **state}
        print("wrote", write_json(data, args.out))


def format_table(rows: list[dict]) -> str:
    def spread(r, key):
        if key not in r:  # a varied config this case could not run (its row's skipped_variants)
            return "-"
        low, high = r[key + "_iqr"]
        return f"{r[key]:.3f} ({low:.3f}-{high:.3f})"

    extra = [key for key in ("plain_ptr_epilogue_vs_plain",) if rows and key in rows[0]] + varied_keys(rows)
    table = [  # FP8 cases have no plain kernel: "-"
        [case_of(r).label(), r["ms"]["cublas"], r["ms"].get("plain", "-"), r["ms"]["fused"],
         f'{r["plain_vs_cublas"]:.3f}' if "plain_vs_cublas" in r else "-", spread(r, "fused_vs_cublas"),
         f'{r["fused_vs_plain"]:.3f}' if "fused_vs_plain" in r else "-"]
        + [spread(r, key) for key in extra]
        for r in rows
    ]
    headers = ["case", "cuBLAS", "plain", "fused", "plain/cuBLAS", "fused/cuBLAS (middle half)", "fused/plain"]
    return tabulate(table, headers=headers + [key.removesuffix("_vs_plain").removesuffix("_vs_fused") + "/ref" for key in extra])


def format_sustained(rows: list[dict]) -> str:
    """`--sustained`'s table: each variant's time, SM clock and power alone; fused/cuBLAS alone and
    interleaved."""

    def cell(value, digits=1):
        return "-" if value is None else f"{value:.{digits}f}"

    table = []
    for r in rows:
        s = r["sustained"]
        c, f = s["cublas"], s["fused"]
        table.append([case_of(r).label(), c["ms"], cell(c["sm_mhz"], 0), cell(c["watts"], 0), f["ms"], cell(f["sm_mhz"], 0),
                      cell(f["watts"], 0), f'{s["fused_vs_cublas"]:.3f}', f'{r["fused_vs_cublas"]:.3f}'])  # fmt: skip
    headers = ["case", "cuBLAS ms", "MHz", "W", "fused ms", "MHz", "W", "fused/cuBLAS alone", "interleaved"]
    return tabulate(table, headers=headers, disable_numparse=True)


def format_summary(rows: list[dict]) -> str:
    """fused/cuBLAS per (op, TP degree): geometric mean and worst case over the cases timed."""
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault((r["op"], r["world"], r["dtype"] in ("float8_e4m3fn",)), []).append(r["fused_vs_cublas"])
    table = [
        [op + (" fp8" if is_fp8 else ""), world, len(v), f"{statistics.geometric_mean(v):.3f}", f"{max(v):.3f}"]
        for (op, world, is_fp8), v in sorted(groups.items())
    ]
    return tabulate(table, headers=["op", "TP", "cases", "fused/cuBLAS geomean", "worst"])


def case_target(row: dict) -> tuple[float, float]:
    """(geometric mean, every case) targets of a results row's group (TARGETS)."""
    if case_of(row).fp8:
        return TARGETS["fp8"]
    mean, each = TARGETS[row["op"]]
    if row["op"] == "matmul_reduce_scatter" and row["world"] >= 8:
        each = RS_CASE_TARGET_TP8
    return mean, each


def waves(row: dict) -> float:
    """The row's launched tiles over the SMs of an H100 / H200: the all-gather's per segment of
    rows (a rank's), the reduce-scatter's over the whole per-rank GEMM."""
    case, config = case_of(row), row["config"]
    m, n, _ = case.gemm_shape
    if case.op == "all_gather_matmul":
        tiles = case.world * cdiv(m // case.world, config["block_m"]) * cdiv(n, config["block_n"])
    else:
        tiles = cdiv(m, config["block_m"]) * cdiv(n, config["block_n"])
    return tiles / HOPPER_SMS


def report_rows(paths: list[str]) -> list[dict]:
    """The rows of result files, one per case: a later file's row replaces an earlier one's."""
    rows = {}
    for path in paths:
        with open(path) as f:
            for row in json.load(f)["rows"]:
                rows[dataclasses.replace(case_of(row), model="")] = row  # older rows name no model
    return list(rows.values())


def format_targets(rows: list[dict]) -> str:
    """Per (op, dtype, accumulation, weight layout, TP degree): cases, fused/cuBLAS geomean and
    worst against the targets; then every case over its own target, cost split in two."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        case = case_of(r)
        dtype = case.dtype + (" fast" if case.fast_accum else "")
        groups.setdefault((case.op, dtype, case.weight_layout, case.world), []).append(r)
    summary, over = [], []
    for (op, dtype, layout, world), group in sorted(groups.items()):
        ratios = [r["fused_vs_cublas"] for r in group]
        mean_target, case_limit = case_target(group[0])
        misses = [r for r in group if r["fused_vs_cublas"] > case_limit]
        geomean = statistics.geometric_mean(ratios)
        summary.append([op, dtype, layout, world, len(group), f"{geomean:.3f}", f"{mean_target:.2f}", f"{max(ratios):.3f}",
                        f"{case_limit:.2f}", len(misses)])  # fmt: skip
        over += [
            [case_of(r).label(), f'{r["fused_vs_cublas"]:.3f}', f"{case_limit:.2f}",
             f'{r["plain_vs_cublas"]:.3f}' if "plain_vs_cublas" in r else "-",
             f'{r["fused_vs_plain"]:.3f}' if "fused_vs_plain" in r else "-", f"{waves(r):.2f}",
             "warp-specialized" if r["config"].get("warp_specialized") else "Triton"]
            for r in sorted(misses, key=lambda r: -r["fused_vs_cublas"])
        ]  # fmt: skip
    headers = ["op", "dtype", "weight", "TP", "cases", "geomean", "target", "worst", "case target", "over"]
    text = tabulate(summary, headers=headers, disable_numparse=True)  # keep the strings' digits
    if over:
        headers = ["case over its target", "fused/cuBLAS", "target", "plain/cuBLAS", "fused/plain", "waves", "kernel"]
        text += "\n\n" + tabulate(over, headers=headers, disable_numparse=True)
    return text


if __name__ == "__main__":
    main()
