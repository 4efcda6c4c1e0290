"""benchmarks/kernel_counters.py's reading of Nsight Compute's raw CSV (units rescaled, the program's
own output skipped) and of cuBLAS's kernel names."""

import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
kernel_counters = importlib.import_module("kernel_counters")


def _raw_csv(kernels: list[tuple[str, list[str]]], units: dict[str, str]) -> str:
    metrics = list(kernel_counters.METRICS.values())
    quote = lambda cells: ",".join(f'"{c}"' for c in cells)  # noqa: E731
    lines = ["==PROF== Connected to process 625", "ag 16384x28672x8192 TP2 (the program's own line)"]
    lines.append(quote(["ID", "Kernel Name", *metrics]))
    lines.append(quote(["", "", *(units.get(m, "") for m in metrics)]))
    lines += [quote([str(i), name, *values]) for i, (name, values) in enumerate(kernels)]
    return "\n".join(lines) + "\n"


def test_raw_csv_rescales_durations_and_clocks_and_keeps_launch_counts():
    values = ["2.540320", "1,414,338,252.66", "3,642,012", "98.85", "75.41", "76.28", "28.96", "80.85",
              "132", "384", "2", "168"]  # fmt: skip
    ours = ["2584.96", "1.479", "3,852,742", "93.29", "63.11", "59.90", "35.18", "77.94", "131", "384", "0", "168"]
    units = {"gpu__time_duration.sum": "msecond", "sm__cycles_elapsed.avg.per_second": "hz"}
    text = _raw_csv([("nvjet_sm90_qqtst_128x128_128x6_1x2_h_bz_ovscale_TNT", values),
                     ("all_gather_matmul_pingpong_kernel", ours)], units)  # fmt: skip
    cublas, fused = kernel_counters.parse_raw_csv(text)
    assert cublas["duration"] == pytest.approx(2540.32) and cublas["sm_clock"] == pytest.approx(1.414, abs=1e-3)
    assert cublas["cycles"] == 3642012 and cublas["cluster"] == 2 and cublas["grid"] == 132
    assert fused["kernel"] == "all_gather_matmul_pingpong_kernel" and fused["tensor_active_pct"] == pytest.approx(93.29)
    # A second file whose units differ: ncu picks them per run.
    units = {"gpu__time_duration.sum": "ns", "sm__cycles_elapsed.avg.per_second": "Ghz"}
    (again,) = kernel_counters.parse_raw_csv(_raw_csv([("k", ours)], units))
    assert again["duration"] == pytest.approx(2.585) and again["sm_clock"] == pytest.approx(1.479)
    with pytest.raises(ValueError, match="unit 'fortnight'"):
        kernel_counters.parse_raw_csv(_raw_csv([("k", ours)], {"gpu__time_duration.sum": "fortnight"}))


def test_output_without_a_profiled_kernel_is_an_error():
    with pytest.raises(ValueError, match="no ncu CSV"):
        kernel_counters.parse_raw_csv("==PROF== Disconnected from process 625\n")


@pytest.mark.parametrize("name, tiling", [
    ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "192x192, 64x4, cluster 2x1"),
    ("nvjet_sm90_qqtst_128x128_128x6_1x2_h_bz_ovscale_TNT", "128x128, 128x6, cluster 1x2"),
    ("all_gather_matmul_pingpong_kernel", ""),
])  # fmt: skip
def test_cublas_tiling_reads_nvjet_names(name, tiling):
    assert kernel_counters.cublas_tiling(name) == tiling
