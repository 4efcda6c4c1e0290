"""Benchmarks: the timing harness (harness.py, its protocol in the docstring), the results
envelope (results.py) and the scenarios of `fluxtp bench <scenario>`.

A scenario is a module named in SCENARIOS that provides:
- `add_arguments(group)`: its own options, added to `fluxtp bench` as an argument group
  (the common ones, --dtype --backends --rounds --nproc --out --plot, are the CLI's);
- `make_config(args, world, device_type) -> frozen dataclass`: checks the options before any
  process starts (ValueError with a message on bad ones); the config travels to every rank;
- `run(config, info, device, show_progress) -> (rows, notes)`: on every rank, collectively;
  rows are JSON-ready dicts, notes are sentences rank 0 prints under the table; keys with a
  leading underscore are for the table only and are left out of the results file;
- `format_table(rows) -> str` and `plot(rows, path, title)`: rank 0's report;
- optionally `describe(config, world, device_type) -> str`: what the run will do, a line or two
  the CLI prints before it starts.

The benchmark's own backends, registered here (fluxtp.backends.register) so that importing any
part of fluxtp.bench makes them selectable like the built-in ones (backend=NO_COMM anywhere):
NO_COMM (fluxtp/bench/no_comm.py: the communication removed, the ceiling of train and serve)
and REORDERED (fluxtp/bench/nccl_reordered.py: nccl summed in another order, the loss curves'
noise reference).
"""

from __future__ import annotations

import importlib

from fluxtp import backends
from fluxtp.bench import nccl_reordered, no_comm

NO_COMM = "no_comm"
REORDERED = "nccl_reordered"
backends.register(NO_COMM, no_comm)
backends.register(REORDERED, nccl_reordered)

# Later scenarios add a line here.
SCENARIOS = {
    "ops": "fluxtp.bench.ops",
    "gemm": "fluxtp.bench.gemm",
    "train": "fluxtp.bench.train",
    "serve": "fluxtp.bench.serve",
}


class BenchError(RuntimeError):
    """A benchmark cannot go on (e.g. a backend disagrees with the reference). Raised on every
    rank alike (the ranks agree first), so that all of them stop together with one message."""


def scenario_module(name: str):
    if name not in SCENARIOS:
        raise ValueError(f"unknown benchmark scenario {name!r}; choose one of {', '.join(SCENARIOS)}")
    return importlib.import_module(SCENARIOS[name])
