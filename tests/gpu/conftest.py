"""Everything under tests/gpu needs CUDA GPUs: each test is marked `gpu`, and skipped on a host
with fewer than MIN_GPUS of them (so `python -m pytest` stays green on CPU machines)."""

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
MIN_GPUS = 2


def pytest_collection_modifyitems(config, items):
    # A conftest's hook sees the whole session's items: act only on the ones in this folder.
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip = pytest.mark.skip(reason=f"needs {MIN_GPUS} CUDA GPUs, this host has {gpus}")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if gpus < MIN_GPUS:
                item.add_marker(skip)
