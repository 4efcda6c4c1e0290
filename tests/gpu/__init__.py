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


def stream_k_shape(world: int, scaled=None) -> tuple[int, int, int] | None:
    """(rows a rank, columns a rank, K) of an all-gather the launcher splits by stream-K at this
    world size on this GPU, ragged rows first; scaled: an FP8 call's (fluxtp.backends.fused._scaled.Scaled,
    fast accumulation: its rule wants K from 12288). The table or the heuristic picks the tiling,
    so the shape is searched, not fixed; None if no candidate splits."""
    from fluxtp.backends.fused._all_gather_matmul import _config_for

    dtype = torch.bfloat16 if scaled is None else torch.float8_e4m3fn
    for k in (4096, 8192) if scaled is None else (12288, 16384):
        for n in (3456, 3584, 3328, 4608):
            for total in (4096, 8192, 2048):
                for m in (total // world - 40, total // world):
                    x = torch.empty(m, k, device="cuda", dtype=dtype)
                    w = torch.empty(n, k, device="cuda", dtype=dtype)
                    if _config_for(x, w, world, None, scaled).stream_k:
                        return m, n, k
    return None


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
