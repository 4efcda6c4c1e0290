"""fluxtp.testing.run_on_ranks: failures propagate; a crash in teardown after a pass does not; a
gloo rank killed by a signal in its body is run once more, an NCCL one fails at once."""

import atexit
import os
from pathlib import Path
from unittest import mock

import pytest
import torch.multiprocessing as mp

from fluxtp import testing
from fluxtp.testing import run_on_ranks


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
    with pytest.warns(UserWarning, match="rank 1 was killed by SIGABRT on gloo; running every rank once more"):
        with pytest.raises(mp.ProcessExitedException, match="process 1 terminated with signal SIGABRT"):
            run_on_ranks(_abort_in_body, 2, backend="gloo", timeout_s=120)


def test_a_gloo_rank_killed_in_its_body_once_passes_with_a_warning(tmp_path):
    marker = tmp_path / "aborted_once"
    with pytest.warns(UserWarning, match="rank 1 was killed by SIGABRT on gloo"):
        run_on_ranks(_abort_in_first_body, 2, str(marker), backend="gloo", timeout_s=120)
    assert marker.exists()


@pytest.mark.parametrize(
    "backend, exit_code, signal_name",
    [("nccl", -6, "SIGABRT"), ("gloo", 1, None)],
    ids=["nccl-signal", "gloo-exit-code"],
)
def test_no_second_run_for_nccl_or_a_plain_exit(backend, exit_code, signal_name):
    death = mp.ProcessExitedException("died", error_index=0, error_pid=1, exit_code=exit_code, signal_name=signal_name)
    with mock.patch.object(testing, "_spawn_and_join", side_effect=death) as spawn:
        with pytest.raises(mp.ProcessExitedException):
            run_on_ranks(_abort_in_body, 2, backend=backend)
    assert spawn.call_count == 1


def test_an_exception_in_a_body_fails_the_test():
    # The first rank to fail is reported: rank 0's assert, or rank 1's barrier that lost rank 0.
    with pytest.raises(mp.ProcessRaisedException):
        run_on_ranks(_raise_in_body, 2, backend="gloo", timeout_s=120)


def test_a_crash_in_teardown_after_every_rank_passed_only_warns():
    with pytest.warns(UserWarning, match="died after the test passed"):
        run_on_ranks(_abort_at_exit_after_passing, 2, backend="gloo", timeout_s=120)
