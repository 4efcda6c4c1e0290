"""benchmarks/plot_headline.py: the README's headline figure comes from the committed results files."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("plot_headline", ROOT / "benchmarks" / "plot_headline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_headline_points_are_the_files_numbers():
    m = _module()
    name, n, k = m.HEADLINE[("all_gather_matmul", 2)]
    pts = m.speedups(m.RESULTS / name, "all_gather_matmul", n, k)
    assert [p["M"] for p in pts] == [1024, 2048, 4096, 8192, 16384]
    # each point is the file's own row: at M 8192, its fused speedup and the ratio of its medians
    row = next(r for r in json.loads((m.RESULTS / name).read_text())["rows"] if r["M"] == 8192 and r["N"] == n)
    p8192 = pts[3]
    assert p8192["vs_nccl"] == row["speedup_vs_nccl"]["fused"]
    assert p8192["vs_torch"] == pytest.approx(row["ms"]["torch"] / row["ms"]["fused"])
    assert p8192["vs_nccl_iqr"][0] <= p8192["vs_nccl"] <= p8192["vs_nccl_iqr"][1]
    assert p8192["vs_torch"] > 0


def test_plot_writes_a_png_naming_every_file(tmp_path):
    pytest.importorskip("matplotlib")
    m = _module()
    out = tmp_path / "headline.png"
    used = m.plot(out)
    assert sorted(used) == sorted(name for name, _, _ in m.HEADLINE.values())
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
