"""The largest batch that fits a memory cap: the figure that says what saving activations buys.

What must fit: the model's parameters and buffers, the batch of inputs, and the peak a
train step (forward, backward, parameter gradients; `memory.train_step`, no optimizer
state) adds on top of them. Two ways to ask whether a batch of n fits, searched alike
(`search`: galloping from a start, then bisection, since fitting is monotone in n):

* counted (`fits_counted`): the step peak counted on a meta-device copy
  (`step_peak_bytes_meta`): no compute, nothing of the user's runs, a second or two for
  ResNet-50. It does not see memory a kernel uses inside itself (oneDNN's conv scratch, a
  fused backward's recomputed conv output), so it is a guide that errs high: on CPU the
  allocator's real peak was 0.6-3.6% above it on ResNet-50 at batch 8-16 (eager and
  fxfuse), 7-9% on ResNet-18 at 128², and 51% for fxfuse on a toy net of 8-channel
  16² convs whose fused kernels' scratch is most of its memory.
* measured (`fits_measured`): real train steps at batch n on the model's device. On CPU,
  the second of two steps (the first warms up: kernels, compilation) fits when the
  allocator's peak (`step_allocated_peak_bytes`) plus the model and inputs is within the
  cap. On CUDA, both steps run under
  `torch.cuda.set_per_process_memory_fraction(cap / total)` and fit unless one raises
  torch.OutOfMemoryError: the caching allocator's own verdict, workspaces and
  fragmentation included.
"""

from __future__ import annotations

import gc
import re
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..errors import ConfigurationError
from .memory import step_allocated_peak_bytes, storage_key, tensors, train_step
from .peak import step_peak_bytes_meta

MAX_BATCH = 1 << 20

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """Bytes in a size like "3GiB", "1.5 GB", "800MiB" or "123456" (GiB/MiB binary, GB/MB decimal)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigurationError(f"a memory size is a number with a unit like 3GiB, 1.5GB or 800MiB, got {text!r}")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ConfigurationError(f"a memory cap must be positive, got {text!r}")
    return size


def search(fits: Callable[[int], bool], start: int = 1, limit: int = MAX_BATCH) -> int:
    """The largest n in [1, limit] with fits(n), 0 if not even 1 fits; `fits` must be monotone
    (true up to some n, false after). Starts at `start` and gallops away from it (steps of 1, 2,
    4, ...) until the answer is bracketed, then bisects: a start at the answer costs two calls
    (n and n + 1), a start k away about 2 log2(k). Asks each n at most once."""
    if limit < 1:
        raise ConfigurationError(f"the batch limit must be at least 1, got {limit}")
    answers: dict[int, bool] = {}

    def ask(n: int) -> bool:
        if n not in answers:
            answers[n] = bool(fits(n))
        return answers[n]

    n = min(max(1, int(start)), limit)
    step = 1
    if ask(n):
        low, high = n, None
        while high is None:
            if low == limit:
                return low
            n = min(low + step, limit)
            if ask(n):
                low, step = n, 2 * step
            else:
                high = n
    else:
        low, high = 0, n
        while low == 0 and high > 1:
            n = max(high - step, 1)
            if ask(n):
                low = n
            else:
                high, step = n, 2 * step
    while high - low > 1:
        n = (low + high) // 2
        if ask(n):
            low = n
        else:
            high = n
    return low


def batched(inputs: Sequence[Any], n: int, device: Optional[torch.device] = None) -> tuple:
    """`inputs` with every tensor's first dimension (the batch) made `n`, rows repeated cyclically,
    in the tensor's memory format (channels_last stays channels_last), dtype and requires_grad.
    On `device` if given; a meta-device result has no data."""
    out = []
    for x in inputs:
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            out.append(x)
            continue
        where = x.device if device is None else torch.device(device)
        fmt = (
            torch.channels_last
            if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
            else torch.contiguous_format
        )
        shape = (n, *x.shape[1:])
        if where.type == "meta":
            y = torch.empty(shape, dtype=x.dtype, device="meta", memory_format=fmt)
        else:
            rows = torch.arange(n, device=x.device) % max(x.shape[0], 1)
            y = torch.empty(shape, dtype=x.dtype, device=where, memory_format=fmt)
            if x.shape[0] > 0:
                y.copy_(x.detach()[rows])
        out.append(y.requires_grad_(x.requires_grad))
    return tuple(out)


def _distinct_bytes(ts) -> int:
    return sum(nbytes for *_, nbytes in {storage_key(t) for t in ts})


def state_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s parameters and buffers (distinct storages)."""
    return _distinct_bytes((*model.parameters(), *model.buffers()))


