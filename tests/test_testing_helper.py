"""fluxtp.testing.run_on_ranks: failures propagate, named even where teardown then hangs or a peer
that lost the failed rank at the final barrier exits first; a crash in teardown after a pass does
not; a gloo rank killed by a crash signal in its body is run once more, an NCCL one fails at once.
run_launch: a torchrun launch whose worker died of a crash signal runs once more, nothing else does."""

import atexit
import gc
import os
import sys
import time
import warnings
import weakref
from pathlib import Path
from unittest import mock

import pytest
import torch.multiprocessing as mp

from fluxtp import testing
from fluxtp.testing import run_launch, run_on_ranks


def _abort_in_body(rank, world):
    if rank == 1:
        os.abort()


def _abort_in_first_body(rank, world, marker):
    if rank == 1 and not Path(marker).exists():
        Path(marker).touch()
        os.abort()


def _abort_at_exit_after_passing(rank, world):
    if rank == 1:
        atexit.register(os.abort)  # dies by SIGABRT after _entry returned: teardown only


def _raise_in_body(rank, world):
    if rank == 0:
        raise AssertionError("rank 0 saw a wrong number")


def test_a_gloo_rank_killed_in_its_body_twice_fails_the_test():
    # The failure reported is the first rank torch saw fail: rank 1's abort, or rank 0's barrier
    # that lost rank 1.
    with pytest.warns(UserWarning, match="rank 1 was killed by SIGABRT; running every rank once more"):
        with pytest.raises((mp.ProcessExitedException, mp.ProcessRaisedException)):
            run_on_ranks(_abort_in_body, 2, backend="gloo", timeout_s=120)


def test_a_gloo_rank_killed_in_its_body_once_passes_with_a_warning(tmp_path):
    marker = tmp_path / "aborted_once"
    with pytest.warns(UserWarning, match="rank 1 was killed by SIGABRT"):
        run_on_ranks(_abort_in_first_body, 2, str(marker), backend="gloo", timeout_s=120)
    assert marker.exists()


class _FailedRanks:
    """What mp.start_processes returns, after a failure: join raises `failure`, every rank reaped
    with its exit code (negative: the signal)."""

    def __init__(self, failure, exit_codes):
        self.failure = failure
        self.processes = [mock.Mock(exitcode=code) for code in exit_codes]

    def join(self, timeout=None):
        raise self.failure


_RAISED = mp.ProcessRaisedException("rank 0: RuntimeError: connection closed by peer", error_index=0, error_pid=1)


@pytest.mark.parametrize(
    "exit_codes, crashed",
    [
        ([1, -6], "rank 1 was killed by SIGABRT"),
        ([-11, -15], "rank 0 was killed by SIGSEGV"),
        ([1, -15], None),
        ([1, -9], None),
    ],
    ids=["peer-aborted", "segfault", "peer-terminated", "peer-killed"],
)
def test_a_crash_signal_on_any_rank_is_told_apart_from_the_failure_reported(exit_codes, crashed):
    # torch reports the first rank it saw fail (here rank 0's exception), then stops the others
    # by SIGTERM / SIGKILL: a crash is any rank that died of a crash signal, whichever was reported.
    with mock.patch.object(mp, "start_processes", return_value=_FailedRanks(_RAISED, exit_codes)):
        if crashed is None:
            with pytest.raises(mp.ProcessRaisedException):
                testing._spawn_and_join(_abort_in_body, 2, (), "gloo", 60)
        else:
            with pytest.raises(testing._NativeCrash, match=crashed) as info:
                testing._spawn_and_join(_abort_in_body, 2, (), "gloo", 60)
            assert info.value.failure is _RAISED


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_nccl_fails_at_once_and_gloo_runs_twice_at_most(backend):
    crash = testing._NativeCrash({1: "SIGABRT"}, _RAISED)
    with mock.patch.object(testing, "_spawn_and_join", side_effect=crash) as spawn:
        with pytest.raises(mp.ProcessRaisedException):
            if backend == "gloo":
                with pytest.warns(UserWarning, match="rank 1 was killed by SIGABRT; running every rank once more"):
                    run_on_ranks(_abort_in_body, 2, backend=backend)
            else:
                run_on_ranks(_abort_in_body, 2, backend=backend)
    assert spawn.call_count == (2 if backend == "gloo" else 1)


