"""`fluxtp bench gemm` on CPU: its cases and option checks, the scenario `fluxtp bench` picks on a
host with one GPU, and its report from rows (the run itself: tests/gpu/test_bench_gemm_gpu.py)."""

import pytest

from fluxtp import cli
from fluxtp.bench import gemm
from fluxtp.bench.gemm_grid import TP_DEGREES, GemmCase, grid
from fluxtp.bench.harness import GPU_PROTOCOL
from fluxtp.bench.ops import DEFAULT_SHAPES


def _config(*argv, world=1, device="cuda"):
    return gemm.make_config(cli.build_parser().parse_args(["bench", "gemm", *argv]), world, device)


def test_default_cases_are_the_ops_layers_at_every_tp_degree():
    config = _config()
    expected = {
        GemmCase(op, s.M, s.N, s.K, w)
        for op in gemm.GEMM_OPS
        for w in TP_DEGREES
        for s in DEFAULT_SHAPES["cuda"][op]
    }
    assert set(config.cases) == expected and len(config.cases) == len(expected) == 24
    assert config.protocol == GPU_PROTOCOL
    assert TP_DEGREES == (2, 4, 8)  # what --tp's help says


def test_options_choose_the_cases():
    config = _config("--op", "matmul_reduce_scatter", "--shapes", "3000x4096x14336", "--tp", "8,4,8", "--rounds", "3")
    assert config.cases == tuple(GemmCase("matmul_reduce_scatter", 3000, 4096, 14336, w) for w in (8, 4))
    assert config.protocol.rounds == 3
    fp8 = _config("--fp8", "row-wise", "--fast-accum", "--tp", "2", "--shapes", "1024x4096x4096")
    assert {(c.dtype, c.fast_accum) for c in fp8.cases} == {("float8_e4m3fn", True)}
    fp16 = _config("--dtype", "float16", "--weight-layout", "transposed", "--tp", "4", "--shapes", "1024x4096x4096")
    assert {(c.dtype, c.weight_layout) for c in fp16.cases} == {("float16", "transposed")}
    assert _config("--grid", "smoke").cases == tuple(grid("smoke"))
    fast = _config("--grid", "fp8-smoke", "--fast-accum", "--op", "all_gather_matmul").cases
    assert fast and all(c.fast_accum and c.op == "all_gather_matmul" for c in fast)


@pytest.mark.parametrize(
    "argv, world, device, message",
    [
        ((), 1, "cpu", "on an NVIDIA GPU; this host has none"),
        ((), 2, "cuda", "runs on one GPU, in one process: got 2"),
        (("--op", "matmul_all_reduce"), 1, "cuda", "--op matmul_all_reduce: fluxtp bench gemm times"),
        (("--fp8", "tensor"), 1, "cuda", "--fp8 tensor: fluxtp bench gemm times row-wise scaling"),
        (("--fast-accum",), 1, "cuda", "--fast-accum needs --fp8"),
        (("--dtype", "float32"), 1, "cuda", "the fused kernels take bfloat16 or float16"),
        (("--fp8", "row-wise", "--dtype", "float16"), 1, "cuda", "leave --dtype at its default"),
        (("--grid", "smoke", "--tp", "2"), 1, "cuda", "--grid smoke names its own shapes"),
        (("--grid", "smoke", "--fast-accum"), 1, "cuda", "--grid smoke has no FP8 case"),
        (("--tp", "2,0"), 1, "cuda", "--tp: '0' is not a positive integer"),
        (("--tp", "8", "--shapes", "1004x4096x4096"), 1, "cuda", "M=1004 must be divisible by the TP degree 8"),
        (("--backends", "fused"), 1, "cuda", "--backends: fluxtp bench gemm times the fused kernel and cuBLAS"),
        (("--calls-per-sample", "0"), 1, "cuda", "--calls-per-sample must be at least 1"),
    ],
)
def test_bad_options_are_named_before_anything_runs(argv, world, device, message):
    with pytest.raises(ValueError) as e:
        _config(*argv, world=world, device=device)
    assert message in str(e.value)


def test_the_cli_stops_with_the_message_on_a_host_without_gpus(capsys, monkeypatch):
    monkeypatch.setattr(cli, "local_device_type", lambda: "cpu")
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "gemm"])
    assert e.value.code == 2
    assert "this host has none" in capsys.readouterr().err


@pytest.mark.parametrize(
    "device, gpus, nproc, torchrun, scenario",
    [
        ("cuda", 1, None, False, "gemm"),  # one GPU: the ops would have no peers
        ("cuda", 2, None, False, "ops"),
        ("cuda", 1, 1, False, "ops"),  # asked for a world of one
        ("cuda", 1, None, True, "ops"),  # torchrun decides the world
        ("cpu", 0, None, False, "ops"),  # the gloo demo
    ],
)
def test_bench_without_a_scenario_runs_gemm_on_a_one_gpu_host(device, gpus, nproc, torchrun, scenario):
    assert cli.default_scenario(device, gpus, nproc, torchrun) == scenario
    assert cli.build_parser().parse_args(["bench"]).scenario is None  # resolved by cmd_bench


def _row(op, m, world, fused, cublas=1.0, **case):
    row = {
        "op": op, "M": m, "N": 4096, "K": 14336, "world": world, "dtype": "bfloat16", "weight_layout": "linear",
        "model": "", "fast_accum": False, **case,
        "ms": {"cublas": cublas, "fused": fused}, "tflops": {"cublas": 400.0, "fused": 400.0 * cublas / fused},
        "fused_vs_cublas": fused / cublas, "fused_vs_cublas_iqr": [fused / cublas - 0.01, fused / cublas + 0.01],
        "kernel": "Triton", "config": {},
    }  # fmt: skip
    return row


def test_report_has_a_row_a_case_then_geomean_and_worst_per_op_and_tp_degree(tmp_path):
    rows = [
        _row("all_gather_matmul", 1024, 2, 1.10),
        _row("all_gather_matmul", 2048, 2, 0.90),
        _row("matmul_reduce_scatter", 1024, 8, 1.20),
    ]
    table = gemm.format_table(rows, width=80)
    assert all(len(line) <= 80 for line in table.split("\n\n")[0].splitlines())  # the legend, wrapped
    lines = table.splitlines()
    assert any("1.100 (1.090-1.110)" in line and "all_gather_matmul" in line for line in lines)
    summary = gemm.format_summary(rows)
    ag = next(line for line in summary.splitlines() if line.startswith("all_gather_matmul"))
    assert ag.split()[-2:] == [f"{(1.1 * 0.9) ** 0.5:.3f}", "1.100"]  # geomean, worst
    rs = next(line for line in summary.splitlines() if line.startswith("matmul_reduce_scatter"))
    assert rs.split()[-4:] == ["8", "1", "1.200", "1.200"]
    text = gemm.describe(_config("--tp", "2", "--shapes", "1024x4096x4096"), 1, "cuda", width=80)
    assert all(len(line) <= 80 for line in text.splitlines())
    assert " ".join(text.split()).startswith("fluxtp bench gemm: 2 bfloat16 per-rank GEMMs on one GPU")
    pytest.importorskip("matplotlib")
    gemm.plot(rows, str(tmp_path / "gemm.png"), "title")
    assert (tmp_path / "gemm.png").stat().st_size > 0
