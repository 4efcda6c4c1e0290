"""benchmarks/plot_train_policies.py: the policies figure draws the committed results' numbers."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _module():
    spec = importlib.util.spec_from_file_location("plot_train_policies", ROOT / "benchmarks" / "plot_train_policies.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FILES = [
    RESULTS / "train_policies-h100-x4-2026-11-28-bf16-tp4.json",
    RESULTS / "train_policies-h100-x4-2026-11-28-bf16-tp4-seq1024-16384.json",
    RESULTS / "train_policies-h100-x4-2026-11-28-fp8-tp2.json",
]


def test_panels_hold_each_files_ratios_by_tokens():
    drawn = _module().panels(FILES)
    assert set(drawn) == {("bf16", 4), ("FP8", 2)}
    fused = drawn[("bf16", 4)]["fused"]
    assert [p[0] for p in fused] == [1024, 2048, 4096, 8192, 16384]  # two runs' rows, in token order
    tokens, speedup, (low, high) = fused[3]
    assert tokens == 8192 and speedup == pytest.approx(1.069, abs=5e-4) and low <= speedup <= high
    assert "forward_fused" not in drawn[("FP8", 2)]  # only the policies the figure names


def test_a_file_of_another_scenario_is_refused(tmp_path):
    other = tmp_path / "ops.json"
    other.write_text('{"schema": "fluxtp.bench/1", "scenario": "ops", "rows": []}')
    with pytest.raises(ValueError, match="not a fluxtp.bench/1 train_policies result"):
        _module().panels([other])


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "policies.png"
    _module().plot(FILES, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
