"""`fluxtp bench serve` on CPU: the gloo demo end to end (tables, JSON rows, plot), the options it
shares with train, its checks, and the row arithmetic."""

import json
import math
import re

import pytest
import torch

from fluxtp import cli
from fluxtp.bench import serve
from fluxtp.bench.harness import Timings
from fluxtp.bench.launch import NO_GPU_LINE
from fluxtp.bench.results import ENVELOPE_KEYS, SCHEMA
from tests.test_cli import fluxtp_cli

ROW_KEYS = {
    "phase",
    "model",
    "layers",
    "batch",
    "prompt_len",
    "dtype",
    "ms",
    "tokens_per_s",
    "speedup_vs_nccl",
    "speedup_vs_nccl_iqr",
    "T_exposed_comm",
    "ideal_speedup",
    "E_overlap",
}


def test_cpu_bench_serve_writes_every_row_key(tmp_path):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    args = ("bench", "serve", "--batch", "1,3", "--prompt-len", "8,24", "--rounds", "2")
    done = fluxtp_cli(*args, "--out", str(out), "--plot", str(png))
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(
        r"^prefill latency: .*\(float32; no_comm: nccl with every collective removed\)$", done.stdout, re.MULTILINE
    )
    assert re.search(r"^decode latency per token: .*lm_head and argmax included", done.stdout, re.MULTILINE)
    assert re.search(r"model\s+layers\s+batch\s+prompt_len\s+nccl ms\s+no_comm ms\s+nccl tok/s", done.stdout)
    assert done.stdout.splitlines()[-1] == NO_GPU_LINE  # the run ends on what the fused kernels need
    data = json.loads(out.read_text())
    assert tuple(data) == ENVELOPE_KEYS and data["schema"] == SCHEMA
    assert data["scenario"] == "serve" and data["device"] == "cpu" and data["world"] == 2
    assert data["command"].endswith(" ".join(args[1:]) + f" --out {out} --plot {png}")
    cases = [(p, b, s) for b in (1, 3) for s in (8, 24) for p in ("prefill", "decode")]
    assert [(r["phase"], r["batch"], r["prompt_len"]) for r in data["rows"]] == cases
    for row in data["rows"]:
        assert set(row) == ROW_KEYS, row
        assert (row["model"], row["layers"], row["dtype"]) == ("tiny", 2, "float32")
        assert set(row["ms"]) == {"nccl", "no_comm"}  # torch and fused need CUDA
        assert set(row["tokens_per_s"]) == set(row["speedup_vs_nccl"]) == set(row["E_overlap"]) == {"nccl"}
        for value in (*row["ms"].values(), row["ideal_speedup"]):
            assert isinstance(value, float) and math.isfinite(value) and value > 0, row
        ms = row["ms"]["nccl"]
        assert math.isclose(row["T_exposed_comm"], ms - row["ms"]["no_comm"], abs_tol=2e-5)
        tokens = row["batch"] * (row["prompt_len"] if row["phase"] == "prefill" else 1)
        # The row rounds tokens_per_s to 0.1 and ms to 1e-5 ms, and tokens_per_s comes from the
        # unrounded ms: the bound is both roundings (the second, relative 0.5e-5 / ms, reached
        # 0.075 tokens/s at a 48 us CPU decode step).
        exact = tokens / ms * 1e3
        bound = 0.05 + exact * 0.5e-5 / ms + 1e-9
        assert abs(row["tokens_per_s"]["nccl"] - exact) <= bound, (row["tokens_per_s"], exact)
        assert row["speedup_vs_nccl"]["nccl"] == 1.0 and row["E_overlap"]["nccl"] in (0.0, None)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _config(*args, world=2, device_type="cpu"):
    return serve.make_config(cli.build_parser().parse_args(["bench", "serve", *args]), world, device_type)


