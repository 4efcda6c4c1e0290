"""How far the untuned config sits from the best tiling a one-GPU tune screened, from its results
files alone (no GPU).

    python benchmarks/heuristic_gap.py benchmarks/results/tune_gemm-h200-x1-2026-11-28-fp8-fast-all-gather.json [...]
        [--worst 10]

A shape outside the shipped tables launches the heuristic's config, so the heuristic is what a
user gets at most shapes: `fluxtp tune --one-gpu --out` records, per case, the median time of
every tiling it screened (`screen_ms`, one short interleaved measurement of all of them). Per file
and op, dtype and accumulation, this prints over each case's fastest screened time, geometric
mean (worst):
- `recorded`: the heuristic of the tune's own commit (the row's `heuristic_config`);
- `current`: the heuristic of this checkout (fluxtp.bench.gemm_grid.heuristic_config, on the
  all-gather's warp-specialized kernel where the tune screened that kernel), looked up among the
  screened tilings (copy chunks and transport aside: communication knobs): an edit of the heuristic is scored on committed measurements before any GPU
  runs it. A current config the tune did not screen counts under `unscreened` and is left out.
- `final`: the recorded heuristic's time over the tuned config's in the tune's final interleaved
  measurement (six rounds, and a second one of the two where they differ: the row's `ms`), i.e.
  what the table entry buys over that heuristic; 1 where the heuristic was kept.
Screens are two rounds and every tiling in them is timed alike, so a ratio of 1.02 is within noise
of 1 (single cases' screens and finals have differed by 5-10%: compare `recorded` with `final`); a
rule fitted to these files is scored in-sample and still needs an independent run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from dataclasses import dataclass

from tabulate import tabulate

from fluxtp.bench.gemm_grid import GemmCase, case_of, heuristic_config
from fluxtp.configs import config_class, describe

# The all-gather's copy chunks and the reduce-scatter's transport are communication knobs, which a
# one-GPU entry takes from the heuristic of the day it is launched: the tiling is what was tuned.
_COMMUNICATION = re.compile(r" chunk_rows=\d+| (push|pull|copy_engine)(?= )")


def _tiling(description: str) -> str:
    return _COMMUNICATION.sub("", description)


@dataclass(frozen=True)
class Gap:
    case: GemmCase
    recorded: float  # the tune's heuristic over the best screened time
    current: float | None  # this checkout's heuristic over it; None: not among the screened tilings
    current_config: str
    final: float | None = None  # the recorded heuristic's time over the tuned one's, in the tune's final measurement


def gaps(rows: list[dict]) -> list[Gap]:
    """One Gap per tune row that recorded its screen."""
    out = []
    for row in rows:
        screened = {_tiling(k): v for k, v in row.get("screen_ms", {}).items()}
        if not screened:
            continue
        case = case_of(row)
        best = min(screened.values())
        cls = config_class(case.op)
        recorded = screened.get(_tiling(describe(cls(**row["heuristic_config"]))))
        if recorded is None:  # the tune always screens its heuristic: a row from another writer
            raise ValueError(f"{case.label()}: its heuristic config is not among its screened tilings")
        warp_specialized = any(" ws " in k for k in screened)
        config = _tiling(describe(heuristic_config(case, warp_specialized)))
        current = screened.get(config)
        ms = row.get("ms", {})
        final = ms["heuristic"] / ms["tuned"] if ms.get("heuristic") and ms.get("tuned") else None
        out.append(Gap(case, recorded / best, None if current is None else current / best, config, final))
    return out


def _geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def _group(case: GemmCase) -> str:
    return f"{case.op} {case.dtype}{' fast' if case.fast_accum else ''}"


def summary(name: str, found: list[Gap]) -> list[list]:
    rows = []
    for group in dict.fromkeys(_group(g.case) for g in found):
        mine = [g for g in found if _group(g.case) == group]
        recorded = [g.recorded for g in mine]
        current = [g.current for g in mine if g.current is not None]
        final = [g.final for g in mine if g.final is not None]
        rows.append([
            name, group, len(mine), f"{_geomean(recorded):.4f} ({max(recorded):.3f})",
            f"{_geomean(current):.4f} ({max(current):.3f})" if current else "-", len(mine) - len(current),
            f"{_geomean(final):.4f} ({max(final):.3f})" if final else "-",
        ])
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="results of `fluxtp tune --one-gpu --out` (scenario tune_gemm)")
    parser.add_argument("--worst", type=int, default=0, help="also list this many cases with the largest current gap")
    args = parser.parse_args(argv)
    table, everything = [], []
    for path in args.files:
        with open(path) as f:
            data = json.load(f)
        if data.get("scenario") != "tune_gemm":
            parser.error(f"{path}: scenario {data.get('scenario')!r}, not a one-GPU tune's results (tune_gemm)")
        found = gaps(data["rows"])
        table += summary(os.path.basename(path).removeprefix("tune_gemm-").removesuffix(".json"), found)
        everything += found
    headers = ["tune", "op", "cases", "recorded heuristic / best (worst)", "current / best (worst)", "unscreened",
               "final: recorded heuristic / tuned (max)"]  # fmt: skip
    print(tabulate(table, headers=headers))
    if args.worst:
        worst = sorted((g for g in everything if g.current is not None), key=lambda g: -g.current)[: args.worst]
        print()
        print(tabulate([[g.case.label(), f"{g.current:.3f}", g.current_config] for g in worst],
                       headers=["case", "current / best", "current config"]))  # fmt: skip


if __name__ == "__main__":
    main()
