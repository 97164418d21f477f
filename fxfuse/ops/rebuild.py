"""Rebuilt activations: a BN→activation output that other ops keep for backward is kept as its recipe.

Eager's conv keeps its input, a multiply keeps both factors, a concatenation's consumer keeps
the concatenation's pieces. Where that input is the output `a = act(bn(x))` of a fused
`batch_norm_act` call, the BN input `x` and its per-channel statistics are kept anyway (the BN
backward needs them), so `a` costs its bytes for nothing: one pointwise pass rebuilds it, with
the same kernel (fxfuse::bn_act), so the same bits. This is what torch.compile's partitioner does
with pointwise ops between convolutions, done for every consumer at once: `a` may feed a conv,
a concatenation and a multiply, and none of them keeps it.

`Scope` is the mechanism: a `saved_tensors_hooks` pair, pushed for one forward of an optimized
graph, that packs a tensor registered by `batch_norm_act(..., rebuildable=True)` as its recipe and
any other tensor as it would be packed without it. Hooks already in effect (the user's offloading,
`fxfuse.measure`'s counting, a checkpoint around the model) still see every tensor kept: the
scope hands them the recipe's tensors instead of `a`, and everything else as it came.

A registration matches only the same tensor object, unchanged since (`_version`), and only while
the recipe's tensors are unchanged too: an output or a BN input changed in place after the BN, or
a view of the output, is kept as it is. Only sites whose every user
just reads the output are registered (fusion/passes/rebuild.py: an allow-list), and only where
the BN's backward keeps its input and this scope's hooks are the ones autograd calls (inside a
checkpoint, its own hooks keep what is saved). An entry is dropped when its output dies.

No scope is pushed (the graph runs as without it) where autograd keeps nothing (no grad mode),
under torch.compile (dynamo traces the compositions of ops/compiled.py instead) and where
saved-tensor hooks are disabled (torch.func's transforms disable them).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Optional

import torch
from torch import Tensor

__all__ = ["Scope", "Tally", "active", "register"]

_local = threading.local()


class Tally:
    """`with Tally() as t:` t.bytes counts the bytes every Scope that ends inside it packed as recipes:
    what backward rebuilds (each time an op keeps the output, so a tensor two ops keep counts twice)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.count = 0  # tensors packed as recipes

    def __enter__(self) -> Tally:
        _tallies().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _tallies().remove(self)


def _tallies() -> list:
    tallies = getattr(_local, "tallies", None)
    if tallies is None:
        tallies = _local.tallies = []
    return tallies


def _stack() -> list:
    stack = getattr(_local, "scopes", None)
    if stack is None:
        stack = _local.scopes = []
    return stack


def active() -> bool:
    """Whether a forward is running under a Scope in this thread (a registration would be used)."""
    return bool(_stack())


def register(out: Tensor, fn: Callable[..., Tensor], tensors: tuple, constants: tuple = ()) -> None:
    """`out` is `fn(*tensors, *constants)`, computed by the same kernels: where an op keeps `out` for backward
    during the current scope, keep that recipe instead. `tensors` (None allowed) are packed as any kept tensor
    is, a registered one as its own recipe; `constants` are numbers and strings.

    Registered only where the scope's own hooks are the ones autograd calls now: inside a checkpoint (a user's,
    or a recompute region's) its hooks keep what is saved, and a recipe would only hold its tensors longer."""
    stack = _stack()
    if stack and stack[-1].on_top():
        stack[-1].register(out, fn, tensors, constants)


# A tensor kept as it came is packed as a plain tuple (packed, version): every tensor of the forward that
# autograd keeps goes through the scope's hooks, and a class's __init__ would be one more Python call each.
# `version` is its version when packed where it is held as itself (no outer hooks), else None.


