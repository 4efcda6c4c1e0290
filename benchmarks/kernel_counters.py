"""Hardware counters of the fused GEMM-only kernels beside cuBLAS's, on one GPU, by Nsight Compute.

    python benchmarks/kernel_counters.py --shapes ag:16384x28672x8192 [--world 2] [--dtype float8_e4m3fn]
        [--fast-accum] [--vary FIELD=INT,...] [--out FILE.json]

The cases and variants of benchmarks/gemm_efficiency.py (cuBLAS, the fused GEMM-only mode, the
plain twin; --vary as there), each launched once under `ncu --clock-control none` (the clocks as
the GPU sets them: never locked here). Per kernel: its name (cuBLAS's nvjet names carry the tile,
the K block x stages and the cluster), launch shape, duration, SM clock, elapsed cycles, the
tensor pipes' active share and the L2 / L1 / DRAM throughput as shares of their peaks.
Each kernel runs alone at the clock its power draw allows, so kernels are compared here by
cycles; time ratios belong to gemm_efficiency.py's interleaved rounds.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).parent))

# Our name -> ncu's metric (the raw page's columns).
METRICS = {
    "duration": "gpu__time_duration.sum",
    "sm_clock": "sm__cycles_elapsed.avg.per_second",
    "cycles": "sm__cycles_elapsed.max",
    "tensor_active_pct": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "l2_pct": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "l1_pct": "l1tex__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_pct": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "l2_hit_pct": "lts__t_sector_hit_rate.pct",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
    "cluster": "launch__cluster_size",
    "registers": "launch__registers_per_thread",
}
# Units ncu may print for the two rescaled metrics, to microseconds and GHz.
TIME_UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}
CLOCK_UNITS = {"hz": 1e-9, "khz": 1e-6, "mhz": 1e-3, "ghz": 1.0}
NVJET = re.compile(r"_(\d+)x(\d+)_(\d+)x(\d+)_(\d+)x(\d+)_")


def parse_raw_csv(text: str) -> list[dict]:
    """ncu's `--csv --page raw` (a header row, a units row, a row per kernel) as METRICS records,
    durations in us and clocks in GHz; lines not of the CSV (the program's own output) are skipped."""
    rows = list(csv.reader(line for line in text.splitlines() if line.startswith('"')))
    if len(rows) < 2:
        raise ValueError("no ncu CSV in the output (did ncu profile any kernel?)")
    header, units = rows[0], rows[1]
    kernel_column = header.index("Kernel Name")
    columns = {name: header.index(metric) for name, metric in METRICS.items()}
    records = []
    for row in rows[2:]:
        record = {"kernel": row[kernel_column]}
        for name, metric in METRICS.items():
            column = columns[name]
            value = float(row[column].replace(",", ""))
            unit = units[column].lower()
            scales = TIME_UNITS if name == "duration" else CLOCK_UNITS if name == "sm_clock" else None
            if scales is not None:
                if unit not in scales:
                    raise ValueError(f"{metric}: unit {units[column]!r} not one of {', '.join(scales)}")
                value *= scales[unit]
            record[name] = round(value, 3) if name not in ("grid", "block", "cluster", "registers", "cycles") else int(value)
        records.append(record)
    return records


def cublas_tiling(kernel: str) -> str:
    """cuBLAS's nvjet kernel name as "MxN, K block x stages, cluster AxB" ('' for other kernels)."""
    match = NVJET.search(kernel) if kernel.startswith("nvjet") else None
    if not match:
        return ""
    m, n, k, stages, cx, cy = match.groups()
    return f"{m}x{n}, {k}x{stages}, cluster {cx}x{cy}"


def child(args) -> None:
    """Builds every case's variants (compiled and checked), then launches each once between the
    profiler's start and stop; writes the (case, variant) of each launch, in order, to args.manifest."""
    import torch

    from fluxtp.bench.gemm_grid import parse_cases
    from gemm_efficiency import case_variants

    cases = parse_cases(args.shapes, args.world, args.dtype)
    if args.fast_accum:
        cases = [dataclasses.replace(c, fast_accum=True) if c.fp8 else c for c in cases]
    prepared = []
    for case in cases:
        variants, config, skipped = case_variants(case, tuple(args.vary), any_bits=True)
        prepared.append((case, variants, config))
    manifest = []
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for case, variants, config in prepared:
        for variant in variants:
            variant.calls[0]()
            torch.cuda.synchronize()
            manifest.append({**dataclasses.asdict(case), "variant": variant.name, "config": dataclasses.asdict(config)})
    torch.cuda.profiler.stop()
    Path(args.manifest).write_text(json.dumps(manifest))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", required=True, help="op:MxNxK,... (op ag or rs; the layer's global sizes)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float8_e4m3fn"))
    parser.add_argument("--fast-accum", action="store_true")
    parser.add_argument("--vary", action="append", default=[], help="as gemm_efficiency.py's (outputs not bit-checked)")
    parser.add_argument("--out")
    parser.add_argument("--manifest", help=argparse.SUPPRESS)  # set: this is the profiled child
    args = parser.parse_args()
    if args.manifest:
        child(args)
        return

    from fluxtp.bench.results import command_line, envelope, write_json

    with tempfile.TemporaryDirectory() as scratch:
        manifest = os.path.join(scratch, "manifest.json")
        command = ["ncu", "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw",
                   "--metrics", ",".join(METRICS.values()), sys.executable, *sys.argv, "--manifest", manifest]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0 or not os.path.exists(manifest):
            sys.exit(f"ncu failed ({done.returncode}):\n{done.stderr[-4000:]}\n{done.stdout[-2000:]}")
        launches = json.loads(Path(manifest).read_text())
    kernels = parse_raw_csv(done.stdout)
    if len(kernels) != len(launches):
        sys.exit(f"{len(kernels)} kernels profiled for {len(launches)} launches: a variant launched more than one "
                 f"kernel ({[k['kernel'][:40] for k in kernels]})")
    rows = [{**launch, **kernel, "cublas_tiling": cublas_tiling(kernel["kernel"])} for launch, kernel in zip(launches, kernels)]
    cycles = {}
    for row in rows:
        key = (row["op"], row["M"], row["N"], row["K"], row["world"])
        cycles.setdefault(key, {})[row["variant"]] = row["cycles"]
        row["cycles_vs_cublas"] = round(row["cycles"] / cycles[key]["cublas"], 3)
    table = [[f"{r['op'][:2]} {r['M']}x{r['N']}x{r['K']} TP{r['world']}", r["variant"], r["kernel"][:36],
              r["cublas_tiling"] or "", r["grid"], r["cluster"], r["duration"], r["sm_clock"], r["cycles_vs_cublas"],
              r["tensor_active_pct"], r["l2_pct"], r["l1_pct"], r["dram_pct"]] for r in rows]  # fmt: skip
    print(tabulate(table, headers=["case", "variant", "kernel", "cuBLAS tiling", "grid", "cluster", "us", "GHz",
                                   "cycles/cuBLAS", "tensor %", "L2 %", "L1 %", "DRAM %"]))  # fmt: skip
    if args.out:
        import torch

        data = envelope("kernel_counters", rows, device=torch.cuda.get_device_name(), gpus=1, world=args.world,
                        command=command_line())
        print("wrote", write_json(data, args.out))


if __name__ == "__main__":
    main()
