"""Run a benchmark scenario on every rank: spawn one process per local GPU (gloo processes on a
host without CUDA), or join a `torchrun` launch. Rank 0 prints the table and writes the files.

Children always run with NVLink multicast off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1): multicast can take a shared
host's GPUs out of service, and nothing in fluxtp needs it.
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fluxtp._dist import destroy_process_group, resolve_group
from fluxtp.bench import BenchError, scenario_module
from fluxtp.bench.results import envelope, result_filename, write_json
from fluxtp.testing import MULTICAST_OFF, run_on_ranks

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# A whole default GPU run takes minutes; a hung collective is cut off well before this.
LAUNCH_TIMEOUT_S = 3600.0
# The last line of a run on a host without CUDA: what it takes to time the fused kernels.
NO_GPU_LINE = (
    "The fused kernels need NVIDIA GPUs with peer access (torch symmetric memory); "
    "there run: torchrun --nproc-per-node N -m fluxtp bench"
)


@dataclass(frozen=True)
class Launch:
    """What every rank needs: the scenario, its checked config, and rank 0's report options."""

    scenario: str
    config: object
    out: str | None
    plot: str | None
    command: str


def under_torchrun() -> bool:
    return all(name in os.environ for name in TORCHRUN_VARIABLES)


def local_device_type() -> str:
    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"


def intro(launch: Launch, world: int, device_type: str) -> str:
    """What the run will do, printed before it starts: the scenario's `describe`, where it has one."""
    module = scenario_module(launch.scenario)
    if hasattr(module, "describe"):
        return module.describe(launch.config, world, device_type)
    where = f"{world} GPUs, one process each" if device_type == "cuda" else f"a {world}-process gloo group on CPU"
    return f"fluxtp bench {launch.scenario}: verify, then time every backend usable here on {where}."


def results_rows(rows: list[dict]) -> list[dict]:
    """The rows as the results file holds them: without the table-only keys (a leading underscore)."""
    return [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows]


def _report(launch: Launch, rows: list[dict], notes: list[str], device: torch.device, world: int) -> None:
    module = scenario_module(launch.scenario)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    gpus = world if device.type == "cuda" else 0
    print(module.format_table(rows), flush=True)
    for note in notes:
        print(note, flush=True)
    rows = results_rows(rows)
    data = envelope(launch.scenario, rows, device=device_name, gpus=gpus, world=world, command=launch.command)
    if launch.out:
        out = Path(launch.out)
        if launch.out.endswith(("/", os.sep)) or out.is_dir():  # a folder: name the file as committed results are
            out = out / result_filename(launch.scenario, device_name, world, data["date"])
        print(f"wrote {write_json(data, out)}", flush=True)
    if launch.plot:
        title = f"fluxtp bench {launch.scenario}: {device_name} x{world}, {data['date']}, {data['commit'][:10]}"
        module.plot(rows, launch.plot, title)
        print(f"wrote {launch.plot}", flush=True)
    if device.type != "cuda":
        print(NO_GPU_LINE, flush=True)


def rank_main(rank: int, world: int, launch: Launch) -> None:
    """The body every rank runs inside an initialized default process group."""
    info = resolve_group(None)
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # ranks share the cores
    try:
        rows, notes = scenario_module(launch.scenario).run(launch.config, info, device, show_progress=rank == 0)
    except BenchError as e:
        if rank == 0:
            print(f"fluxtp bench: {e}", file=sys.stderr, flush=True)
        dist.barrier()  # rank 0 has printed before any rank exits (the launcher stops the rest at the first exit)
        raise SystemExit(1) from None
    if rank == 0:
        _report(launch, rows, notes, device, world)


def run_local(
    launch, nproc: int, device_type: str, rank_fn=rank_main, command: str = "fluxtp bench", timeout_s: float = LAUNCH_TIMEOUT_S
) -> int:
    """Spawn `nproc` ranks (NCCL, one GPU each; gloo without CUDA) running rank_fn(rank, world,
    launch); the exit code of the run. `fluxtp tune` launches through here too."""
    os.environ.update(MULTICAST_OFF)  # inherited by the children from their start
    try:
        run_on_ranks(rank_fn, nproc, launch, backend="nccl" if device_type == "cuda" else "gloo", timeout_s=timeout_s)
    except mp.ProcessExitedException as e:
        if e.signal_name or e.exit_code != 1:  # a crash, not a rank stopping on purpose (rank 0 printed why)
            print(f"{command} failed: {e}", file=sys.stderr, flush=True)
        return 1
    except (mp.ProcessRaisedException, TimeoutError) as e:
        print(f"{command} failed:\n{e}", file=sys.stderr, flush=True)
        return 1
    return 0


def run_torchrun(launch, rank_fn=rank_main) -> int:
    """This process is one rank of a torchrun launch (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_* set),
    running rank_fn(rank, world, launch)."""
    os.environ.update(MULTICAST_OFF)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=LAUNCH_TIMEOUT_S / 2)
    if local_device_type() == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo", timeout=timeout)
    try:
        rank_fn(rank, world, launch)
    except SystemExit as e:
        return int(e.code or 0)
    finally:
        destroy_process_group()
    return 0