class _Rebuilt:
    __slots__ = ("fn", "packed", "constants", "output")

    def __init__(self, fn: Callable[..., Tensor], packed: tuple, constants: tuple, output: tuple) -> None:
        self.fn = fn
        self.packed = packed
        self.constants = constants
        self.output = output  # (weak reference to the output it rebuilds, its version when packed)


def _unchanged(tensors: tuple, versions: tuple) -> bool:
    """Whether a recipe's tensors are as they were when it was registered (the recipe would rebuild the output
    from changed ones)."""
    return all(u is None or u._version == v for u, v in zip(tensors, versions))


def _check_unchanged(t: Optional[Tensor], version: int) -> None:
    """Autograd checks no version of a tensor saved-tensor hooks pack: the scope checks what it holds itself."""
    if t is not None and t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{t.type()} {list(t.shape)}] is at version {t._version}; expected version {version} "
            "instead (fxfuse keeps it for backward under saved-tensor hooks: ops/rebuild.py)"
        )


class Scope:
    """`with Scope():` one forward whose registered BN→activation outputs are kept as recipes.

    `rebuilt_bytes` and `rebuilt_count` count the tensors packed as recipes (each time one is packed)."""

    def __init__(self) -> None:
        self._recipes: dict[int, tuple] = {}
        self._outer = None
        self._hooks = None
        self.rebuilt_bytes = 0
        self.rebuilt_count = 0

    def __enter__(self) -> Scope:
        if (
            torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            and torch._C._autograd._saved_tensors_hooks_is_enabled()
        ):
            self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()
            _stack().append(self)
        return self

    def __exit__(self, *exc) -> None:
        for tally in _tallies():
            tally.bytes += self.rebuilt_bytes
            tally.count += self.rebuilt_count
        if self._hooks is not None:
            _stack().remove(self)
            self._hooks.__exit__(*exc)
            self._hooks = None
        self._recipes.clear()

    def on_top(self) -> bool:
        """Whether autograd packs with this scope's hooks now (no checkpoint or other hooks pushed since)."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        pack = top[0] if top is not None else None
        return (
            torch.is_grad_enabled()
            and getattr(pack, "__self__", None) is self
            and (getattr(pack, "__func__", None) is Scope._pack)
        )

    def register(self, out: Tensor, fn: Callable[..., Tensor], tensors: tuple, constants: tuple) -> None:
        key = id(out)
        recipes = self._recipes
        # Dropped with the output: its tensors are not held past their use, and a reused id finds no entry.
        ref = weakref.ref(out, lambda _: recipes.pop(key, None))
        versions = tuple(None if u is None else u._version for u in tensors)
        recipes[key] = (ref, out._version, fn, tensors, constants, versions)

    def _pack(self, t: Optional[Tensor]) -> Any:
        if t is None:
            return None
        entry = self._recipes.get(id(t))
        if entry is not None and entry[0]() is t and t._version == entry[1] and _unchanged(entry[3], entry[5]):
            self.rebuilt_bytes += t.untyped_storage().nbytes()
            self.rebuilt_count += 1
            ref, _, fn, tensors, constants, _ = entry
            return _Rebuilt(fn, tuple(self._pack(u) for u in tensors), constants, (ref, t._version))
        if self._outer is not None:
            return (self._outer[0](t), None)
        # Detached (it shares the version counter): holding `t` itself would tie a cycle through its grad_fn,
        # which keeps the node holding this; autograd gives the unpacked tensor its grad_fn back.
        return (t.detach(), t._version)

    def _unpack(self, packed: Any) -> Optional[Tensor]:
        if packed is None:
            return None
        if type(packed) is tuple:
            kept, version = packed
            if version is None:
                return self._outer[1](kept)
            if kept._version != version:
                _check_unchanged(kept, version)  # raises
            return kept
        _check_unchanged(packed.output[0](), packed.output[1])
        tensors = [self._unpack(p) for p in packed.packed]
        with torch.no_grad():
            return packed.fn(*tensors, *packed.constants)
