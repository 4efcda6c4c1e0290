"""The ops on 2 GPUs (NCCL): tests/_cases.py's sweep (odd shapes, bias or not, every op)
against float64 for the nccl and torch backends, and smoke runs of `fluxtp info` / `fluxtp bench`.

Run on a host with 2 GPUs: python -m pytest tests/gpu
"""

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fluxtp.testing import run_on_ranks
from tests._cases import sweep

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2


def _sweep_body(rank, world, seed, backend, dtype_names):
    sweep(rank, world, seed, "cuda", [backend], [getattr(torch, name) for name in dtype_names])


@pytest.mark.parametrize(
    "backend, dtype_names",
    [
        ("nccl", ("bfloat16", "float16", "float32")),
        ("torch", ("bfloat16", "float16")),
        ("auto", ("bfloat16", "float16")),
    ],
)
def test_sweep_on_two_gpus(backend, dtype_names):
    # One spawned world per backend: every dtype, shape and op of the sweep inside it.
    run_on_ranks(_sweep_body, WORLD, random.randrange(1 << 30), backend, dtype_names, backend="nccl")


def _cli(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "fluxtp", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )


def test_info_sees_the_gpus_and_their_peers():
    done = _cli("info", timeout=120)
    assert done.returncode == 0, done.stderr
    assert re.search(r"^GPUs\s+\d+", done.stdout, re.M), done.stdout
    assert re.search(r"^GPU0\s+self\s+yes", done.stdout, re.M), done.stdout  # GPU0 reaches GPU1
    assert re.search(r"^torch\s+yes", done.stdout, re.M), done.stdout


def test_bench_smoke(tmp_path):
    out = tmp_path / "bench.json"
    done = _cli("bench", "--shapes", "1024x2048x1024", "--rounds", "3", "--nproc", str(WORLD), "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gemm ms" in done.stdout and "E_overlap torch" in done.stdout, done.stdout
    data = json.loads(out.read_text())
    assert data["schema"] == "fluxtp.bench/1" and data["gpus"] == WORLD and data["world"] == WORLD
    assert data["device"] != "cpu" and data["triton"] != "not installed"
    assert {row["op"] for row in data["rows"]} == {"all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"}
    for row in data["rows"]:
        assert row["dtype"] == "bfloat16"
        assert {"gemm", "nccl", "torch"} <= set(row["ms"]), row
        assert all(v > 0 for v in row["ms"].values()), row
        assert row["speedup_vs_nccl"]["nccl"] == 1.0
