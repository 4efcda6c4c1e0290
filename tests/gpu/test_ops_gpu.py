"""The ops on WORLD GPUs (NCCL): tests/_cases.py's sweep (odd shapes, bias or not, every op)
against float64 for the nccl and torch backends, and smoke runs of `fluxtp info` / `fluxtp bench`.

Run on a host with 2 or more GPUs: python -m pytest tests/gpu
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

import fluxtp

from fluxtp.testing import run_on_ranks
from tests.gpu import WORLD
from tests._cases import ALL_OPS, check_all_gather_matmul, check_matmul_reduce, sweep

ROOT = Path(__file__).resolve().parents[2]


def _sweep_body(rank, world, seed, backend, dtype_names, ops):
    sweep(rank, world, seed, "cuda", [backend], [getattr(torch, name) for name in dtype_names], ops=ops)
    if backend == "torch" and "float16" in dtype_names:
        x = torch.randn(4, 8, device="cuda", dtype=torch.float16)
        with pytest.raises(ValueError, match="float16"):
            fluxtp.matmul_all_reduce(x, torch.randn(6, 8, device="cuda", dtype=torch.float16), backend="torch")


@pytest.mark.parametrize(
    "backend, dtype_names, ops",
    [
        ("nccl", ("bfloat16", "float16", "float32"), ALL_OPS),
        ("torch", ("bfloat16",), ALL_OPS),
        # torch's symmetric-memory all-reduce has no float16 (a clear error, checked in the body).
        ("torch", ("float16",), ("all_gather_matmul", "matmul_reduce_scatter")),
        ("auto", ("bfloat16", "float16"), ALL_OPS),
    ],
)
def test_sweep_on_two_gpus(backend, dtype_names, ops):
    # One spawned world per case: every dtype, shape and op of the sweep inside it.
    run_on_ranks(_sweep_body, WORLD, random.randrange(1 << 30), backend, dtype_names, ops, backend="nccl")


def _memory_body(rank, world, seed):
    """Fresh inputs every call, outputs dropped: the fused ops must leave nothing allocated behind
    and reuse the freed memory (a descriptor cache once kept every call's tensors: +20 GiB and
    two cudaMallocs per all-gather call after 60 calls at 8192 x 28672 x 8192, docs/perf-log.md)."""
    gen = torch.Generator(device="cuda").manual_seed(seed + rank)
    bf = torch.bfloat16
    m, n, k = 512, 1024, 768  # per rank
    w_ag = torch.randn(n, k, device="cuda", dtype=bf, generator=gen)
    w_rs = torch.randn(n, k, device="cuda", dtype=bf, generator=gen)
    cases = [  # (op, rows of its input, one call)
        ("all_gather_matmul", m, lambda x: fluxtp.all_gather_matmul(x, w_ag, backend="fused", return_gathered=True)),
        ("matmul_reduce_scatter", m * world, lambda x: fluxtp.matmul_reduce_scatter(x, w_rs, backend="fused")),
        ("matmul_all_reduce", 64, lambda x: fluxtp.matmul_all_reduce(x, w_ag, backend="fused")),
    ]
    for op, rows, call in cases:
        fresh = lambda: torch.randn(rows, k, device="cuda", dtype=bf, generator=gen)  # noqa: E731
        for _ in range(2):  # warm-up: workspaces, compilation
            call(fresh())
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        mallocs = torch.cuda.memory_stats().get("num_device_alloc", 0)
        for _ in range(30):
            out = call(fresh())
            del out
        torch.cuda.synchronize()
        grown = torch.cuda.memory_allocated() - base
        new_mallocs = torch.cuda.memory_stats().get("num_device_alloc", 0) - mallocs
        assert grown == 0, f"{op}: 30 calls left {grown} bytes allocated behind"
        assert new_mallocs <= 2, f"{op}: 30 calls made {new_mallocs} cudaMallocs (freed memory not reused)"


def test_fused_ops_leave_no_memory_behind():
    run_on_ranks(_memory_body, WORLD, random.randrange(1 << 30), backend="nccl")


def _launch_cache_body(rank, world, seed):
    """Once a call's launch key was seen, the fused ops launch the compiled kernel without
    Triton's binding (JITFunction.run); a new shape or a bias at a differently aligned address
    goes through Triton again (it compiles pointers by alignment), and every result is right."""
    from triton.runtime.jit import JITFunction

    bound = []  # kernels that went through Triton's JITFunction.run
    jit_run = JITFunction.run

    def counted(self, *args, **kwargs):
        bound.append(self.fn.__name__)
        return jit_run(self, *args, **kwargs)

    JITFunction.run = counted
    bf = torch.bfloat16
    ops = {
        "all_gather_matmul": lambda s, m, **kw: check_all_gather_matmul(
            rank, world, s, m, 384, 768, bf, "cuda", "fused", True, **kw
        ),
        "matmul_reduce_scatter": lambda s, m, **kw: check_matmul_reduce(
            "matmul_reduce_scatter", rank, world, s, m * world, 640, 512, bf, "cuda", "fused", True, **kw
        ),
        "matmul_all_reduce": lambda s, m, **kw: check_matmul_reduce(
            "matmul_all_reduce", rank, world, s, m // 16, 640, 512, bf, "cuda", "fused", True, **kw
        ),
    }
    try:
        for i, (op, check) in enumerate(ops.items()):
            seeds = iter(range(seed + 100 * i, seed + 100 * (i + 1)))
            check(next(seeds), 512)  # compiles, or finds the compiled kernel through Triton
            bound.clear()
            for _ in range(3):
                check(next(seeds), 512)
            assert bound == [], f"{op}: calls with a launch key seen before went through Triton: {bound}"
            for m in (512, 1000):  # a new bias alignment, then a new (ragged) shape: new keys
                check(next(seeds), m, misaligned_bias=True)
                # The op's kernel once; the all-gather's new plan also compiles its publish copy
                # (a kernel of its recorded call) through Triton, before recording it.
                gemms = [name for name in bound if name != "copy_kernel"]
                assert len(gemms) == 1, f"{op} m={m}, misaligned bias: expected one launch through Triton, got {bound}"
                bound.clear()
                check(next(seeds), m, misaligned_bias=True)
                assert bound == [], f"{op} m={m}: the second call with a key went through Triton: {bound}"
    finally:
        JITFunction.run = jit_run


def test_fused_launches_skip_triton_binding_and_stay_right():
    run_on_ranks(_launch_cache_body, WORLD, random.randrange(1 << 30), backend="nccl")


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