def _input_bytes(inputs: Sequence[Any]) -> int:
    return _distinct_bytes(tensors(inputs))


def fits_counted(model: nn.Module, example_inputs: Sequence[Any], cap_bytes: int) -> Callable[[int], bool]:
    """Whether batch n fits `cap_bytes`, by the meta-device count (see the module docstring)."""
    fixed = state_bytes(model)

    def fits(n: int) -> bool:
        inputs = batched(example_inputs, n, device="meta")
        return fixed + _input_bytes(inputs) + step_peak_bytes_meta(model, inputs) <= cap_bytes

    return fits


def fits_measured(model: nn.Module, example_inputs: Sequence[Any], cap_bytes: int) -> Callable[[int], bool]:
    """Whether batch n fits `cap_bytes`, by real train steps on the model's device (see the module docstring)."""
    device = next((t.device for t in tensors(example_inputs)), torch.device("cpu"))
    if device.type == "cuda":
        return _fits_cuda(model, example_inputs, cap_bytes, device)
    fixed = state_bytes(model)

    def fits(n: int) -> bool:
        inputs = batched(example_inputs, n)
        held = fixed + _input_bytes(inputs)
        if held > cap_bytes:
            return False
        train_step(model, inputs)
        return held + step_allocated_peak_bytes(lambda: train_step(model, inputs), device) <= cap_bytes

    return fits


def _fits_cuda(model: nn.Module, example_inputs: Sequence[Any], cap_bytes: int, device: torch.device):
    total = torch.cuda.get_device_properties(device).total_memory
    if cap_bytes > total:
        raise ConfigurationError(
            f"the cap ({cap_bytes / 2**30:.2f} GiB) is more than {device} has ({total / 2**30:.2f} GiB)"
        )

    def attempt(n: int) -> bool:
        try:
            inputs = batched(example_inputs, n)
            train_step(model, inputs)
            train_step(model, inputs)
            torch.cuda.synchronize(device)
        except torch.OutOfMemoryError:
            return False
        return True

    def fits(n: int) -> bool:
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # not in every torch
        before = getter(device) if getter is not None else 1.0
        # Blocks the caching allocator kept from earlier work would be reused outside the cap.
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(cap_bytes / total, device)
        try:
            ok = attempt(n)  # the exception and its frames are gone before the cache is emptied
        finally:
            model.zero_grad(set_to_none=True)
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(before, device)
        return ok

    return fits


def largest_batch(
    model: nn.Module,
    example_inputs: Sequence[Any],
    cap_bytes: int,
    how: str = "counted",
    start: Optional[int] = None,
    limit: int = MAX_BATCH,
) -> int:
    """The largest batch of `example_inputs`' shape (first dimension changed) that trains on
    `model` within `cap_bytes`, 0 if not even one sample does; `how` is "counted" or
    "measured" (see the module docstring). `start` is where the search begins (default: the
    example's batch); a measured search started from the counted answer takes a few steps.
    A measured search leaves `model`'s buffers and gradients as it found them."""
    if how not in ("counted", "measured"):
        raise ConfigurationError(f"how must be 'counted' or 'measured', got {how!r}")
    batch = next((t.shape[0] for t in tensors(example_inputs) if t.dim() > 0), None)
    if batch is None:
        raise ConfigurationError("the largest batch needs a tensor input with a batch dimension")
    if how == "counted":
        return search(fits_counted(model, example_inputs, cap_bytes), start=start or batch or 1, limit=limit)
    # Real steps move BatchNorm's running statistics and clear gradients: both are put back.
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    grads = [(p, p.grad) for p in model.parameters()]
    model.zero_grad(set_to_none=True)  # backward would add into them (and allocate nothing)
    try:
        return search(fits_measured(model, example_inputs, cap_bytes), start=start or batch or 1, limit=limit)
    finally:
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)
        for p, grad in grads:
            p.grad = grad
