"""Helpers for tests: run a function on N local ranks, with a deadline; or one rank of a world
simulated on one GPU.

`run_on_ranks(fn, world_size)` spawns one process per rank (gloo on CPU, NCCL on GPUs, one GPU
a rank), initializes the default group on a free port, calls `fn(rank, world_size, *args)` and
raises in the parent with the failing rank's traceback. If any rank fails, the others are
terminated (torch.multiprocessing), and a hang is cut off at `timeout_s`: a test never hangs.
`run_launch(cmd)` runs a launch of gloo ranks (torchrun on CPU) as a subprocess, with
run_on_ranks's rule for a rank that dies of a crash signal.

`simulated_world(world, rank)` runs the public ops as one rank of a world whose peers' symmetric
buffers are local tensors of this GPU (host-time benchmarks, one-GPU tests of a whole call).
"""

from __future__ import annotations

import datetime
import faulthandler
import functools
import importlib
import math
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import traceback
import types
import warnings
from contextlib import ExitStack, contextmanager
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fluxtp._dist import destroy_process_group

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world_size, port, backend, timeout_s, args, done_dir):
    # A rank killed by a signal (a native abort or segfault) prints every thread's Python stack.
    faulthandler.enable(all_threads=True)
    os.environ.update(MULTICAST_OFF)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(
        backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s), **kwargs
    )
    failure, in_body = None, True
    try:
        fn(rank, world_size, *args)
        in_body = False
        dist.barrier()
        # Every rank's body passed: what may still go wrong is teardown (see run_on_ranks).
        Path(done_dir, f"rank{rank}.done").touch()
    except Exception:
        failure = traceback.format_exc()
        # A body's failure, or (.lost) the final barrier's: a peer whose body failed left it.
        Path(done_dir, f"rank{rank}.{'failed' if in_body else 'lost'}").write_text(failure)
    # Torn down outside the except clause: its traceback's frames hold the body's objects (a model
    # with captured NCCL graphs), which made destroy_process_group hang and hid the failure.
    destroy_process_group()
    if failure is not None:
        raise RuntimeError(f"rank {rank}: {fn.__name__} failed:\n{failure}")


def run_on_ranks(fn, world_size: int, *args, backend: str | None = None, timeout_s: float = 300.0) -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned ranks; raise if any rank fails.

    `fn` must be importable (a module-level function). backend defaults to NCCL when there are
    enough GPUs, else gloo. On gloo, a rank killed in its body by a crash signal (an abort or a
    segfault: native code) runs every rank once more, with a warning: fluxtp runs no native code
    of its own on CPU, so that is a crash inside torch (one was seen on a 2-core CI host); a
    second one fails. On NCCL such a death is the watchdog's abort after a fault or a hang, or a
    kernel's: it fails at once.
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    try:
        _spawn_and_join(fn, world_size, args, backend, timeout_s)
    except _NativeCrash as crash:
        if backend != "gloo":
            raise crash.failure from None
        warnings.warn(f"{fn.__name__}: {crash}; running every rank once more", stacklevel=2)
        try:
            _spawn_and_join(fn, world_size, args, backend, timeout_s)
        except _NativeCrash as again:
            raise again.failure from None


# The signals a process dies of in native code; SIGTERM and SIGKILL are how torch stops the others.
_CRASH_SIGNALS = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL)
_CRASH_EXIT_CODES = {-int(s): s.name for s in _CRASH_SIGNALS}  # multiprocessing's exitcode of a signal death


class _NativeCrash(Exception):
    """Ranks killed by crash signals; `failure` is what torch.multiprocessing raised (the first
    rank it saw fail, perhaps a peer that lost the crashed rank)."""

    def __init__(self, crashed: dict[int, str], failure: Exception):
        super().__init__(", ".join(f"rank {r} was killed by {name}" for r, name in crashed.items()))
        self.failure = failure


# torchrun's summary line for a worker killed by a signal.
_TORCHRUN_CRASH = re.compile(rf"Signal \d+ \(({'|'.join(s.name for s in _CRASH_SIGNALS)})\) received by PID")


