"""Copies of a fused kernel's source with parts switched off or changed, for one-GPU A/B runs,
and what the part-by-part benchmarks share: their cases, the variants' GEMM-only launches, the
interleaved timing beside plain and cuBLAS, the table and the JSON.

A variant is a list of (old, new) text replacements, each of which must apply exactly: a
benchmark whose replacement no longer matches the kernel stops and says so, instead of timing
the shipped kernel under another name (tests/test_kernel_variants.py checks them on CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from tabulate import tabulate

from fluxtp._dist import GroupInfo
from fluxtp.bench.gemm_grid import expected_rows, launched_config, model_cases, relative_error
from fluxtp.bench.harness import Protocol, Variant, graphed, measure_rounds
from fluxtp.bench.results import command_line, envelope, write_json

sys.path.insert(0, str(Path(__file__).parent))
from gemm_efficiency import plain_matmul  # noqa: E402

KERNELS = Path(__file__).parents[1] / "fluxtp" / "kernels"


def variant_source(source: str, name: str, replacements: list[tuple[str, str]]) -> str:
    """`source` with every replacement applied; SystemExit naming the first that does not match once."""
    for old, new in replacements:
        if source.count(old) != 1:
            raise SystemExit(f"{name}: the kernel contains {old!r} {source.count(old)} times, not once; update this benchmark")
        source = source.replace(old, new)
    return source


def variant_kernel(kernel_file: str, kernel_name: str, name: str, replacements: list[tuple[str, str]], directory: Path):
    """`kernel_name` compiled from fluxtp/kernels/`kernel_file` with the replacements applied."""
    source = variant_source((KERNELS / kernel_file).read_text(), name, replacements)
    module_name = f"_variant_{Path(kernel_file).stem}_{name}"
    path = directory / f"{module_name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # triton.jit reads the function's source through its module
    spec.loader.exec_module(module)
    return getattr(module, kernel_name)


def variant_kernels(launcher_module, kernel_name: str, kernel_file: str, variants: dict) -> dict:
    """name -> kernel: the launcher's shipped `kernel_name` as "fused", then every variant of
    `variants` (name -> replacements) compiled from fluxtp/kernels/`kernel_file`."""
    directory = Path(tempfile.mkdtemp(prefix=f"fluxtp-{Path(kernel_file).stem}-parts-"))
    kernels = {"fused": getattr(launcher_module, kernel_name)}
    for name, replacements in variants.items():
        kernels[name] = variant_kernel(kernel_file, kernel_name, name, replacements, directory)
    return kernels


def graphed_runs(launcher_module, kernel_name: str, kernels: dict, case, x, weight, check) -> dict:
    """name -> the GEMM-only launch of each of `kernels` for the case, as a CUDA graph replay;
    `check(name, output)` sees each one's first output (and raises if it is wrong)."""
    runs = {}
    for name, kernel in kernels.items():
        run = gemm_only(launcher_module, kernel_name, kernel, case, x, weight)
        check(name, run())
        runs[name] = graphed(run)
    return runs


def gemm_only(launcher_module, kernel_name: str, kernel, case, x, weight):
    """The launcher's GEMM-only mode for rank 0 of the case, launching `kernel` in place of its
    shipped Triton `kernel_name` (bound now: the returned callable keeps launching `kernel`), with
    the config a call launches on the Triton kernel (never a warp-specialized one, which would
    not run `kernel`)."""
    config = dataclasses.replace(launched_config(case, x, weight), warp_specialized=False)
    shipped = getattr(launcher_module, kernel_name)
    setattr(launcher_module, kernel_name, kernel)
    try:
        return launcher_module.gemm_only(x, weight, None, GroupInfo(None, 0, case.world), config)
    finally:
        setattr(launcher_module, kernel_name, shipped)


def checked_triton_reduce_scatter(case, x, weight):
    """(the shipped Triton reduce-scatter kernel's GEMM-only mode for the case, F.linear's result)
    once its rows match F.linear's."""
    from fluxtp.backends.fused import _matmul_reduce_scatter

    full = F.linear(x, weight)
    run = gemm_only(_matmul_reduce_scatter, "matmul_reduce_scatter_kernel",
                    _matmul_reduce_scatter.matmul_reduce_scatter_kernel, case, x, weight)  # fmt: skip
    if not relative_error(run(), expected_rows(case, full)) < 1e-2:
        raise AssertionError(f"{case.label()}: the fused kernel computes a wrong result")
    return run, full


def case_parser(doc: str, models: str, worlds: str, tokens: str, variants: dict) -> argparse.ArgumentParser:
    """The part-by-part benchmarks' arguments: which cases (cases_of), which of `variants` if any
    (chosen_variants), rounds, the JSON's path."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--models", default=models)
    parser.add_argument("--worlds", default=worlds)
    parser.add_argument("--tokens", default=tokens)
    if variants:
        parser.add_argument("--variants", default=",".join(variants), help="comma-separated names of the variants")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out")
    return parser


def chosen_variants(parser: argparse.ArgumentParser, args, variants: dict) -> dict:
    """The variants (name -> replacements) that --variants names; a parser error for an unknown name."""
    names = args.variants.split(",")
    unknown = sorted(set(names) - set(variants))
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(variants)}")
    return {n: variants[n] for n in names}


def cases_of(args, op: str) -> list:
    """The `op` cases of the grid of case_parser's --models, --worlds and --tokens."""
    worlds = tuple(int(v) for v in args.worlds.split(","))
    tokens = tuple(int(v) for v in args.tokens.split(","))
    return [c for model in args.models.split(",") for c in model_cases(model, tokens=tokens, worlds=worlds) if c.op == op]


def time_case(case, runs: dict, a: torch.Tensor, weight: torch.Tensor, config, rounds: int, reference=None,
              **fields) -> dict:  # fmt: skip
    """`runs` (name -> graphed callable) interleaved with the plain twin of `config` and cuBLAS on
    a @ weight^T (the case's whole per-rank GEMM), or with `reference` alone as "cublas" where it
    is given (an FP8 case's torch._scaled_mm: plain has no FP8 form); the case's row, times over
    cuBLAS's (medians)."""
    if reference is None:
        runs = {**runs, "plain": graphed(plain_matmul(a, weight, config)), "cublas": graphed(lambda: F.linear(a, weight))}
    else:
        runs = {**runs, "cublas": graphed(reference)}
    ms = measure_rounds([Variant(n, (r,)) for n, r in runs.items()], Protocol(rounds, 2, 5), GroupInfo(None, 0, 1), "cuda").ms
    row = {"case": case.label(), "M": case.M, "N": case.N, "K": case.K, "world": case.world, **fields,
           "ms": {k: round(v, 5) for k, v in ms.items()}, "vs_cublas": {k: round(v / ms["cublas"], 4) for k, v in ms.items()}}
    print(row["case"], row["vs_cublas"], flush=True)
    return row


def report(scenario: str, rows: list[dict], columns: list[str], detail: str, out: str | None) -> None:
    """The table of every row's times over cuBLAS's (with the row's `detail` field), and the JSON."""
    print(tabulate([[r["case"], r[detail], *(r["vs_cublas"][n] for n in columns)] for r in rows],
                   headers=["case (time / cuBLAS)", detail, *columns]))  # fmt: skip
    if out:
        data = envelope(scenario, rows, device=torch.cuda.get_device_name(), gpus=1, world=0, command=command_line())
        print("wrote", write_json(data, out))
