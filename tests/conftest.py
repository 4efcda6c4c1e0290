"""Settings for the whole test session.

The CPU suite spawns gloo worlds of 2-3 processes on machines with as few as 2 cores. With the
default of one OpenMP thread per core in every rank, the ranks oversubscribe the cores and
every collective waits on descheduled threads (torchrun picks 1 thread for the same reason).
Set here, before any rank is spawned: the children inherit it; a caller's own value wins."""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

# Worker processes for the whole suite on a host without CUDA (pytest-xdist, one file per worker):
# most of its time is one core's (kernel compiles, the Triton interpreter), so files side by side
# take about two thirds of the time on CI's two cores. At most this many: each imports torch.
MAX_CPU_WORKERS = 4


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """`python -m pytest` with no paths on a host without CUDA runs the suite on every core (up to
    MAX_CPU_WORKERS), where pytest-xdist is installed and no `-n` was given. Never on GPU hosts:
    the multi-GPU files' ranks take every GPU, and two files' kernels on one GPU would slow each
    other's bounded waits. A run of named files or tests stays in one process."""
    if config.args_source != pytest.Config.ArgsSource.TESTPATHS or not config.pluginmanager.hasplugin("xdist"):
        return
    if hasattr(config, "workerinput"):  # an xdist worker runs its files itself
        return
    if config.getoption("numprocesses", None) is not None:
        return
    import torch

    if torch.cuda.is_available():
        return
    config.option.numprocesses = "auto"
    config.option.maxprocesses = MAX_CPU_WORKERS
    config.option.dist = "loadfile"