def test_an_exception_in_a_body_fails_the_test():
    # Rank 0's assert is reported, though rank 1's barrier that lost rank 0 may fail first.
    with pytest.raises(mp.ProcessRaisedException, match="rank 0 saw a wrong number"):
        run_on_ranks(_raise_in_body, 2, backend="gloo", timeout_s=120)


class _Captured:
    """Stands for what a failed body may hold: a model with captured NCCL graphs."""


def _teardown_hangs_while(alive):
    """Patch this rank's teardown to hang (as NCCL's did) while `alive()`: the fixture of the two
    tests below, run inside the rank."""
    real = testing.destroy_process_group

    def destroy():
        gc.collect()
        while alive():
            time.sleep(0.1)
        real()

    testing.destroy_process_group = destroy


def _raise_holding_a_graph(rank, world):
    held = _Captured()
    _teardown_hangs_while(weakref.ref(held))
    if rank == 0:
        raise AssertionError("rank 0 saw a wrong number")


def _raise_then_hang_in_teardown(rank, world):
    _teardown_hangs_while(lambda: rank == 0)
    if rank == 0:
        raise AssertionError("rank 0 saw a wrong number")


def test_a_failed_body_tears_down_without_its_frames_and_reports_the_failure():
    # Before, teardown ran inside the exception's handling: its frames kept the body's objects
    # alive, teardown hung on them, and the test ended in a timeout that never named the failure.
    with pytest.raises(mp.ProcessRaisedException, match="rank 0 saw a wrong number"):
        run_on_ranks(_raise_holding_a_graph, 2, backend="gloo", timeout_s=120)


def _raise_then_leave_last(rank, world):
    """Rank 0's body fails, and it exits a while after tearing down: rank 1, at the final barrier,
    loses it and exits first."""
    if rank == 0:
        real = testing.destroy_process_group

        def destroy():
            real()
            time.sleep(3)

        testing.destroy_process_group = destroy
        raise AssertionError("rank 0 saw a wrong number")


def test_a_rank_that_lost_its_failed_peer_at_the_barrier_does_not_hide_the_failure():
    # Rank 1's error (the connection rank 0 closed) reached join first and was the one raised.
    with pytest.raises(mp.ProcessRaisedException, match="rank 0 saw a wrong number"):
        run_on_ranks(_raise_then_leave_last, 2, backend="gloo", timeout_s=120)


def test_a_timeout_names_the_failures_of_ranks_that_hang_in_teardown():
    with pytest.raises(TimeoutError, match="(?s)within 20 s.*rank0: .*AssertionError: rank 0 saw a wrong number"):
        run_on_ranks(_raise_then_hang_in_teardown, 2, backend="gloo", timeout_s=20)


def test_a_crash_in_teardown_after_every_rank_passed_only_warns():
    with pytest.warns(UserWarning, match="died after the test passed"):
        run_on_ranks(_abort_at_exit_after_passing, 2, backend="gloo", timeout_s=120)


# A torchrun worker script: rank 1 counts its runs, then aborts (in the first run only, or in
# every run) or raises; rank 0 does nothing.
_WORKER = """
import os, sys
from pathlib import Path
runs, mode = Path(sys.argv[1]), sys.argv[2]
if os.environ["RANK"] == "1":
    with runs.open("a") as f:
        f.write("run\\n")
    if mode == "raise":
        raise RuntimeError("a wrong number")
    if mode == "always" or len(runs.read_text().splitlines()) == 1:
        os.abort()
"""


@pytest.mark.parametrize(
    "mode, passes, runs",
    [("abort_once", True, 2), ("always", False, 2), ("raise", False, 1)],
)
def test_run_launch_runs_a_torchrun_launch_again_only_after_a_crash(tmp_path, mode, passes, runs):
    worker, counted = tmp_path / "worker.py", tmp_path / "runs"
    worker.write_text(_WORKER)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd = [*torchrun, str(worker), str(counted), mode]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        done = run_launch(cmd, timeout=120)
    assert (done.returncode == 0) == passes, done.stderr[-3000:]
    assert len(counted.read_text().splitlines()) == runs
    reruns = [str(w.message) for w in seen if "running it once more" in str(w.message)]
    assert len(reruns) == (runs - 1) and all("killed by SIGABRT" in m for m in reruns), reruns
