"""The `fluxtp` command (also `python -m fluxtp`).

    fluxtp info                      versions, GPUs and their links, which backends run here
    fluxtp bench [ops] [options]     verify, then time the ops on every local GPU (a gloo demo on CPU)
    fluxtp bench gemm [options]      the fused ops' GEMMs against cuBLAS on one GPU (the default there)
    fluxtp tune --op OP --shapes ... measure the fused kernels' configs, write the winners to the cache
    fluxtp tune --one-gpu --grid G   the same for the GEMM tiling alone, on one GPU (no peers)
    fluxtp info --configs            which config each shape would use, and why (no GPU needed)

`fluxtp bench` launches one process per local GPU itself, or joins a torchrun launch
(`torchrun --nproc-per-node 2 -m fluxtp bench ...`) when RANK, WORLD_SIZE and LOCAL_RANK are set.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

import torch
import torch.distributed as dist
from tabulate import tabulate

import fluxtp
from fluxtp import backends
from fluxtp._dist import GroupInfo
from fluxtp.bench import SCENARIOS, scenario_module
from fluxtp.bench.harness import CPU_PROTOCOL, GPU_PROTOCOL
from fluxtp.bench.launch import Launch, intro, local_device_type, run_local, run_torchrun, under_torchrun
from fluxtp.bench.plot import matplotlib_missing
from fluxtp.bench.results import command_line, triton_version
from fluxtp.bench.serve import PROTOCOLS as SERVE_PROTOCOLS
from fluxtp.ops import BACKENDS, OPS
from fluxtp.configs import WEIGHT_LAYOUTS

BACKEND_SUMMARY = {
    "nccl": "the collective (NCCL on GPUs, gloo on CPU), then the matmul, in sequence (the reference)",
    "torch": "PyTorch's async-TP ops on symmetric memory (torch.ops.symm_mem)",
    "fused": "fluxtp's fused Triton kernels on symmetric memory",
}


# ---------------------------------------------------------------- fluxtp info


def _nccl_version() -> str:
    if not torch.cuda.is_available():
        return "n/a (no CUDA GPU)"
    try:
        version = torch.cuda.nccl.version()
    except Exception as e:  # a CUDA build without NCCL
        return f"unavailable ({e})"
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _peer_matrix(n: int) -> str:
    rows = [
        [f"GPU{a}"]
        + ["self" if a == b else ("yes" if torch.cuda.can_device_access_peer(a, b) else "NO") for b in range(n)]
        for a in range(n)
    ]
    return tabulate(rows, headers=["peer access"] + [f"GPU{b}" for b in range(n)])


def _nvlink_summary(n: int) -> str:
    """Best effort, from `nvidia-smi topo -m`: the NVLink links between the GPUs, if any."""
    if shutil.which("nvidia-smi") is None:
        return "unknown (nvidia-smi not found)"
    try:
        done = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown (nvidia-smi topo -m failed: {e})"
    if done.returncode != 0:
        return f"unknown (nvidia-smi topo -m exited {done.returncode})"
    text = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout)  # drop the terminal underline codes
    links = []
    for line in text.splitlines():
        tokens = line.split()
        if tokens and re.fullmatch(r"GPU\d+", tokens[0]):
            a = int(tokens[0][3:])
            for b, token in enumerate(tokens[1 : n + 1]):
                if b > a and re.fullmatch(r"NV\d+", token):
                    links.append(f"GPU{a}-GPU{b} {token}")
    return "yes: " + ", ".join(links) if links else "no NVLink between the GPUs (nvidia-smi topo -m)"


def _symmetric_memory_status() -> str:
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as e:
        return f"unavailable in this torch ({e})"
    if not torch.cuda.is_available():
        return "in this torch, but it needs CUDA GPUs (none here)"
    return "available in this torch (per-group checks below)"


def _backend_rows(device_type: str, n_gpus: int) -> list[list[str]]:
    """Ask each backend whether it could run a bfloat16 op on a group of this host's GPUs.

    The backends answer about a real process group, so this builds a one-process group in
    this process and describes it as spanning every local GPU (at least 2: a world of one
    needs no backend at all)."""
    world = max(2, n_gpus)
    initialized_here = False
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device_type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
        )
        initialized_here = True
    try:
        info = GroupInfo(dist.group.WORLD, 0, world)
        device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        x = torch.empty(world * 8, 64, dtype=torch.bfloat16, device=device)
        weight = torch.empty(world * 8, 64, dtype=torch.bfloat16, device=device)
        rows = []
        for name in ("nccl", "torch", "fused"):
            reasons = {op: backends.unsupported_reason(op, name, x, weight, info) for op in OPS}
            usable = [op for op, r in reasons.items() if r is None]
            if len(usable) == len(OPS):
                verdict, why = "yes", BACKEND_SUMMARY[name]
            elif usable:
                verdict = "partly"
                why = "; ".join(f"{op}: {r}" for op, r in reasons.items() if r is not None)
            else:
                verdict, why = "no", "; ".join(dict.fromkeys(reasons.values()))
            rows.append([name, verdict, why])
        auto = backends.choose(OPS[0], "auto", x, weight, info)
        rows.append(
            ["auto", "yes", f"picks {auto!r} here (the first of {', '.join(backends.AUTO_ORDER)} that can run)"]
        )
        return rows
    finally:
        if initialized_here:
            dist.destroy_process_group()


def cmd_info(args: argparse.Namespace) -> int:
    if args.configs:
        from fluxtp import tune

        return tune.cmd_info_configs(args)
    if (args.op is not None or args.shapes or args.gpu or args.world is not None or args.weight_layout is not None
            or args.fast_accum):  # fmt: skip
        args.parser.error("--op, --shapes, --gpu, --world, --weight-layout and --fast-accum go with --configs")
    device_type = local_device_type()
    n_gpus = torch.cuda.device_count() if device_type == "cuda" else 0
    print(f"fluxtp    {fluxtp.__version__}")
    print(f"torch     {torch.__version__} (CUDA {torch.version.cuda or 'none'} build)")
    print(f"triton    {triton_version()}")
    print(f"NCCL      {_nccl_version()}")
    if n_gpus:
        print(f"GPUs      {n_gpus}")
        for i in range(n_gpus):
            props = torch.cuda.get_device_properties(i)
            print(f"  GPU{i}: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB")
        print(_peer_matrix(n_gpus))
        print(f"NVLink    {_nvlink_summary(n_gpus)}")
    else:
        print("GPUs      none (torch.cuda.is_available() is False)")
        print("NVLink    n/a (no GPUs)")
    print(f"symmetric memory: {_symmetric_memory_status()}")
    group_desc = f"a group of the {max(2, n_gpus)} local GPUs" if n_gpus else "a 2-process gloo group on CPU"
    print(f"\nbackends for {group_desc}, bfloat16:")
    print(tabulate(_backend_rows(device_type, n_gpus), headers=["backend", "usable", "what / why not"]))
    return 0


# ---------------------------------------------------------------- fluxtp bench


def _add_bench_parser(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="verify, then time the ops (or another scenario) on every local GPU",
        description="Verify every backend against the nccl reference, then time it with fluxtp.bench.harness's "
        "protocol (CUDA events, interleaved rounds, median per rank, slowest rank). Without a CUDA GPU: a "
        "2-process gloo demo on small shapes. gemm: the fused ops' GEMMs alone against cuBLAS on one GPU (the "
        "default on a host with one GPU).",
    )
    bench.add_argument(
        "scenario",
        nargs="?",
        choices=tuple(SCENARIOS),
        help="what to run (default: ops; gemm on a host with one GPU, where the ops have no peers)",
    )
    common = bench.add_argument_group("common options")
    common.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32", "float64"),
        help="default: bfloat16 on GPUs, float32 on CPU",
    )
    common.add_argument(
        "--backends",
        metavar="NAME,...",
        help=f"comma list of {', '.join(BACKENDS)} (default: every backend usable here; nccl, the baseline, is always timed)",
    )
    common.add_argument(
        "--rounds",
        type=int,
        help=f"measured rounds per variant (default: {GPU_PROTOCOL.rounds} on GPUs, {CPU_PROTOCOL.rounds} on CPU; "
        f"serve's prefill: {SERVE_PROTOCOLS['cuda']['prefill'].rounds} on GPUs)",
    )
    common.add_argument("--nproc", type=int, help="processes to launch (default: one per local GPU; 2 on CPU)")
    common.add_argument(
        "--out",
        metavar="FILE.json",
        help="write the results (schema fluxtp.bench/1) here; given a folder (e.g. benchmarks/results/), "
        "the file is named <scenario>-<gpu>-x<n>-<date>.json",
    )
    common.add_argument("--plot", metavar="FILE.png", help="draw the results here (needs matplotlib)")
    for name in SCENARIOS:
        scenario_module(name).add_arguments(bench.add_argument_group(f"{name} scenario"))
    bench.set_defaults(func=cmd_bench, parser=bench)


def default_scenario(device_type: str, n_gpus: int, nproc: int | None, torchrun: bool) -> str:
    """`fluxtp bench`'s scenario when none is named: gemm on a host with one GPU and no --nproc
    or torchrun (the ops would run a world of one, nothing communicated), else ops."""
    return "gemm" if device_type == "cuda" and n_gpus == 1 and nproc is None and not torchrun else "ops"


def cmd_bench(args: argparse.Namespace) -> int:
    parser = args.parser
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.plot and matplotlib_missing():
        parser.error(matplotlib_missing())
    device_type = local_device_type()
    if args.scenario is None:
        args.scenario = default_scenario(device_type, torch.cuda.device_count(), args.nproc, under_torchrun())
        if args.scenario == "gemm":
            print("fluxtp bench: one GPU here, so the fused kernels alone against cuBLAS (fluxtp bench gemm); "
                  "the ops need 2+ GPUs (fluxtp bench ops --nproc 1: a world of one)", file=sys.stderr)  # fmt: skip
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if args.nproc is not None and args.nproc != world:
            print(f"fluxtp bench: --nproc {args.nproc} ignored: torchrun started {world} ranks", file=sys.stderr)
    else:
        if args.nproc is not None:
            world = args.nproc
        elif args.scenario == "gemm":
            world = 1  # one GPU, one process
        else:
            world = torch.cuda.device_count() if device_type == "cuda" else 2
        if world < 1:
            parser.error(f"--nproc must be at least 1, got {world}")
        if device_type == "cuda" and world > torch.cuda.device_count():
            parser.error(f"--nproc {world}: this host has only {torch.cuda.device_count()} CUDA GPUs (one per process)")
    try:
        config = scenario_module(args.scenario).make_config(args, world, device_type)
    except ValueError as e:
        parser.error(str(e))
    launch = Launch(args.scenario, config, args.out, args.plot, args.command_line)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 alone
        print(intro(launch, world, device_type), flush=True)
    if world == 1 and args.scenario != "gemm":
        print(
            "fluxtp bench: a world of one process: every op is a plain linear, nothing is communicated", file=sys.stderr
        )
    if under_torchrun():
        return run_torchrun(launch)
    return run_local(launch, world, device_type)


# ---------------------------------------------------------------- fluxtp tune


def _add_info_config_arguments(info) -> None:
    configs = info.add_argument_group("--configs: the fused ops' launch configs (fluxtp/tune.py)")
    configs.add_argument(
        "--configs",
        action="store_true",
        help="show which config each shape would use and why (the user's cache, the table shipped with fluxtp, "
        "or the heuristic; exact key or nearest M bucket)",
    )
    configs.add_argument("--op", choices=("all_gather_matmul", "matmul_reduce_scatter", "all"), help="default: both")
    configs.add_argument("--shapes", metavar="MxNxK,...", help="global layer sizes (default: LLaMA-70B MLP dims)")
    configs.add_argument("--gpu", help="GPU name to look up (default: torch.cuda's GPU 0, or 'cpu' without one)")
    configs.add_argument("--world", type=int, help="group size (default: the local GPUs, at least 2)")
    configs.add_argument("--dtype", choices=("bfloat16", "float16", "float8_e4m3fn"), default="bfloat16",
                         help="default: bfloat16 (float8_e4m3fn: the scaled ops', row-wise, a bf16 output)")  # fmt: skip
    configs.add_argument("--fast-accum", action="store_true", help="with --dtype float8_e4m3fn: use_fast_accum calls")
    configs.add_argument(
        "--weight-layout",
        choices=WEIGHT_LAYOUTS,
        help="the weight's layout to look up (default: linear; transposed: the backward's W^T views)",
    )
    info.set_defaults(parser=info)


def _add_tune_parser(subparsers) -> None:
    tune = subparsers.add_parser(
        "tune",
        help="measure the fused kernels' configs on the local GPUs and cache the fastest",
        description="For each shape, verify every candidate config of the fused op against the nccl reference, "
        "time it on every rank with fluxtp.bench.harness (the slowest rank counts), drop candidates slower than "
        "1.3x the best so far, and write the winner (the same on every rank) to $FLUXTP_CACHE_DIR/configs.json, "
        "which the op then uses for that GPU, world size, dtype, N, K, M bucket and weight layout. Needs NVIDIA GPUs.",
    )
    tune.add_argument("--op", choices=("all_gather_matmul", "matmul_reduce_scatter"), help="required without --one-gpu")
    tune.add_argument(
        "--shapes", metavar="MxNxK,...", help="global layer sizes, as for fluxtp bench (required without --one-gpu)"
    )
    one_gpu = tune.add_argument_group(
        "--one-gpu: tune only the GEMM tiling of the fused ops' GEMM-only modes on GPU 0, per TP degree "
        "(communication knobs stay at their heuristic; fluxtp/tune_gemm.py)"
    )
    one_gpu.add_argument("--one-gpu", action="store_true", help="tune the GEMM tiling on one GPU, no peers needed")
    one_gpu.add_argument(
        "--grid",
        help="a named grid of cases (fluxtp/bench/gemm_grid.py: full, bf16, fp16, all-gather, fp8-all-gather, fp8-reduce-scatter, llama3-70b, smoke)",
    )
    one_gpu.add_argument("--worlds", default="2,4,8", help="with --shapes: the TP degrees to tune for (default 2,4,8)")
    one_gpu.add_argument("--cache", metavar="FILE.json", help="the cache file to write (default: the user's cache)")
    one_gpu.add_argument(
        "--fast-accum", action="store_true", help="FP8 cases with fast accumulation (use_fast_accum; default: precise)"
    )
    tune.add_argument("--dtype", choices=("bfloat16", "float16", "float8_e4m3fn"), default="bfloat16",
                      help="default: bfloat16 (float8_e4m3fn: --one-gpu, the all-gather, precise accumulation)")
    tune.add_argument(
        "--budget-seconds",
        type=float,
        default=600.0,
        help="for all shapes together (default: 600), split evenly; not used by --one-gpu (it screens every "
        "tiling of each case)",
    )
    tune.add_argument(
        "--nproc", type=int, help="processes to launch (default: one per local GPU; --one-gpu runs on GPU 0 alone)"
    )
    tune.add_argument(
        "--vary",
        metavar="FIELD,...",
        help="only re-measure these config fields (e.g. transport) around the config each shape uses now (the "
        "cache's, the shipped table's or the heuristic), which then stands in for the heuristic as the baseline "
        "(not with --one-gpu)",
    )
    tune.add_argument(
        "--weight-layout",
        choices=WEIGHT_LAYOUTS,
        default="linear",
        help="linear: nn.Linear's [N, K] weights (default); transposed: the W^T views the backward passes, "
        "cached under a key of their own (calls with that layout fall back to the linear entries); "
        "--one-gpu --grid takes the layouts of its grid",
    )
    tune.add_argument(
        "--out",
        metavar="FILE.json",
        help="also write the tuned-vs-heuristic comparison per shape (ms of cuBLAS, nccl, heuristic, tuned; "
        "E_overlap; schema fluxtp.bench/1, scenario tune) here; given a folder (e.g. benchmarks/results/), the file "
        "is named tune-<gpu>-x<n>-<date>-<op>.json (with --one-gpu: the GEMM-only rows, tune_gemm-<gpu>-x1-<date>.json)",
    )
    tune.set_defaults(func=cmd_tune, parser=tune)


def cmd_tune(args: argparse.Namespace) -> int:
    if args.one_gpu:
        from fluxtp import tune_gemm

        return tune_gemm.cmd_tune_one_gpu(args)
    if not (args.op and args.shapes):
        args.parser.error("--op and --shapes are required (or --one-gpu with --grid)")
    from fluxtp import tune

    return tune.cmd_tune(args)


# ---------------------------------------------------------------- entry point


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fluxtp", description="fluxtp: tensor-parallel communication fused into the GEMMs (the Flux method)."
    )
    parser.add_argument("--version", action="version", version=f"fluxtp {fluxtp.__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = subparsers.add_parser("info", help="versions, GPUs and their links, which backends are usable here")
    info.set_defaults(func=cmd_info)
    _add_info_config_arguments(info)
    _add_bench_parser(subparsers)
    _add_tune_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # What the results record as the command: this process's, or the argv a caller passed in.
    args.command_line = command_line(None if argv is None else ["fluxtp", *argv])
    return args.func(args)
