"""`fluxtp tune` on WORLD GPUs: it finishes within its budget, writes the winner for this GPU, and
the next call of the op (backend "fused") launches exactly that config; a hand-written cache
entry that differs from the heuristic is launched too, and its result is right."""

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fluxtp
from fluxtp import tune
from fluxtp.backends.fused._all_gather_matmul import warp_specialized_runs
from fluxtp.bench.ops import Shape, relative_error, shard_shapes
from fluxtp.testing import run_on_ranks
from tests.gpu import WORLD, plan_configs

ROOT = Path(__file__).resolve().parents[2]

BUDGET_S = 45
# Process start, NCCL set-up and the first compile are outside the tuner's budget.
STARTUP_SLACK_S = 120
CASES = {
    "all_gather_matmul": Shape(4096, 8192, 4096),
    "matmul_reduce_scatter": Shape(4096, 4096, 8192),
}


def _launched_configs(op: str) -> list:
    from fluxtp.backends.fused import _all_gather_matmul, _matmul_reduce_scatter

    return plan_configs(_all_gather_matmul if op == "all_gather_matmul" else _matmul_reduce_scatter)


def _call_and_check(rank, world, op, shape, cache_dir, expected, out_file):
    os.environ["FLUXTP_CACHE_DIR"] = cache_dir
    device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=device).manual_seed(rank)
    x_shape, w_shape = shard_shapes(op, shape, world)
    x = torch.randn(x_shape, dtype=torch.bfloat16, device=device, generator=g)
    w = torch.randn(w_shape, dtype=torch.bfloat16, device=device, generator=g) * w_shape[1] ** -0.5
    seen = _launched_configs(op)
    fn = getattr(fluxtp, op)
    out = fn(x, w, backend="fused")
    ref = fn(x, w, backend="nccl")
    torch.cuda.synchronize()
    error = relative_error(out, ref)
    assert error <= 8 * 2**-8, f"rank {rank}: {op} with the cached config is off by {error:.3g}"
    assert seen, "the fused kernel was not launched"
    assert dataclasses.asdict(seen[-1]) == expected, (dataclasses.asdict(seen[-1]), expected)
    if rank == 0:
        Path(out_file).write_text(json.dumps(dataclasses.asdict(seen[-1])))


@pytest.mark.parametrize("op", sorted(CASES))
def test_tune_finishes_in_budget_and_the_next_call_uses_the_winner(op, tmp_path):
    shape = CASES[op]
    cache_dir = tmp_path / "cache"
    env = dict(os.environ, FLUXTP_CACHE_DIR=str(cache_dir), PYTHONUNBUFFERED="1")
    args = ["--op", op, "--shapes", str(shape), "--budget-seconds", str(BUDGET_S), "--nproc", str(WORLD)]
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "fluxtp", "tune", *args],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUDGET_S + STARTUP_SLACK_S + 300,
    )
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert elapsed <= BUDGET_S + STARTUP_SLACK_S, f"took {elapsed:.0f} s with a {BUDGET_S} s budget"
    assert "wrote 1 entries to" in done.stdout, done.stdout

    entries, problem = tune.load(cache_dir / tune.CACHE_FILE)
    assert problem is None
    (entry,) = entries.values()
    gpu = torch.cuda.get_device_name(0)
    assert entry.key == tune.Key(gpu, WORLD, "bfloat16", op, shape.N, shape.K, tune.m_bucket(shape.M))
    assert entry.measured["ms"] <= entry.measured["heuristic_ms"]  # the heuristic was a finalist
    # the tuner's space as launched: with the op's warp-specialized kernel where this GPU runs it
    warp_specialized = warp_specialized_runs(torch.device("cuda", 0), torch.bfloat16)
    space = tune.search_space(op, shape.M, shape.N, shape.K, WORLD, warp_specialized)
    assert entry.config in tune.launched_space(op, space, shape, WORLD, warp_specialized, 2)
    choice = tune.choose(op, gpu, WORLD, "bfloat16", shape.M, shape.N, shape.K, path=cache_dir / tune.CACHE_FILE)
    assert choice.source == "exact" and choice.config == entry.config

    out_file = tmp_path / "launched.json"
    expected = dataclasses.asdict(entry.config)
    run_on_ranks(_call_and_check, WORLD, op, shape, str(cache_dir), expected, str(out_file), timeout_s=300)
    assert json.loads(out_file.read_text()) == expected


@pytest.mark.parametrize("op", sorted(CASES))
def test_a_cached_config_other_than_the_heuristic_is_launched(op, tmp_path):
    shape = CASES[op]
    base = tune.heuristic(op, shape.M, shape.N, shape.K, WORLD)
    # the heuristic's tiling with another tile order and the op's other knob (both kernel paths
    # are covered by the fused-op GPU tests), from the search space
    space = tune.search_space(op, shape.M, shape.N, shape.K, WORLD)
    if op == "all_gather_matmul":  # another chunking of the search space's
        other = next(
            c for c in space if c.chunk_rows != base.chunk_rows and c == dataclasses.replace(base, group_m=4, chunk_rows=c.chunk_rows)
        )
    else:
        other = dataclasses.replace(base, group_m=4, transport="pull" if base.transport != "pull" else "push")
    assert other != base and other in space
    gpu = torch.cuda.get_device_name(0)
    key = tune.Key(gpu, WORLD, "bfloat16", op, shape.N, shape.K, tune.m_bucket(shape.M))
    cache_dir = tmp_path / "cache"
    tune.write_entries([tune.Entry(key, other, {"M": shape.M})], cache_dir / tune.CACHE_FILE)
    out_file = tmp_path / "launched.json"
    expected = dataclasses.asdict(other)
    run_on_ranks(_call_and_check, WORLD, op, shape, str(cache_dir), expected, str(out_file), timeout_s=300)
    assert json.loads(out_file.read_text()) == expected
