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
