"""benchmarks/heuristic_gap.py: the untuned config's time over the best screened one, read from a
one-GPU tune's results (no GPU)."""

import dataclasses
import importlib
import json
import sys
from pathlib import Path

import pytest

from fluxtp.bench.gemm_grid import GemmCase, heuristic_config
from fluxtp.configs import describe

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
heuristic_gap = importlib.import_module("heuristic_gap")


def _row(case: GemmCase, screen: dict, recorded, ms=None) -> dict:
    row = {**dataclasses.asdict(case), "screen_ms": screen, "heuristic_config": dataclasses.asdict(recorded)}
    return row if ms is None else {**row, "ms": ms}


def test_gaps_over_the_best_screened_tiling_communication_knobs_aside():
    ag = GemmCase("all_gather_matmul", 4096, 28672, 8192, 4, "float8_e4m3fn", fast_accum=True)
    now = heuristic_config(ag, warp_specialized=True)
    older = dataclasses.replace(now, num_stages=now.num_stages + 1)  # what an older heuristic was
    other_chunks = describe(dataclasses.replace(now, chunk_rows=now.chunk_rows * 2))  # the same GEMM
    screen = {describe(older): 0.30, other_chunks: 0.25, "128x128x128 ws s6 g4 chunk_rows=512": 0.20}
    rs = GemmCase("matmul_reduce_scatter", 2048, 8192, 28672, 8)
    rs_now = heuristic_config(rs)
    rs_older = dataclasses.replace(rs_now, group_m=4)
    # another transport is the same tiling; another epilogue split is not
    other_transport = dataclasses.replace(rs_now, transport="pull" if rs_now.transport != "pull" else "push")
    rs_screen = {describe(rs_older): 0.5, "128x128x64 w4 s4 g8 push epilogue_split=2": 0.4,
                 describe(dataclasses.replace(other_transport, epilogue_split=2)): 0.45}  # fmt: skip
    final = {"cublas": 0.18, "heuristic": 0.24, "tuned": 0.2}  # the tune's final measurement
    (gap, rs_gap) = heuristic_gap.gaps([_row(ag, screen, older, final), _row(rs, rs_screen, rs_older)])
    assert gap.final == pytest.approx(1.2) and rs_gap.final is None  # a row without its final times
    assert gap.case == ag and gap.recorded == pytest.approx(1.5) and gap.current == pytest.approx(1.25)
    assert gap.current_config == describe(now).split(" chunk_rows=")[0]
    # the reduce-scatter's current heuristic (its tiling, whatever the transport) was not screened:
    # no ratio, counted apart
    assert rs_gap.recorded == pytest.approx(1.25) and rs_gap.current is None
    screened_now = {**rs_screen, describe(other_transport): 0.6}
    (_, scored) = heuristic_gap.gaps([_row(ag, screen, older), _row(rs, screened_now, rs_older)])
    assert scored.current == pytest.approx(1.5)
    assert not any(t in scored.current_config for t in ("push", "pull", "copy_engine"))
    (summary_ag, summary_rs) = heuristic_gap.summary("file", [gap, rs_gap])
    assert summary_ag == ["file", "all_gather_matmul float8_e4m3fn fast", 1, "1.5000 (1.500)", "1.2500 (1.250)", 0,
                          "1.2000 (1.200)"]  # fmt: skip
    assert summary_rs == ["file", "matmul_reduce_scatter bfloat16", 1, "1.2500 (1.250)", "-", 1, "-"]


def test_the_warp_specialized_heuristic_only_where_the_tune_screened_that_kernel():
    ag = GemmCase("all_gather_matmul", 16384, 28672, 8192, 2)
    triton = heuristic_config(ag, warp_specialized=False)
    screen = {describe(triton): 1.0}
    (gap,) = heuristic_gap.gaps([_row(ag, screen, triton)])
    assert gap.current == 1.0  # no ws tiling screened: the Triton heuristic is scored
    screen[describe(heuristic_config(ag, warp_specialized=True))] = 0.9
    (gap,) = heuristic_gap.gaps([_row(ag, screen, triton)])
    assert gap.current == 1.0 and gap.recorded == pytest.approx(1 / 0.9)


def test_a_row_whose_heuristic_was_not_screened_is_refused():
    ag = GemmCase("all_gather_matmul", 4096, 28672, 8192, 2)
    h = heuristic_config(ag)
    with pytest.raises(ValueError, match="ag 4096x28672x8192 TP2 bfloat16: its heuristic config is not among"):
        heuristic_gap.gaps([_row(ag, {"128x128x64 w4 s4 g8": 1.0}, dataclasses.replace(h, group_m=16))])


def test_main_reads_the_committed_tunes(capsys, tmp_path):
    files = sorted(str(p) for p in (ROOT / "benchmarks" / "results").glob("tune_gemm-*.json"))
    assert files
    heuristic_gap.main([*files, "--worst", "3"])
    out = capsys.readouterr().out
    assert "current / best (worst)" in out and "h200-x1-2026-11-28-fp8-fast-all-gather" in out
    assert len([line for line in out.splitlines() if " TP" in line]) == 3  # the worst three cases
    other = tmp_path / "ops.json"
    other.write_text(json.dumps({"scenario": "ops", "rows": []}))
    with pytest.raises(SystemExit):
        heuristic_gap.main([str(other)])
