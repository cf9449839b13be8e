"""GPU tests run only on a Hopper GPU; elsewhere they are skipped with the reason. Fixtures the
test modules share."""

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


@pytest.fixture
def entry_tiles_on_every_grid():
    """The shipped entries' tiles on every grid (config.grid_fitted off: the test grids are
    small) with plans built afresh; yields the forward configs the calls compiled
    (cute_flash.benchmarking.entry_tiles_on_every_grid)."""
    from cute_flash.benchmarking import entry_tiles_on_every_grid as entry_tiles

    with entry_tiles() as compiled:
        yield compiled
