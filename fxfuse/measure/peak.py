"""Peak memory of one train step, counted on a meta-device copy: what decides whether a batch fits.

A TorchDispatchMode sees every tensor an op creates during forward and backward; it
adds the bytes of each new storage and takes them off when the storage is freed (a
weak reference on the storage, which lives as long as anything, autograd included,
holds it; views and in-place results are no new storage). The peak of that sum over
the step is the estimate: activations, their gradients and the parameter gradients,
as the resident-memory peak of
`fxfuse.measure` counts them on a real run. Memory an op's kernel uses inside itself
(a fused backward's recomputed conv output) is not seen.

`step_peak_parts_meta` also says what is alive at that peak: the parameters' gradients, what
the forward made and still holds (saved for backward), and what backward made (activation
gradients, recomputed tensors): recompute only lowers the second part.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .memory import counted_run, meta_copy, tensors, to_meta, train_step

_serials = itertools.count()


def _tensors(obj, found: list | None = None) -> list[torch.Tensor]:
    """`tensors` for an op's arguments and results (tuples, lists, dicts): without pytree, which was a
    sixth of a meta-device count's time."""
    found = [] if found is None else found
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            _tensors(x, found)
    elif isinstance(obj, dict):
        for x in obj.values():
            _tensors(x, found)
    return found


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under this mode that are still alive, and their peak."""

    def __init__(self, parts: bool = False) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        # With `parts`: each storage's (serial, made in backward), and each storage alive at the peak
        # with its (serial, made in backward, bytes).
        self.parts = parts
        self.born: dict[int, tuple[int, bool]] = {}
        self.at_peak: dict[int, tuple[int, bool, int]] = {}

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Views and in-place results share an input's storage, which may predate the mode (a parameter).
        reused = {t.untyped_storage()._cdata for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self.live or key in reused:
                continue
            self.live[key] = storage.nbytes()
            self.current += self.live[key]
            weakref.finalize(storage, self._free, key)
            if self.parts:
                self.born[key] = (next(_serials), torch._C._current_graph_task_id() != -1)
        if self.current > self.peak:
            self.peak = self.current
            if self.parts:
                self.at_peak = {k: (*self.born[k], n) for k, n in self.live.items()}
        return out


def step_peak_bytes_meta(
    model: nn.Module, inputs: Sequence[Any], prepare: Callable[[nn.Module], Any] | None = None
) -> int:
    """Peak bytes allocated during one forward + backward (`measure.train_step`) of a meta-device copy of
    `model`; `prepare` runs on the copy first (e.g. to optimize it with a candidate selection)."""
    copy_ = meta_copy(model)
    with counted_run():
        if prepare is not None:
            prepare(copy_)
        meta_inputs = to_meta(inputs)
        with LiveBytes() as mode:
            train_step(copy_, meta_inputs)
    return mode.peak


@dataclass(frozen=True)
class PeakParts:
    """What is alive at the step peak (bytes); the first three add up to `peak`."""

    peak: int
    parameter_grads: int  # parameters' gradients accumulated by then
    forward_kept: int  # made by the forward and still held: saved for backward, the output
    backward_transient: int  # made by backward and not a parameter's gradient: activation gradients, recomputes
    inputs: int  # the step's inputs, held throughout and made before it (not in `peak`)


def step_peak_parts_meta(
    model: nn.Module, inputs: Sequence[Any], prepare: Callable[[nn.Module], Any] | None = None
) -> PeakParts:
    """`step_peak_bytes_meta`, and what the live bytes at that peak consist of."""
    copy_ = meta_copy(model)
    with counted_run():
        if prepare is not None:
            prepare(copy_)
        meta_inputs = to_meta(inputs)
        with LiveBytes(parts=True) as mode:
            train_step(copy_, meta_inputs, keep_grads=True)
    # A parameter's gradient counts as one at the peak only if it is the storage alive then (same
    # serial), not a later one at the same address.
    grads = {
        mode.born[k][0]
        for k in {p.grad.untyped_storage()._cdata for p in copy_.parameters() if p.grad is not None}
        if k in mode.born
    }
    parts = {"grad": 0, "forward": 0, "backward": 0}
    for serial, in_backward, n in mode.at_peak.values():
        parts["grad" if serial in grads else "backward" if in_backward else "forward"] += n
    input_bytes = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in tensors(meta_inputs)}.values())
    return PeakParts(mode.peak, parts["grad"], parts["forward"], parts["backward"], input_bytes)
