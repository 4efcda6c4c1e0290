"""GPU tests. WORLD is the number of ranks (one per GPU) every multi-GPU test spawns: every local
GPU by default, so a 4-GPU host tests the ops at TP=4; FLUXTP_TEST_WORLD picks fewer."""

import os
import subprocess
import sys

import torch


def _world() -> int:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    asked = os.environ.get("FLUXTP_TEST_WORLD")
    if asked is None:
        return max(2, gpus)
    world = int(asked)
    if not 2 <= world <= max(2, gpus):
        raise ValueError(f"FLUXTP_TEST_WORLD={asked}: expected 2 to {max(2, gpus)} (this host has {gpus} GPUs)")
    return world


WORLD = _world()


def plan_configs(module) -> list:
    """The config of every call plan of a fused launcher `module` (its Plan) built in this process
    from now on, in order (a plan launches the config it resolved, on every call of its signature)."""
    seen = []
    original = module.Plan.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.append(self.config)

    module.Plan.__init__ = spy
    return seen


def skip_unless_hopper() -> None:
    """Skip the calling test off Hopper: the warp-specialized (Gluon) kernels are for sm_90."""
    import pytest

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialized kernels are for Hopper")


_REPORT_TAIL = """
try:
    torch.cuda.synchronize()
    print("no error")
except Exception as e:
    print("error:", type(e).__name__)
from fluxtp.backends.fused import {module} as _op
print("report:", _op.timeout_report(), flush=True)
"""


def run_until_trap(script: str, module: str, *args: str) -> subprocess.CompletedProcess:
    """Run `script` (it imports torch and launches a kernel whose wait must give up) in a fresh
    process with `args`, then synchronize and print fluxtp.backends.fused.<module>'s
    timeout_report(); asserts that the launch failed. A trap leaves the CUDA context unusable,
    hence the process of its own."""
    proc = subprocess.run([sys.executable, "-c", script + _REPORT_TAIL.format(module=module), *args], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert "error:" in proc.stdout, f"the kernel did not fail: {proc.stdout[-2000:]} {proc.stderr[-2000:]}"
    return proc
