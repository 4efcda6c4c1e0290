"""fluxtp/tune.py on CPU: the search space, the config cache (format, keys, nearest bucket,
corrupt and stale files, atomic writes), the shipped table (package data, lookup order, a
corrupt one, merging tuned entries into it), the same choice on every rank of a gloo world, the
tuner's control flow (verify, prune, budget, one winner, the confirmation against the heuristic,
the comparison results) with CPU stand-ins for the kernels, and the `fluxtp tune` /
`fluxtp info --configs` commands."""

import dataclasses
import fnmatch
import json
import os
import re
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("triton")  # the fused configs live beside the Triton launchers

from fluxtp import cli, configs, tune
from fluxtp._dist import resolve_group
from fluxtp.backends.fused._all_gather_matmul import AllGatherMatmulConfig
from fluxtp.backends.fused._matmul_reduce_scatter import MatmulReduceScatterConfig
from fluxtp.bench.harness import overlap_efficiency
from fluxtp.bench.ops import Shape
from fluxtp.bench.results import ENVELOPE_KEYS
from fluxtp.testing import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
AG, RS = "all_gather_matmul", "matmul_reduce_scatter"
H200 = "NVIDIA H200"
# (op, M, N, K) global sizes: LLaMA-70B MLP dims at small and large M, a ragged M, a small layer.
SHAPES = [
    (AG, 1024, 28672, 8192),
    (AG, 16384, 28672, 8192),
    (AG, 3000, 14336, 4096),
    (RS, 1024, 8192, 28672),
    (RS, 8192, 8192, 28672),
    (RS, 256, 4096, 1024),
]


