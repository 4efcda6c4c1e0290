"""benchmarks/gemm_efficiency.py's table over cases whose varied configs differ: a --vary that a
case could not run (its shared memory, a kernel's refusal) shows "-" there, and the others' columns
stay (the run used to stop at the first such case)."""

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
gemm_efficiency = importlib.import_module("gemm_efficiency")


def _row(m: int, varied: dict) -> dict:
    row = {"op": "matmul_reduce_scatter", "M": m, "N": 4096, "K": 14336, "world": 4, "dtype": "float8_e4m3fn",
           "weight_layout": "linear", "model": "llama3-8b", "ms": {"cublas": 0.1, "fused": 0.12},
           "fused_vs_cublas": 1.2, "fused_vs_cublas_iqr": [1.19, 1.21]}  # fmt: skip
    for key, value in varied.items():
        row[key], row[key + "_iqr"] = value, [value - 0.01, value + 0.01]
    return row


def test_a_variant_a_case_could_not_run_shows_a_dash_and_keeps_its_column():
    ran = _row(8192, {"fused_num_stages=5_vs_fused": 0.95})
    skipped = {**_row(1024, {}), "skipped_variants": {"num_stages=5": "OutOfResources: shared memory"}}
    assert gemm_efficiency.varied_keys([skipped, ran]) == ["fused_num_stages=5_vs_fused"]
    table = gemm_efficiency.format_table([skipped, ran]).splitlines()
    assert "fused_num_stages=5/ref" in table[0]
    assert table[2].rstrip().endswith("-") and "0.950 (0.940-0.960)" in table[3]


def _target_row(op: str, m: int, world: int, fused: float, plain: float, block_n: int = 256) -> dict:
    n, k = (14336, 4096) if op == "all_gather_matmul" else (4096, 14336)
    return {"op": op, "M": m, "N": n, "K": k, "world": world, "dtype": "bfloat16", "weight_layout": "linear",
            "model": "llama3-8b", "ms": {}, "fused_vs_cublas": fused, "plain_vs_cublas": plain,
            "fused_vs_plain": round(fused / plain, 4),
            "config": {"block_m": 128, "block_n": block_n, "warp_specialized": block_n == 256}}  # fmt: skip


def test_the_targets_report_lists_each_case_over_its_groups_bound_with_its_costs_apart(tmp_path):
    """A reduce-scatter at TP=8 may read up to 1.08, at TP=4 up to 1.05; an all-gather 1.02. A case
    in two files counts once, the later file's; the report splits the cost and counts the waves."""
    import json

    first = [_target_row("matmul_reduce_scatter", 1024, 8, 1.30, 1.01), _target_row("all_gather_matmul", 1024, 8, 1.5, 1.1)]
    later = [
        {**_target_row("all_gather_matmul", 1024, 8, 1.179, 1.1, block_n=128), "model": ""},  # an older file's row
        _target_row("matmul_reduce_scatter", 1024, 4, 1.06, 1.02),
        _target_row("matmul_reduce_scatter", 2048, 8, 1.07, 1.00),  # within TP=8's bound
    ]
    paths = []
    for name, rows in (("a.json", first), ("b.json", later)):
        (tmp_path / name).write_text(json.dumps({"rows": rows}))
        paths.append(str(tmp_path / name))
    rows = gemm_efficiency.report_rows(paths)
    assert len(rows) == 4
    text = gemm_efficiency.format_targets(rows)
    summary, misses = text.split("\n\n")
    assert "1.5" not in summary and "1.179" in summary  # the later row replaced the earlier one
    over = misses.splitlines()[2:]
    assert [line.split()[:3] for line in over] == [["ag", "1024x14336x4096", "TP8"], ["rs", "1024x4096x14336", "TP4"],
                                                  ["rs", "1024x4096x14336", "TP8"]]  # fmt: skip
    assert over[0].split()[4:10] == ["1.179", "1.02", "1.100", "1.072", "0.85", "Triton"]  # 8 x 14 tiles: 0.85 waves
    assert over[1].split()[4:6] == ["1.060", "1.05"] and over[2].split()[4:6] == ["1.300", "1.08"]


def test_the_plain_twin_runs_triton_s_warps_for_a_warp_specialized_config():
    """A stream-K config says num_warps=4 (its kernel's consumer warpgroups); Triton's twin of its
    128x256 tiles needs 8, or its accumulator spills."""
    from fluxtp.configs import AllGatherMatmulConfig

    split = AllGatherMatmulConfig(warp_specialized=True, stream_k=True, num_warps=4)
    assert gemm_efficiency.triton_warps(split) == 8
    assert gemm_efficiency.triton_warps(AllGatherMatmulConfig(block_n=128, num_warps=4)) == 4
    assert gemm_efficiency.triton_warps(AllGatherMatmulConfig(block_n=128, num_warps=8)) == 8


def test_sustained_rows_take_each_variants_median_spell(monkeypatch):
    """--sustained: the median of the spells per variant, time, clock and power each; a GPU whose
    clock cannot be read shows "-" there."""
    from fluxtp.bench.harness import Spell, Variant

    spells = {"cublas": [Spell(1.0, 1350, 690), Spell(1.1, 1340, 691), Spell(1.0, 1350, 692)],
              "fused": [Spell(1.02, 1418, 690), Spell(1.02, 1417, 690), Spell(1.03, 1417.5, 689)]}  # fmt: skip
    asked = []

    def fake(variants, seconds, count, device, gpu):
        asked.append(([v.name for v in variants], seconds, count, gpu))
        return spells

    monkeypatch.setattr(gemm_efficiency, "measure_sustained", fake)
    variants = [Variant(name, (lambda: None,)) for name in ("cublas", "fused", "plain", "fused_group_m=4")]
    row = gemm_efficiency.sustained_row(variants, 3.0, 3, "cuda", "GPU-x")
    assert asked == [(["cublas", "fused"], 3.0, 3, "GPU-x")]
    assert row["cublas"] == {"ms": 1.0, "sm_mhz": 1350.0, "watts": 691.0}
    assert row["fused"] == {"ms": 1.02, "sm_mhz": 1417.5, "watts": 690.0}
    assert row["fused_vs_cublas"] == 1.02
    table = gemm_efficiency.format_sustained([{**_row(8192, {}), "sustained": row}]).splitlines()
    assert "alone" in table[0] and "1418" in table[2] and table[2].split()[-2:] == ["1.020", "1.200"]

    spells = {name: [Spell(1.0, None, None)] for name in ("cublas", "fused")}
    row = gemm_efficiency.sustained_row(variants, 3.0, 1, "cuda", None)
    assert row["cublas"]["sm_mhz"] is None
    assert " - " in gemm_efficiency.format_sustained([{**_row(8192, {}), "sustained": row}]).splitlines()[2]
