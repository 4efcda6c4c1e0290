"""`fluxtp bench train` on CPU: the gloo demo end to end (table, JSON rows, plot), the
"communication removed" variant (no collective at all, the same shapes), the loss curves
(--loss-steps: the same start and data per backend, the noise reference, rows and plot), the
row arithmetic and the option checks."""

import itertools
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fluxtp
from fluxtp import cli, fp8
from fluxtp._dist import GroupInfo, resolve_group
from fluxtp.backends import reference
from fluxtp.bench import nccl_reordered, no_comm, train
from fluxtp.bench.harness import Protocol
from fluxtp.bench.harness import Timings
from fluxtp.bench.launch import NO_GPU_LINE
from fluxtp.bench.results import ENVELOPE_KEYS, SCHEMA
from fluxtp.testing import run_on_ranks
from tests.test_cli import fluxtp_cli

ROW_KEYS = {
    "model",
    "layers",
    "seq",
    "batch",
    "dtype",
    "fp8",
    "ms",
    "tokens_per_s",
    "speedup_vs_nccl",
    "speedup_vs_nccl_iqr",
    "T_exposed_comm",
    "ideal_speedup",
    "E_overlap",
}


def _timings(ms: dict[str, float]) -> Timings:
    """Timings whose every round took the median time."""
    return Timings(ms, {name: [t] * 3 for name, t in ms.items()})


def _positive_finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_cpu_bench_train_writes_every_row_key(tmp_path):
    out, png = tmp_path / "train.json", tmp_path / "train.png"
    done = fluxtp_cli("bench", "train", "--seq", "32,64", "--out", str(out), "--plot", str(png))
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(
        r"^train steps \(forward \+ backward \+ AdamW; float32",
        done.stdout,
        re.MULTILINE,
    ), done.stdout
    assert re.search(r"model\s+layers\s+seq\s+batch\s+nccl ms\s+no_comm ms", done.stdout), done.stdout
    assert done.stdout.splitlines()[-1] == NO_GPU_LINE  # the run ends on what the fused kernels need
    data = json.loads(out.read_text())
    assert tuple(data) == ENVELOPE_KEYS and data["schema"] == SCHEMA
    assert data["scenario"] == "train" and data["device"] == "cpu" and data["world"] == 2
    assert data["command"].endswith(f"-m fluxtp bench train --seq 32,64 --out {out} --plot {png}")
    assert [(r["model"], r["layers"], r["seq"], r["batch"]) for r in data["rows"]] == [
        ("tiny", 2, 32, 2),
        ("tiny", 2, 64, 2),
    ]
    for row in data["rows"]:
        assert set(row) == ROW_KEYS, row
        assert row["dtype"] == "float32"
        assert set(row["ms"]) == {"nccl", "no_comm"}  # torch and fused need CUDA
        assert set(row["tokens_per_s"]) == set(row["speedup_vs_nccl"]) == set(row["E_overlap"]) == {"nccl"}
        for value in (
            *row["ms"].values(),
            *row["tokens_per_s"].values(),
            row["T_exposed_comm"],
            row["ideal_speedup"],
        ):
            assert _positive_finite(value), row
        # gloo collectives between processes cost far more than these tiny matmuls
        assert row["ideal_speedup"] > 1.0 and row["ms"]["no_comm"] < row["ms"]["nccl"], row
        assert math.isclose(
            row["T_exposed_comm"],
            row["ms"]["nccl"] - row["ms"]["no_comm"],
            abs_tol=2e-4,
        )
        assert math.isclose(
            row["tokens_per_s"]["nccl"],
            2 * row["seq"] / row["ms"]["nccl"] * 1e3,
            rel_tol=1e-3,
        )
        assert row["speedup_vs_nccl"]["nccl"] == 1.0 and row["E_overlap"]["nccl"] == 0.0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


LOSS_ROW_KEYS = {
    "phase",
    "backend",
    "model",
    "layers",
    "seq",
    "batch",
    "dtype",
    "fp8",
    "lr",
    "warmup_steps",
    "final_lr_fraction",
    "losses",
    "max_rel_diff_vs_nccl",
    "within_noise",
}