def expected_smem(op, c) -> int:
    """Written out independently of tune.smem_bytes: bf16 operand stages + the epilogue tile."""
    operands = c.num_stages * (c.block_m + c.block_n) * c.block_k * 2
    if op == AG:
        return operands + c.block_m * (c.block_n // 2) * 2  # half-tile TMA store, bf16
    return operands + c.block_m * (c.block_n // c.epilogue_split) * 4  # fp32 epilogue slice


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty FLUXTP_CACHE_DIR and no shipped table (whatever the package ships); the cache
    file's path."""
    monkeypatch.setenv("FLUXTP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(configs._table, "SHIPPED_TABLE", str(tmp_path / "shipped" / "default.json"))
    return tmp_path / "cache" / tune.CACHE_FILE


@pytest.fixture
def shipped(cache, tmp_path):
    """The shipped table's path in this test (no file yet), beside an empty user cache."""
    return tmp_path / "shipped" / "default.json"


def entry(op=AG, gpu=H200, world=2, dtype="bfloat16", n=28672, k=8192, m=4096, layout="linear", **fields):
    base = AllGatherMatmulConfig() if op == AG else MatmulReduceScatterConfig()
    key = tune.Key(gpu, world, dtype, op, n, k, tune.m_bucket(m), layout)
    return tune.Entry(key, dataclasses.replace(base, **fields), {"M": m, "ms": 1.0})


def measured(m, **extra) -> dict:
    """What rank_tune records of a measurement (every field a shipped entry needs)."""
    return {"M": m, "ms": 0.9, "heuristic_ms": 1.0, "nccl_ms": 1.1, "gemm_ms": 0.8, "candidates": 300, "screened": 40,
            "date": "2026-11-22", "torch": "2.11.0", "triton": "3.6.0", "commit": "0" * 40, **extra}  # fmt: skip


def measured_entry(m=4096, **kwargs):
    e = entry(m=m, **kwargs)
    return dataclasses.replace(e, measured=measured(m))


# ---------------------------------------------------------------- search space


@pytest.mark.parametrize("op, M, N, K", SHAPES)
def test_search_space_fits_shared_memory_without_duplicates(op, M, N, K):
    space = tune.search_space(op, M, N, K, 2)
    assert len(space) == len(set(space)) > 20
    assert set(space) == set(tune.candidates(op, M, N, K, 2))
    for c in space:
        assert expected_smem(op, c) == tune.smem_bytes(op, c)
        assert expected_smem(op, c) + tune.SMEM_RESERVE_BYTES <= 227 * 1024, tune.describe(c)
        assert c.block_m * c.block_n // (32 * c.num_warps) <= 128, tune.describe(c)  # accumulator registers
        if op == AG:
            assert c.chunk_rows % c.block_m == 0 and c.chunk_rows >= c.block_m
    # every axis of the space is explored where it fits
    assert {(c.block_m, c.block_n) for c in space} == {(128, 128), (128, 256), (256, 128)}
    assert {c.block_k for c in space} == {64, 128}
    assert {c.num_stages for c in space} == {3, 4, 5}
    assert {c.num_warps for c in space} == {4, 8}
    assert {c.group_m for c in space} == {4, 8, 16}
    if op == RS:
        assert {c.transport for c in space} == {"push", "pull", "copy_engine"}
        assert {c.epilogue_split for c in space} == {1, 2, 4}
    else:
        assert len({c.chunk_rows for c in space}) >= 2


@pytest.mark.parametrize("op, M, N, K", SHAPES)
def test_heuristic_config_is_in_the_space_and_tried_first(op, M, N, K):
    h = tune.heuristic(op, M, N, K, 2)
    if op == AG:
        assert h == AllGatherMatmulConfig.heuristic(M // 2, N // 2, K, 2)
    else:
        assert h == MatmulReduceScatterConfig.heuristic(M, N, K // 2, 2)
    assert h in tune.candidates(op, M, N, K, 2)  # enumerated, not only prepended
    space = tune.search_space(op, M, N, K, 2)
    assert space[0] == h
    # then the neighbours: one field away from the heuristic before anything two fields away
    fields = [f.name for f in dataclasses.fields(h)]
    distances = [sum(getattr(c, f) != getattr(h, f) for f in fields) for c in space]
    assert distances == sorted(distances)


@pytest.mark.parametrize("M, N, K", [(1024, 28672, 8192), (16384, 28672, 8192), (3000, 14336, 4096)])
def test_the_all_gathers_space_has_the_warp_specialized_kernel_where_it_runs(M, N, K):
    triton_only = tune.candidates(AG, M, N, K, 2)
    both = tune.candidates(AG, M, N, K, 2, warp_specialized=True)
    twins = [c for c in both if c.warp_specialized]
    assert not any(c.warp_specialized for c in triton_only)
    assert [c for c in both if not c.warp_specialized] == triton_only
    # one twin per 128-row, 64-deep Triton tiling of the warps its shape takes (4 for 128 columns,
    # 8 for 256), chunks included, where its staging (the whole tile) fits
    for c in twins:
        assert (c.block_m, c.block_k, c.num_warps) == (128, 64, c.block_n // 32), tune.describe(c)
        assert dataclasses.replace(c, warp_specialized=False) in triton_only
        stages = c.num_stages * (c.block_m + c.block_n) * c.block_k * 2
        assert tune.smem_bytes(AG, c) == stages + c.block_m * c.block_n * 2
        assert tune.smem_bytes(AG, c) + tune.SMEM_RESERVE_BYTES <= 227 * 1024
    assert {(c.block_n, c.num_stages) for c in twins} == {(128, 3), (128, 4), (128, 5), (256, 3)}
    assert {c.chunk_rows for c in twins} == {c.chunk_rows for c in triton_only if c.block_m == 128}
    # the search starts where the launcher does: the heuristic on that kernel
    space = tune.search_space(AG, M, N, K, 2, warp_specialized=True)
    assert space[0] == AllGatherMatmulConfig.heuristic(M // 2, N // 2, K, 2, warp_specialized=True)
    assert set(space) == set(both)
    # the reduce-scatter's are its reducer kernel's, after Triton's (test_multi_gpu_tune_measures_...)
    rs_both = tune.candidates(RS, M, N // 4, K * 4, 2, warp_specialized=True)
    assert [c for c in rs_both if not c.warp_specialized] == tune.candidates(RS, M, N // 4, K * 4, 2)


def test_reduce_scatter_transport_heuristic_and_check():
    # the copy engine where a segment of rows has two waves of tiles or more, else push
    assert MatmulReduceScatterConfig.heuristic(8192, 8192, 14336, 2).transport == "copy_engine"  # 32 x 32 tiles
    assert MatmulReduceScatterConfig.heuristic(2048, 8192, 14336, 2).transport == "copy_engine"  # 8 x 64
    assert MatmulReduceScatterConfig.heuristic(1024, 4096, 7168, 2).transport == "push"  # 4 x 32
    assert MatmulReduceScatterConfig.heuristic(4 * 8192, 8192, 7168, 4).transport == "push"  # TP=4: push at any size
    with pytest.raises(ValueError, match="transport must be one of push, pull, copy_engine, got 'nvlink'"):
        MatmulReduceScatterConfig(transport="nvlink")
    with pytest.raises(tune.CacheFileError, match="transport must be one of"):
        tune.config_from_dict(RS, {**dataclasses.asdict(MatmulReduceScatterConfig()), "transport": "nvlink"})


def test_what_does_not_fit_is_pruned():
    space = set(tune.candidates(AG, 8192, 28672, 8192, 2))
    shapes = {(c.block_m, c.block_n, c.block_k, c.num_stages, c.num_warps) for c in space}
    assert (128, 256, 64, 4, 8) in shapes  # 192 KiB operands + 32 KiB half tile: fits 227 KiB
    assert (128, 256, 64, 5, 8) not in shapes  # 240 KiB of operands alone
    assert (128, 128, 128, 4, 8) not in shapes  # 256 KiB
    assert not any(bk == 128 and max(bm, bn) == 256 for bm, bn, bk, _, _ in shapes)
    assert (128, 256, 64, 3, 4) not in shapes  # 256 accumulator registers a thread
    rs = set(tune.candidates(RS, 8192, 8192, 28672, 2))
    assert not any(c.block_n == 256 and c.epilogue_split == 1 for c in rs)  # spills (_matmul_reduce_scatter note)
    assert any(c.block_n == 128 and c.num_warps == 8 and c.epilogue_split == 1 for c in rs)
    assert tune.smem_bytes(AG, AllGatherMatmulConfig()) == 3 * (128 + 256) * 64 * 2 + 128 * 128 * 2


def test_m_bucket_rounds_up_to_powers_of_two():
    assert [tune.m_bucket(m) for m in (1, 2, 3, 1000, 1024, 1025, 16384)] == [1, 2, 4, 1024, 1024, 2048, 16384]


# ---------------------------------------------------------------- the cache file


def test_cache_round_trip(cache):
    entries = [
        entry(m=4096, block_n=128, num_stages=4, chunk_rows=1024),
        entry(op=RS, n=8192, k=28672, m=8192, transport="pull", epilogue_split=2),
    ]
    assert tune.write_entries(entries) == cache
    data = json.loads(cache.read_text())
    assert data["schema"] == "fluxtp.tune/1"
    first = data["entries"][0]
    assert {k: first[k] for k in tune.KEY_FIELDS} == {
        "gpu": H200, "world": 2, "dtype": "bfloat16", "op": AG, "N": 28672, "K": 8192, "M_bucket": 4096,
        "weight_layout": "linear",
    }  # fmt: skip
    assert first["config"] == dataclasses.asdict(entries[0].config)
    loaded, problem = tune.load()
    assert problem is None
    assert loaded == {e.key: e for e in entries}
    assert tune.parse(tune.dumps(loaded.values())) == loaded


def test_a_field_optional_in_tables_may_be_left_out_and_means_its_default():
    """warp_specialized came after tables were written: their entries read as False; a required
    field left out is still an error (test_corrupt_or_stale_file_is_ignored_with_one_warning)."""
    data = _valid_file()
    config = data["entries"][0]["config"]
    assert config["warp_specialized"] is False  # written like every other field
    del config["warp_specialized"]
    (parsed,) = tune.parse(json.dumps(data)).values()
    assert parsed.config.warp_specialized is False
    config["warp_specialized"] = True
    (parsed,) = tune.parse(json.dumps(data)).values()
    assert parsed.config.warp_specialized is True
    config["warp_specialized"] = 1
    with pytest.raises(tune.CacheFileError, match="warp_specialized=1"):
        tune.parse(json.dumps(data))


def test_a_reduce_scatter_entry_of_another_bucket_gives_way_where_its_tiles_leave_the_grid_idle(cache):
    """A 128x256 tiling tuned at 1024 tokens leaves a 256-token call (2 x 16 tiles at N 4096) a
    quarter of a wave: the call takes the heuristic's narrow tiles; the entry's own bucket, a call
    whose grid it fills, an FP8 entry and one on the reducer kernel keep the entry."""
    tuned = dict(op=RS, n=4096, k=14336, m=1024, num_stages=4, group_m=4, transport="copy_engine")
    fp8 = dict(tuned, dtype="float8_e4m3fn")  # its tilings were tuned apart (key_dtype)
    tune.write_entries([entry(**tuned), entry(**fp8), entry(**tuned, warp_specialized=True, world=4),
                        entry(**tuned, gpu="cpu")])  # fmt: skip
    for m in (256, 512):
        choice = tune.choose(RS, H200, 2, "bfloat16", m, 4096, 14336)
        assert choice.source == "nearest"
        assert choice.config == MatmulReduceScatterConfig.heuristic(m, 4096, 7168, 2) and choice.config.block_n == 128
        assert "mostly idle: the heuristic's instead" in choice.why
        x, w = torch.empty(m, 7168, dtype=torch.bfloat16), torch.empty(4096, 7168, dtype=torch.bfloat16)
        assert tune.tuned_config(RS, x, w, 2) == choice.config  # what the launcher takes (on a "cpu" key)
    kept = tune.choose(RS, H200, 2, "bfloat16", 1024, 4096, 14336)
    assert kept.config == entry(**tuned).config and "idle" not in kept.why
    assert tune.choose(RS, H200, 2, "bfloat16", 2048, 4096, 14336).config == entry(**tuned).config  # 256 tiles
    assert tune.choose(RS, H200, 2, "float8_e4m3fn", 256, 4096, 14336).config == entry(**fp8).config
    assert tune.choose(RS, H200, 4, "bfloat16", 256, 4096, 14336).config.warp_specialized


def test_writes_merge_and_replace_equal_keys(cache):
    tune.write_entries([entry(m=1024, block_n=128), entry(m=4096)])
    tune.write_entries([entry(m=4096, group_m=16), entry(m=16384)])
    loaded, _ = tune.load()
    assert sorted(k.M_bucket for k in loaded) == [1024, 4096, 16384]
    assert loaded[entry(m=4096).key].config.group_m == 16


def test_lookup_exact_then_nearest_bucket_then_heuristic(cache):
    tune.write_entries([entry(m=1024, block_n=128, chunk_rows=128), entry(m=16384, group_m=16)])
    exact = tune.choose(AG, H200, 2, "bfloat16", 1000, 28672, 8192)  # bucket 1024
    assert exact.source == "exact" and exact.config.chunk_rows == 128
    assert "exact" in exact.why
    near = tune.choose(AG, H200, 2, torch.bfloat16, 8192, 28672, 8192)  # 16384 is 1 bucket away, 1024 is 3
    assert near.source == "nearest" and near.config.group_m == 16
    assert "nearest M bucket 16384" in near.why
    tie = tune.choose(AG, H200, 2, "bfloat16", 4096, 28672, 8192)  # 2 buckets from each: the smaller
    assert tie.source == "nearest" and tie.config.chunk_rows == 128
    for other in [
        ("NVIDIA H100 80GB HBM3", 2, "bfloat16", 28672, 8192),
        (H200, 4, "bfloat16", 28672, 8192),
        (H200, 2, "float16", 28672, 8192),
        (H200, 2, "bfloat16", 14336, 8192),
        (H200, 2, "bfloat16", 28672, 4096),
    ]:
        gpu, world, dtype, n, k = other
        choice = tune.choose(AG, gpu, world, dtype, 4096, n, k)
        assert choice.source == "heuristic", other
        assert choice.config == AllGatherMatmulConfig.heuristic(4096 // world, n // world, k, world)
        assert "no tuned entry" in choice.why
    assert tune.choose(RS, H200, 2, "bfloat16", 4096, 28672, 8192).source == "heuristic"  # another op


def test_weight_layouts_have_keys_of_their_own_and_fall_back_to_linear(cache):
    """The backward's W^T views look up their own entries; without one, the linear layout's (the
    same config runs either layout), and a linear call never takes a transposed entry."""
    tune.write_entries([entry(m=4096, group_m=4), entry(m=8192, layout="transposed", group_m=16)])
    own = tune.choose(AG, H200, 2, "bfloat16", 8192, 28672, 8192, weight_layout="transposed")
    assert own.source == "exact" and own.config.group_m == 16 and "layout" not in own.why
    near = tune.choose(AG, H200, 2, "bfloat16", 4096, 28672, 8192, weight_layout="transposed")
    assert near.source == "nearest" and near.config.group_m == 16  # its own layout's nearest bucket first
    linear = tune.choose(AG, H200, 2, "bfloat16", 8192, 28672, 8192)
    assert linear.source == "nearest" and linear.config.group_m == 4  # not the transposed entry
    tune.write_entries([entry(op=RS, n=8192, k=28672, m=8192, transport="pull")])
    fallback = tune.choose(RS, H200, 2, "bfloat16", 8192, 8192, 28672, weight_layout="transposed")
    assert fallback.source == "exact" and fallback.config.transport == "pull"
    assert "from the linear layout (none tuned for transposed)" in fallback.why
    # The launchers' lookup reads the layout off the weight's strides.
    tune.write_entries([entry(gpu="cpu", n=64, k=32, m=256, layout="transposed", group_m=16)])
    x = torch.empty(128, 32, dtype=torch.bfloat16)
    w_t = torch.empty(32, 32, dtype=torch.bfloat16).t()  # [n, k] with strides (1, n)
    assert tune.weight_layout_of(w_t) == "transposed" and tune.weight_layout_of(w_t.contiguous()) == "linear"
    assert tune.tuned_config(AG, x, w_t, 2).group_m == 16
    assert tune.tuned_config(AG, x, w_t.contiguous(), 2) is None
    # Files written before the field existed (the shipped table's entries) are "linear".
    data = json.loads(tune.dumps([entry(m=2048)]))
    del data["entries"][0]["weight_layout"]
    (parsed,) = tune.parse(json.dumps(data)).values()
    assert parsed.key.weight_layout == "linear"


def test_an_fp8_all_gather_takes_its_tuned_entry_for_its_accumulation_on_the_warp_specialized_kernel(cache, monkeypatch):
    """An FP8 all-gather that can take the warp-specialized kernel launches its table entry for its
    accumulation (float8 keys; capped at four stages beside a float32 output's staging, and its
    heuristic where the entry's tiles leave that staging no room); one on the Triton kernel its
    heuristic."""
    from fluxtp.backends.fused import _all_gather_matmul, _scaled

    x, w = torch.zeros(512, 64).to(torch.float8_e4m3fn), torch.zeros(256, 64).to(torch.float8_e4m3fn)
    precise, fast = _scaled.Scaled(torch.bfloat16, True, True), _scaled.Scaled(torch.bfloat16, True, False)
    wide_out, fast_wide_out = _scaled.Scaled(torch.float32, True, True), _scaled.Scaled(torch.float32, True, False)
    assert not _all_gather_matmul._config_for(x, w, 2, None, precise).warp_specialized  # CPU: Triton, untuned
    monkeypatch.setattr(_scaled, "pingpong_unsupported", lambda *args, **kwargs: None)
    before = {s: _all_gather_matmul._config_for(x, w, 2, None, s) for s in (precise, fast, wide_out, fast_wide_out)}
    tuned = dataclasses.replace(before[precise], num_stages=6, group_m=4, chunk_rows=128)
    one_gpu = entry(gpu="cpu", world=2, dtype="float8_e4m3fn", n=512, k=64, m=1024)
    tune.write_entries([tune.Entry(one_gpu.key, tuned, {**one_gpu.measured, "mode": configs.GEMM_ONLY_MODE})])
    assert _all_gather_matmul._config_for(x, w, 2, None, precise) == tuned.with_communication_heuristic(512)
    assert _all_gather_matmul._config_for(x, w, 2, None, wide_out).num_stages == 4
    assert _all_gather_matmul._config_for(x, w, 2, None, fast) == before[fast]  # its own key
    assert tune.tuned_config(AG, x.to(torch.bfloat16), w.to(torch.bfloat16), 2) is None  # a bf16 call's key differs
    # Fast accumulation's key: "+fast_accum"; its 128x256 tiles leave no room for a float32 output.
    fast_key = dataclasses.replace(one_gpu.key, dtype=configs.key_dtype("float8_e4m3fn", fast_accum=True))
    assert fast_key.dtype == "float8_e4m3fn+fast_accum"
    wide = dataclasses.replace(tuned, block_n=256, num_stages=3, group_m=4)
    tune.write_entries([tune.Entry(fast_key, wide, {**one_gpu.measured, "mode": configs.GEMM_ONLY_MODE})])
    assert _all_gather_matmul._config_for(x, w, 2, None, fast) == wide.with_communication_heuristic(512)
    assert _all_gather_matmul._config_for(x, w, 2, None, fast_wide_out) == before[fast_wide_out]
    assert _all_gather_matmul._config_for(x, w, 2, None, precise) == tuned.with_communication_heuristic(512)


def test_an_fp8_reduce_scatter_takes_its_tuned_entry_for_its_accumulation_where_it_runs(cache, monkeypatch):
    """An FP8 reduce-scatter launches its table entry for its accumulation (float8 keys, tuned with
    bf16 partials): a Triton-kernel entry anywhere, a reducer-kernel one where that kernel runs and
    the call's partials leave it room (a float32 output's do not beside 128x256 tiles: the
    heuristic then); untuned, the heuristic on the reducer kernel where it runs."""
    from fluxtp.backends.fused import _matmul_reduce_scatter, _scaled
    from fluxtp.configs._classes import REDUCER_FP8_WIDE_PRECISE_TILING

    x, w = torch.zeros(1024, 64).to(torch.float8_e4m3fn), torch.zeros(256, 64).to(torch.float8_e4m3fn)
    precise, fast = _scaled.Scaled(torch.bfloat16, True, True), _scaled.Scaled(torch.bfloat16, True, False)
    wide_out = _scaled.Scaled(torch.float32, True, True)
    untuned = _matmul_reduce_scatter._config_for(x, w, 4, None, precise)
    assert not untuned.warp_specialized  # CPU: the Triton kernel's heuristic
    assert untuned == MatmulReduceScatterConfig.heuristic_fp8(1024, 256, 64, 4, True)
    one_gpu = entry(gpu="cpu", world=4, dtype="float8_e4m3fn", op=RS, n=256, k=256, m=1024)
    measured = {**one_gpu.measured, "mode": configs.GEMM_ONLY_MODE}
    triton = dataclasses.replace(untuned, group_m=4)
    tune.write_entries([tune.Entry(one_gpu.key, triton, measured)])
    assert _matmul_reduce_scatter._config_for(x, w, 4, None, precise) == triton
    assert _matmul_reduce_scatter._config_for(x, w, 4, None, fast) == untuned_fast(x, w)  # its own key
    # A reducer-kernel entry: the heuristic where that kernel does not run (here, the CPU)...
    reducer = MatmulReduceScatterConfig(**REDUCER_FP8_WIDE_PRECISE_TILING, group_m=4, epilogue_split=2,
                                        warp_specialized=True).with_communication_heuristic(1024, 256, 4)  # fmt: skip
    tune.write_entries([tune.Entry(one_gpu.key, reducer, measured)])
    assert _matmul_reduce_scatter._config_for(x, w, 4, None, precise) == untuned
    # ...and itself where it runs, unless a float32 output's partials leave its tiles no room.
    monkeypatch.setattr(_scaled, "pingpong_unsupported", lambda *args, **kwargs: None)
    assert _matmul_reduce_scatter._config_for(x, w, 4, None, precise) == reducer
    assert not _matmul_reduce_scatter.reducer_fits(reducer, 256, 4, 1, wide_out)
    heuristic = _matmul_reduce_scatter._config_for(x, w, 4, None, wide_out)
    assert heuristic == _matmul_reduce_scatter.scaled_heuristic(1024, 256, 64, 4, wide_out, True)
    assert heuristic.warp_specialized and heuristic.block_n == 128


def untuned_fast(x, w):
    return MatmulReduceScatterConfig.heuristic_fp8(x.shape[0], w.shape[0], x.shape[1], 4, False)


def test_a_one_gpu_entry_takes_todays_communication_knobs(cache):
    """An entry tuned on one GPU (GEMM-only) measured its tiling alone: the launcher takes its
    tiling with the heuristic's transport (push at TP=4) and copy chunks; an entry measured with
    communication keeps its own."""
    x, w = torch.empty(4 * 2048, 16, dtype=torch.bfloat16), torch.empty(8192, 16, dtype=torch.bfloat16)
    one_gpu = entry(op=RS, gpu="cpu", world=4, n=8192, k=64, m=4 * 2048, transport="copy_engine", group_m=4)
    one_gpu = dataclasses.replace(one_gpu, measured={**one_gpu.measured, "mode": configs.GEMM_ONLY_MODE})
    tune.write_entries([one_gpu])
    assert tune.tuned_config(RS, x, w, 4) == dataclasses.replace(one_gpu.config, transport="push")
    shown = tune.choose(RS, "cpu", 4, "bfloat16", 4 * 2048, 8192, 64)  # what `fluxtp info --configs` says
    assert shown.config == tune.tuned_config(RS, x, w, 4) and shown.entry.config.transport == "copy_engine"
    tune.write_entries([dataclasses.replace(one_gpu, measured=measured(4 * 2048))])
    assert tune.tuned_config(RS, x, w, 4) == one_gpu.config  # measured with communication: copy engine
    ag = entry(gpu="cpu", world=2, n=64, k=32, m=8192, chunk_rows=256)
    ag = dataclasses.replace(ag, measured={**ag.measured, "mode": configs.GEMM_ONLY_MODE})
    tune.write_entries([ag])
    shard = torch.empty(4096, 32, dtype=torch.bfloat16)
    assert tune.tuned_config(AG, shard, torch.empty(32, 32, dtype=torch.bfloat16), 2).chunk_rows == 1024  # 4 chunks


@pytest.mark.parametrize("tiling, rows, n, k, world", [
    (dict(block_n=256, num_warps=8, num_stages=3, warp_specialized=True), 2048, 12288, 12288, 4),  # 23.45 waves
    (dict(block_n=128, num_warps=4, num_stages=5), 128, 6656, 16384, 8),  # a Triton tiling the rule moves
    (dict(block_n=128, num_warps=8, num_stages=4), 128, 6656, 16384, 8),  # its 8-warp twin
])
def test_a_tuned_stream_k_launch_is_recorded_without_it_and_launches_as_measured(tiling, rows, n, k, world):
    """The tuners measure each tiling as launched (stream-K where the rule splits, on 4 warps a
    consumer) and record it without the split, at warps its Triton twin can run: at the tuned shape
    the rule splits it again into exactly what was measured; where the warp-specialized kernel
    cannot run, the entry is a Triton tiling that fits."""
    from fluxtp.backends.fused._all_gather_matmul import routed, runnable

    launched = routed(AllGatherMatmulConfig(**tiling), rows, n, k, world, True)
    assert launched.stream_k and launched.warp_specialized and launched.num_warps == 4
    recorded = launched.as_entry()
    assert not recorded.stream_k and recorded.num_warps == max(4, 128 * recorded.block_n // (32 * 128))
    assert routed(recorded, rows, n, k, world, True) == launched
    assert configs.fits(AG, runnable(recorded, False)) and not runnable(recorded, False).warp_specialized
    plain = AllGatherMatmulConfig(**tiling)
    assert plain.as_entry() is plain and MatmulReduceScatterConfig().as_entry() == MatmulReduceScatterConfig()


def test_the_shipped_table_records_no_stream_k():
    """stream-K is the launcher's per call (the all-gather's rule): no shipped entry forces it."""
    entries, problem = tune.load(shipped=True)
    assert problem is None
    assert not [key for key, e in entries.items() if getattr(e.config, "stream_k", False)]


def test_launcher_lookup_converts_local_shapes_to_the_global_key(cache):
    # CPU tensors: the GPU name is "cpu". all_gather_matmul holds x_shard [M/W, K], w [N/W, K];
    # matmul_reduce_scatter x [M, K/W], w [N, K/W]; the cache keys the layer's global M, N, K.
    ag = entry(gpu="cpu", world=2, n=64, k=32, m=256, block_n=128, chunk_rows=256)
    rs = entry(op=RS, gpu="cpu", world=2, n=64, k=32, m=256, transport="pull")
    tune.write_entries([ag, rs])
    x, w = torch.empty(128, 32, dtype=torch.bfloat16), torch.empty(32, 32, dtype=torch.bfloat16)
    assert tune.tuned_config(AG, x, w, 2) == ag.config
    x, w = torch.empty(256, 16, dtype=torch.bfloat16), torch.empty(64, 16, dtype=torch.bfloat16)
    assert tune.tuned_config(RS, x, w, 2) == rs.config
    assert tune.tuned_config(RS, x, w, 4) is None  # world 4: K = 64, no entry
    assert tune.tuned_config(RS, x.half(), w.half(), 2) is None  # another dtype


def test_all_gather_takes_a_tuned_kernel_as_measured_and_routes_only_the_heuristic(cache, monkeypatch):
    """Where the warp-specialized all-gather runs, an untuned call's heuristic moves to it
    (on_warp_specialized_kernel) while a table entry keeps the kernel its tune measured; an entry
    on it read where it cannot run (the interpreter, a Triton without its Gluon) runs its tiling
    on Triton."""
    from fluxtp.backends.fused import _all_gather_matmul

    runs = {"now": True}
    monkeypatch.setattr(_all_gather_matmul, "warp_specialized_runs", lambda device, dtype: runs["now"])
    x, w = torch.empty(2048, 32, dtype=torch.bfloat16), torch.empty(256, 32, dtype=torch.bfloat16)  # 4096 rows at W=2
    untuned = _all_gather_matmul._config_for(x, w, 2, None)
    assert untuned.warp_specialized and (untuned.block_n, untuned.num_stages) == (256, 3)
    triton_tuned = entry(gpu="cpu", world=2, n=512, k=32, m=4096, chunk_rows=2048)
    tune.write_entries([triton_tuned])
    assert _all_gather_matmul._config_for(x, w, 2, None) == triton_tuned.config  # not moved
    on_it = entry(gpu="cpu", world=2, n=512, k=32, m=4096, block_n=128, num_stages=4, warp_specialized=True)
    tune.write_entries([on_it])
    assert _all_gather_matmul._config_for(x, w, 2, None) == on_it.config
    runs["now"] = False
    assert _all_gather_matmul._config_for(x, w, 2, None) == dataclasses.replace(on_it.config, warp_specialized=False)


def test_multi_gpu_tune_measures_reduce_scatter_candidates_as_launched():
    """The multi-GPU tune's reduce-scatter candidates are what an entry of each launches: at TP=8
    on a GPU that runs the reducer kernel, each push or copy-engine tiling is that kernel's (one
    candidate per band and transport), pull stays on Triton; where it does not run, all stay. At
    TP=2, where no Triton tiling moves, the reducer kernel's are in the space beside them."""
    from fluxtp.bench.ops import Shape
    from fluxtp.configs._classes import REDUCER_TILING

    shape = Shape(4096, 8192, 28672)
    space = tune.search_space(RS, shape.M, shape.N, shape.K // 8, 8, warp_specialized=True)
    assert tune.search_space(RS, shape.M, shape.N, shape.K // 8, 8) == [c for c in space if not c.warp_specialized]
    launched = tune.launched_space(RS, space, shape, 8, True, 2)
    k = shape.K // 8
    assert launched[0] == tune.heuristic(RS, shape.M, shape.N, k, 8).on_reducer_kernel(8, shape.M, shape.N, k)
    on_reducer = [c for c in launched if c.warp_specialized]
    bands_and_transports = {(g, t) for g in (4, 8, 16) for t in ("push", "copy_engine")}
    assert {(c.group_m, c.transport) for c in on_reducer} == bands_and_transports
    tiling = {f: getattr(on_reducer[0], f) for f in REDUCER_TILING}
    assert tiling == REDUCER_TILING and all({f: getattr(c, f) for f in REDUCER_TILING} == tiling for c in on_reducer)
    assert all(c.transport == "pull" for c in launched if not c.warp_specialized) and len(launched) == len(set(launched))
    triton_space = tune.search_space(RS, shape.M, shape.N, shape.K // 8, 8)
    assert tune.launched_space(RS, triton_space, shape, 8, False, 2) == triton_space
    tp2 = tune.search_space(RS, shape.M, shape.N, shape.K // 2, 2, warp_specialized=True)
    assert tune.launched_space(RS, tp2, shape, 2, True, 2) == tp2
    assert {(c.group_m, c.transport) for c in tp2 if c.warp_specialized} == bands_and_transports
    ag_shape = Shape(4096, 28672, 8192)
    ag_space = tune.search_space(AG, 4096, 28672, 8192, 8)
    assert tune.launched_space(AG, ag_space, ag_shape, 8, False, 2) == ag_space  # no warp-specialized kernel here
    # Where it runs, an all-gather tiling whose last wave stream-K splits (128x256x64: 3.4 waves,
    # 128 K blocks) is measured with it, the others as they are.
    launched_ag = tune.launched_space(AG, ag_space, ag_shape, 8, True, 2)
    split = [c for c in launched_ag if c.stream_k]
    assert split and all(c.warp_specialized and (c.block_n, c.block_k) == (256, 64) for c in split)
    assert all(c in ag_space for c in launched_ag if not c.stream_k)


def test_reduce_scatter_takes_a_reducer_kernel_entry_as_measured_and_its_twin_where_it_cannot_run(cache, monkeypatch):
    """A bf16 reduce-scatter's table entry on the reducer kernel (what the one-GPU tune writes
    where it measured that kernel fastest, at TP=2 too) launches as it is where that kernel runs;
    where it cannot (no Hopper, a Triton without its Gluon) or cannot take it (pull), its tiling
    runs on Triton."""
    from fluxtp.backends.fused import _matmul_reduce_scatter
    from fluxtp.configs._classes import REDUCER_TILING

    runs = {"now": None}
    monkeypatch.setattr(_matmul_reduce_scatter._scaled, "pingpong_unsupported", lambda *args: runs["now"])
    x, w = torch.empty(4096, 32, dtype=torch.bfloat16), torch.empty(512, 32, dtype=torch.bfloat16)
    assert not _matmul_reduce_scatter._config_for(x, w, 2, None).warp_specialized  # TP=2: the heuristic stays
    on_it = entry(op=RS, gpu="cpu", world=2, n=512, k=64, m=4096, **REDUCER_TILING, group_m=4, warp_specialized=True)
    tune.write_entries([on_it])
    assert _matmul_reduce_scatter._config_for(x, w, 2, None) == on_it.config
    runs["now"] = "it needs a Hopper GPU (sm_90)"
    assert _matmul_reduce_scatter._config_for(x, w, 2, None) == dataclasses.replace(on_it.config, warp_specialized=False)
    runs["now"] = None
    pulled = dataclasses.replace(on_it, config=dataclasses.replace(on_it.config, transport="pull"))
    tune.write_entries([pulled])
    assert _matmul_reduce_scatter._config_for(x, w, 2, None) == dataclasses.replace(pulled.config, warp_specialized=False)


def test_no_cache_file_means_heuristic_and_no_warning(cache):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x, w = torch.empty(128, 32), torch.empty(32, 32)
        assert tune.tuned_config(AG, x, w, 2) is None
        choice = tune.choose(AG, H200, 2, "bfloat16", 4096, 28672, 8192)
    assert choice.source == "heuristic" and "no cache file" in choice.why
    assert choice.config == tune.heuristic(AG, 4096, 28672, 8192, 2) and not choice.config.warp_specialized
    # where the call may take the warp-specialized kernel, the heuristic is the one launched there
    on_it = tune.choose(AG, H200, 2, "bfloat16", 4096, 28672, 8192, warp_specialized=True)
    assert on_it.config == AllGatherMatmulConfig.heuristic(2048, 14336, 8192, 2, warp_specialized=True)
    assert on_it.config.warp_specialized and on_it.config != choice.config
    rs = tune.choose(RS, H200, 2, "bfloat16", 4096, 8192, 28672, warp_specialized=True)
    assert rs.config == tune.heuristic(RS, 4096, 8192, 28672, 2)


def _valid_file() -> dict:
    return json.loads(tune.dumps([entry(gpu="cpu", n=64, k=32, m=256)]))


def _stale_schema(d):
    d["schema"] = "fluxtp.tune/0"


def _unknown_field(d):
    d["entries"][0]["config"]["swizzle"] = 3


def _missing_field(d):
    del d["entries"][0]["config"]["chunk_rows"]


def _mistyped_field(d):
    d["entries"][0]["config"]["block_m"] = "128"


def _bool_for_int(d):
    d["entries"][0]["config"]["num_warps"] = True


def _missing_key(d):
    del d["entries"][0]["N"]


def _duplicate_key(d):
    d["entries"].append(d["entries"][0])


def _unknown_layout(d):
    d["entries"][0]["weight_layout"] = "diagonal"


@pytest.mark.parametrize(
    "spoil, reason",
    [
        ("{not json", "not valid JSON"),
        ("", "not valid JSON"),
        ("[]", "schema"),
        (b"\xff\xfe\x00garbage", "cannot read"),
        (_stale_schema, "schema 'fluxtp.tune/0'"),
        (_unknown_field, "unknown config field(s) swizzle"),
        (_missing_field, "chunk_rows missing"),
        (_mistyped_field, "block_m='128'"),
        (_bool_for_int, "num_warps=True"),
        (_missing_key, "lacks"),
        (_duplicate_key, "two entries"),
        (_unknown_layout, "weight_layout must be one of"),
    ],
)
def test_corrupt_or_stale_file_is_ignored_with_one_warning(cache, spoil, reason):
    cache.parent.mkdir(parents=True)
    if callable(spoil):
        data = _valid_file()
        spoil(data)
        cache.write_text(json.dumps(data))
    elif isinstance(spoil, bytes):
        cache.write_bytes(spoil)
    else:
        cache.write_text(spoil)
    x, w = torch.empty(128, 32, dtype=torch.bfloat16), torch.empty(32, 32, dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert tune.tuned_config(AG, x, w, 2) is None  # the launcher then takes the heuristic
        choice = tune.choose(AG, "cpu", 2, "bfloat16", 256, 64, 32)
    ours = [w for w in caught if issubclass(w.category, tune.CacheWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert reason in str(ours[0].message) and str(cache) in str(ours[0].message)
    assert choice.source == "heuristic" and reason in choice.why
    assert choice.config == AllGatherMatmulConfig.heuristic(128, 32, 32, 2)
    # a repaired file is used from the next call on (the memory copy is keyed by the file's version)
    tune.write_entries([entry(gpu="cpu", n=64, k=32, m=256, group_m=4)])
    assert tune.tuned_config(AG, x, w, 2).group_m == 4


def test_a_failed_write_leaves_the_old_file_and_no_temporary(cache, monkeypatch):
    tune.write_entries([entry(m=1024)])
    before = cache.read_bytes()

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(tune.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        tune.write_entries([entry(m=4096)])
    assert cache.read_bytes() == before
    assert sorted(p.name for p in cache.parent.iterdir()) == [tune.CACHE_FILE, tune.CACHE_FILE + ".lock"]


def test_readers_never_see_a_half_written_file(cache):
    # Large enough that writing it in place would take many write() calls.
    many = [entry(m=1 << (i % 15), n=8 * (i + 1)) for i in range(600)]
    tune.write_entries(many)
    stop, seen, bad = threading.Event(), [0], []

    def reader():
        while not stop.is_set():
            text = cache.read_text()
            try:
                assert len(tune.parse(text)) >= 600
                seen[0] += 1
            except Exception as e:  # noqa: BLE001  recorded, asserted below
                bad.append(f"{type(e).__name__}: {e}"[:200])

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(40):
            tune.write_entries([entry(m=4096, n=8 * (i + 1), group_m=4 if i % 2 else 16)])
    finally:
        stop.set()
        t.join()
    assert not bad, bad[:3]
    assert seen[0] > 0


# ---------------------------------------------------------------- the shipped table


def test_the_shipped_table_is_package_data():
    from importlib.resources import files

    resource = files("fluxtp") / "configs" / "default.json"
    assert resource.is_file()
    assert tune.shipped_path() == Path(str(resource))
    entries = tune.parse(resource.read_text())  # a valid table (empty until GPU numbers are merged in)
    assert tune.load(shipped=True) == (entries, None)
    for e in entries.values():  # what ships was measured, and says so
        assert set(tune.SHIPPED_MEASURED_FIELDS) <= set(e.measured), e.key
        assert e.measured["ms"] <= e.measured["heuristic_ms"], e.key
    # `pip install .` ships it: setuptools' package data for fluxtp names it
    tomllib = pytest.importorskip("tomllib")
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["fluxtp"]
    assert any(fnmatch.fnmatch("configs/default.json", pattern) for pattern in patterns)


def test_lookup_order_user_cache_then_shipped_table_then_heuristic(cache, shipped):
    tune.write_entries([entry(m=1024, group_m=16)])  # the user's own tuning, one bucket
    tune.write_entries([measured_entry(m=4096, group_m=4), measured_entry(n=14336, k=4096, m=4096, block_n=128)], shipped)

    def pick(n, k, m):
        return tune.choose(AG, H200, 2, "bfloat16", m, n, k)

    own = pick(28672, 8192, 1024)
    assert (own.origin, own.source, own.config.group_m) == (tune.USER_CACHE, "exact", 16)
    assert own.why == "user cache: exact key (M bucket 1024)"
    # the user's nearest bucket beats the shipped table's exact key: their own measurement of this layer
    near = pick(28672, 8192, 4096)
    assert (near.origin, near.source, near.config.group_m) == (tune.USER_CACHE, "nearest", 16)
    shipped_exact = pick(14336, 4096, 4096)
    assert (shipped_exact.origin, shipped_exact.source, shipped_exact.config.block_n) == (tune.SHIPPED, "exact", 128)
    assert shipped_exact.entry.measured == measured(4096)
    shipped_near = pick(14336, 4096, 16384)
    assert (shipped_near.origin, shipped_near.source) == (tune.SHIPPED, "nearest")
    assert "shipped table: nearest M bucket 4096" in shipped_near.why
    none = pick(8192, 8192, 4096)
    assert (none.origin, none.source) == (tune.HEURISTIC, "heuristic")
    assert none.config == AllGatherMatmulConfig.heuristic(2048, 4096, 8192, 2)
    assert "no tuned entry in the user cache; no tuned entry in the shipped table" in none.why
    cache.unlink()  # without the user's cache, the shipped table answers
    assert (pick(28672, 8192, 4096).origin, pick(28672, 8192, 4096).config.group_m) == (tune.SHIPPED, 4)
    assert "no cache file at" in pick(8192, 8192, 4096).why


def test_the_launchers_lookup_takes_the_same_order(cache, shipped):
    tune.write_entries([entry(gpu="cpu", n=64, k=32, m=256, group_m=16)])
    tune.write_entries([measured_entry(gpu="cpu", n=64, k=32, m=1024, group_m=4),
                        measured_entry(gpu="cpu", n=128, k=32, m=256, group_m=8)], shipped)  # fmt: skip
    w = torch.empty(32, 32, dtype=torch.bfloat16)  # all_gather_matmul: w [N/W, K], N = 64

    def lookup(m, weight=w):
        return tune.tuned_config(AG, torch.empty(m // 2, 32, dtype=torch.bfloat16), weight, 2)

    assert lookup(256).group_m == 16  # the user's, exact
    assert lookup(1024).group_m == 16  # the user's nearest bucket before the shipped exact key
    assert lookup(256, torch.empty(64, 32, dtype=torch.bfloat16)).group_m == 8  # N = 128: only shipped
    assert lookup(256, torch.empty(16, 32, dtype=torch.bfloat16)) is None  # N = 32: nowhere, the heuristic
    cache.unlink()
    assert lookup(1024).group_m == 16  # the tables are read once: a file removed behind its back is not seen...
    configs.reload()
    assert lookup(1024).group_m == 4  # ... until reload(): the shipped table now
    tune.write_entries([entry(gpu="cpu", n=64, k=32, m=1024, group_m=2)])
    assert lookup(1024).group_m == 2  # the tuner's own write reloads: the remembered answer is dropped
    assert lookup(1024, w.t().contiguous().t()).group_m == 2  # the transposed layout falls back to linear


def test_a_corrupt_shipped_table_only_warns(cache, shipped):
    shipped.parent.mkdir(parents=True)
    shipped.write_text('{"schema": "fluxtp.tune/1", "entries": [')
    x, w = torch.empty(128, 32, dtype=torch.bfloat16), torch.empty(32, 32, dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert tune.tuned_config(AG, x, w, 2) is None  # the launcher takes the heuristic
        choice = tune.choose(AG, "cpu", 2, "bfloat16", 256, 64, 32)
        tune.write_entries([entry(gpu="cpu", n=64, k=32, m=256, group_m=4)])
        assert tune.tuned_config(AG, x, w, 2).group_m == 4  # the user's cache still answers
    ours = [w for w in caught if issubclass(w.category, tune.CacheWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "config table shipped with fluxtp" in str(ours[0].message) and str(shipped) in str(ours[0].message)
    assert "not valid JSON" in str(ours[0].message)
    assert (choice.origin, choice.source) == (tune.HEURISTIC, "heuristic")
    assert "the shipped table is ignored (not valid JSON" in choice.why
    assert choice.config == AllGatherMatmulConfig.heuristic(128, 32, 32, 2)


def _merge(*args):
    return subprocess.run(
        [sys.executable, "-m", "fluxtp.tune", "merge-defaults", *map(str, args)],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_merge_defaults_puts_tuned_entries_into_the_shipped_table(tmp_path, shipped):
    tuned = tmp_path / "tuned" / tune.CACHE_FILE  # FLUXTP_CACHE_DIR=tmp/tuned fluxtp tune ... writes this
    first = [measured_entry(m=1024), measured_entry(op=RS, n=8192, k=28672, m=8192, transport="pull")]
    tune.write_entries(first, tuned)
    shipped.parent.mkdir(parents=True)
    shipped.write_text(tune.dumps([]))  # as the package ships it before any GPU numbers
    done = _merge(tuned, "--into", shipped)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"merged 2 entries from {tuned} into {shipped} (2 new, 0 replaced; 2 in all)" in done.stdout
    table, problem = tune.load(shipped, shipped=True)
    assert problem is None and table == {e.key: e for e in first}
    # a later tune: one key again (its config and measurement replace the shipped ones), one new
    again = tmp_path / "again" / tune.CACHE_FILE
    newer = dataclasses.replace(measured_entry(m=1024, group_m=4), measured=measured(1024, date="2026-12-01"))
    tune.write_entries([newer, measured_entry(m=16384)], again)
    assert tune.merge_into_shipped(again) == (1, 1)  # default target: the shipped table
    table, _ = tune.load(shipped, shipped=True)
    assert len(table) == 3 and table[newer.key] == newer
    assert shipped.read_text() == tune.dumps(table.values())  # sorted, diffable
    assert tune.choose(AG, H200, 2, "bfloat16", 1024, 28672, 8192).origin == tune.SHIPPED


def test_the_one_gpu_tune_leaves_every_entry_measured_with_communication(shipped):
    from fluxtp import tune_gemm

    with_nccl = measured_entry(m=1024)
    early = dataclasses.replace(measured_entry(m=4096), measured={k: v for k, v in measured(4096).items() if k != "nccl_ms"})
    gemm_only = dataclasses.replace(measured_entry(m=8192), measured={**measured(8192), "mode": "gemm_only"})
    tune.write_entries([with_nccl, early, gemm_only], shipped)
    # A multi-GPU tune's early entries record no nccl_ms: they are kept all the same.
    assert tune_gemm.multi_gpu_keys() == {with_nccl.key, early.key}


def _tune_row(m, won: bool, **config):
    tuned = dataclasses.asdict(dataclasses.replace(AllGatherMatmulConfig(), **config))
    return {"op": AG, "M": m, "N": 28672, "K": 8192, "dtype": "bfloat16", "weight_layout": "linear",
            "ms": {"gemm": 0.8, "nccl": 1.1, "heuristic": 1.0, "tuned": 0.9 if won else 1.0}, "tuned_config": tuned,
            "tuned_is_heuristic": not won, "candidates": 3, "screened": 3}  # fmt: skip


def test_merge_defaults_from_a_tune_results_file_ships_its_tuned_rows_or_those_named(tmp_path, shipped):
    results = tmp_path / "tune-h200-x2.json"  # what `fluxtp tune --vary ... --out` wrote (rows before "varied")
    command = ("fluxtp tune --op all_gather_matmul --nproc 2 --shapes 2048x28672x8192,8192x28672x8192 "
               "--vary warp_specialized,num_stages")
    run = {"torch": "2.11.0+cu130", "triton": "3.6.0", "commit": "d22cabf", "date": "2026-11-29"}
    rows = [_tune_row(2048, False), _tune_row(8192, True, warp_specialized=True, stream_k=True, num_warps=4, num_stages=3)]
    results.write_text(json.dumps({"schema": "fluxtp.bench/1", "scenario": "tune", "device": H200, "gpus": 2, "world": 2,
                                   **run, "command": command, "rows": rows}))  # fmt: skip
    shipped.parent.mkdir(parents=True)
    shipped.write_text(tune.dumps([]))
    done = _merge(results, "--into", shipped)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"merged 1 entries from {results} into {shipped} (1 new, 0 replaced; 1 in all)" in done.stdout
    table, problem = tune.load(shipped, shipped=True)
    (entry,) = table.values()
    assert problem is None and entry.key == tune.Key(H200, 2, "bfloat16", AG, 28672, 8192, 8192)
    # as the launcher's table holds it: stream-K is decided per call, at its Triton twin's warps
    assert entry.config == dataclasses.replace(AllGatherMatmulConfig(), warp_specialized=True, num_stages=3, num_warps=8)
    assert entry.measured == {"M": 8192, "ms": 0.9, "heuristic_ms": 1.0, "nccl_ms": 1.1, "gemm_ms": 0.8, "candidates": 3,
                              "screened": 3, **run, "varied": ["warp_specialized", "num_stages"]}  # fmt: skip
    assert tune.merge_into_shipped(results, shipped, ("2048x28672x8192",)) == (1, 0)  # named: kept rows too
    done = _merge(results, "--shapes", "4096x28672x8192", "--into", shipped)
    assert done.returncode == 2 and "no row of 4096x28672x8192 (the file has 2048x28672x8192, 8192x28672x8192)" in done.stderr
    cache = tmp_path / "cache.json"
    tune.write_entries([measured_entry(m=1024)], cache)
    done = _merge(cache, "--shapes", "1024x28672x8192", "--into", shipped)
    assert done.returncode == 2 and "--shapes picks rows of a `fluxtp tune --out` results file" in done.stderr
    assert len(tune.load(shipped, shipped=True)[0]) == 2


def test_merge_defaults_refuses_unmeasured_entries_and_a_corrupt_table(tmp_path, shipped):
    tuned = tmp_path / "tuned" / tune.CACHE_FILE
    tune.write_entries([entry(m=1024)], tuned)  # "measured" holds only M and ms
    shipped.parent.mkdir(parents=True)
    shipped.write_text(tune.dumps([]))
    before = shipped.read_bytes()
    done = _merge(tuned, "--into", shipped)
    assert done.returncode == 2
    assert "lacks measured heuristic_ms, date, torch, triton, commit" in done.stderr
    assert shipped.read_bytes() == before
    tune.write_entries([measured_entry(m=1024)], tuned)
    shipped.write_text("{broken")
    done = _merge(tuned, "--into", shipped)
    assert done.returncode == 2 and "cannot be used" in done.stderr and "fix or delete it" in done.stderr
    assert shipped.read_text() == "{broken"
    done = _merge(tmp_path / "missing.json", "--into", shipped)
    assert done.returncode == 2 and "cannot read" in done.stderr


# ---------------------------------------------------------------- every rank, the same choice


def _choices_on_rank(rank, world, cache_dir):
    os.environ["FLUXTP_CACHE_DIR"] = cache_dir
    info = resolve_group(None)
    answers = []
    for m in (256, 512, 4096, 100):  # exact, exact, nearest (1024), nearest (256)
        x, w = torch.empty(m // world, 32, dtype=torch.bfloat16), torch.empty(32, 32, dtype=torch.bfloat16)
        config = tune.tuned_config(AG, x, w, info.world_size)
        answers.append(None if config is None else dataclasses.asdict(config))
    everyone = [None] * world
    dist.all_gather_object(everyone, answers)
    assert all(a == answers for a in everyone), everyone
    expected = [{"group_m": 4}, {"group_m": 16}, {"group_m": 16}, {"group_m": 4}]
    assert [None if a is None else {"group_m": a["group_m"]} for a in answers] == expected


def test_every_rank_chooses_the_same_config(tmp_path):
    cache_dir = tmp_path / "shared"
    tune.write_entries(
        [entry(gpu="cpu", n=64, k=32, m=256, group_m=4), entry(gpu="cpu", n=64, k=32, m=512, group_m=16)],
        cache_dir / tune.CACHE_FILE,
    )
    run_on_ranks(_choices_on_rank, 2, str(cache_dir), backend="gloo", timeout_s=120)


# ---------------------------------------------------------------- the tuner's control flow


SLOW = {"group_m": 16}  # stand-in cost model: these configs are 3x slower than the rest
BEST = {"block_n": 128, "num_stages": 4, "group_m": 4}  # and this one the fastest


_REFERENCES = []  # (x, w, (out, gathered)) per rank process; held, so no later input reuses their memory


def _reference(x, w, info):
    """The stand-ins' output: the gloo reference, computed once per input pair (every rank sees
    the same pairs in the same order; the tuner asks _launchers again for every candidate, so
    the cache is the module's). Recomputed per call, its jitter on 2 busy cores swamped the
    stand-in costs' 1.5 ms differences, and the tuner now and then picked another winner."""
    import fluxtp

    result = next((res for rx, rw, res in _REFERENCES if rx is x and rw is w), None)
    if result is None:
        result = fluxtp.all_gather_matmul(x, w, group=info.group, backend="nccl", return_gathered=True)
        _REFERENCES.append((x, w, result))
    return result


def _fake_launchers(op):
    """CPU stand-ins for the fused launchers: the nccl reference plus a sleep that depends on the
    config; a 256x128 tile "does not compile", and num_warps=4 with 3 stages computes garbage."""

    def cost_s(config):
        if all(getattr(config, k) == v for k, v in BEST.items()):
            return 0.0005
        return 0.006 if all(getattr(config, k) == v for k, v in SLOW.items()) else 0.002

    def run(x, w, info, config):
        out, gathered = _reference(x, w, info)
        time.sleep(cost_s(config))
        if config.num_warps == 4 and config.num_stages == 3:
            out = out + 1
        return out, gathered

    def gemm_only(x, w, bias, info, config):
        if config.block_m == 256:
            raise RuntimeError("out of resource: shared memory (stand-in)")
        return lambda: None

    return run, gemm_only


def _tune_on_rank(rank, world, budget_s, out_dir):
    tune._launchers = _fake_launchers
    info = resolve_group(None)
    device = torch.device("cpu")
    generator = torch.Generator().manual_seed(rank)
    shape = Shape(4096, 64, 32)
    start = time.monotonic()
    result = tune.tune_shape(AG, shape, torch.float32, start + budget_s, info, device, generator)
    elapsed = time.monotonic() - start
    summary = {
        "elapsed": elapsed,
        "winner": dataclasses.asdict(result.winner),
        "space": result.space,
        "screened": result.screened,
        "pruned": result.pruned,
        "failed": [tune.describe(c) for c, _ in result.failed],
        "wrong": [tune.describe(c) for c, _ in result.wrong],
        "heuristic_ms": result.heuristic_ms,
        "winner_ms": result.winner_ms,
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(summary))


def test_tuner_verifies_prunes_and_agrees_on_one_winner(tmp_path):
    run_on_ranks(_tune_on_rank, 2, 600.0, str(tmp_path), backend="gloo", timeout_s=600)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["winner"] == r1["winner"]
    assert r0["screened"] == r0["space"]  # a large budget: every candidate screened
    assert {k: r0["winner"][k] for k in BEST} == BEST
    assert r0["winner_ms"] < r0["heuristic_ms"]
    assert r0["pruned"] > 0  # the 3x slower group_m=16 ones
    assert r0["failed"] and all(d.startswith("256x") for d in r0["failed"])
    assert r0["wrong"] and all(" w4 s3 " in d for d in r0["wrong"])


def test_tuner_stops_at_its_budget(tmp_path):
    run_on_ranks(_tune_on_rank, 2, 3.0, str(tmp_path), backend="gloo", timeout_s=300)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["winner"] == r1["winner"]
    assert 1 <= r0["screened"] < r0["space"]
    # The candidate in flight when the screening share ran out and the final measurement (at
    # least 3 rounds) may overrun a little, more on a loaded machine; screening every candidate
    # would take several times the budget.
    assert r0["elapsed"] < 1.5 * 3.0 + 2.0, r0["elapsed"]


def _rank_tune_on_cpu(rank, world, job, out_dir):
    tune._launchers = _fake_launchers
    start = time.monotonic()
    try:
        tune.rank_tune(rank, world, job)
        code = 0
    except SystemExit as e:
        code = e.code
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"code": code, "elapsed": time.monotonic() - start}))


def test_rank_tune_writes_every_shape_and_reports_wrong_candidates(tmp_path):
    path = tmp_path / "cache" / tune.CACHE_FILE
    tune.write_entries([entry(gpu="cpu", m=1024)], path)  # kept: the tuner merges
    shapes = (Shape(4096, 64, 32), Shape(1024, 64, 32))
    command = "fluxtp tune --op all_gather_matmul --shapes 4096x64x32,1024x64x32 --out results/"
    job = tune.TuneJob(AG, shapes, torch.float32, 8.0, str(path), str(tmp_path / "results") + "/", command)
    run_on_ranks(_rank_tune_on_cpu, 2, job, str(tmp_path), backend="gloo", timeout_s=300)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["code"] == r1["code"] == 1  # the w4 s3 stand-ins computed garbage: a kernel bug, loudly
    assert r0["elapsed"] < 1.5 * 8.0 + 2.0, r0["elapsed"]
    entries, problem = tune.load(path)
    assert problem is None
    assert len(entries) == 3
    for shape in shapes:
        e = entries[tune.Key("cpu", 2, "float32", AG, 64, 32, shape.M)]
        assert {k: getattr(e.config, k) for k in BEST} == BEST
        assert e.measured["M"] == shape.M and 0 < e.measured["ms"] <= e.measured["heuristic_ms"]
        assert 1 <= e.measured["screened"] <= e.measured["candidates"]
        assert set(tune.SHIPPED_MEASURED_FIELDS) <= set(e.measured)  # enough to be merged into the shipped table
        assert e.measured["nccl_ms"] > 0 and e.measured["gemm_ms"] > 0
    # the tuned-vs-heuristic comparison, in the results envelope
    (result_file,) = (tmp_path / "results").iterdir()
    assert re.fullmatch(r"tune-cpu-x2-\d{4}-\d{2}-\d{2}-all_gather_matmul\.json", result_file.name)
    data = json.loads(result_file.read_text())
    assert tuple(data) == ENVELOPE_KEYS and data["scenario"] == "tune" and data["command"] == command
    assert (data["device"], data["gpus"], data["world"]) == ("cpu", 0, 2)
    assert [(r["M"], r["N"], r["K"], r["op"], r["dtype"]) for r in data["rows"]] == [
        (4096, 64, 32, AG, "float32"),
        (1024, 64, 32, AG, "float32"),
    ]
    for row in data["rows"]:
        e = entries[tune.Key("cpu", 2, "float32", AG, 64, 32, row["M"])]
        assert set(row["ms"]) == {"gemm", "nccl", "heuristic", "tuned"} and min(row["ms"].values()) > 0
        assert row["ms"]["tuned"] == e.measured["ms"] and row["ms"]["nccl"] == e.measured["nccl_ms"]
        assert row["ms"]["tuned"] < row["ms"]["heuristic"] and row["speedup_vs_heuristic"] > 1  # 0.5 ms against 2
        assert row["tuned_config"] == dataclasses.asdict(e.config) and row["tuned_is_heuristic"] is False
        assert row["heuristic_config"] == dataclasses.asdict(tune.heuristic(AG, row["M"], 64, 32, 2))
        assert set(row["E_overlap"]) == set(row["speedup_vs_nccl"]) == {"heuristic", "tuned"}
        for key in ("heuristic", "tuned"):
            expected = overlap_efficiency(row["ms"][key], row["ms"]["gemm"], row["ms"]["nccl"])
            assert row["E_overlap"][key] == (None if expected is None else pytest.approx(expected, abs=2e-3))
        assert 1 <= row["screened"] <= row["candidates"] and row["failed"] >= 1  # the 256x tiles, the w4 s3 ones
    # The results file is enough to ship the entries the cache got (its rows whose tuned config won).
    table = tmp_path / "shipped.json"
    assert tune.merge_into_shipped(result_file, table) == (2, 0)
    shipped, problem = tune.load(table, shipped=True)
    tuned = [tune.Key("cpu", 2, "float32", AG, 64, 32, shape.M) for shape in shapes]
    assert problem is None and shipped == {key: entries[key] for key in tuned}


def _rank_tune_transposed_on_cpu(rank, world, job, out_dir):
    seen = set()

    def launchers(op):
        run, gemm_only = _fake_launchers(op)

        def spy(x, w, info, config):
            seen.add(tune.weight_layout_of(w))
            return run(x, w, info, config)

        return spy, gemm_only

    tune._launchers = launchers
    try:
        tune.rank_tune(rank, world, job)
    except SystemExit:
        pass  # the w4 s3 stand-ins compute garbage (the test above checks that exit)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(sorted(seen)))


def test_rank_tune_of_the_transposed_layout_keys_its_entries_by_it(tmp_path):
    path = tmp_path / "cache" / tune.CACHE_FILE
    job = tune.TuneJob(AG, (Shape(1024, 64, 32),), torch.float32, 3.0, str(path), None, "fluxtp tune", "transposed")
    run_on_ranks(_rank_tune_transposed_on_cpu, 2, job, str(tmp_path), backend="gloo", timeout_s=300)
    assert json.loads((tmp_path / "rank0.json").read_text()) == ["transposed"]  # every candidate ran on W^T views
    entries, problem = tune.load(path)
    assert problem is None and list(entries) == [tune.Key("cpu", 2, "float32", AG, 64, 32, 1024, "transposed")]


def test_rank_tune_can_vary_only_some_fields_of_the_config_in_use(tmp_path):
    path = tmp_path / "cache" / tune.CACHE_FILE
    shape = Shape(1024, 64, 32)
    in_use = dataclasses.replace(AllGatherMatmulConfig(), block_n=128, num_stages=4, group_m=8, chunk_rows=512)
    key = tune.Key("cpu", 2, "float32", AG, 64, 32, 1024)
    tune.write_entries([tune.Entry(key, in_use, {"M": 1024, "ms": 1.0})], path)
    job = tune.TuneJob(AG, (shape,), torch.float32, 6.0, str(path), None, "fluxtp tune --vary group_m", vary=("group_m",))
    run_on_ranks(_rank_tune_on_cpu, 2, job, str(tmp_path), backend="gloo", timeout_s=300)
    assert json.loads((tmp_path / "rank0.json").read_text())["code"] == 0
    e = tune.load(path)[0][key]
    assert e.config == dataclasses.replace(in_use, group_m=4)  # BEST's group_m, nothing else moved
    assert e.measured["candidates"] == 3 and e.measured["varied"] == ["group_m"]  # group_m 4, 8, 16
    assert e.measured["ms"] < e.measured["heuristic_ms"]  # the baseline: the config in use before
    space = tune.varied_space(AG, in_use, ("group_m",), 1024, 64, 32, 2)
    assert space[0] == in_use and {c.group_m for c in space} == {4, 8, 16}
    with pytest.raises(ValueError, match="no field"):
        tune.varied_space(AG, in_use, ("transport",), 1024, 64, 32, 2)


def test_varying_a_reduce_scatters_kernel_meets_the_entrys_twin_on_the_other_kernel():
    """--vary warp_specialized on a reduce-scatter entry: a Triton entry of any tiling against the
    reducer kernel in the same band and transport (its one tiling), a reducer-kernel entry against
    that tiling on Triton; with group_m varied too, the twin in every band; pull has no twin."""
    from fluxtp.configs._classes import REDUCER_TILING

    m, n, k = 16384, 4096, 7168
    triton = MatmulReduceScatterConfig(block_n=128, num_warps=4, num_stages=5, epilogue_split=2, group_m=16)
    space = tune.varied_space(RS, triton, ("warp_specialized",), m, n, k, 2, warp_specialized=True)
    twin = MatmulReduceScatterConfig(**REDUCER_TILING, group_m=16, transport=triton.transport, warp_specialized=True)
    assert space == [triton, twin]
    assert tune.varied_space(RS, twin, ("warp_specialized",), m, n, k, 2, warp_specialized=True) == [
        twin, dataclasses.replace(twin, warp_specialized=False)]  # fmt: skip
    banded = tune.varied_space(RS, triton, ("warp_specialized", "group_m"), m, n, k, 2, warp_specialized=True)
    assert {(c.warp_specialized, c.group_m) for c in banded} == {(w, g) for w in (False, True) for g in (4, 8, 16)}
    assert all(c.block_n == 128 for c in banded if not c.warp_specialized)
    pulled = dataclasses.replace(triton, transport="pull")
    assert tune.varied_space(RS, pulled, ("warp_specialized",), m, n, k, 2, warp_specialized=True) == [pulled]
    assert tune.varied_space(RS, triton, ("warp_specialized",), m, n, k, 2) == [triton]  # where it cannot run


def test_varying_an_all_gathers_kernel_meets_the_entrys_twin_in_a_tile_of_the_same_area():
    """--vary warp_specialized on an all-gather entry the warp-specialized kernel cannot take (256
    rows): that kernel in 128x256 tiles, the entry's other knobs kept; back from it, Triton's
    tilings of that area; nothing where the kernel does not run."""
    m, n, k = 2048, 14336, 8192  # llama3-70b TP=2, whose H200 entry is such a Triton tiling
    triton = AllGatherMatmulConfig(block_m=256, block_n=128, num_warps=8, num_stages=4, group_m=16, chunk_rows=1024)
    space = tune.varied_space(AG, triton, ("warp_specialized",), m, n, k, 2, warp_specialized=True)
    assert space[0] == triton and len(space) == 2
    twin = space[1]
    assert (twin.warp_specialized, twin.block_m, twin.block_n) == (True, 128, 256)
    assert (twin.group_m, twin.chunk_rows, twin.block_k) == (16, 1024, 64)  # the entry's other knobs
    back = tune.varied_space(AG, twin, ("warp_specialized",), m, n, k, 2, warp_specialized=True)
    assert triton in back and all(c.block_m * c.block_n == 128 * 256 and c.group_m == 16 for c in back)
    assert tune.varied_space(AG, triton, ("warp_specialized",), m, n, k, 2) == [triton]  # where it cannot run
    staged = tune.varied_space(AG, triton, ("num_stages",), m, n, k, 2, warp_specialized=True)
    assert all(not c.warp_specialized and c.block_m == 256 for c in staged)  # the kernel not varied: no twin


LUCKY = [False]  # the stand-in below: BEST is fast until the confirmation measures it


def _lucky_launchers(op):
    """BEST looks fastest while candidates are screened and compared, but is the slowest in the
    confirmation: a finalist that got lucky."""

    def run(x, w, info, config):
        out, gathered = _reference(x, w, info)
        best = all(getattr(config, k) == v for k, v in BEST.items())
        time.sleep((0.006 if LUCKY[0] else 0.0005) if best else 0.002)
        return out, gathered

    return run, lambda x, w, bias, info, config: (lambda: None)


def _confirm_on_rank(rank, world, out_dir):
    from fluxtp.bench import harness

    tune._launchers = _lucky_launchers
    measure = harness.measure

    def flagging_measure(variants, *args, **kwargs):
        LUCKY[0] = any(v.name == "heuristic" for v in variants)  # the confirmation's variant
        return measure(variants, *args, **kwargs)

    harness.measure = flagging_measure
    info = resolve_group(None)
    result = tune.tune_shape(
        AG, Shape(4096, 64, 32), torch.float32, time.monotonic() + 6.0, info, torch.device("cpu"),
        torch.Generator().manual_seed(rank),
    )  # fmt: skip
    summary = {
        "selected": dataclasses.asdict(result.selected),
        "winner": dataclasses.asdict(result.winner),
        "heuristic": dataclasses.asdict(result.heuristic),
        "winner_ms": result.winner_ms,
        "heuristic_ms": result.heuristic_ms,
        "selection_ms": result.selection_ms,
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(summary))


def test_a_finalist_slower_when_timed_again_does_not_replace_the_heuristic(tmp_path):
    run_on_ranks(_confirm_on_rank, 2, str(tmp_path), backend="gloo", timeout_s=300)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["winner"] == r1["winner"] == r0["heuristic"]
    assert {k: r0["selected"][k] for k in BEST} == BEST  # it won the finalists' comparison
    assert r0["selection_ms"] < r0["heuristic_ms"]  # there it looked faster (1.5 ms of sleep less)
    assert r0["winner_ms"] == r0["heuristic_ms"]  # what is cached is the heuristic, at its own time


# ---------------------------------------------------------------- the commands


def test_tune_without_cuda_exits_2_and_says_why(monkeypatch, capsys):
    import fluxtp.bench.launch

    monkeypatch.setattr(fluxtp.bench.launch, "local_device_type", lambda: "cpu")
    assert cli.main(["tune", "--op", AG, "--shapes", "4096x28672x8192"]) == 2
    err = capsys.readouterr().err
    assert "tuning measures the fused Triton kernels, which need NVIDIA GPUs" in err
    assert "Nothing was tuned" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the real no-GPU path needs a host without CUDA")
def test_tune_command_on_a_cpu_host(tmp_path):
    env = dict(os.environ, FLUXTP_CACHE_DIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-m", "fluxtp", "tune", "--op", RS, "--shapes", "1024x8192x28672", "--budget-seconds", "5"],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "need NVIDIA GPUs" in done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize(
    "args, message",
    [
        (("--op", AG, "--shapes", "64x64"), "'64x64' is not MxNxK"),
        (("--op", AG, "--shapes", "64x64x64", "--budget-seconds", "0"), "--budget-seconds must be positive"),
        (("--op", "matmul_all_reduce", "--shapes", "64x64x64"), "invalid choice"),
        (("--shapes", "64x64x64",), "--op"),
        (("--op", AG, "--shapes", "64x64x64", "--vary", "transport"), "all_gather_matmul configs have the fields"),
    ],
)  # fmt: skip
def test_tune_rejects_bad_options(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["tune", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def config_tables(out: str) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """`fluxtp info --configs` output (wide enough not to wrap): per op, each shape's table row,
    and the lines under the table (why, where the row does not say it all)."""
    rows, notes, op = {}, {}, None
    for line in out.splitlines():
        if line in (f"{AG}:", f"{RS}:"):
            op = line[:-1]
            rows[op], notes[op] = {}, ""
        elif op and re.match(r"\d+x\d+x\d+ ", line):
            rows[op][line.split()[0]] = line
        elif op and line.strip() and not line.startswith(("MxNxK ", "---")):
            notes[op] += line + "\n"
    return rows, notes


@pytest.fixture
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # no cell wraps: a row is one line


def test_info_configs_says_what_each_shape_uses_and_why(cache, shipped, wide, capsys):
    tune.write_entries([entry(m=4096, block_n=128, num_stages=4, chunk_rows=1024)])
    shapes = "4096x28672x8192,16384x28672x8192,4096x14336x8192"
    assert cli.main(["info", "--configs", "--op", AG, "--shapes", shapes, "--gpu", H200, "--world", "2"]) == 0
    out = capsys.readouterr().out
    assert f"config cache: {cache} (1 entries)" in out
    assert f"shipped table: {shipped} (not found in this installation)" in out
    assert f"lookup for: {H200}, world 2, bfloat16" in out
    tables, notes = config_tables(out)
    lines = tables[AG]
    assert " user cache, exact " in lines["4096x28672x8192"]
    assert "128x128x64 w8 s4 g8 chunk_rows=1024" in lines["4096x28672x8192"]
    assert " user cache, nearest " in lines["16384x28672x8192"]
    heuristic = tune.describe(AllGatherMatmulConfig.heuristic(2048, 7168, 8192, 2))
    assert " heuristic " in lines["4096x14336x8192"] and heuristic in lines["4096x14336x8192"]
    # Why, under the table, for the shapes the row does not explain (N and K differ: full shapes).
    assert "16384x28672x8192: user cache: nearest M bucket 4096 (none for bucket 16384)" in notes[AG]
    assert re.search(r"^4096x14336x8192: heuristic \(.*N=14336 K=8192.*no tuned entry", notes[AG], re.M), notes[AG]
    # An exact entry: the row says it all, but how a Hopper GPU launches it (its 128x128 tiles leave
    # the 14th wave 0.68 full: the warp-specialized kernel with stream-K).
    (note,) = [line for line in notes[AG].splitlines() if line.startswith("4096x28672x8192:")]
    assert note.startswith("4096x28672x8192: on a Hopper GPU whose Triton runs the warp-specialized kernels, launched as:")
    assert "128x128x64 ws s4 g8 stream-K" in note


def test_info_configs_looks_up_a_weight_layout(cache, shipped, wide, capsys):
    tune.write_entries([entry(m=4096, layout="transposed", group_m=16)])
    args = ["info", "--configs", "--op", AG, "--shapes", "4096x28672x8192", "--gpu", H200, "--world", "2"]
    assert cli.main([*args, "--weight-layout", "transposed"]) == 0
    out = capsys.readouterr().out
    assert "bfloat16, transposed weight" in out and re.search(r" user cache, exact +\S+ w8 s\d g16 ", out), out
    assert cli.main(args) == 0
    assert " heuristic " in capsys.readouterr().out  # the linear lookup does not take it
    with pytest.raises(SystemExit):
        cli.main(["info", "--weight-layout", "transposed"])
    assert "go with --configs" in capsys.readouterr().err


def test_info_configs_names_the_table_that_answered(cache, shipped, wide, capsys):
    tune.write_entries([entry(m=4096, group_m=16)])
    tune.write_entries([measured_entry(n=14336, k=4096, m=4096, group_m=4)], shipped)
    shapes = "4096x28672x8192,4096x14336x4096,4096x8192x8192"
    assert cli.main(["info", "--configs", "--op", AG, "--shapes", shapes, "--gpu", H200, "--world", "2"]) == 0
    out = capsys.readouterr().out
    assert f"config cache: {cache} (1 entries)" in out and f"shipped table: {shipped} (1 entries)" in out
    assert "(the user's cache, then the shipped table, then the heuristic)" in out
    lines = config_tables(out)[0][AG]
    assert re.search(r" user cache, exact +\S+ w8 s\d g16 ", lines["4096x28672x8192"]), out
    assert re.search(r" shipped table, exact +\S+ w8 s\d g4 ", lines["4096x14336x4096"]), out
    assert re.search(r" heuristic +\S+ w\d", lines["4096x8192x8192"]), out
    # The measured speedup over NCCL, and what "auto" makes of it (measured_entry: 1.1 / 0.9 ms).
    assert " 1.22x (auto: fused)" in lines["4096x14336x4096"], out
    # No nccl_ms recorded, or none at all: auto's thresholds answer (for the call alone).
    assert lines["4096x28672x8192"].rstrip().endswith(" - (auto: fused by thresholds)"), out
    assert lines["4096x8192x8192"].rstrip().endswith(" - (auto: fused by thresholds)"), out


def test_info_configs_says_what_auto_does_without_a_clear_measurement(cache, shipped, wide, capsys):
    """Below auto's thresholds NCCL; a measurement within AUTO_WIN_RATIO leaves it to them too; the
    FP8 ops follow their own rule (their tables' measurements do not decide)."""
    tune.write_entries([measured_entry(n=14336, k=4096, m=4096, group_m=4)], shipped)  # 1.1 / 0.9 ms
    close = dataclasses.replace(entry(m=2048, n=14336, k=4096), measured=measured(2048, ms=0.98, nccl_ms=1.0))
    tune.write_entries([close], shipped)
    shapes = "512x14336x4096,2048x14336x4096,4096x14336x4096"
    assert cli.main(["info", "--configs", "--op", AG, "--shapes", shapes, "--gpu", H200, "--world", "2"]) == 0
    lines = config_tables(capsys.readouterr().out)[0][AG]
    assert lines["512x14336x4096"].rstrip().endswith(" - (auto: nccl by thresholds)"), lines
    assert lines["2048x14336x4096"].rstrip().endswith(" 1.02x (auto: fused by thresholds)"), lines
    assert lines["4096x14336x4096"].rstrip().endswith(" 1.22x (auto: fused)"), lines


def test_info_configs_defaults_and_a_corrupt_cache(cache, wide, capsys):
    cache.parent.mkdir(parents=True)
    cache.write_text("{broken")
    with pytest.warns(tune.CacheWarning):
        assert cli.main(["info", "--configs", "--gpu", H200]) == 0
    out = capsys.readouterr().out
    assert "ignored: not valid JSON" in out
    tables, notes = config_tables(out)
    assert set(tables) == {AG, RS}  # both ops, the default LLaMA-70B shapes
    assert [s.split("x")[0] for s in tables[AG]] == ["1024", "2048", "4096", "8192"]
    assert all(" heuristic " in line for table in tables.values() for line in table.values())
    assert all(note.startswith("M 1024, 2048, 4096, 8192: heuristic") for note in notes.values())
    assert all("cache file is ignored" in note for note in notes.values())


@pytest.mark.parametrize("columns", [80, 100, 120])
def test_info_configs_fits_the_terminal(cache, shipped, monkeypatch, capsys, columns):
    """Every line fits $COLUMNS (the table's config cells wrap, the reasons under it too), and
    nothing is lost: each shape's row, its whole config and the reason stay."""
    monkeypatch.setenv("COLUMNS", str(columns))
    tune.write_entries([measured_entry(n=28672, k=8192, m=4096, group_m=4)], shipped)
    assert cli.main(["info", "--configs", "--gpu", H200, "--world", "2"]) == 0
    out = capsys.readouterr().out
    # (a path longer than the terminal stays whole, alone on its line)
    too_wide = [line for line in out.splitlines() if len(line) > columns and " " in line.strip()]
    assert not too_wide, "\n".join(too_wide)
    words = out.split()
    for op in (AG, RS):
        assert f"{op}:" in words
        for m in (1024, 2048, 4096, 8192):
            shape = f"{m}x28672x8192" if op == AG else f"{m}x8192x28672"
            assert shape in words
            config = tune.describe(tune.choose(op, H200, 2, "bfloat16", m, *map(int, shape.split("x")[1:])).config)
            assert all(word in words for word in config.split()), (config, out)
    assert "1.22x" in words and {"shipped", "table,", "exact"} <= set(words)  # the cells may wrap
    assert "no tuned entry in the shipped table" in " ".join(words)


def test_info_configs_shows_the_fp8_tables_and_the_reducer_kernel_as_launched(cache, shipped, wide, capsys):
    """--dtype float8_e4m3fn [--fast-accum] looks up the FP8 keys of each accumulation and falls back
    to the FP8 heuristics; where the launcher's warp-specialized kernels run here, a reduce-scatter
    shows the reducer kernel its call takes, and an entry naming a kernel that does not run here
    gives way to the heuristic; another GPU's lookup notes the reducer kernel a Hopper GPU takes,
    and an all-gather's stream-K there."""
    from fluxtp.backends.fused import _matmul_reduce_scatter
    from fluxtp.backends.fused._scaled import Scaled
    from fluxtp.bench.ops import Shape
    from fluxtp.configs._classes import REDUCER_FP8_WIDE_PRECISE_TILING

    rs_key = dict(op=RS, n=8192, k=28672, m=4096, world=4)
    reducer = MatmulReduceScatterConfig(**REDUCER_FP8_WIDE_PRECISE_TILING, group_m=4, epilogue_split=2, warp_specialized=True)
    fp8 = entry(dtype="float8_e4m3fn", **rs_key)
    tune.write_entries([tune.Entry(fp8.key, reducer, {"M": 4096, "mode": configs.GEMM_ONLY_MODE})])
    tune.write_entries([entry(**rs_key, group_m=4)])  # bf16: the Triton kernel's tiling
    args = ["info", "--configs", "--op", RS, "--shapes", "4096x8192x28672,1024x4096x14336", "--gpu", H200, "--world", "4"]
    assert cli.main([*args, "--dtype", "float8_e4m3fn"]) == 0
    out = capsys.readouterr().out
    assert f"lookup for: {H200}, world 4, float8_e4m3fn (bf16 output)" in out
    rows = config_tables(out)[0][RS]
    assert " user cache, exact " in rows["4096x8192x28672"]
    assert tune.describe(reducer.with_communication_heuristic(4096, 8192, 4)) in rows["4096x8192x28672"]
    # no entry: the FP8 heuristic (another GPU's: on the Triton kernel), not bf16's
    fp8_heuristic = MatmulReduceScatterConfig.heuristic_fp8(1024, 4096, 3584, 4, True)
    assert " heuristic " in rows["1024x4096x14336"] and tune.describe(fp8_heuristic) in rows["1024x4096x14336"]
    assert cli.main([*args, "--dtype", "float8_e4m3fn", "--fast-accum"]) == 0
    out = capsys.readouterr().out
    assert "float8_e4m3fn+fast_accum (bf16 output)" in out and " heuristic " in config_tables(out)[0][RS]["4096x8192x28672"]
    # Another GPU's bf16 lookup: the entry as recorded, and what a Hopper GPU moves it to.
    assert cli.main(args) == 0
    rows, notes = config_tables(capsys.readouterr().out)
    assert " w8 s3 g4 " in rows[RS]["4096x8192x28672"] and "the reducer kernel instead: 128x256x64 ws s3" in notes[RS]
    # This GPU, its kernels running: the bf16 entry on the reducer kernel, as the launcher routes it.
    shape = Shape(4096, 8192, 28672)
    choice = tune.choose(RS, H200, 4, "bfloat16", 4096, 8192, 28672)
    launched = tune._as_launched_here(RS, choice, shape, 4, "bfloat16", None, True)
    assert launched == _matmul_reduce_scatter.routed(choice.config, 4096, 8192, 7168, 4, 2, True) and launched.warp_specialized
    table = tune._format_choices(RS, [shape], H200, 4, "bfloat16", "linear", cache, shipped, 400, True)
    assert "user cache, exact, on the reducer kernel" in table and tune.describe(launched) in table
    # ...and not running: an FP8 entry of the reducer kernel gives way to the FP8 heuristic.
    table = tune._format_choices(RS, [shape], H200, 4, "float8_e4m3fn", "linear", cache, shipped, 400, False,
                                 Scaled(torch.bfloat16, True, True))  # fmt: skip
    assert "names a kernel that does not run here" in table
    assert tune.describe(MatmulReduceScatterConfig.heuristic_fp8(4096, 8192, 7168, 4, True)) in table.splitlines()[3]
    # A bf16 all-gather entry on the warp-specialized kernel, where that does not run: its Triton twin.
    tune.write_entries([entry(m=4096, block_n=256, num_stages=3, group_m=4, warp_specialized=True)])
    ag_shape = Shape(4096, 28672, 8192)
    ag_choice = tune.choose(AG, H200, 2, "bfloat16", 4096, 28672, 8192)
    assert ag_choice.config.warp_specialized
    table = tune._format_choices(AG, [ag_shape], H200, 2, "bfloat16", "linear", cache, shipped, 400, False)
    twin = dataclasses.replace(ag_choice.config, warp_specialized=False)
    assert "user cache, exact, on the Triton kernel" in table and tune.describe(twin) in table
    assert "does not run here: its tiling on Triton" in table
    # Another GPU's lookup of an all-gather whose last wave the stream-K rule splits there (llama3-405b
    # TP=8, 2048 tokens): the note says how a Hopper GPU launches it.
    table = tune._format_choices(AG, [Shape(2048, 53248, 16384)], H200, 8, "bfloat16", "linear", cache, shipped, 400)
    assert "warp-specialized kernels, launched as: " in table and " stream-K " in table.split("launched as: ")[1]
    with pytest.raises(SystemExit):
        cli.main(["info", "--configs", "--fast-accum"])
    assert "--fast-accum: FP8 calls only" in capsys.readouterr().err


def test_info_configs_needs_no_gpu_and_rejects_options_without_it(cache, capsys):
    # no --gpu: torch.cuda's GPU 0, or "cpu" on a host without one
    assert cli.main(["info", "--configs", "--op", RS, "--shapes", "8192x8192x28672"]) == 0
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    assert f"lookup for: {gpu}," in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["info", "--shapes", "64x64x64"])
    assert e.value.code == 2
    assert "go with --configs" in capsys.readouterr().err


def test_reduce_scatter_runs_push_and_copy_engine_configs_on_the_reducer_kernel_by_world_and_work(cache, monkeypatch):
    """From REDUCER_WORLD ranks on, an unscaled push or copy-engine config the caller did not pass
    (a table entry or the heuristic) runs on the reducer kernel where it can (Hopper, rows of
    16-byte multiples, its shared memory, push to at most 8 ranks); from REDUCER_MIN_WORLD on only
    GEMMs of REDUCER_MIN_WORK tile K-blocks; FP8 precise from TP=2; pull, fewer ranks and the
    caller's own config stay."""
    from fluxtp.backends.fused import _matmul_reduce_scatter
    from fluxtp.configs import REDUCER_MIN_WORK, MatmulReduceScatterConfig
    from fluxtp.configs._classes import (
        REDUCER_FP8_WIDE_PRECISE_TILING,
        WARP_SPECIALIZED_FP8_FAST_TILING,
        WARP_SPECIALIZED_FP8_TILING,
    )

    runs = {"now": None}
    monkeypatch.setattr(_matmul_reduce_scatter._scaled, "pingpong_unsupported", lambda *args: runs["now"])
    x, w = torch.empty(8 * 2048, 32, dtype=torch.bfloat16), torch.empty(4096, 32, dtype=torch.bfloat16)
    heuristic = MatmulReduceScatterConfig.heuristic(8 * 2048, 4096, 32, 8)
    assert heuristic.transport == "push" and not heuristic.warp_specialized  # the copy engine only at TP<=2
    moved = _matmul_reduce_scatter._config_for(x, w, 8, None)
    assert moved == dataclasses.replace(heuristic, num_stages=3, warp_specialized=True)
    copy_engine = dataclasses.replace(heuristic, transport="copy_engine")  # e.g. a multi-GPU tune's
    assert copy_engine.on_reducer_kernel(8, 8 * 2048, 4096, 32) == dataclasses.replace(moved, transport="copy_engine")
    assert _matmul_reduce_scatter._config_for(x[: 4 * 2048], w, 4, None) == MatmulReduceScatterConfig.heuristic(
        4 * 2048, 4096, 32, 4)  # TP=4, little work (8192 x 4096 x 32)
    assert _matmul_reduce_scatter._config_for(x[: 2 * 2048], w, 2, None) == MatmulReduceScatterConfig.heuristic(
        2 * 2048, 4096, 32, 2)  # fewer ranks
    assert _matmul_reduce_scatter._config_for(x, w, 8, heuristic) == heuristic  # the caller's own
    assert not _matmul_reduce_scatter._config_for(x, w[:4092], 8, None).warp_specialized  # rows of 8184 bytes
    runs["now"] = "no Hopper here"
    assert _matmul_reduce_scatter._config_for(x, w, 8, None) == heuristic
    push = dataclasses.replace(heuristic, transport="push")
    on_reducer = dataclasses.replace(heuristic, transport="push", num_stages=3, warp_specialized=True)
    assert push.on_reducer_kernel(8, 1024, 4096, 1792) == on_reducer  # TP=8: any work
    pull = dataclasses.replace(heuristic, transport="pull")
    assert pull.on_reducer_kernel(8, 8 * 2048, 4096, 1792) == pull
    # TP=4: llama3-70b's reduce-scatter at 1024 tokens has 8 x 32 x 112 = 28672 tile K-blocks,
    # llama3-8b's at 2048 tokens 16 x 16 x 56 = 14336
    assert 14336 < REDUCER_MIN_WORK <= 28672
    assert push.on_reducer_kernel(4, 1024, 8192, 7168) == on_reducer
    assert push.on_reducer_kernel(4, 2048, 4096, 3584) == push
    assert push.on_reducer_kernel(2, 16384, 8192, 14336) == push
    assert "push" in _matmul_reduce_scatter.reducer_unsupported(on_reducer, 1024, 16, 2)  # a descriptor per rank
    # FP8 in the warp-specialized FP8 tiling: from TP=4 either accumulation, at any work.
    fp8 = MatmulReduceScatterConfig.heuristic_fp8(4096, 4096, 3584, 4, True)
    fp8_reducer = dataclasses.replace(fp8, **WARP_SPECIALIZED_FP8_TILING, warp_specialized=True)
    five_stages = dataclasses.replace(fp8_reducer, num_stages=5)  # precise, bf16 slots, at most 1024 tiles
    # Precise in 128x256 tiles where each SM gets 40 of their 128-deep K blocks: 32 x 16 tiles x 28 blocks.
    wide_precise = dataclasses.replace(fp8, **REDUCER_FP8_WIDE_PRECISE_TILING, warp_specialized=True)
    assert fp8.on_reducer_kernel(4, 4096, 4096, 3584, True) == wide_precise
    assert fp8.on_reducer_kernel(4, 8192, 4096, 3584, True) == wide_precise
    assert fp8.on_reducer_kernel(4, 8192, 4096, 3584, True, out_bytes=4) == fp8_reducer
    for world in (2, 4, 8):  # four 128-deep stages beside staging in quarters and a reduction unit
        assert _matmul_reduce_scatter.reducer_unsupported(wide_precise, 4096, world, 1, 2, split=True) is None
        assert _matmul_reduce_scatter.reducer_units_in_flight(wide_precise, world, 1, 2, split=True) >= 1
    assert "shared memory" in _matmul_reduce_scatter.reducer_unsupported(wide_precise, 4096, 8, 1, 2)  # whole staging
    assert fp8.on_reducer_kernel(4, 1024, 4096, 3584, True) == five_stages  # llama3-8b at 1024 tokens: 3584 blocks
    # Fast accumulation into a 2-byte output takes the wide tiling its slots leave room for.
    fp8_wide = dataclasses.replace(fp8, **WARP_SPECIALIZED_FP8_FAST_TILING, warp_specialized=True)
    assert fp8.on_reducer_kernel(4, 4096, 4096, 3584, False) == fp8_wide
    assert fp8.on_reducer_kernel(4, 1024, 4096, 3584, False, out_bytes=4) == fp8_reducer
    assert fp8.on_reducer_kernel(8, 1024, 4096, 1792, False) == fp8_wide
    assert fp8.on_reducer_kernel(8, 1024, 4096, 1792, False, out_bytes=4) == fp8_reducer
    assert fp8.on_reducer_kernel(8, 1024, 4096, 1792, True) == five_stages
    # Fast below TP=4: from 4096 rows a rank with 2-byte slots (TP=2 at 8192 tokens), else Triton.
    assert fp8.on_reducer_kernel(2, 8192, 4096, 7168, False) == fp8_wide
    assert fp8.on_reducer_kernel(2, 8190, 4096, 7168, False) == fp8  # 4095 rows a rank
    assert fp8.on_reducer_kernel(2, 16384, 4096, 7168, False, out_bytes=4) == fp8
    assert fp8.on_reducer_kernel(8, 1024, 4096, 1792, True, out_bytes=4) == fp8_reducer
    assert _matmul_reduce_scatter.reducer_unsupported(fp8_wide, 4096, 8, 1, 2) is None
    assert "shared memory" in _matmul_reduce_scatter.reducer_unsupported(fp8_wide, 4096, 8, 1, 4)
    # TP=2: precise on it too (bf16 slots, the copy engine's transport kept), fast on Triton below
    # 4096 rows a rank.
    fp8_tp2 = MatmulReduceScatterConfig.heuristic_fp8(16384, 8192, 14336, 2, True)
    assert fp8_tp2.transport == "copy_engine"
    assert fp8_tp2.on_reducer_kernel(2, 16384, 8192, 14336, True) == dataclasses.replace(
        fp8_tp2, **REDUCER_FP8_WIDE_PRECISE_TILING, warp_specialized=True)  # fmt: skip
    assert fp8_tp2.on_reducer_kernel(2, 512, 4096, 7168, True) == dataclasses.replace(
        fp8_tp2, **{**WARP_SPECIALIZED_FP8_TILING, "num_stages": 5}, warp_specialized=True)  # 4 x 16 x 56 blocks: narrow
    assert fp8_tp2.on_reducer_kernel(2, 4096, 8192, 14336, False) == fp8_tp2
    assert fp8_tp2.on_reducer_kernel(2, 16384, 8192, 14336, False) == dataclasses.replace(
        fp8_tp2, **WARP_SPECIALIZED_FP8_FAST_TILING, warp_specialized=True)  # fmt: skip
    assert push.on_reducer_kernel(2, 16384, 8192, 14336, None) == push  # bf16 at TP=2: Triton
    # 1-byte operands, a float32 output's slots
    assert _matmul_reduce_scatter.reducer_unsupported(fp8_reducer, 4096, 8, 1, 4) is None
    assert "multiple of 4" in _matmul_reduce_scatter.reducer_unsupported(fp8_reducer, 4098, 8, 1, 4)
    assert "pull" in _matmul_reduce_scatter.reducer_unsupported(dataclasses.replace(on_reducer, transport="pull"), 1024, 8, 2)
    moved_ce = dataclasses.replace(moved, transport="copy_engine")
    assert "shared memory" in _matmul_reduce_scatter.reducer_unsupported(moved_ce, 1024, 16, 2)  # 16 ranks' unit rows
    assert "shared memory" in _matmul_reduce_scatter.reducer_unsupported(
        dataclasses.replace(moved, num_stages=4), 1024, 8, 2)
    assert _matmul_reduce_scatter.reducer_unsupported(moved, 1024, 8, 2) is None


def test_the_reducer_kernels_workspace_adds_an_own_slot_and_own_tile_flags_the_call_resets():
    """Layout.of(..., own_region=True): the copy engine's 2(W-1) slots plus the own slot, its
    flags and counters, then a flag per own tile and a done counter, all inside what a call zeroes
    (reset_words); a layout without the region keeps exactly the Triton kernel's bytes."""
    from fluxtp.backends.fused._matmul_reduce_scatter import Layout
    from fluxtp.configs import MatmulReduceScatterConfig

    config = MatmulReduceScatterConfig(transport="copy_engine", warp_specialized=True)
    m, n, world = 300, 1000, 8  # ragged rows: 3 x 4 tiles of 128 x 256
    plain = Layout.of(m, n, 2, world, dataclasses.replace(config, warp_specialized=False))
    own = Layout.of(m, n, 2, world, config, True)
    assert plain.own_offset == 0 and plain.reset_words == plain.num_flags
    assert plain.nbytes == plain.flags_offset + 4 * plain.num_flags
    assert own.flags_offset == -(-(2 * world - 1) * m * n * 2 // 16) * 16  # one more slot
    # the reducer's bands are its tile order's groups, group_m / W tile rows: 3 a segment here, 1 for the Triton kernel
    assert (own.band_rows, own.bands, plain.bands) == (1, 3, 1)
    assert own.num_flags == 2 * (world - 1) * 3 and plain.num_flags == 2 * (world - 1) and own.tile_arrivals == 2
    assert own.own_offset == own.flags_offset + 4 * own.num_flags
    assert own.nbytes == own.own_offset + 4 * (own.tiles_m * own.tiles_n + 1)
    assert own.reset_words * 4 == own.nbytes - own.flags_offset
    assert own.slots == 2 * world - 1 and not own.counts_bands
    assert bool((own.complete_flags(True) == 1).all())


def test_the_reducer_kernels_push_counts_each_peers_band_in_its_owners_buffer():
    """Push on the reducer kernel: W-1 incoming slots and the own slot, a counter per (peer, band)
    that reads 2 per tile of its band once every half arrived (a ragged last band fewer), then the
    own region; the Triton kernel's push layout is unchanged (a flag per (peer, tile))."""
    from fluxtp.backends.fused._matmul_reduce_scatter import Layout
    from fluxtp.configs import MatmulReduceScatterConfig

    config = MatmulReduceScatterConfig(transport="push", warp_specialized=True)
    m, n, world = 300, 1000, 4  # 3 x 4 tiles; group_m 8 / 4 ranks: bands of 2 and 1 tile rows
    plain = Layout.of(m, n, 2, world, dataclasses.replace(config, warp_specialized=False))
    own = Layout.of(m, n, 2, world, config, True)
    assert plain.num_flags == (world - 1) * 3 * 4 and not plain.counts_bands and plain.slots == world - 1
    assert own.slots == world and own.counts_bands and own.bands == 2
    assert own.flags_offset == -(-world * m * n * 2 // 16) * 16
    assert own.num_flags == (world - 1) * 2
    assert own.complete_flags(False).tolist() == [2 * 8, 2 * 4] * (world - 1)
    assert own.own_offset == own.flags_offset + 4 * own.num_flags
    assert own.reset_words * 4 == own.nbytes - own.flags_offset
