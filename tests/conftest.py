import os

import pytest
import torch
from support.threads import intra_op_threads


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs `-n 2`) each worker runs one intra-op thread: the workers
    already share the cores, and more threads per worker only wait on each other's OpenMP barriers.
    Tests that need more threads (test_ops_conv2d's thread-count test, the wild zoo's thread floor)
    set them themselves."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def single_thread():
    """One intra-op thread for the module's tests (the model zoo). float64 CPU kernels on the
    zoo's tiny tensors gain nothing from threads, and when the cores are shared each OpenMP
    barrier can wait for a scheduler slice: with 2 threads on a loaded 2-core machine the zoo's
    fast part took 261 s instead of 29 s."""
    with intra_op_threads(1):
        yield


@pytest.fixture
def one_thread():
    """One intra-op thread for one test: tests that run hundreds of tiny ops (gradcheck,
    opcheck), where threads only add fork/join latency, and bitwise comparisons with ATen,
    which splits work into per-thread chunks."""
    with intra_op_threads(1):
        yield
