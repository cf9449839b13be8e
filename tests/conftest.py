"""GPU tests run only on a Hopper GPU; elsewhere they are skipped with the reason."""

import pytest
import torch


def _hopper_status():
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    return major == 9, f"{name} (compute capability {major}.{minor})"


def pytest_collection_modifyitems(config, items):
    is_hopper, found = _hopper_status()
    if is_hopper:
        return
    skip = pytest.mark.skip(reason=f"needs an NVIDIA Hopper GPU (compute capability 9.x); found: {found}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
