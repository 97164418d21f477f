import pytest
import torch
from support.threads import intra_op_threads


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
