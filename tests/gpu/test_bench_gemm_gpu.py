"""`fluxtp bench gemm` on one GPU, through the command a user types: `fluxtp bench` on a host that
shows one GPU runs it, checks each fused kernel against cuBLAS, times both and writes its rows."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpus(1)

ROOT = Path(__file__).resolve().parents[2]
SHAPE = "1024x4096x4096"  # small: the compiles, not the timing, take the time


def _bench(*args, timeout=600):
    first_gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]  # the command sees one GPU
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES=first_gpu)
    return subprocess.run([sys.executable, "-m", "fluxtp", "bench", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)  # fmt: skip


def _rows(path: Path, dtype: str) -> list[dict]:
    data = json.loads(path.read_text())
    assert data["scenario"] == "gemm" and data["gpus"] == 1 and data["world"] == 1, data
    assert data["device"] != "cpu"
    for row in data["rows"]:
        assert row["dtype"] == dtype
        assert all(v > 0 and math.isfinite(v) for v in row["ms"].values()), row
        assert 0.2 < row["fused_vs_cublas"] < 5, row  # a kernel of the same GEMM, not a broken launch
        low, high = row["fused_vs_cublas_iqr"]
        assert low <= high, row
        assert row["kernel"] in ("Triton", "warp-specialized") and row["config"], row
    return data["rows"]


def test_bench_on_one_gpu_runs_gemm_and_writes_its_rows(tmp_path):
    out, png = tmp_path / "gemm.json", tmp_path / "gemm.png"
    done = _bench("--shapes", SHAPE, "--tp", "2,8", "--rounds", "3", "--out", str(out), "--plot", str(png))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "one GPU here, so the fused kernels alone against cuBLAS" in done.stderr, done.stderr
    assert "fused/cuBLAS geomean" in done.stdout, done.stdout
    rows = _rows(out, "bfloat16")
    assert sorted((r["op"], r["world"]) for r in rows) == [
        ("all_gather_matmul", 2), ("all_gather_matmul", 8), ("matmul_reduce_scatter", 2), ("matmul_reduce_scatter", 8)
    ]  # fmt: skip
    assert png.stat().st_size > 0


def test_bench_gemm_times_the_fp8_kernels_against_scaled_mm(tmp_path):
    out = tmp_path / "gemm.json"
    done = _bench("gemm", "--fp8", "row-wise", "--fast-accum", "--shapes", SHAPE, "--tp", "4", "--rounds", "3",
                  "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _rows(out, "float8_e4m3fn")
    assert len(rows) == 2 and all(r["fast_accum"] for r in rows)
