"""fluxtp.testing.run_on_ranks: failures propagate; a crash in teardown after a pass does not."""

import atexit
import os

import pytest
import torch.multiprocessing as mp

from fluxtp.testing import run_on_ranks


def _abort_in_body(rank, world):
    if rank == 1:
        os.abort()


def _abort_at_exit_after_passing(rank, world):
    if rank == 1:
        atexit.register(os.abort)  # dies by SIGABRT after _entry returned: teardown only


def _raise_in_body(rank, world):
    if rank == 0:
        raise AssertionError("rank 0 saw a wrong number")


def test_a_rank_killed_in_its_body_fails_the_test():
    with pytest.raises(mp.ProcessExitedException):
        run_on_ranks(_abort_in_body, 2, backend="gloo", timeout_s=120)


def test_an_exception_in_a_body_fails_the_test():
    # The first rank to fail is reported: rank 0's assert, or rank 1's barrier that lost rank 0.
    with pytest.raises(mp.ProcessRaisedException):
        run_on_ranks(_raise_in_body, 2, backend="gloo", timeout_s=120)


def test_a_crash_in_teardown_after_every_rank_passed_only_warns():
    with pytest.warns(UserWarning, match="died after the test passed"):
        run_on_ranks(_abort_at_exit_after_passing, 2, backend="gloo", timeout_s=120)
