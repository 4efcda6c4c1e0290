"""examples/train_hybrid.py on 4 gloo processes (dp 2 x tp 2, and pp 2 x tp 2) prints the same
losses as a single-process run of the same model and data, for 5 steps.

The runs are real torchrun launches (subprocesses with a timeout), so this also tests the
recipe as a user runs it: mesh setup, FSDP2 over dp, the pipeline schedule over pp.
"""

import os
import re
import sys
from pathlib import Path

import pytest
import transformers  # noqa: F401  (the example needs it; a missing install fails here, not in a subprocess)

from fluxtp.testing import run_launch

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "train_hybrid.py")
# float64 and plain SGD: SGD's update is proportional to the gradient, so a gradient off by any
# factor (a reduction counted twice, micro-batches not averaged) changes the next losses at the
# 1e-3 level; AdamW would hide a uniform factor. The parallel runs sum the same products in
# another order (rank partials, micro-batches), ~1e-16 relative a value; after 5 steps of
# lr 0.5 the measured loss differences are ~1e-15. Allowed: 1e-10 relative.
COMMON = ["--dtype", "float64", "--steps", "5", "--optimizer", "sgd", "--lr", "0.5", "--seed", "3"]
TOLERANCE = 1e-10
TIMEOUT_S = 400


def _losses(cmd) -> list[float]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = run_launch(cmd, timeout=TIMEOUT_S, env=env)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    losses = [float(m.group(2)) for m in re.finditer(r"^step (\d+) loss (\S+)$", proc.stdout, re.MULTILINE)]
    assert len(losses) == 5, f"expected 5 'step N loss X' lines, got:\n{proc.stdout[-3000:]}"
    return losses


@pytest.fixture(scope="module")
def reference_losses():
    return _losses([sys.executable, EXAMPLE, "--reference", *COMMON])


@pytest.mark.parametrize("layout", [("--dp", "2", "--tp", "2"), ("--pp", "2", "--tp", "2")], ids=["dp2-tp2", "pp2-tp2"])
def test_losses_match_single_process(reference_losses, layout):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    losses = _losses([*cmd, EXAMPLE, *layout, "--microbatches", "2", *COMMON])
    for step, (got, want) in enumerate(zip(losses, reference_losses)):
        assert abs(got - want) <= TOLERANCE * abs(want), f"{layout} step {step}: loss {got!r}, single process {want!r}"
    assert reference_losses[0] != reference_losses[-1]  # the steps did train
