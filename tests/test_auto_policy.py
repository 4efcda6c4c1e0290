"""The "auto" policy: the fused kernels only where they measured faster: the thresholds measured on
the DESIGN.md shapes, and the tuning table's own measurements where they are clear."""

import dataclasses
import importlib

import pytest
import torch

from fluxtp import backends, configs, tune
from fluxtp._dist import GroupInfo
from fluxtp.backends import fused
from fluxtp.backends.fused._all_gather_matmul import AllGatherMatmulConfig
from fluxtp.backends.fused._matmul_reduce_scatter import MatmulReduceScatterConfig

TWO = GroupInfo(None, 0, 2)
AG, RS = "all_gather_matmul", "matmul_reduce_scatter"
BF = torch.bfloat16


def test_all_gather_matmul_counts_gathered_tokens():
    w = torch.empty(14336, 64, device="meta")  # LLaMA-70B gate projection per rank at TP=2
    threshold = fused.AUTO_ALL_GATHER[2][0]
    assert not fused.preferred("all_gather_matmul", torch.empty(threshold // 2 - 1, 64, device="meta"), w, TWO)
    assert fused.preferred("all_gather_matmul", torch.empty(threshold // 2, 64, device="meta"), w, TWO)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_all_gather_matmul_needs_enough_output_per_rank(world):
    """A rank's output elements (global tokens x its weight's rows) count, not only the tokens."""
    info = GroupInfo(None, 0, world)
    least_tokens, least_outputs, _ = fused.AUTO_ALL_GATHER[min(world, 8)]
    columns = least_outputs // (2 * least_tokens)  # narrow: twice the least tokens reach the least outputs
    assert columns <= fused.AUTO_WIDE_COLUMNS
    w = torch.empty(columns, 64, device="meta")
    assert not fused.preferred(AG, torch.empty(least_tokens // world, 64, device="meta"), w, info)
    assert fused.preferred(AG, torch.empty(2 * least_tokens // world, 64, device="meta"), w, info)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_all_gathers_of_wide_weights_need_more_tokens_from_tp4(world):
    """At TP=4 and 1024 tokens the GPT-3 / LLaMA-405B all-gathers (12288-13312 columns a rank) lost
    on H100s where LLaMA-8B / -70B ones (3584-7168) won; TP=2 won at both; TP=8 is unmeasured."""
    info = GroupInfo(None, 0, world)
    least_tokens, _, least_tokens_wide = fused.AUTO_ALL_GATHER[2 if world == 2 else 4 if world <= 4 else 8]
    wide = torch.empty(fused.AUTO_WIDE_COLUMNS + 1, 64, device="meta")
    narrow = torch.empty(fused.AUTO_WIDE_COLUMNS, 64, device="meta")
    x = torch.empty(-(-least_tokens // world), 64, device="meta")  # rows a rank: at least the least tokens
    assert fused.preferred(AG, x, narrow, info)
    assert fused.preferred(AG, x, wide, info) == (x.shape[0] * world >= least_tokens_wide)
    assert fused.preferred(AG, torch.empty(-(-least_tokens_wide // world), 64, device="meta"), wide, info)
    if world in (2, 4):  # the measured degrees fuse from 1024 tokens, wide weights at TP=4 from 2048
        assert least_tokens == 1024 and least_tokens_wide == (1024 if world == 2 else 2048)


def test_matmul_reduce_scatter_counts_rows_at_any_width():
    threshold = fused.AUTO_MIN_TOKENS["matmul_reduce_scatter"][2]
    for n in (8, 12288):  # GPT-3 dims (N 12288) won too with the copy-engine transport
        w = torch.empty(n, 64, device="meta")
        assert not fused.preferred("matmul_reduce_scatter", torch.empty(threshold - 2, 64, device="meta"), w, TWO)
        assert fused.preferred("matmul_reduce_scatter", torch.empty(threshold, 64, device="meta"), w, TWO)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_fp8_reduce_scatters_always_fused_all_gathers_from_the_measured_tokens(world):
    """Reduce-scatters of either accumulation (the FP8 recipe's forward and its gradients) at any
    size; all-gathers that keep nothing from the fewest tokens where they won alone (TP=2: 512, more
    ranks: 1024, the fewest measured), below that to NCCL then torch._scaled_mm; either scaling and
    accumulation alike."""
    info = GroupInfo(None, 0, world)
    w = torch.empty(14336, 8192, device="meta")
    least = configs.by_ranks(fused.AUTO_MIN_TOKENS["all_gather_scaled_matmul"], world)
    assert least == (512 if world == 2 else 1024)
    fast = {"out_dtype": torch.bfloat16, "use_fast_accum": True}
    for row_wise in (True, False):
        for accumulation in (fast, {**fast, "use_fast_accum": False}):
            details = {"row_wise": row_wise, **accumulation}
            for rows in (8, 1024, 16384):
                x = torch.empty(rows, 8192, device="meta")
                assert fused.preferred("scaled_matmul_reduce_scatter", x, w, info, **details)
            for tokens, fuses in ((least - world, False), (least, True), (16384, True)):
                x = torch.empty(tokens // world, 8192, device="meta")
                assert fused.preferred("all_gather_scaled_matmul", x, w, info, **details) == fuses, tokens


def test_unmeasured_tp_degrees_keep_the_older_all_gather_thresholds():
    eight = GroupInfo(None, 0, 8)
    w = torch.empty(1 << 16, 64, device="meta")  # wide: only the token count decides
    least_tokens = fused.AUTO_ALL_GATHER[8][0]
    assert least_tokens > fused.AUTO_ALL_GATHER[4][2]
    assert not fused.preferred(AG, torch.empty(least_tokens // 8 - 1, 64, device="meta"), w, eight)
    assert fused.preferred(AG, torch.empty(least_tokens // 8, 64, device="meta"), w, eight)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_reduce_scatters_by_tp_degree(world):
    """At TP 2 and 4 the op alone won from 512 tokens, eagerly and under CUDA graphs (2x and 4x
    H200; at 256 it lost under graphs); TP=8, unmeasured, from 1024, where the training step at
    TP=4 gained with its reduce-scatters fused."""
    info = GroupInfo(None, 0, world)
    w = torch.empty(8192, 64, device="meta")
    least = configs.by_ranks(fused.AUTO_MIN_TOKENS["matmul_reduce_scatter"], world)
    assert least == (1024 if world == 8 else 512)
    assert not fused.preferred("matmul_reduce_scatter", torch.empty(least - world, 64, device="meta"), w, info)
    assert fused.preferred("matmul_reduce_scatter", torch.empty(least, 64, device="meta"), w, info)


@pytest.mark.parametrize("op", [AG, "all_gather_scaled_matmul"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_a_caller_keeping_the_gathered_rows_fuses_by_the_training_steps_tokens(op, world, user_cache):
    """Training layers keep the gathered rows for their weight gradient; their steps (bf16 and FP8,
    TP 2 and 4) gained with those all-gathers fused from 4096 tokens on and lost below, whatever the
    op alone measured (the thresholds, a tuned entry's clear win or loss)."""
    info = GroupInfo(None, 0, world)
    least = fused.AUTO_MIN_TOKENS_KEEPING_ROWS
    w = torch.empty(1 << 16, 64, dtype=BF)
    wide = torch.empty(16384 // world, 64, dtype=BF)
    assert fused.preferred(op, wide, w, info, return_gathered=True)
    narrow = torch.empty(8, 64, dtype=BF)  # below the thresholds of a call keeping nothing
    assert fused.preferred(op, torch.empty(least // world, 64, dtype=BF), narrow, info, return_gathered=True)
    below = torch.empty(least // world - 1, 64, dtype=BF)
    assert not fused.preferred(op, below, w, info, return_gathered=True)
    if op == AG and world == 2:  # the tuned table's verdicts are for calls alone
        _tuned(AG, 2 << 16, 64, 2048, ms=0.5, nccl_ms=1.0)  # the key counts the layer's N: W x a rank's
        small = torch.empty(2048 // 2, 64, dtype=BF)
        assert fused.preferred(AG, small, w, TWO) and not fused.preferred(AG, small, w, TWO, return_gathered=True)
        _tuned(AG, 2 << 16, 64, 8192, ms=1.5, nccl_ms=1.0)
        big = torch.empty(8192 // 2, 64, dtype=BF)
        assert not fused.preferred(AG, big, w, TWO) and fused.preferred(AG, big, w, TWO, return_gathered=True)


@pytest.mark.parametrize("op", ["all_gather_matmul", "all_gather_scaled_matmul"])
@pytest.mark.parametrize("return_gathered", [False, True])
def test_the_op_tells_auto_whether_it_keeps_the_gathered_rows(op, return_gathered, monkeypatch):
    op_module = importlib.import_module(f"fluxtp.ops.{op}")  # fluxtp.ops names the function
    asked = {}

    def choose(op, backend, x, weight, info, **details):
        asked.update(details)
        return "nccl"

    monkeypatch.setattr(backends, "choose", choose)
    monkeypatch.setattr(backends, "prepare", lambda *args: None)
    if op == AG:
        op_module._build(torch.randn(4, 8), torch.randn(6, 8), None, TWO, "auto", return_gathered)
    else:
        x, w = torch.randn(4, 16).to(torch.float8_e4m3fn), torch.randn(16, 16).to(torch.float8_e4m3fn)
        op_module._build(x, w, torch.ones(()), torch.ones(()), None, TWO, "auto", torch.bfloat16, False, return_gathered)
    assert asked["return_gathered"] == return_gathered


def test_matmul_all_reduce_only_at_decode_rows():
    bf16 = torch.bfloat16
    w = torch.empty(8192, 64, dtype=bf16)
    rows = fused.AUTO_MAX_ROWS["matmul_all_reduce"]
    assert fused.preferred("matmul_all_reduce", torch.empty(1, 64, dtype=bf16), w, TWO)
    assert fused.preferred("matmul_all_reduce", torch.empty(rows, 64, dtype=bf16), w, TWO)
    assert not fused.preferred("matmul_all_reduce", torch.empty(rows + 1, 64, dtype=bf16), w, TWO)
    # Narrow outputs stay under the row cap, not only the byte cap.
    narrow = torch.empty(64, 64, dtype=bf16)
    assert not fused.preferred("matmul_all_reduce", torch.empty(rows + 1, 64, dtype=bf16), narrow, TWO)


@pytest.mark.parametrize("world, most", [(2, 4 << 20), (4, 4 << 20), (8, 1 << 20)])
def test_matmul_all_reduce_up_to_measured_output_bytes(world, most):
    # One-shot pushes the whole output to every peer: measured at TP 2 and 4 up to 128 rows of
    # 16384 columns (4 MB, bf16); more ranks get a quarter.
    info = GroupInfo(None, 0, world)
    bf16 = torch.bfloat16
    rows = min(most // (2 * 16384), fused.AUTO_MAX_ROWS["matmul_all_reduce"])
    x = torch.empty(rows, 64, dtype=bf16)
    assert fused.preferred("matmul_all_reduce", x, torch.empty(most // (2 * rows), 64, dtype=bf16), info)
    assert not fused.preferred("matmul_all_reduce", x, torch.empty(most // (2 * rows) + 1, 64, dtype=bf16), info)


def test_all_reduce_up_to_measured_bytes():
    most = configs.ALL_REDUCE_ONE_SHOT_MAX_BYTES[2]
    assert fused.preferred("all_reduce", torch.empty(most // 2, dtype=torch.bfloat16), None, TWO)
    assert not fused.preferred("all_reduce", torch.empty(most // 2 + 1, dtype=torch.bfloat16), None, TWO)


@pytest.mark.parametrize("world, most", [(1, 8 << 20), (2, 8 << 20), (3, 1 << 20), (4, 1 << 20), (8, 256 << 10), (16, 256 << 10)])
def test_all_reduce_one_shot_reach_shrinks_with_ranks(world, most):
    # One-shot sends W-1 copies of the tensor: at TP=4 it lost from 1.5 MB (0.79x NCCL), at 8 MB
    # 0.48x, where TP=2 still won; a rank count between entries takes the next entry's, one past
    # the last the last's.
    info = GroupInfo(None, 0, world)
    assert configs.all_reduce_one_shot_max_bytes(world) == most
    assert fused.preferred("all_reduce", torch.empty(most // 2, dtype=torch.bfloat16), None, info)
    assert not fused.preferred("all_reduce", torch.empty(most // 2 + 1, dtype=torch.bfloat16), None, info)


# ---------------------------------------------------------------- measured verdicts (tune entries)

@pytest.fixture
def user_cache(tmp_path, monkeypatch):
    """An empty user cache and no shipped table; entries are keyed for CPU tensors (GPU "cpu")."""
    monkeypatch.setenv("FLUXTP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(configs._table, "SHIPPED_TABLE", str(tmp_path / "none.json"))


def _tuned(op, n, k, m, ms, nccl_ms, layout="linear"):
    config = AllGatherMatmulConfig() if op == AG else MatmulReduceScatterConfig()
    key = tune.Key("cpu", 2, "bfloat16", op, n, k, tune.m_bucket(m), layout)
    tune.write_entries([tune.Entry(key, config, {"M": m, "ms": ms, "nccl_ms": nccl_ms})])


def _ag(tokens, n_local, k=64, weight=None):
    x = torch.empty(tokens // 2, k, dtype=BF)
    return fused.preferred(AG, x, torch.empty(n_local, k, dtype=BF) if weight is None else weight, TWO)


def test_a_clear_measured_win_takes_fused_below_the_thresholds(user_cache):
    assert not _ag(1024, 64)  # the thresholds alone: far too small
    _tuned(AG, 128, 64, 1024, ms=0.90, nccl_ms=1.0)
    assert _ag(1024, 64)
    assert _ag(600, 64)  # the same M bucket (1024)
    assert not _ag(2048, 64)  # another bucket: its nearest entry measured another M, thresholds decide
    _tuned(RS, 128, 64, 1024, ms=0.90, nccl_ms=1.0)
    assert fused.preferred(RS, torch.empty(1024, 32, dtype=BF), torch.empty(128, 32, dtype=BF), TWO)


def test_a_close_measurement_leaves_it_to_the_thresholds(user_cache):
    _tuned(AG, 128, 64, 1024, ms=0.97, nccl_ms=1.0)  # 3% faster: within one measurement's noise
    assert not _ag(1024, 64)


def test_a_measured_loss_takes_nccl_above_the_thresholds(user_cache):
    n_local = fused.AUTO_ALL_GATHER[2][1] // 8192
    assert _ag(8192, n_local)  # the thresholds alone
    _tuned(AG, 2 * n_local, 64, 8192, ms=1.01, nccl_ms=1.0)
    assert not _ag(8192, n_local)


def test_a_measurement_counts_only_for_its_own_weight_layout(user_cache):
    _tuned(AG, 128, 64, 1024, ms=0.90, nccl_ms=1.0)  # linear layout
    transposed = torch.empty(64, 64, dtype=BF).t()  # [n, k] with strides (1, n): the backward's view
    assert tune.weight_layout_of(transposed) == "transposed"
    assert not _ag(1024, 64, weight=transposed)
    _tuned(AG, 128, 64, 1024, ms=0.90, nccl_ms=1.0, layout="transposed")
    assert _ag(1024, 64, weight=transposed)


def test_entries_without_an_nccl_time_leave_it_to_the_thresholds(user_cache):
    key = tune.Key("cpu", 2, "bfloat16", AG, 128, 64, 1024, "linear")
    tune.write_entries([tune.Entry(key, AllGatherMatmulConfig(), {"M": 1024, "ms": 0.1})])
    assert not _ag(1024, 64)


@pytest.mark.parametrize("m", [1, 64, 128])
def test_matmul_all_reduce_tiles_widen_where_a_program_would_take_two(m):
    # 64-column tiles while they fit one a program (the SMs), 128 beyond: at N 12288 and 16384
    # each program's second tile refilled its pipeline from empty.
    assert configs.MatmulAllReduceConfig.heuristic(m, 64 * 132, 4096, 4, sms=132).block_n == 64
    assert configs.MatmulAllReduceConfig.heuristic(m, 64 * 132 + 1, 4096, 4, sms=132).block_n == 128
    assert configs.MatmulAllReduceConfig.heuristic(m, 64 * 132 + 1, 4096, 4, sms=200).block_n == 64


def test_the_all_gather_splits_its_last_wave_by_k_where_that_paid(monkeypatch):
    """stream_k_pays over 131 programs, by the one-H200 screens of all-gathers at TP 2, 4 and 8: the
    split paid where the last wave was at most 0.7 full after whole waves (bf16), at most 0.6 full
    after two or more, in tiles of K 12288 or deeper (fast FP8)."""
    from fluxtp.backends.fused import _all_gather_matmul, _scaled
    from fluxtp.configs._classes import stream_k_pays

    assert stream_k_pays(832, 16384, 131)  # llama3-405b TP=8, 2048 tokens, 128x128 tiles: 6.35 waves, 0.91x the time
    assert stream_k_pays(208, 16384, 131)  # llama3-405b TP=8, 1024 tokens, 128x256: 1.59 waves, 0.92x
    assert stream_k_pays(3584, 4096, 131)  # llama3-8b TP=2, 16384 tokens: 27.36 waves, 0.98x
    assert not stream_k_pays(112, 8192, 131)  # llama3-70b TP=8, 1024 tokens: less than a wave, 1.07x
    assert not stream_k_pays(224, 8192, 131)  # 1.71 waves, the last one 0.71 full: 1.01-1.03x
    assert not stream_k_pays(384, 12288, 131)  # gpt3-175b: 2.93 waves, 1.01-1.03x
    assert not stream_k_pays(832, 2048, 131)  # K shallower than measured: never split
    assert not stream_k_pays(262, 16384, 131)  # whole waves: nothing to split
    assert not stream_k_pays(13312, 16384, 131)  # 101.6 waves: 0.4% to take back, 1.02x
    assert stream_k_pays(832, 16384, 131, fp8=True)  # fast FP8, llama3-405b TP=4, 1024 tokens: 0.95x
    assert stream_k_pays(3072, 12288, 131, fp8=True)  # gpt3-175b TP=8, 16384 tokens, 0.45 full: 0.98x
    assert not stream_k_pays(1792, 8192, 131, fp8=True)  # llama3-70b TP=8, 16384 tokens, 0.68 full: 1.00x
    assert not stream_k_pays(1664, 16384, 131, fp8=True)  # 0.70 full: 1.00-1.04x
    assert not stream_k_pays(208, 16384, 131, fp8=True)  # llama3-405b TP=8, 1024 tokens, 1.59 waves: 0.97 / 1.02x
    monkeypatch.setattr(_all_gather_matmul, "warp_specialized_runs", lambda device, dtype: True)
    monkeypatch.setattr(_scaled, "pingpong_unsupported", lambda *args, **kwargs: None)
    monkeypatch.setattr(_all_gather_matmul, "num_sms", lambda device: 132)
    x, w = torch.empty(256, 16384, dtype=torch.bfloat16), torch.empty(6656, 16384, dtype=torch.bfloat16)
    split = _all_gather_matmul._config_for(x, w, 8, None)  # llama3-405b TP=8, 2048 tokens
    assert split.stream_k and split.warp_specialized and split.block_m == 128
    assert configs.smem_bytes("all_gather_matmul", split) + configs.SMEM_RESERVE_BYTES <= configs.SMEM_LIMIT_BYTES
    unsplit = _all_gather_matmul.looked_up(x, w, 8)  # the tiling the rule split, as it was (benchmarks' `unrouted`)
    assert not unsplit.stream_k and _all_gather_matmul.routed(unsplit, 256, 6656, 16384, 8, True, 132) == split
    x2, w2 = torch.empty(8192, 4096, dtype=torch.bfloat16), torch.empty(7168, 4096, dtype=torch.bfloat16)
    assert _all_gather_matmul._config_for(x2, w2, 2, None).stream_k  # llama3-8b TP=2, 16384 tokens
    x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    fast, precise = (_scaled.Scaled(torch.bfloat16, True, p) for p in (False, True))
    fp8_split = _all_gather_matmul._config_for(x8, w8, 8, None, fast)
    assert fp8_split.stream_k and fp8_split.warp_specialized
    untuned = AllGatherMatmulConfig.heuristic_fp8(256, 6656, 16384, 8, False, 132, True)
    assert fp8_split == dataclasses.replace(untuned, stream_k=True)  # its tiling and stages as without the rule
    assert not _all_gather_matmul._config_for(x8, w8, 8, None, precise).stream_k  # precise: no stream-K kernel
    monkeypatch.setattr(_all_gather_matmul, "warp_specialized_runs", lambda device, dtype: False)
    assert not _all_gather_matmul._config_for(x, w, 8, None).stream_k  # no warp-specialized kernel here
