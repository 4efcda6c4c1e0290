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


def test_fp8_kernels_and_launcher():
    """Both fused kernels with FP8 operands and scales, and the all-gather launcher's row scales."""
    run_interpreted("_interpret_fp8.py")


def test_fp8_quantization_kernel():
    """fluxtp.fp8's quantization kernel against the eager reference: scales bit for bit."""
    run_interpreted("_interpret_quantize.py")


def test_weight_operand_reads_transposed_views_in_place():
    """The backward's W^T views go to the kernels' [k, n] path without a copy, unless TMA cannot
    read the [k, n] rows (n * element size not a multiple of 16 bytes): then a row-major [n, k]."""
    import torch

    from fluxtp.backends.fused._launch import weight_operand

    w = torch.randn(64, 32, dtype=torch.float16)  # nn.Linear layout [n, k]
    b, kn = weight_operand(w)
    assert not kn and b.data_ptr() == w.data_ptr()
    base = torch.randn(32, 64, dtype=torch.float16)  # [k, n]; base.t() is the backward's view
    b, kn = weight_operand(base.t())
    assert kn and b.data_ptr() == base.data_ptr() and b.shape == (32, 64)
    ragged = torch.randn(32, 1001, dtype=torch.float16)  # 1001 * 2 bytes per [k, n] row: not TMA-readable
    b, kn = weight_operand(ragged.t())
    assert not kn and b.shape == (1001, 32) and b.is_contiguous() and torch.equal(b, ragged.t())


def test_publish_copy_kernel():
    run_interpreted("_interpret_copy.py")
