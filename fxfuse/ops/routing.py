"""The switch that runs fxfuse's ops on CPU through their device-generic implementations.

The generic implementations (csrc/generic/*.cpp) are what CUDA, for the ops without a CUDA
kernel, and every other device run. On CPU, hand-written kernels normally serve the
batch-norm, GELU and conv-backward ops; inside `generic_path()` (or in a process started
with FXFUSE_GENERIC=1) CPU tensors take the generic implementations instead, end to end
through the composites, so that the tests and benchmarks check and measure on CPU what a
GPU runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .. import _extension

__all__ = ["generic_path", "generic_path_enabled"]


def _set(enabled: bool) -> bool:
    _extension.require()
    return bool(torch.ops.fxfuse_generic.set_enabled(enabled))


def generic_path_enabled() -> bool:
    """Whether CPU tensors take the generic implementations now."""
    _extension.require()
    return bool(torch.ops.fxfuse_generic.enabled())


@contextlib.contextmanager
def generic_path(enabled: bool = True) -> Iterator[None]:
    """Route CPU tensors to the device-generic implementations inside the block (process-wide:
    every thread sees it). `generic_path(False)` routes them back to the CPU kernels."""
    previous = _set(enabled)
    try:
        yield
    finally:
        _set(previous)
