"""The `fluxtp` command on CPU (info; the gloo bench demo, spawned and under torchrun; its
errors), the results format, the timing harness's arithmetic, and the quickstart example."""

import collections
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch

from fluxtp import cli
from fluxtp._dist import GroupInfo
from fluxtp.bench import BenchError
from fluxtp.bench import ops as ops_scenario
from fluxtp.bench.harness import Protocol, Timings, Variant, format_speedup, input_copies, measure, measure_rounds
from fluxtp.bench.harness import overlap_efficiency, round_order, speedup, speedup_iqr
from fluxtp.testing import run_launch, run_on_ranks
from fluxtp.bench.launch import NO_GPU_LINE
from fluxtp.bench.results import ENVELOPE_KEYS, SCHEMA, command_line, device_slug, result_filename

ROOT = Path(__file__).resolve().parents[1]
ROW_KEYS = {
    "op", "M", "N", "K", "dtype", "cuda_graphs", "weight_layout", "calls_per_sample", "ms", "E_overlap", "speedup_vs_nccl",
    "speedup_vs_nccl_iqr",
}  # fmt: skip
OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")


def fluxtp_cli(*args, timeout=300, launcher=("-m", "fluxtp"), columns=None):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if columns is not None:  # the terminal width the command sees (shutil.get_terminal_size reads COLUMNS)
        env["COLUMNS"] = str(columns)
    return run_launch([sys.executable, *launcher, *args], cwd=ROOT, env=env, timeout=timeout)


def check_envelope(data: dict, world: int) -> None:
    """Every key of the fluxtp.bench/1 envelope and of each ops row."""
    assert tuple(data) == ENVELOPE_KEYS
    assert data["schema"] == SCHEMA == "fluxtp.bench/1"
    assert data["scenario"] == "ops"
    assert data["device"] == "cpu" and data["gpus"] == 0 and data["world"] == world
    assert data["torch"] == torch.__version__
    assert isinstance(data["triton"], str) and data["triton"]
    assert data["commit"] == "unknown" or re.fullmatch(r"[0-9a-f]{40}", data["commit"])
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", data["date"])
    assert "fluxtp bench" in data["command"]
    assert data["rows"]
    for row in data["rows"]:
        assert set(row) == ROW_KEYS
        assert row["op"] in OPS and row["dtype"] == "float32" and row["weight_layout"] in ("linear", "transposed")
        assert all(isinstance(row[k], int) and row[k] > 0 for k in ("M", "N", "K"))
        assert {"gemm", "nccl"} <= set(row["ms"]), row["ms"]
        assert all(isinstance(v, float) and 0 < v < 60_000 for v in row["ms"].values())
        assert set(row["E_overlap"]) == set(row["speedup_vs_nccl"]) == set(row["ms"]) - {"gemm"}
        assert row["speedup_vs_nccl"]["nccl"] == 1.0
        assert set(row["speedup_vs_nccl_iqr"]) == set(row["speedup_vs_nccl"])
        assert row["speedup_vs_nccl_iqr"]["nccl"] == [1.0, 1.0]  # nccl against itself, round by round
        assert all(0 < low <= high for low, high in row["speedup_vs_nccl_iqr"].values())
        assert row["E_overlap"]["nccl"] in (0.0, None)  # None: NCCL exposed no time over the GEMM


def test_info_exits_0_and_names_the_backends():
    done = fluxtp_cli("info", timeout=120)
    assert done.returncode == 0, done.stderr
    for needle in ("fluxtp", "torch", "triton", "NCCL", "GPUs", "symmetric memory"):
        assert needle in done.stdout
    assert re.search(r"^nccl\s+yes", done.stdout, re.M), done.stdout
    if not torch.cuda.is_available():
        assert re.search(r"^torch\s+no\s+it needs CUDA", done.stdout, re.M), done.stdout
        assert re.search(r"^fused\s+no", done.stdout, re.M), done.stdout


