"""Peak memory of one train step, counted on a meta-device copy: what decides whether a batch fits.

A TorchDispatchMode sees every tensor an op creates during forward and backward; it
adds the bytes of each new storage and takes them off when the storage is freed (a
weak reference on the storage, which lives as long as anything, autograd included,
holds it; views and in-place results are no new storage). The peak of that sum over
the step is the estimate: activations, their gradients and the parameter gradients,
as the resident-memory peak of
`fxfuse.measure` counts them on a real run. Memory an op's kernel uses inside itself
(a fused backward's recomputed conv output) is not seen.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .memory import meta_copy, tensors, to_meta, train_step


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under this mode that are still alive, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Views and in-place results share an input's storage, which may predate the mode (a parameter).
        reused = {t.untyped_storage()._cdata for t in tensors((args, kwargs))}
        for t in tensors(out):
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self.live or key in reused:
                continue
            self.live[key] = storage.nbytes()
            self.current += self.live[key]
            weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.current)
        return out


def step_peak_bytes_meta(
    model: nn.Module, inputs: Sequence[Any], prepare: Callable[[nn.Module], Any] | None = None
) -> int:
    """Peak bytes allocated during one forward + backward (`measure.train_step`) of a meta-device copy of
    `model`; `prepare` runs on the copy first (e.g. to optimize it with a candidate selection)."""
    copy_ = meta_copy(model)
    if prepare is not None:
        prepare(copy_)
    meta_inputs = to_meta(inputs)
    with LiveBytes() as mode:
        train_step(copy_, meta_inputs)
    return mode.peak
