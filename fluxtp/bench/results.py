"""The results envelope every fluxtp benchmark writes (schema "fluxtp.bench/1").

    {"schema": "fluxtp.bench/1", "scenario": "ops", "device": "NVIDIA H200" | "cpu",
     "gpus": n, "world": w, "torch": "2.11.0+cu130", "triton": "3.6.0" | "not installed",
     "commit": sha | "unknown", "date": "YYYY-MM-DD", "command": "fluxtp bench ...",
     "rows": [...]}

Rows are the scenario's own (for "ops": op, M, N, K, dtype, ms, E_overlap, speedup_vs_nccl and its
spread speedup_vs_nccl_iqr, the middle half of the per-round ratios: fluxtp.bench.harness).
Results measured on GPUs are committed as benchmarks/results/<result_filename(...)>.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import torch

import fluxtp

SCHEMA = "fluxtp.bench/1"
ENVELOPE_KEYS = (
    "schema",
    "scenario",
    "device",
    "gpus",
    "world",
    "torch",
    "triton",
    "commit",
    "date",
    "command",
    "rows",
)


def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "not installed"
    return triton.__version__


def git_commit() -> str:
    """$FLUXTP_COMMIT if set (a copy of the tree without .git, as on a lent GPU machine), else
    HEAD of the checkout fluxtp is imported from, or "unknown" (e.g. an installed wheel)."""
    if os.environ.get("FLUXTP_COMMIT"):
        return os.environ["FLUXTP_COMMIT"]
    source_dir = Path(fluxtp.__file__).resolve().parent
    try:
        done = subprocess.run(
            ["git", "-C", str(source_dir), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    sha = done.stdout.strip()
    return sha if done.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", sha) else "unknown"


def command_line(argv: list[str] | None = None) -> str:
    """The command as typed: `python -m fluxtp ...` or `fluxtp ...`, then the arguments, shell-quoted."""
    argv = list(sys.argv if argv is None else argv)
    program = argv[0] if argv else "fluxtp"
    if Path(program).name == "__main__.py":  # python -m fluxtp
        head = [Path(sys.executable).name, "-m", "fluxtp"]
    else:
        head = [Path(program).name]
    return shlex.join(head + argv[1:])


def envelope(scenario: str, rows: list[dict], *, device: str, gpus: int, world: int, command: str) -> dict:
    return {
        "schema": SCHEMA,
        "scenario": scenario,
        "device": device,
        "gpus": gpus,
        "world": world,
        "torch": torch.__version__,
        "triton": triton_version(),
        "commit": git_commit(),
        "date": datetime.date.today().isoformat(),
        "command": command,
        "rows": rows,
    }


def device_slug(device: str) -> str:
    """ "NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100-80gb-hbm3", "cpu" -> "cpu"."""
    words = re.sub(r"\bnvidia\b", " ", device.lower())
    return re.sub(r"[^a-z0-9]+", "-", words).strip("-") or "unknown"


def result_filename(scenario: str, device: str, n: int, date: str) -> str:
    """<scenario>-<gpu>-x<n>-<date>.json, the name of a committed result under benchmarks/results/."""
    return f"{scenario}-{device_slug(device)}-x{n}-{date}.json"


def write_json(data: dict, path: str | os.PathLike) -> Path:
    path = Path(path)
    if path.parent != Path():
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