def run_launch(cmd: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd)` with its output captured as text, for a launch of gloo ranks on CPU
    (torchrun): when it failed because a rank died of a crash signal, it runs once more, with a
    warning (run_on_ranks's rule); a second failure, or any other, is returned as it is."""
    run = functools.partial(subprocess.run, cmd, capture_output=True, text=True, timeout=timeout, check=False, **kwargs)
    done = run()
    crash = _TORCHRUN_CRASH.search(done.stderr) if done.returncode else None
    if crash is None:
        return done
    warnings.warn(f"{' '.join(cmd)}: a rank was killed by {crash.group(1)}; running it once more", stacklevel=2)
    return run()


def _body_failures(done_dir: str) -> dict[int, str]:
    """rank -> the traceback its body failed with (_entry's rank{r}.failed files), by rank."""
    failed = {int(f.stem.removeprefix("rank")): f.read_text() for f in Path(done_dir).glob("*.failed")}
    return dict(sorted(failed.items()))


def _spawn_and_join(fn, world_size: int, args: tuple, backend: str, timeout_s: float) -> None:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="fluxtp-ranks-") as done_dir:
        ctx = mp.start_processes(
            _entry,
            args=(fn, world_size, port, backend, max(30.0, timeout_s / 2), args, done_dir),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        if p.is_alive():
                            p.kill()
                    # Bodies that failed, then hung in teardown.
                    failures = "".join(f"\nrank{r}: {text}" for r, text in _body_failures(done_dir).items())
                    raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish within {timeout_s:.0f} s{failures}")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            # A rank killed by a signal after every rank's body passed and met at the final
            # barrier died in teardown (gloo's threads at exit have aborted this way, rarely):
            # the test itself passed. Any other death is a failure: a native crash's is told
            # apart (_NativeCrash) for run_on_ranks's rule.
            if isinstance(e, mp.ProcessExitedException) and all(
                Path(done_dir, f"rank{r}.done").exists() for r in range(world_size)
            ):
                warnings.warn(f"{fn.__name__}: a rank died after the test passed on every rank ({e})", stacklevel=3)
                return
            # join() has stopped and reaped every rank: their exit codes are final.
            codes = [p.exitcode for p in ctx.processes]
            crashed = {r: _CRASH_EXIT_CODES[code] for r, code in enumerate(codes) if code in _CRASH_EXIT_CODES}
            if crashed:
                raise _NativeCrash(crashed, e) from e
            failed = _body_failures(done_dir)
            if isinstance(e, mp.ProcessRaisedException) and failed and e.error_index not in failed:
                # The first rank seen to fail only lost a failed peer at the final barrier: name the
                # peer's own failure (the one the test is about), as the rank raised it.
                rank = min(failed)
                raise mp.ProcessRaisedException(
                    f"\n\n-- Process {rank} terminated with the following error:\n{failed[rank]}", rank, ctx.processes[rank].pid
                ) from e
            raise


class SimulatedHandle:
    """torch's symmetric-memory handle, for W ranks' buffers that are local tensors of one device.
    mark_delivered=False: the barrier does nothing (ranks simulated one after another)."""

    def __init__(self, buffers, rank, mark_delivered: bool = True):
        self.buffers, self.rank, self.mark_delivered = buffers, rank, mark_delivered

    def get_buffer(self, rank, shape, dtype, storage_offset):
        numel = math.prod(shape)
        return self.buffers[rank].view(dtype)[storage_offset : storage_offset + numel].view(shape)

    def barrier(self, channel=0, timeout_ms=0):
        # One small kernel, as the real barrier is; it marks every word of this rank's buffer 1,
        # so the reduce-scatter's flags read "delivered" (simulated_world sets them to the values
        # its kernels wait for) and its kernel never waits (its sums are then garbage). The
        # all-gather reads only the peers' buffers: its result stays exact.
        if self.mark_delivered:
            self.buffers[self.rank].view(torch.int32).fill_(1)


class SimulatedGroup:
    """What the ops need of a process group: a name (the plans key by the object itself)."""

    def __init__(self, world, rank):
        self.group_name = f"simulated-{world}-rank{rank}"


SIMULATED_OPS = ("all_gather_matmul", "matmul_reduce_scatter", "all_gather_scaled_matmul", "scaled_matmul_reduce_scatter")


def _deliver_reduce_scatter_flags(stack: ExitStack) -> None:
    """After a reduce-scatter plan's reset and stand-in barrier: every flag or counter its peers
    (or their copy streams) set reads the value its kernel waits for (Layout.complete_flags: a
    tile's arrivals, a band's count), and what this rank's own kernel counts (the copy engine's
    tile counters, the reducer kernel's own region) reads 0, as after a real barrier. Each plan's
    values are put on its device once, when it is made (its reset is recorded as a graph, where
    no host copy may run)."""
    from fluxtp.backends.fused import _matmul_reduce_scatter as rs

    make, reset = rs.Plan.__init__, rs.Plan._reset_and_barrier
    complete = {}

    def made(plan, *args, **kwargs):
        make(plan, *args, **kwargs)
        layout, copy_engine = plan.layout, plan.config.copy_engine
        by_peers = layout.num_flags // 2 if copy_engine else layout.num_flags  # then the tile counters
        complete[id(plan)] = (layout.complete_flags(copy_engine)[:by_peers].to(plan.flags.device), by_peers)

    def reset_and_barrier(plan):
        reset(plan)
        values, count = complete[id(plan)]
        plan.flags[:count].copy_(values)
        plan.flags[count:].zero_()

    stack.enter_context(mock.patch.object(rs.Plan, "__init__", made))
    stack.enter_context(mock.patch.object(rs.Plan, "_reset_and_barrier", reset_and_barrier))


@contextmanager
def simulated_world(world: int, rank: int = 0):
    """Calls of the public ops (SIMULATED_OPS) with group=<the yielded group> run as `rank` of a
    world of `world` on this one GPU: group resolution and torch's symmetric memory are stood in
    for, each peer's buffer a local tensor (SimulatedHandle; all ones until written)."""
    from fluxtp import symm
    from fluxtp._dist import GroupInfo
    from fluxtp._dist import resolve_group as real_resolve

    group = SimulatedGroup(world, rank)
    info = GroupInfo(group, rank, world)

    def empty(size, dtype, device):
        return torch.ones(size, dtype=dtype, device=device)

    def rendezvous(tensor, name):
        buffers = [tensor if r == rank else torch.ones_like(tensor) for r in range(world)]
        return SimulatedHandle(buffers, rank)

    fake = types.SimpleNamespace(empty=empty, rendezvous=rendezvous, enable_symm_mem_for_group=lambda name: None)

    def resolve(g):
        return info if g is group else real_resolve(g)

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(symm, "_symm_mem", lambda: fake))
        _deliver_reduce_scatter_flags(stack)
        for op in SIMULATED_OPS:
            module = importlib.import_module(f"fluxtp.ops.{op}")  # fluxtp.ops.<op> is the function
            stack.enter_context(mock.patch.object(module, "resolve_group", resolve))
        symm._reasons[group.group_name] = None  # the group's GPUs share memory: they are one
        try:
            yield group
        finally:
            symm.free_workspaces(group.group_name)
