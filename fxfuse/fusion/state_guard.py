"""Keeping tracing from changing a model.

torch.fx runs a forward's Python code on proxies, but that code can still change the
real model: an in-place op on a tensor reached without a proxy (a plain tensor
attribute, `self._buffers[...]`) runs once, at trace time, `self.steps += 1` on
a proxied buffer rebinds the attribute to an fx Proxy, and a cache filled in forward
(timm LeViT's `attention_bias_cache[device] = ...` in eval) keeps a Proxy in a dict of the
user's. None of it is in the graph. `StateGuard` snapshots every tensor (with its version
counter), the attribute bindings and the contents of dict and list attributes of a module
tree, names what changed while tracing, and puts it back.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import Tensor, nn

_MISSING = object()
# Attributes torch.fx itself adds to the traced root: tensors created in forward.
_FX_CONSTANT_PREFIX = "_tensor_constant"


def owned_tensors(root: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(qualified name, tensor) for every parameter, buffer and plain tensor attribute under `root`."""
    seen: set[int] = set()
    for path, m in root.named_modules():
        prefix = f"{path}." if path else ""
        attrs = [(k, v) for k, v in vars(m).items() if isinstance(v, Tensor)]
        for name, t in [*m._parameters.items(), *m._buffers.items(), *attrs]:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                yield prefix + name, t


# nn.Module's own registries (parameters, buffers, submodules: the bindings; hooks): not user state.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def _containers(m: nn.Module) -> dict[str, tuple]:
    """`m`'s own dict and list attributes, each with a shallow snapshot of its contents: what a
    forward can change without rebinding an attribute."""
    out = {}
    for key, value in vars(m).items():
        if key in _MODULE_INTERNALS:
            continue
        if isinstance(value, dict):
            out[key] = (value, list(value.items()))
        elif isinstance(value, list):
            out[key] = (value, list(value))
    return out


def _same_contents(value, snapshot: list) -> bool:
    current = list(value.items()) if isinstance(value, dict) else list(value)
    if len(current) != len(snapshot):
        return False
    if isinstance(value, dict):
        return all(k is j or k == j for (k, _), (j, _) in zip(current, snapshot)) and all(
            a is b for (_, a), (_, b) in zip(current, snapshot)
        )
    return all(a is b for a, b in zip(current, snapshot))


def _bindings(m: nn.Module) -> tuple[dict, ...]:
    """The dicts that hold `m`'s attributes: assignments to it land in one of them."""
    return m.__dict__, m._parameters, m._buffers, m._modules


class StateGuard:
    """Finds and undoes what tracing a module changed: `begin(m)` before tracing `m`, `end(m)` after.

    Calls nest like the modules' forwards. `end` reports only what changed since the
    matching `begin`, so a write is blamed on the innermost module that made it.
    """

    def __init__(self, root: nn.Module) -> None:
        self._root = root
        with torch.no_grad():
            self._tensors = [(name, t, t.detach().clone()) for name, t in owned_tensors(root)]
        self._paths = {m: path for path, m in root.named_modules()}
        self._frames: list[tuple[list[int], dict]] = []

    def begin(self, scope: nn.Module) -> None:
        versions = [t._version for _, t, _ in self._tensors]
        modules = [m for m in scope.modules() if m in self._paths]
        bindings = {m: tuple(dict(d) for d in _bindings(m)) for m in modules}
        containers = {m: _containers(m) for m in modules}
        self._frames.append((versions, bindings, containers))

    def end(self) -> list[str]:
        """Qualified names of what changed since the matching `begin`; their old values and bindings are put back."""
        versions, bindings, containers = self._frames.pop()
        changed = []
        for i, (name, t, saved) in enumerate(self._tensors):
            if t._version != versions[i]:
                changed.append(name)
                with torch.no_grad():
                    t.copy_(saved)
                for outer_versions, _, _ in self._frames:  # the restore is no write of theirs
                    outer_versions[i] = t._version
        for m, saved in bindings.items():
            changed += self._restore_bindings(m, saved)
        for m, saved in containers.items():
            changed += self._restore_contents(m, saved)
        return changed

    def _restore_contents(self, m: nn.Module, saved: dict[str, tuple]) -> list[str]:
        prefix = f"{self._paths[m]}." if self._paths[m] else ""
        changed = []
        for key, (value, snapshot) in saved.items():
            if _same_contents(value, snapshot):
                continue
            changed.append(prefix + key)
            if isinstance(value, dict):
                value.clear()
                value.update(snapshot)
            else:
                value[:] = snapshot
        return changed

    def _restore_bindings(self, m: nn.Module, saved_dicts: tuple[dict, ...]) -> list[str]:
        prefix = f"{self._paths[m]}." if self._paths[m] else ""
        changed = []
        for live, saved in zip(_bindings(m), saved_dicts):
            for key in live.keys() | saved.keys():
                old = saved.get(key, _MISSING)
                if live.get(key, _MISSING) is old:
                    continue
                if old is _MISSING and m is self._root and key.startswith(_FX_CONSTANT_PREFIX):
                    continue
                changed.append(prefix + key)
                if old is _MISSING:
                    del live[key]
                else:
                    live[key] = old
        return sorted(set(changed))
