import gc
import os

import pytest
import torch
from support.threads import intra_op_threads


def _inductor_cache_per_capability() -> None:
    """One inductor cache directory per ATen CPU capability. Inductor's cache does not key its C++
    kernels on ATEN_CPU_CAPABILITY: a kernel compiled in a run under `ATEN_CPU_CAPABILITY=avx2` and
    loaded in one under AVX-512 (or the other way round) computed wrong values or crashed
    (tests/test_bench.py's compile tests, 2026-11-28), and test_cpu_capabilities runs the op tests
    under other capabilities in child processes. Children inherit the base and pick their own."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = os.environ.setdefault(
        "FXFUSE_INDUCTOR_CACHE_BASE", os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    )
    capability = torch.backends.cpu.get_cpu_capability().lower()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"aten-{capability}")


_inductor_cache_per_capability()


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs `-n 2`) each worker runs one intra-op thread: the workers
    already share the cores, and more threads per worker only wait on each other's OpenMP barriers.
    Tests that need more threads (test_ops_conv2d's thread-count test, the wild zoo's thread floor)
    set them themselves."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


# The modules that take longest under `make test`, longest first (a whole run's --durations, 2026-11-28).
# Under `--dist loadscope --no-loadscope-reorder` (the Makefile's PYTEST_XDIST) each worker takes the next
# module in collection order when it runs low: these start first, and the many short modules fill in at
# the end. xdist's own order (most tests first) started test_cpu_capabilities' one long test, the
# FSDP2 tests and the wild zoo among the last, leaving one worker idle while the other finished them.
SLOWEST_FIRST = (
    "test_policy.py",
    "test_wild_zoo.py",
    "test_bench.py",
    "test_compile.py",
    "test_gpu_check.py",
    "test_verify.py",
    "test_zoo.py",
    "test_budget_floor.py",
    "test_cpu_capabilities.py",
    "test_audit_zoo.py",
    "test_user_checkpoint.py",
    "test_fsdp2.py",
    "test_generic_path.py",
    "test_cpu_probe.py",
    "test_accuracy.py",
    "test_cpu_kernel_build.py",
)


def pytest_collection_modifyitems(items):
    """SLOWEST_FIRST's modules first, each module's tests in their own order, the rest as collected (a
    stable sort: every worker collects the same order, which xdist checks)."""
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="module", autouse=True)
def _freeze_survivors():
    """Each module starts with what earlier ones left alive moved out of the collector's sight
    (gc.freeze): fxfuse.measure calls gc.collect() before and after each count, and a collection that
    walks torch's, sympy's and the earlier modules' objects took 0.2 s or more, which the bench and fit
    tests paid dozens of times each. Garbage is collected first; what a test creates is collected as
    before, and so is anything frozen that its last reference leaves."""
    gc.collect()
    gc.freeze()
    yield


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
