"""tests/gpu/ runs only where torch sees a CUDA device: every test here is skipped with the reason otherwise.

The count comes from NVML (``torch.cuda.device_count``), not a CUDA context: the launches these tests start fork
their workers, and a parent that had initialised CUDA would leave them unable to."""

from __future__ import annotations

import pytest
import torch

NO_GPU = "no CUDA device (torch.cuda.device_count() == 0): the GPU tests run on a host with an NVIDIA GPU (tests/gpu/check.sh)"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.device_count() > 0:
        return
    skip = pytest.mark.skip(reason=NO_GPU)
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
