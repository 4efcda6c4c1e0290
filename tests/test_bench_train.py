"""`fluxtp bench train` on CPU: the gloo demo end to end (table, JSON rows, plot), the
"communication removed" variant (no collective at all, the same shapes), the row arithmetic and
the option checks."""

import json
import math
import re

import pytest
import torch
import torch.distributed as dist

from fluxtp import cli
from fluxtp._dist import resolve_group
from fluxtp.bench import train
from fluxtp.bench.harness import Protocol
from fluxtp.bench.results import ENVELOPE_KEYS, SCHEMA
from fluxtp.testing import run_on_ranks
from tests.test_cli import fluxtp_cli

ROW_KEYS = {
    "model",
    "layers",
    "seq",
    "batch",
    "dtype",
    "ms",
    "tokens_per_s",
    "speedup_vs_nccl",
    "T_exposed_comm",
    "ideal_speedup",
    "E_overlap",
}


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
    assert "the fused kernels need NVIDIA GPUs" in done.stdout
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


def _no_comm_rank(rank, world):
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
    )
    trainer = train.Trainer(config, resolve_group(None), torch.device("cpu"))
    trainer.set_input(16)
    originals = {
        (m, n): getattr(__import__(m, fromlist=[n]), n) for m, names in train.NO_COMM_REPLACES.items() for n in names
    }

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
    # The stand-ins are gone again: the layers communicate as before.
    for (module, name), original in originals.items():
        assert getattr(__import__(module, fromlist=[name]), name) is original
    trainer.step("nccl")
    assert "reduce_scatter_tensor" in calls


def test_no_comm_step_issues_no_collective_and_keeps_the_shapes():
    run_on_ranks(_no_comm_rank, 2, backend="gloo", timeout_s=120)


def test_no_comm_stand_ins_compute_the_shapes_of_the_ops():
    one = resolve_group(None)  # a world of one: W = 1, the stand-ins are the plain linear
    x, w = torch.randn(6, 4), torch.randn(5, 4)
    y, gathered = train._local_all_gather_matmul(x, w, return_gathered=True)
    assert torch.equal(gathered, x) and torch.allclose(y, x @ w.t())
    assert torch.allclose(train._local_matmul_reduce_scatter(x, w, bias=torch.ones(5)), x @ w.t() + 1)
    assert torch.equal(train._local_gather_rows(x, one), x)
    assert train._local_all_reduce_sum(x, one) is None


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
    row = train._row(config, 4096, ["nccl", "fused"], {"nccl": 100.0, "fused": 92.0, "no_comm": 80.0})
    assert row["T_exposed_comm"] == 20.0
    assert row["ideal_speedup"] == 1.25  # 100 / (100 - 20)
    assert row["speedup_vs_nccl"] == {"nccl": 1.0, "fused": round(100 / 92, 4)}
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
        (("--model", "llama2"), "invalid choice: 'llama2'"),
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