def test_gpu_defaults_are_llama3_70b_with_the_whole_vocabulary():
    config = _config(device_type="cuda")
    assert (config.model, config.layers, config.batches, config.prompt_lens, config.phases, config.dtype) == (
        "llama3-70b",
        2,
        (1, 8, 64),
        (128, 2048),
        ("prefill", "decode"),
        torch.bfloat16,
    )
    assert (config.dims.hidden, config.dims.ffn, config.dims.heads, config.dims.kv_heads, config.vocab) == (
        8192,
        28672,
        64,
        8,
        128256,
    )
    llama = serve.llama_config(_config("--model", "llama3-8b", "--layers", "3", device_type="cuda"))
    assert (llama.hidden_size, llama.intermediate_size, llama.num_attention_heads, llama.num_key_value_heads) == (
        4096,
        14336,
        32,
        8,
    )
    rope = getattr(llama, "rope_parameters", None) or llama.rope_scaling  # transformers 5 | 4
    assert (llama.num_hidden_layers, llama.vocab_size, rope["rope_type"]) == (3, 128256, "llama3")
    assert config.protocols["decode"].calls_per_sample > 1 and config.protocols["prefill"].calls_per_sample == 1


def test_options_shared_with_train():
    assert _config("--batch", "4").batches == (4,)
    assert _config("--batch", "2,16", "--phase", "decode", "--rounds", "3").batches == (2, 16)
    config = _config("--phase", "decode", "--rounds", "3")
    assert config.phases == ("decode",) and {p.rounds for p in config.protocols.values()} == {3}
    train_args = cli.build_parser().parse_args(["bench", "train", "--batch", "3"])
    assert train_args.batch == 3  # train still gets one int


@pytest.mark.parametrize(
    "args, message",
    [
        (("--prompt-len", "128,x"), "--prompt-len: '128,x' is not a comma list of positive integers"),
        (("--batch", "0"), "argument --batch: '0' is not a comma list of positive integers"),
        (("--nproc", "3"), "its 8 attention heads do not divide over the world size 3"),
        (("--layers", "0"), "--layers must be at least 1"),
        (("--phase", "both2"), "invalid choice: 'both2'"),
    ],
)
def test_bench_serve_rejects_bad_options_before_launching(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "serve", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_row_arithmetic_and_table():
    config = _config("--model", "llama3-70b", device_type="cuda")
    rounds = {"nccl": [2.0, 2.0, 2.2], "fused": [1.6, 1.6, 1.6], "no_comm": [1.5, 1.5, 1.5]}
    ms = {"nccl": 2.0, "fused": 1.6, "no_comm": 1.5}
    row = serve._row("decode", config, 8, 2048, ["nccl", "fused"], Timings(ms, rounds))
    assert set(row) == ROW_KEYS and row["dtype"] == "bfloat16"
    assert row["speedup_vs_nccl"] == {"nccl": 1.0, "fused": 1.25}
    assert row["speedup_vs_nccl_iqr"] == {"nccl": [1.0, 1.0], "fused": [1.25, 1.3125]}  # rounds 1.25, 1.25, 1.375
    assert row["tokens_per_s"] == {"nccl": 4000.0, "fused": 5000.0}  # 8 tokens per step
    assert (row["T_exposed_comm"], row["ideal_speedup"]) == (0.5, round(2.0 / 1.5, 4))
    assert row["E_overlap"] == {"nccl": 0.0, "fused": 0.8}  # 0.4 of the 0.5 exposed ms hidden
    prefill_ms = {"nccl": 100.0, "no_comm": 90.0}
    prefill = serve._row("prefill", config, 8, 2048, ["nccl"], Timings(prefill_ms, {k: [v] for k, v in prefill_ms.items()}))
    assert prefill["tokens_per_s"] == {"nccl": 163840.0}  # 8 * 2048 tokens per call
    table = serve.format_table([prefill, row])
    assert "speedup fused" in table and "E_overlap fused" in table and "ideal_speedup" in table
    assert "prefill latency" in table and "decode latency per token" in table
