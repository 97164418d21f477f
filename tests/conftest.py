import pytest
import torch


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
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