def test_cpu_bench_prints_a_table_and_writes_json_and_png(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    done = fluxtp_cli("bench", "--out", str(out), "--plot", str(png))
    assert done.returncode == 0, done.stdout + done.stderr
    for op in OPS:
        assert re.search(rf"^{op} \(float32", done.stdout, re.M), done.stdout
    assert re.search(r"M\s+N\s+K\s+gemm ms\s+nccl ms\s+ceiling \(p25-p75\)", done.stdout)
    assert done.stdout.splitlines()[-1] == NO_GPU_LINE
    data = json.loads(out.read_text())
    check_envelope(data, world=2)
    assert data["command"].endswith(f"-m fluxtp bench --out {out} --plot {png}")
    assert {r["op"] for r in data["rows"]} == set(OPS)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def _table_rows(stdout: str, title: str) -> list[list[str]]:
    """The cells of the table under `title` (tabulate's plain format: a header, a dashes line)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows = []
    for line in lines[start + 3 :]:
        if not line.strip() or not line.lstrip()[0].isdigit():
            break
        rows.append(re.findall(r"\S+ \([^)]*\)|\S+", line.strip()))
    return rows


def test_cpu_bench_says_what_it_does_shows_the_ceiling_and_its_spread_and_what_gpus_need(tmp_path):
    out = tmp_path / "bench.json"
    args = ("--op", "matmul_all_reduce", "--shapes", "32x48x64,64x48x64", "--rounds", "4", "--out", str(out))
    done = fluxtp_cli("bench", *args, columns=100)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    # It starts by saying what it will do, in two sentences wrapped to the terminal.
    intro = " ".join(lines[:4])
    assert lines[0].startswith("fluxtp bench ops: no CUDA GPU here, so a demo on a 2-process gloo group: 2 small")
    assert "float32 cases of matmul_all_reduce." in intro
    assert "Only the reference (the collective, then the matmul) runs on CPU" in intro
    assert "over 4 rounds of 3 calls." in intro
    # The legend says what the speedups and their spread are.
    text = " ".join(done.stdout.split())
    assert "ceiling = nccl ms / gemm ms" in text
    assert "(p25-p75) = the middle half of the per-round speedups" in text
    header = next(line for line in lines if line.lstrip().startswith("M "))
    assert header.split()[-2:] == ["ceiling", "(p25-p75)"], header
    # Every line but the closing one fits the 100 columns (the table's are narrow on CPU).
    assert all(len(line) <= 100 for line in lines[:-1]), [line for line in lines if len(line) > 100]
    # The ceiling column: nccl ms / gemm ms of the results file, then the middle half of its rounds.
    data = json.loads(out.read_text())
    check_envelope(data, world=2)  # the table-only spread of the ceiling is not in the file
    table = _table_rows(done.stdout, "matmul_all_reduce (float32")
    assert [[int(c) for c in cells[:3]] for cells in table] == [[32, 48, 64], [64, 48, 64]]
    for cells, row in zip(table, data["rows"], strict=True):
        assert len(cells) == 6, cells  # M N K, gemm ms, nccl ms, ceiling
        assert float(cells[3]) == pytest.approx(row["ms"]["gemm"], rel=2e-3, abs=1e-4)
        assert float(cells[4]) == pytest.approx(row["ms"]["nccl"], rel=2e-3, abs=1e-4)
        value, low, high = map(float, re.fullmatch(r"(\S+) \((\S+)-(\S+)\)", cells[5]).groups())
        assert value == pytest.approx(row["ms"]["nccl"] / row["ms"]["gemm"], rel=1e-2)
        assert 0 < low <= high
    # It ends with what the fused kernels would need, after the files it wrote.
    assert lines[-2] == f"wrote {out}"
    assert lines[-1] == NO_GPU_LINE
    for needle in ("NVIDIA GPUs", "peer access", "symmetric memory", "torchrun --nproc-per-node N -m fluxtp bench"):
        assert needle in NO_GPU_LINE


@pytest.mark.parametrize(
    "argv, device, first, second",
    [
        ([], "cuda", "14 bfloat16 cases of the 3 ops on 2 GPUs, one process each.",
         "Each case checks every backend usable here against the reference (the collective, then the matmul), then "
         "times them beside the reference and the matmul alone, over 20 rounds of 5 calls."),
        (["--backends", "fused", "--op", "matmul_all_reduce", "--cuda-graphs"], "cuda",
         "6 bfloat16 cases of matmul_all_reduce on 2 GPUs, one process each.",
         "Each case checks fused against the reference (the collective, then the matmul), then times them beside "
         "the reference and the matmul alone, over 20 rounds of 5 calls (CUDA graph replays)."),
        ([], "cpu", "no CUDA GPU here, so a demo on a 2-process gloo group: 9 small float32 cases of the 3 ops.",
         "Only the reference (the collective, then the matmul) runs on CPU: each case times it beside the matmul "
         "alone, over 5 rounds of 3 calls."),
        (["--backends", "nccl", "--rounds", "2"], "cpu", "9 small float32 cases of the 3 ops.",
         "Each case times the reference (the collective, then the matmul) beside the matmul alone, over 2 rounds of "
         "3 calls."),
    ],
)  # fmt: skip
def test_bench_intro_says_what_will_run(argv, device, first, second):
    config = ops_scenario.make_config(cli.build_parser().parse_args(["bench", *argv]), 2, device)
    text = ops_scenario.describe(config, 2, device, width=80)
    assert all(len(line) <= 80 for line in text.splitlines())
    one_line = " ".join(text.split())
    assert one_line.startswith("fluxtp bench ops: ") and first in one_line and one_line.endswith(second)


def test_progress_bar_is_drawn_only_on_a_terminal():
    import io

    from fluxtp.bench.progress import DESCRIPTION_WIDTH, describe, progress_bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    pipe, terminal = io.StringIO(), Terminal()
    assert progress_bar(3, "round", True, file=pipe).disable  # a log or a pipe: no carriage returns
    assert progress_bar(3, "round", False, file=terminal).disable  # the ranks but 0
    bar = progress_bar(3, "round", True, file=terminal)
    assert not bar.disable
    long = "1/9 matmul_reduce_scatter 8192x8192x28672 and more"
    describe(bar, long)
    bar.update(1)
    bar.refresh()
    frame = terminal.getvalue().split("\r")[-1]
    assert frame.startswith(long[: DESCRIPTION_WIDTH - 3] + "... ")  # cut to a fixed width
    assert frame[DESCRIPTION_WIDTH:].lstrip().startswith("33%") and "1/3 rounds" in frame
    describe(bar, "short")
    assert bar.desc == "short".ljust(DESCRIPTION_WIDTH)  # padded: the bar does not move
    bar.close()


def _help(monkeypatch, capsys, *command) -> str:
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps at the terminal's width: one line per option
    with pytest.raises(SystemExit) as e:
        cli.main([*command, "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # an option's help may start on the next line


def test_help_defaults_are_the_ones_that_run(monkeypatch, capsys):
    """Every default --help states is the constant the code paths use."""
    from fluxtp.bench import serve, train

    bench = _help(monkeypatch, capsys, "bench")
    gpu, cpu = ops_scenario.GPU_PROTOCOL, ops_scenario.CPU_PROTOCOL
    dtypes = ops_scenario.DEFAULT_DTYPE
    assert f"--dtype {{bfloat16,float16,float32,float64}} default: {dtypes['cuda']} on GPUs, {dtypes['cpu']} on CPU" in bench
    # --rounds: the ops', train's and serve's decode protocols agree; serve's prefill is named.
    assert f"(default: {gpu.rounds} on GPUs, {cpu.rounds} on CPU; serve's prefill: " in bench
    assert (train.GPU_PROTOCOL.rounds, train.CPU_PROTOCOL.rounds) == (gpu.rounds, cpu.rounds)
    assert (serve.PROTOCOLS["cuda"]["decode"].rounds, serve.PROTOCOLS["cpu"]["decode"].rounds) == (gpu.rounds, cpu.rounds)
    assert serve.PROTOCOLS["cpu"]["prefill"].rounds == cpu.rounds
    assert f"serve's prefill: {serve.PROTOCOLS['cuda']['prefill'].rounds} on GPUs)" in bench
    assert f"(default: {gpu.calls_per_sample} on GPUs, {cpu.calls_per_sample} on CPU)" in bench
    # --shapes: the M of the default shapes, per op and device.
    shapes = ops_scenario.DEFAULT_SHAPES
    assert sorted({s.M for s in shapes["cuda"]["all_gather_matmul"]}) == [1024, 2048, 4096, 8192]
    assert sorted({s.M for s in shapes["cuda"]["matmul_all_reduce"]}) == [1, 128, 1024, 2048, 4096, 8192]
    assert "LLaMA-70B MLP dims, M 1024..8192, and M 1 and 128 too for matmul_all_reduce" in bench
    assert {s.M for op in ops_scenario.OPS for s in shapes["cpu"][op]} == {64, 128, 256}
    assert "on CPU: small demo shapes, M 64..256" in bench
    assert "(default: all three)" in bench and cli.build_parser().parse_args(["bench"]).op == "all"
    # train and serve.
    t, sv = train.DEFAULTS, serve.DEFAULTS
    assert f"(default: {t['cuda']['model']} on GPUs, {t['cpu']['model']} on CPU)" in bench
    assert (sv["cuda"]["model"], sv["cpu"]["model"]) == (t["cuda"]["model"], t["cpu"]["model"])
    assert t["cuda"]["layers"] == t["cpu"]["layers"] == sv["cuda"]["layers"] == sv["cpu"]["layers"] == 2
    assert "decoder layers in the stack (default: 2)" in bench
    seqs = {d: ",".join(map(str, t[d]["seq"])) for d in ("cuda", "cpu")}
    assert f"(default on GPUs: {seqs['cuda']}; on CPU: {seqs['cpu']})" in bench
    assert f"(default: {t['cuda']['batch']} on GPUs, {t['cpu']['batch']} on CPU)" in bench
    batches = {d: ",".join(map(str, sv[d]["batch"])) for d in ("cuda", "cpu")}
    assert f"(default: {batches['cuda']} on GPUs, {batches['cpu']} on CPU)" in bench
    lens = {d: ",".join(map(str, sv[d]["prompt_len"])) for d in ("cuda", "cpu")}
    assert f"(default on GPUs: {lens['cuda']}; on CPU: {lens['cpu']})" in bench
    lr = train.LOSS_LEARNING_RATE
    assert lr["llama3-8b"] == lr["llama3-70b"] == 1e-4 and lr["tiny"] == 1e-3
    assert "(default: 1e-4 for llama3 sizes, 1e-3 for tiny)" in bench
    assert "vocabulary 128256 for llama3-8b, 128256 for llama3-70b, 1024 for tiny" in bench
    # info --configs and tune.
    info = _help(monkeypatch, capsys, "info")
    assert re.search(r"--dtype \{bfloat16,float16,float8_e4m3fn\}\s+default: bfloat16", info)
    assert cli.build_parser().parse_args(["info"]).dtype == "bfloat16"
    tune_help = _help(monkeypatch, capsys, "tune")
    tune_args = cli.build_parser().parse_args(["tune"])
    assert (tune_args.dtype, tune_args.budget_seconds, tune_args.worlds) == ("bfloat16", 600.0, "2,4,8")
    assert re.search(r"--dtype \{bfloat16,float16,float8_e4m3fn\}\s+default: bfloat16", tune_help)
    assert "(default: 600)" in tune_help and "(default 2,4,8)" in tune_help


def test_bench_times_the_backward_weight_layout(tmp_path):
    """--weight-layout transposed: every op verified and timed with the W^T views the backward
    passes; --calls-per-sample is recorded in every row."""
    out = tmp_path / "bench.json"
    args = ("--weight-layout", "transposed", "--calls-per-sample", "3", "--shapes", "64x48x32", "--rounds", "2")
    done = fluxtp_cli("bench", *args, "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(out.read_text())
    check_envelope(data, world=2)
    assert {r["op"] for r in data["rows"]} == set(OPS)
    assert all(r["weight_layout"] == "transposed" and r["calls_per_sample"] == 3 for r in data["rows"])


@pytest.mark.parametrize("scaling, fast", [("row-wise", False), ("tensor", True)])
def test_bench_times_the_scaled_ops_with_fp8(tmp_path, scaling, fast):
    """--fp8: both scaled ops verified (the nccl reference, the gemm is torch._scaled_mm's
    stand-in on CPU) and timed; the rows say which op, scaling and accumulation they timed."""
    out = tmp_path / "bench.json"
    args = ("--fp8", scaling, *(("--fast-accum",) if fast else ()), "--shapes", "64x48x32", "--rounds", "2")
    done = fluxtp_cli("bench", *args, "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all_gather_scaled_matmul (float8_e4m3fn, " + scaling in done.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["op"], r["scaled_op"]) for r in rows] == list(ops_scenario.SCALED_OPS.items())
    assert all(r["dtype"] == "float8_e4m3fn" and r["fp8_scaling"] == scaling and r["use_fast_accum"] == fast for r in rows)
    assert all(r["ms"]["gemm"] > 0 and r["ms"]["nccl"] > 0 for r in rows)


@pytest.mark.parametrize("scaling", ops_scenario.FP8_SCALINGS)
def test_fp8_operands_are_the_scaled_ops_inputs(scaling):
    """Quantized from fresh random data, close to it, with the scales' shapes the ops take; a
    per-tensor scale is the same on every rank (it does not depend on the rank's data)."""
    config = ops_scenario.OpsConfig((), torch.bfloat16, None, ops_scenario.CPU_PROTOCOL, fp8=scaling)
    scales = []
    for seed in (1, 2):
        x8, w8, sx, sw = ops_scenario.operands(config, (16, 64), (24, 64), "cpu", torch.Generator().manual_seed(seed))
        # x was the first draw: dequantized, each element within e4m3's rounding of it
        x = torch.randn(16, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(seed)).float()
        assert bool(((x8.float() * sx - x).abs() <= x.abs() * 2**-4 + sx * 2**-9).all())
        assert x8.dtype == w8.dtype == torch.float8_e4m3fn and sx.dtype == sw.dtype == torch.float32
        assert x8.float().abs().amax() > 0 and bool(torch.isfinite(x8.float()).all())
        if scaling == "row-wise":
            assert sx.shape == (16, 1) and sw.shape == (1, 24)
        else:
            assert sx.numel() == sw.numel() == 1
        scales.append((sx.reshape(-1)[0].item(), sw.reshape(-1)[0].item()))
    if scaling == "tensor":
        assert scales[0] == scales[1]


def test_bench_fp8_options_are_checked():
    def config(*args):
        return ops_scenario.make_config(cli.build_parser().parse_args(["bench", *args]), 2, "cpu")

    fp8 = config("--fp8", "tensor")
    assert [c.op for c in fp8.cases] == ["all_gather_matmul"] * 3 + ["matmul_reduce_scatter"] * 3  # no all-reduce
    assert [fp8.op_name(c.op) for c in fp8.cases[::3]] == list(ops_scenario.SCALED_OPS.values())
    assert config("--fp8", "row-wise", "--fast-accum").use_fast_accum and not fp8.use_fast_accum
    with pytest.raises(ValueError, match="needs --fp8"):
        config("--fast-accum")
    with pytest.raises(ValueError, match="matmul_all_reduce has no scaled op"):
        config("--fp8", "row-wise", "--op", "matmul_all_reduce")
    with pytest.raises(ValueError, match="leave --dtype and --weight-layout"):
        config("--fp8", "row-wise", "--weight-layout", "transposed")


def test_bench_protocol_options_are_checked():
    from fluxtp import cli
    from fluxtp.bench import ops

    def config(*args):
        return ops.make_config(cli.build_parser().parse_args(["bench", *args]), 2, "cpu")

    assert config("--calls-per-sample", "7", "--rounds", "4").protocol.calls_per_sample == 7
    cpu = ops.CPU_PROTOCOL
    assert config("--rounds", "4").protocol == Protocol(4, cpu.warmup_rounds, cpu.calls_per_sample)
    with pytest.raises(ValueError, match="calls-per-sample"):
        config("--calls-per-sample", "0")


def test_bench_joins_a_torchrun_launch(tmp_path):
    # --out given a folder: the file gets the name of committed results.
    args = ("--op", "matmul_reduce_scatter", "--shapes", "48x40x96", "--rounds", "2", "--out", f"{tmp_path}/")
    done = fluxtp_cli(*args, launcher=("-m", "torch.distributed.run", "--nproc-per-node", "3", "-m", "fluxtp", "bench"))
    assert done.returncode == 0, done.stdout + done.stderr
    (out,) = tmp_path.iterdir()
    assert re.fullmatch(r"ops-cpu-x3-\d{4}-\d{2}-\d{2}\.json", out.name), out.name
    data = json.loads(out.read_text())
    check_envelope(data, world=3)
    assert [(r["op"], r["M"], r["N"], r["K"]) for r in data["rows"]] == [("matmul_reduce_scatter", 48, 40, 96)]


@pytest.mark.parametrize(
    "args, message",
    [
        (("--shapes", "65x64x64", "--op", "all_gather_matmul"), "M=65 must be divisible by the world size 2"),
        (("--shapes", "64x63x64", "--op", "all_gather_matmul"), "N=63 must be divisible by the world size 2"),
        (("--shapes", "64x64x63", "--op", "matmul_all_reduce"), "K=63 must be divisible by the world size 2"),
        (("--shapes", "63x64x64", "--op", "matmul_reduce_scatter"), "M=63 must be divisible by the world size 2"),
        (
            (
                "--shapes",
                "64x64",
            ),
            "'64x64' is not MxNxK",
        ),
        (("--backends", "nccl,cutlass"), "unknown backend 'cutlass'"),
        (("--rounds", "0"), "--rounds must be at least 1"),
    ],
)
def test_bench_rejects_bad_options_before_launching(args, message, capsys):
    # In-process: these are caught by the parser, before any rank is spawned.
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU host can capture CUDA graphs")
def test_bench_cuda_graphs_need_gpus(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--cuda-graphs"])
    assert e.value.code == 2
    assert "--cuda-graphs needs CUDA GPUs" in capsys.readouterr().err


def test_bench_stops_with_a_message_when_a_named_backend_cannot_run():
    done = fluxtp_cli("bench", "--backends", "torch", "--op", "matmul_all_reduce", "--shapes", "8x8x8")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "backend 'torch' cannot run matmul_all_reduce" in done.stderr and "CUDA" in done.stderr
    assert "Traceback" not in done.stderr


def test_quickstart_example_runs_under_torchrun():
    done = fluxtp_cli("examples/quickstart.py", launcher=("-m", "torch.distributed.run", "--nproc-per-node", "2"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "quickstart ok" in done.stdout


def test_examples_help_says_how_to_launch_and_what_generate_stops_at():
    hybrid = fluxtp_cli("--help", launcher=("examples/train_hybrid.py",), timeout=120)
    assert hybrid.returncode == 0, hybrid.stderr
    text = hybrid.stdout
    assert "torchrun --standalone --nproc-per-node 4 examples/train_hybrid.py --dp 2 --tp 2" in text  # CPU
    assert "torchrun --nnodes 1 --nproc-per-node 8 examples/train_hybrid.py --pp 2 --dp 2 --tp 2" in text  # GPUs
    assert "python examples/train_hybrid.py --reference" in text
    assert "NCCL where CUDA GPUs are visible, else the CPU\nand gloo" in text
    assert re.search(r"--steps STEPS\s+optimizer steps \(default: 20\)", text), text
    generate = fluxtp_cli("--help", launcher=("examples/generate.py",), timeout=120)
    assert generate.returncode == 0, generate.stderr
    text = " ".join(generate.stdout.split())
    assert "torchrun --nproc-per-node 2 examples/generate.py" in text
    assert "does not stop at an end-of-sequence token" in text
    assert "always this many: no stop at end-of-sequence (default: 32)" in text


# ------------------------------------------------------------- verification before timing

WORLD_OF_ONE = GroupInfo(None, 0, 1)


@pytest.mark.parametrize("op", OPS)
def test_verify_passes_backends_that_agree(op):
    x, w = torch.randn(16, 32), torch.randn(24, 32)
    ops_scenario.verify(ops_scenario.Case(op, ops_scenario.Shape(16, 24, 32)), ["nccl", "auto"], (x, w), WORLD_OF_ONE)


CORRUPTIONS = {
    "scaled": (lambda y, g: (y * 1.1, g), "relative error 0.1"),
    "nan": (lambda y, g: (y.index_fill(0, torch.tensor([3]), float("nan")), g), "NaN or Inf"),
    "gathered": (lambda y, g: (y, (g[0].index_fill(1, torch.tensor([0]), 0.0), *g[1:])), "gathered input"),
    "shape": (lambda y, g: (y[:-1], g), "returned shape"),
}


@pytest.mark.parametrize(
    "op, corruption",
    [("all_gather_matmul", c) for c in CORRUPTIONS] + [("matmul_all_reduce", c) for c in ("scaled", "nan", "shape")],
)
def test_verify_stops_on_a_backend_that_disagrees(monkeypatch, op, corruption):
    corrupt, message = CORRUPTIONS[corruption]
    real_call = ops_scenario._call

    def broken(config, op_, args, backend, info):
        y, g = real_call(config, op_, args, backend, info)
        return corrupt(y, g) if backend == "torch" else (y, g)

    monkeypatch.setattr(ops_scenario, "_call", broken)
    x, w = torch.randn(16, 32), torch.randn(24, 32)
    case = ops_scenario.Case(op, ops_scenario.Shape(16, 24, 32))
    with pytest.raises(BenchError, match=r"verification failed: backend 'torch' on " + op) as e:
        ops_scenario.verify(case, ["nccl", "torch"], (x, w), WORLD_OF_ONE)
    assert message in str(e.value) and "nothing was timed" in str(e.value)


def test_verify_catches_one_wrong_tile_in_a_large_output(monkeypatch):
    # A 16x16 tile of zeros in a 1024x512 bfloat16 output moves the normwise error by only about
    # sqrt(256 / 524288) = 0.022, under bfloat16's tolerance 0.031; the max-norm error is ~0.5.
    real_call = ops_scenario._call

    def one_bad_tile(config, op_, args, backend, info):
        y, g = real_call(config, op_, args, backend, info)
        if backend == "torch":
            y = y.clone()
            y[16:32, 16:32] = 0
        return y, g

    monkeypatch.setattr(ops_scenario, "_call", one_bad_tile)
    x, w = torch.randn(1024, 64, dtype=torch.bfloat16), (torch.randn(512, 64) / 8).bfloat16()
    case = ops_scenario.Case("matmul_all_reduce", ops_scenario.Shape(1024, 512, 64))
    with pytest.raises(BenchError, match="max-norm relative error"):
        ops_scenario.verify(case, ["nccl", "torch"], (x, w), WORLD_OF_ONE)


# ------------------------------------------------------------- harness arithmetic


def test_overlap_efficiency_and_speedup():
    assert overlap_efficiency(t_x=1.0, t_gemm=1.0, t_nccl=2.0) == 1.0  # all communication hidden
    assert overlap_efficiency(t_x=2.0, t_gemm=1.0, t_nccl=2.0) == 0.0  # no better than the baseline
    assert overlap_efficiency(t_x=1.5, t_gemm=1.0, t_nccl=2.0) == 0.5
    assert overlap_efficiency(t_x=3.0, t_gemm=1.0, t_nccl=2.0) == -1.0  # slower than the baseline
    assert overlap_efficiency(t_x=1.0, t_gemm=1.0, t_nccl=0.9) is None  # nothing exposed to hide
    # DESIGN.md's row: AG+GEMM M=1024, torch async-TP.
    assert math.isclose(overlap_efficiency(0.550, 0.323, 0.385), -2.66, abs_tol=0.01)
    assert speedup(t_nccl=3.0, t_x=2.0) == 1.5


def test_input_copies_rotate_only_what_fits_the_cache():
    l2 = 50 << 20
    assert input_copies(4 * l2, l2) == 1
    assert input_copies(10 * l2, l2) == 1
    assert input_copies(l2, l2) == 4
    assert input_copies(3 * l2, l2) == 2
    assert input_copies(1, l2) == 16  # capped


def test_measure_interleaves_variants_and_takes_the_median():
    order = []

    def make(name, seconds):
        def call():
            order.append(name)
            time.sleep(seconds)

        return call

    variants = [
        Variant("a", (make("a", 0.0),)),
        Variant("b", (make("b", 0.004), make("b2", 0.004))),
        Variant("c", (make("c", 0.0),)),
    ]
    ms = measure(variants, Protocol(rounds=3, warmup_rounds=1, calls_per_sample=2), WORLD_OF_ONE, torch.device("cpu"))
    # A warm-up round and 3 rounds of one sample (2 calls) per variant; b rotates its input copies;
    # each measured round starts one variant later, so no variant always follows the same one.
    a, b, c = ["a", "a"], ["b", "b2"], ["c", "c"]
    assert order == [*a, *b, *c] + [*a, *b, *c] + [*b, *c, *a] + [*c, *a, *b]
    assert ms["a"] < 1.0 and ms["c"] < 1.0 and 3.5 < ms["b"] < 40.0


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7])
def test_round_orders_balance_positions_and_predecessors(n):
    rounds = n if n % 2 == 0 else 2 * n  # a Williams design's period
    rows = [round_order(r, n) for r in range(rounds)]
    assert all(sorted(row) == list(range(n)) for row in rows)
    positions = collections.Counter((i, v) for row in rows for i, v in enumerate(row))
    followers = collections.Counter(pair for row in rows for pair in zip(row, row[1:]))
    # Every variant in every position, and right after every other variant, equally often.
    assert len(positions) == n * n and len(set(positions.values())) == 1
    assert len(followers) == n * (n - 1) and len(set(followers.values())) == 1
    assert round_order(rounds, n) == rows[0] and round_order(0, 0) == []


def test_measure_rounds_keeps_each_round_for_paired_ratios():
    variants = [Variant("fast", (lambda: time.sleep(0.001),)), Variant("slow", (lambda: time.sleep(0.004),))]
    protocol = Protocol(rounds=5, warmup_rounds=0, calls_per_sample=1)
    timings = measure_rounds(variants, protocol, WORLD_OF_ONE, torch.device("cpu"))
    assert set(timings.rounds) == {"fast", "slow"} and all(len(r) == 5 for r in timings.rounds.values())
    for name, rounds in timings.rounds.items():  # one rank: the medians are the rounds' medians
        assert timings.ms[name] == pytest.approx(statistics.median(rounds))
    low, mid, high = timings.ratio_quartiles("slow", "fast")
    assert 1.5 < low <= mid <= high  # every round's slow sample took ~4x its fast one


def _slowest_rank_rounds(rank, world):
    from fluxtp._dist import resolve_group

    info = resolve_group(None)
    variants = [Variant("a", (lambda: time.sleep(0.002 + 0.010 * rank),))]  # rank 1 is the slow one
    protocol = Protocol(rounds=3, warmup_rounds=0, calls_per_sample=1)
    timings = measure_rounds(variants, protocol, info, torch.device("cpu"))
    assert all(t >= 11.0 for t in timings.rounds["a"]), timings  # every round as slow as rank 1
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, timings)
    assert all(t == everyone[0] for t in everyone)  # every rank reports the same numbers


def test_measure_rounds_takes_the_slowest_rank_of_each_round():
    run_on_ranks(_slowest_rank_rounds, 2, backend="gloo", timeout_s=120)


def test_ratio_quartiles_pair_samples_of_the_same_round():
    # Drift that doubles both variants' times from round to round cancels in the paired ratios.
    timings = Timings(
        ms={"nccl": 4.0, "fused": 4.0},
        rounds={"nccl": [1.1, 2.2, 4.4, 8.8, 17.6], "fused": [1.0, 2.0, 4.0, 8.0, 16.0]},
    )
    assert timings.ratio_quartiles("nccl", "fused") == pytest.approx((1.1, 1.1, 1.1))
    assert speedup_iqr(timings, "nccl", ["nccl", "fused"]) == {"nccl": [1.0, 1.0], "fused": [1.1, 1.1]}
    single = Timings(ms={"a": 2.0, "b": 1.0}, rounds={"a": [2.0], "b": [1.0]})
    assert single.ratio_quartiles("a", "b") == (2.0, 2.0, 2.0)
    assert format_speedup(1.0361, [1.0212, 1.0483]) == "1.036 (1.021-1.048)"
    assert format_speedup(None, None) == "-" and format_speedup(0.9, None) == "0.9000"


def test_shapes_are_sharded_as_the_layer_says():
    shape = ops_scenario.Shape(8192, 28672, 8192)
    assert ops_scenario.shard_shapes("all_gather_matmul", shape, 2) == ((4096, 8192), (14336, 8192))
    assert ops_scenario.gemm_shapes("all_gather_matmul", shape, 2) == ((8192, 8192), (14336, 8192))
    row = ops_scenario.Shape(8192, 8192, 28672)
    assert ops_scenario.shard_shapes("matmul_reduce_scatter", row, 2) == ((8192, 14336), (8192, 14336))
    assert ops_scenario.gemm_shapes("matmul_all_reduce", row, 2) == ((8192, 14336), (8192, 14336))
    assert ops_scenario.shard_shapes("matmul_all_reduce", ops_scenario.Shape(1, 8192, 28672), 2) == (
        (1, 14336),
        (8192, 14336),
    )
    assert ops_scenario.parse_shapes("1024x28672x8192, 2048X8X16") == (
        ops_scenario.Shape(1024, 28672, 8192),
        ops_scenario.Shape(2048, 8, 16),
    )
    assert ops_scenario.parse_backends("torch,fused") == ("nccl", "torch", "fused")


def test_result_file_names_and_command_line():
    assert device_slug("NVIDIA H200") == "h200"
    assert device_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert result_filename("ops", "NVIDIA H200", 2, "2026-11-22") == "ops-h200-x2-2026-11-22.json"
    assert result_filename("serve", "cpu", 2, "2026-11-22") == "serve-cpu-x2-2026-11-22.json"
    assert command_line(["/usr/bin/fluxtp", "bench", "--shapes", "1x2x3", "--out", "a b.json"]) == (
        "fluxtp bench --shapes 1x2x3 --out 'a b.json'"
    )
    assert command_line(["/x/fluxtp/__main__.py", "info"]).endswith("-m fluxtp info")
