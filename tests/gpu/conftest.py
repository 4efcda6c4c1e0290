"""Everything under tests/gpu needs CUDA GPUs: each test is marked `gpu`, and skipped on a host
with fewer than MIN_GPUS of them, or fewer than its `gpus(n)` mark asks (a test of one GPU's
kernels: `pytestmark = pytest.mark.gpus(1)`), so `python -m pytest` stays green on CPU machines."""

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
MIN_GPUS = 2


def pytest_collection_modifyitems(config, items):
    # A conftest's hook sees the whole session's items: act only on the ones in this folder.
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            mark = item.get_closest_marker("gpus")
            needed = mark.args[0] if mark is not None else MIN_GPUS
            if gpus < needed:
                item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA GPU(s), this host has {gpus}"))
