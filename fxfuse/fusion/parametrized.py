"""Keeping optimize from changing a model's parametrizations.

A tensor registered through `torch.nn.utils.parametrize` is computed on every read, and the
computation may write state: `spectral_norm` runs a power iteration in training mode, updating
its `_u` and `_v` in place. The passes, the policy and the layout check read weights for their
shapes and strides, which eager never does; each such read put the model a step of power
iteration ahead of eager's copy. `kept` puts back every tensor of the model's parametrizations
that was written while it was entered. A recompute region must not run such a parametrization
again (`with_state`): its recompute would start from the buffers the forward updated.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.nn.utils import parametrize


@contextlib.contextmanager
def kept(model: nn.Module) -> Iterator[None]:
    """Every tensor of `model`'s parametrizations as it was on entering, whatever ran inside."""
    owned = {}
    for m in model.modules():
        if parametrize.is_parametrized(m):
            for t in (*m.parametrizations.parameters(), *m.parametrizations.buffers()):
                owned[id(t)] = t
    with torch.no_grad():
        before = [(t, t._version, t.detach().clone()) for t in owned.values()]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, version, saved in before:
                if t._version != version:
                    t.copy_(saved)


def keeping(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn(model, ...)`, run inside `kept(model)`."""

    @functools.wraps(fn)
    def run(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with kept(model):
            return fn(model, *args, **kwargs)

    return run


def with_state(m: nn.Module) -> Optional[str]:
    """What parametrization of `m` keeps buffers, if one does (`spectral_norm`'s `_u`, `_v`): a forward may
    update them and read them updated, so running it again computes another value."""
    if not parametrize.is_parametrized(m):
        return None
    for name, chain in m.parametrizations.items():
        for p in chain:
            buffers = [b for b, _ in p.named_buffers()]
            if buffers:
                return f"{name} is parametrized by {type(p).__name__}, with buffers {', '.join(buffers)}"
    return None
