import gc

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: no GPU visible here (run `make test-gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def unfrozen_heap():
    """ShardRunner.capture freezes the process's objects out of the garbage collector's walks, as a worker
    wants; after each test they are walked again, so that no test's garbage outlives it."""
    yield
    gc.unfreeze()
