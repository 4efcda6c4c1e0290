"""GPU tests. WORLD is the number of ranks (one per GPU) every multi-GPU test spawns: every local
GPU by default, so a 4-GPU host tests the ops at TP=4; FLUXTP_TEST_WORLD picks fewer."""

import os

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
