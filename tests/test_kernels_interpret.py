"""Triton kernel bodies under TRITON_INTERPRET=1 on CPU, each in a subprocess (the flag must be
set before triton is imported, and must not leak into other tests)."""

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).parent


def run_interpreted(script: str):
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(HERE / script), str(random.randrange(1 << 30))],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ok" in proc.stdout


def test_all_gather_matmul_kernel():
    run_interpreted("_interpret_ag_gemm.py")


def test_matmul_reduce_scatter_kernel():
    run_interpreted("_interpret_gemm_rs.py")


def test_all_gather_matmul_launcher_host_logic():
    run_interpreted("_interpret_ag_launcher.py")


def test_matmul_all_reduce_kernel():
    run_interpreted("_interpret_gemm_ar.py")