def test_cpu_loss_curves_through_the_cli(tmp_path):
    out, png = tmp_path / "train.json", tmp_path / "train.png"
    done = fluxtp_cli(
        "bench", "train", "--seq", "128", "--rounds", "1", "--loss-steps", "5", "--backends", "nccl,auto",
        "--out", str(out), "--plot", str(png),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(out.read_text())
    timing = [r for r in data["rows"] if "phase" not in r]
    losses = [r for r in data["rows"] if r.get("phase") == "loss"]
    assert len(timing) + len(losses) == len(data["rows"])
    assert [r["seq"] for r in timing] == [128] and all(set(r) == ROW_KEYS for r in timing)  # as without curves
    assert [r["backend"] for r in losses] == ["nccl", "auto", train.REORDERED]
    curves = {r["backend"]: r["losses"] for r in losses}
    for row in losses:
        assert set(row) == LOSS_ROW_KEYS, row
        assert (row["model"], row["layers"], row["seq"], row["batch"], row["dtype"]) == ("tiny", 2, 128, 2, "float32")
        assert row["lr"] == train.LOSS_LEARNING_RATE["tiny"] and row["warmup_steps"] == train.LOSS_WARMUP_STEPS
        assert row["final_lr_fraction"] == train.LOSS_FINAL_LR_FRACTION
        curve = row["losses"]
        assert len(curve) == 5 and all(isinstance(v, float) and math.isfinite(v) for v in curve), row
        # next-token cross-entropy of an untrained model over 128 tokens starts near ln 128 = 4.85
        assert 4.0 < curve[0] < 6.0, curve
        assert curve[-1] < curve[0] - 0.05, curve  # it trains
        assert row["max_rel_diff_vs_nccl"] == train._max_rel_diff(curve, curves["nccl"])
    # auto is nccl on CPU: the very same computation, so the same curve to the bit; it would not
    # be if a backend did not start from the saved weights with a fresh optimizer on the same data
    assert curves["auto"] == curves["nccl"]
    by_backend = {r["backend"]: r for r in losses}
    assert by_backend["auto"]["within_noise"] is True
    assert by_backend["nccl"]["within_noise"] is None and by_backend[train.REORDERED]["within_noise"] is None
    # float32: the GEMMs summed in another order move the loss by a few float32 roundings at most
    assert by_backend[train.REORDERED]["max_rel_diff_vs_nccl"] <= 1e-5
    assert re.search(r"^loss curves \(5 steps, tiny x2 layers, seq 128, batch 2, float32, lr 0.001\)", done.stdout, re.MULTILINE)
    assert "loss curves against nccl's, max relative difference over the steps: auto 0; noise: nccl_reordered" in done.stdout
    assert re.search(r"within noise \(<= max\(2 x noise, unit roundoff 5.96e-08\) = \S+\): auto yes", done.stdout)
    assert "did not decrease" not in done.stdout
    for picture in (png, tmp_path / "train-loss.png"):
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {tmp_path / 'train-loss.png'}" in done.stdout


def test_loss_learning_rate_warms_up_then_decays():
    factors = [train.loss_lr_factor(step, 50) for step in range(50)]
    warm = train.LOSS_WARMUP_STEPS
    assert factors[:warm] == pytest.approx([(i + 1) / warm for i in range(warm)])
    assert factors[warm - 1] == 1.0 and factors[-1] == pytest.approx(train.LOSS_FINAL_LR_FRACTION)
    assert all(a > b for a, b in zip(factors[warm - 1 :], factors[warm:]))
    assert [train.loss_lr_factor(step, 3) for step in range(3)] == pytest.approx([1 / warm, 2 / warm, 3 / warm])


def test_loss_data_follows_the_chain_is_fixed_by_the_seed_and_new_every_step():
    successors = train.markov_successors()
    assert successors == train.markov_successors()
    assert len(successors) == train.VOCAB
    assert all(len(set(s)) == train.MARKOV_BRANCHES and all(0 <= t < train.VOCAB for t in s) for s in successors)
    first = train.loss_batch(0, 2, 300, successors)
    assert first.shape == (2, 300) and first.dtype == torch.long
    assert torch.equal(first, train.loss_batch(0, 2, 300, successors))
    assert not torch.equal(first, train.loss_batch(1, 2, 300, successors))
    for row in first.tolist():
        assert all(b in successors[a] for a, b in itertools.pairwise(row))
        assert len(set(row)) > train.MARKOV_BRANCHES  # it wanders over the vocabulary


def _bench_backends_rank(rank, world):
    """The bench's backends through the public ops, against nccl's on the same inputs."""
    generator = torch.Generator().manual_seed(0)
    x_full, w, bias = (torch.randn(shape, generator=generator) for shape in ((8 * world, 256), (48, 256), (48,)))
    x_shard = x_full.chunk(world)[rank]
    w_t = torch.randn(256, 48, generator=generator).t()  # the layers' backward passes transposed views
    for weight in (w, w_t):
        y_ref, gathered_ref = fluxtp.all_gather_matmul(x_shard, weight, bias=bias, backend="nccl", return_gathered=True)
        y, gathered = fluxtp.all_gather_matmul(x_shard, weight, bias=bias, backend=train.REORDERED, return_gathered=True)
        assert torch.equal(gathered, gathered_ref)  # the real rows (the weight gradient reads them)
        assert torch.allclose(y, y_ref, rtol=1e-5, atol=1e-4)
        out_ref = fluxtp.matmul_reduce_scatter(x_full, weight, bias=bias, backend="nccl")
        out = fluxtp.matmul_reduce_scatter(x_full, weight, bias=bias, backend=train.REORDERED)
        assert torch.allclose(out, out_ref, rtol=1e-5, atol=1e-4)

    y, gathered = fluxtp.all_gather_matmul(x_shard, w, bias=bias, backend=train.NO_COMM, return_gathered=True)
    assert torch.equal(gathered, x_shard.repeat(world, 1))
    assert torch.equal(y, torch.nn.functional.linear(gathered, w, bias))
    partial = x_full @ w.t()
    out = fluxtp.matmul_reduce_scatter(x_full, w, bias=bias, backend=train.NO_COMM)
    assert torch.allclose(out, partial.view(world, -1, partial.shape[1]).sum(0) + bias)


def test_bench_backends_run_through_the_public_ops():
    run_on_ranks(_bench_backends_rank, 2, backend="gloo", timeout_s=120)


def test_reordered_backend_sums_the_gemm_in_another_order():
    one = resolve_group(None)
    x, w = torch.randn(64, 256), torch.randn(48, 256)
    x_swapped, w_swapped = nccl_reordered.k_swapped(x, w)
    assert torch.equal(x_swapped[:, :128], x[:, 128:]) and torch.equal(w_swapped[:, 128:], w[:, :128])
    y, gathered = nccl_reordered.all_gather_matmul(x, w, None, one, True)
    assert torch.equal(gathered, x) and torch.allclose(y, x @ w.t(), rtol=1e-5, atol=1e-4)


def test_loss_rows_have_their_own_table_and_plot(tmp_path):
    config = train.TrainConfig("tiny", train.MODELS["tiny"], 2, (64,), 2, torch.bfloat16, None, train.CPU_PROTOCOL)
    common = {"phase": "loss", "model": "tiny", "layers": 2, "seq": 64, "batch": 2, "dtype": "bfloat16", "fp8": None,
              "lr": 1e-3, "warmup_steps": 8, "final_lr_fraction": 0.1}  # fmt: skip
    rows = [
        train._row(config, 64, ["nccl"], _timings({"nccl": 10.0, "no_comm": 8.0})),
        {**common, "backend": "nccl", "losses": [5.0, 4.0, 3.0], "max_rel_diff_vs_nccl": 0.0, "within_noise": None},
        {**common, "backend": "fused", "losses": [5.0, 4.01, None], "max_rel_diff_vs_nccl": None, "within_noise": False},
        {**common, "backend": train.REORDERED, "losses": [5.0, 4.0, 3.003], "max_rel_diff_vs_nccl": 0.001,
         "within_noise": None},
    ]  # fmt: skip
    table = train.format_table(rows)
    assert "T_exposed_comm ms" in table and "loss curves (3 steps, tiny x2 layers" in table
    assert re.search(r"fused\s+5\s+-\s+4.01\s+-\s+NO", table), table
    assert train.loss_plot_path(str(tmp_path / "r.png")) == str(tmp_path / "r-loss.png")
    assert train.loss_plot_path("plot") == "plot-loss.png"
    train.plot(rows, str(tmp_path / "r.png"), "title")
    assert (tmp_path / "r.png").exists() and (tmp_path / "r-loss.png").exists()
    assert train._max_rel_diff([1.0, 2.2], [1.0, 2.0]) == pytest.approx(0.1)
    assert train._max_rel_diff([1.0, math.nan], [1.0, 2.0]) == math.inf


# Every torch.distributed entry point a layer could communicate through.
COLLECTIVES = (
    "all_gather_into_tensor",
    "all_gather",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_reduce",
    "broadcast",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
)


def _no_comm_rank(rank, world, fp8):
    calls = []
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    config = train.TrainConfig(
        "tiny",
        train.MODELS["tiny"],
        2,
        (16,),
        2,
        torch.float32,
        None,
        Protocol(1, 0, 1),
        fp8=fp8,
    )
    trainer = train.Trainer(config, resolve_group(None), torch.device("cpu"))
    trainer.set_input(16)

    weights = [p.detach().clone() for p in trainer.optimizer.param_groups[0]["params"]]
    trainer.step("nccl")
    assert {"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"} <= set(calls), calls  # the counter works
    calls.clear()
    ref = trainer.forward("nccl")
    calls.clear()
    with torch.no_grad():
        local = trainer.forward(train.NO_COMM)
    trainer.step(train.NO_COMM)
    assert calls == [], f"the no_comm step communicated: {calls}"
    assert local.shape == ref.shape == (2 * 16 // world, train.MODELS["tiny"].hidden)
    assert torch.isfinite(local).all()
    # Both steps trained: every parameter moved.
    after = trainer.optimizer.param_groups[0]["params"]
    assert all(not torch.equal(w, p) for w, p in zip(weights, after))
    # The whole model (embedding, token scatter before the first layer and gather after the
    # last, the final norm's gradient sum, the head) communicates through its backend too.
    ids = torch.randint(train.VOCAB, (2, 16))
    trainer.model(input_ids=ids, labels=ids).loss.backward()
    assert calls == [], f"the no_comm model communicated: {calls}"
    # Back on nccl, the layers communicate as before.
    trainer.step("nccl")
    assert "reduce_scatter_tensor" in calls


@pytest.mark.parametrize("fp8", [None, train.TRAIN_FP8])
def test_no_comm_step_issues_no_collective_and_keeps_the_shapes(fp8):
    """Also with the layers' GEMMs in FP8, through the scaled ops' stand-ins."""
    run_on_ranks(_no_comm_rank, 2, fp8, backend="gloo", timeout_s=120)


def test_no_comm_stand_ins_compute_the_shapes_of_the_ops():
    one = resolve_group(None)  # a world of one: W = 1, the stand-ins are the plain linear
    x, w = torch.randn(6, 4), torch.randn(5, 4)
    y, gathered = no_comm.all_gather_matmul(x, w, None, one, True)
    assert torch.equal(gathered, x) and torch.allclose(y, x @ w.t())
    assert torch.allclose(no_comm.matmul_reduce_scatter(x, w, torch.ones(5), one), x @ w.t() + 1)
    assert torch.allclose(no_comm.matmul_all_reduce(x, w, None, one), x @ w.t())
    assert torch.equal(no_comm.gather_rows(x, one), x)
    assert no_comm.all_reduce_sum(x, one, async_op=True) is None


def test_scaled_stand_ins_repeat_the_fp8_rows_and_sum_the_blocks():
    two = GroupInfo(None, 0, 2)  # no collective is issued: any world size runs in one process
    x = torch.randn(6, 32).to(torch.float8_e4m3fn)
    w = torch.randn(5, 32).to(torch.float8_e4m3fn)
    scale_x, scale_w, bias = torch.rand(6, 1) + 0.5, torch.rand(1, 5) + 0.5, torch.randn(5)
    y, (gathered, scales) = no_comm.all_gather_scaled_matmul(x, w, scale_x, scale_w, bias, two, torch.float32,
                                                             False, True)  # fmt: skip
    assert torch.equal(gathered.view(torch.uint8), x.view(torch.uint8).repeat(2, 1))
    assert torch.equal(scales, scale_x.repeat(2, 1))
    full = fp8.scaled_linear(gathered, w, scales, scale_w, bias, torch.float32)
    assert torch.equal(y, full)
    out = no_comm.scaled_matmul_reduce_scatter(x, w, scale_x, scale_w, bias, two, torch.float32, False)
    partial = fp8.scaled_linear(x, w, scale_x, scale_w, None, torch.float32)
    assert torch.allclose(out, partial[:3] + partial[3:] + bias)
    per_tensor = torch.tensor(0.5)
    _, (_, kept) = no_comm.all_gather_scaled_matmul(x, w, per_tensor, per_tensor, None, two, torch.float32, False, True)
    assert kept is per_tensor  # one scale of the whole x: as it is


def _reordered_scaled_rank(rank, world):
    info = resolve_group(None)
    generator = torch.Generator().manual_seed(7)  # the same weight on every rank; x its own
    w = torch.randn(4, 64, generator=generator).to(torch.float8_e4m3fn)
    scale_w = torch.rand(1, 4, generator=generator) + 0.5
    x = torch.randn(8, 64).mul_(rank + 1).to(torch.float8_e4m3fn)
    scale_x = torch.rand(8, 1) + 0.5
    y, (gathered, scales) = nccl_reordered.all_gather_scaled_matmul(x, w, scale_x, scale_w, None, info, torch.float32,
                                                                    False, True)  # fmt: skip
    ref_y, (ref_gathered, ref_scales) = reference.all_gather_scaled_matmul(x, w, scale_x, scale_w, None, info,
                                                                           torch.float32, False, True)  # fmt: skip
    assert torch.equal(gathered.view(torch.uint8), ref_gathered.view(torch.uint8)) and torch.equal(scales, ref_scales)
    assert torch.allclose(y, ref_y, rtol=1e-5, atol=1e-5)
    out = nccl_reordered.scaled_matmul_reduce_scatter(x, w, scale_x, scale_w, None, info, torch.float32, False)
    ref_out = reference.scaled_matmul_reduce_scatter(x, w, scale_x, scale_w, None, info, torch.float32, False)
    assert out.shape == (8 // world, 4) and torch.allclose(out, ref_out, rtol=1e-5, atol=1e-5)


def test_reordered_scaled_ops_compute_the_reference_function():
    """The scaled ops with K's halves swapped: the same gathered bytes and scales, the same
    products (the FP8 row scales stay with their rows)."""
    run_on_ranks(_reordered_scaled_rank, 2, backend="gloo", timeout_s=120)


def test_cpu_bench_train_with_fp8_gemms(tmp_path):
    out = tmp_path / "train.json"
    done = fluxtp_cli("bench", "train", "--fp8", "row-wise", "--seq", "32", "--rounds", "1", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "float32, FP8 GEMMs (row-wise scales)" in done.stdout, done.stdout
    (row,) = json.loads(out.read_text())["rows"]
    assert row["fp8"] == "row-wise" and set(row["ms"]) == {"nccl", "no_comm"}
    args = cli.build_parser().parse_args(["bench", "train"])
    assert train.make_config(args, 2, "cpu").fp8 is None


def test_row_arithmetic():
    config = train.TrainConfig(
        "llama3-70b",
        train.MODELS["llama3-70b"],
        2,
        (4096,),
        1,
        torch.bfloat16,
        None,
        train.GPU_PROTOCOL,
    )
    ms = {"nccl": 100.0, "fused": 92.0, "no_comm": 80.0}
    rounds = {"nccl": [100.0, 99.0], "fused": [92.0, 90.0], "no_comm": [80.0, 80.0]}
    row = train._row(config, 4096, ["nccl", "fused"], Timings(ms, rounds))
    assert row["T_exposed_comm"] == 20.0
    assert row["ideal_speedup"] == 1.25  # 100 / (100 - 20)
    assert row["speedup_vs_nccl"] == {"nccl": 1.0, "fused": round(100 / 92, 4)}
    # Quartiles (inclusive) of the rounds' ratios 100/92 = 1.087 and 99/90 = 1.1.
    assert row["speedup_vs_nccl_iqr"] == {"nccl": [1.0, 1.0], "fused": [1.0902, 1.0967]}
    assert row["E_overlap"] == {
        "nccl": 0.0,
        "fused": 0.4,
    }  # 8 of the 20 exposed ms hidden
    assert row["tokens_per_s"] == {"nccl": 40960.0, "fused": round(4096 / 0.092, 1)}
    assert row["dtype"] == "bfloat16" and set(row) == ROW_KEYS
    assert "ideal_speedup" in train.format_table([row]) and "speedup fused" in train.format_table([row])


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ("--batch", "1", "--seq", "63"),
            "batch*seq = 1*63 tokens must be divisible by the world size 2",
        ),
        (("--nproc", "3"), "its 8 attention heads do not divide over the world size 3"),
        (("--seq", "64,x"), "'64,x' is not a comma list of positive integers"),
        (("--layers", "0"), "--layers must be at least 1"),
        (("--batch", "1,2"), "--batch: train takes one batch size, got 1,2"),
        (("--model", "llama2"), "invalid choice: 'llama2'"),
        (("--loss-steps", "-1"), "--loss-steps must be 0 (no loss curves) or more, got -1"),
        (("--loss-lr", "0"), "--loss-lr must be a positive number, got 0.0"),
        (("--fp8", "tensor"), "--fp8 tensor: train runs fluxtp.nn's FP8 recipe, whose scales are row-wise"),
        (("--fp8", "row-wise", "--fast-accum"), "--fast-accum: train runs fluxtp.nn's FP8 recipe"),
    ],
)
def test_bench_train_rejects_bad_options_before_launching(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "train", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_gpu_defaults_are_llama3_70b_layers_at_4096_and_8192_tokens():
    args = cli.build_parser().parse_args(["bench", "train"])
    config = train.make_config(args, 2, "cuda")
    assert (config.model, config.layers, config.seqs, config.batch, config.dtype) == (
        "llama3-70b",
        2,
        (4096, 8192),
        1,
        torch.bfloat16,
    )
    assert config.dims == train.LayerDims(hidden=8192, ffn=28672, heads=64, kv_heads=8)
    assert train.MODELS["llama3-8b"] == train.LayerDims(hidden=4096, ffn=14336, heads=32, kv_heads=8)
    assert config.protocol.calls_per_sample == 1 and config.backends is None
    assert config.loss_steps == 0 and config.loss_lr is None  # no loss curves unless asked
    args = cli.build_parser().parse_args(["bench", "train", "--loss-steps", "50", "--seq", "4096"])
    config = train.make_config(args, 2, "cuda")
    assert (config.loss_steps, config.seqs, config.loss_lr) == (50, (4096,), None)


def _profile_script():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "train_step_profile.py"
    spec = importlib.util.spec_from_file_location("train_step_profile", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_profile_groups_kernels_and_counts_busy_time_once():
    profile = _profile_script()
    assert profile.kind_of("all_gather_matmul_kernel") == "fused all_gather_matmul"
    assert profile.kind_of("all_gather_matmul_pingpong_kernel") == "fused all_gather_matmul"
    assert profile.kind_of("matmul_reduce_scatter_reducer_kernel") == "fused matmul_reduce_scatter"  # not "cat"
    assert profile.kind_of("Memcpy DtoD (Device -> Device)") == "copy/cat/transpose"
    assert profile.kind_of("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "nccl"
    assert profile.kind_of("c10d::symmetric_memory::barrier_kernel(unsigned int**, int)") == "symm barrier/signal"
    assert profile.kind_of("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "gemm (cuBLAS)"
    assert profile.kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16") == "attention"
    assert profile.kind_of("void at::native::CatArrayBatchedCopy<...>") == "copy/cat/transpose"
    assert profile.kind_of("void at::native::rms_norm_kernel") == "other"
    # overlapping kernels on two streams count once; a gap counts not at all
    assert profile.union_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert profile.union_us([]) == 0
