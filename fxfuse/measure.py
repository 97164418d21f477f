"""Measuring what fxfuse changes, the same way everywhere (tests, benchmarks, CLI, examples).

* saved activations: unique storages packed by autograd during one forward
  (`torch.autograd.graph.saved_tensors_hooks`), excluding parameters, buffers and inputs;
* resident memory at the end of forward: /proc/self/statm before and after forward
  (run with MALLOC_MMAP_THRESHOLD_=65536 so freed blocks go back to the OS);
* time: median train step, reported as a ratio against eager measured in the same process.
"""
from __future__ import annotations

import gc
import os
import statistics
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn


def _storage_key(t: torch.Tensor):
    storage = t.untyped_storage()
    return (t.device.type, storage.data_ptr(), storage.nbytes())


def _tensors(obj) -> list[torch.Tensor]:
    leaves, _ = torch.utils._pytree.tree_flatten(obj)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def saved_activation_bytes(model: nn.Module, inputs: Sequence[Any]) -> int:
    """Bytes of the distinct storages autograd keeps for backward during one forward."""
    exclude = {_storage_key(t) for t in (*model.parameters(), *model.buffers(), *_tensors(inputs))}
    seen: dict[tuple, int] = {}

    def pack(t: torch.Tensor):
        key = _storage_key(t)
        if key not in exclude and key[1] != 0:
            seen[key] = key[2]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*inputs)
    del out
    return sum(seen.values())


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def forward_resident_bytes(model: nn.Module, inputs: Sequence[Any]) -> int:
    """Growth of resident memory from before forward to the end of forward (graph alive)."""
    gc.collect()
    before = rss_bytes()
    out = model(*inputs)
    after = rss_bytes()
    del out
    gc.collect()
    return after - before


def train_step(model: nn.Module, inputs: Sequence[Any], optimizer: torch.optim.Optimizer | None = None) -> None:
    out = model(*inputs)
    loss = sum(t.float().square().mean() for t in _tensors(out))
    loss.backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)


def median_step_times(steps: dict[str, Callable[[], None]], repeats: int = 5, warmup: int = 1) -> dict[str, float]:
    """Median seconds per call of each function, calls interleaved so drift hits all alike."""
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}
