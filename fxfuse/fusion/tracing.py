"""Tracing models with torch.fx for fxfuse's passes.

`FxFuseTracer` differs from `torch.fx.Tracer` in these ways:
 * a subclass of a torch.nn module that keeps the library's `forward` is a leaf
   (the pass can then recognise it by its type and forward), and so is a third-party
   module the passes recognise by its type (timm's BatchNormAct2d);
 * buffers are proxies, so in-place updates of them (`num_batches_tracked.add_(1)`,
   an EMA's `mul_`) are graph nodes that run on every call, not once while tracing;
 * tracing never changes the model: a module whose traced forward still writes a
   real tensor in place (a plain tensor attribute, say) gets its values put back and
   becomes a leaf, so the write runs on every call; the reason is recorded;
 * a submodule that cannot be traced through becomes a leaf instead of failing the
   whole trace: the partial trace is rolled back and the reason recorded;
 * a submodule with module hooks is a leaf, so that `Module.__call__` runs its hooks
   at call time with the same tensors as eager (recorded in `hooked`); an optimized
   submodule that is traced through is traced through its original forward;
 * it records which modules were traced through: their `training` flags are baked
   into the graph, so the optimized model keys its graphs on them.
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass, field

import torch.fx as fx
from torch import nn

from ..errors import TracingError
from .passes.known_modules import is_known_leaf
from .passes.matchers import describe_hooks, has_hooks
from .state_guard import StateGuard

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _library_forward(m: nn.Module) -> bool:
    forward_owner = getattr(type(m).forward, "__module__", "") or ""
    return forward_owner.startswith(("torch.nn", "torch.ao.nn")) and not isinstance(m, _CONTAINERS)


@dataclass
class TraceResult:
    graph: fx.Graph
    traced_modules: list[str]  # qualified names of modules traced through (root is "")
    leaf_failures: dict[str, str] = field(default_factory=dict)  # module path -> why it became a leaf
    hooked: dict[str, str] = field(default_factory=dict)  # module path -> its hooks (a leaf so that they fire)


class FxFuseTracer(fx.Tracer):
    def __init__(self, guard: StateGuard) -> None:
        super().__init__()
        self.record_stack_traces = True
        self.proxy_buffer_attributes = True
        self.guard = guard
        self.leaf_failures: dict[str, str] = {}
        self.traced_modules: list[str] = []
        self.hooked: dict[str, str] = {}

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_failures or has_hooks(m):
            return True
        return super().is_leaf_module(m, module_qualified_name) or _library_forward(m) or is_known_leaf(m)

    def call_module(self, m, forward, args, kwargs):
        path = self.path_of_module(m)
        if self.is_leaf_module(m, path):
            if has_hooks(m):
                self.hooked[path] = describe_hooks(m)
            return super().call_module(m, forward, args, kwargs)
        # `forward` is Module.__call__, which would run global module hooks on the proxies;
        # this module has no hooks of its own, so its forward alone is what eager runs.
        forward = _plain_forward(m)
        tail = self.graph._root.prev  # last node before this call
        module_stack = collections.OrderedDict(self.module_stack)
        num_calls = dict(self.num_calls)
        n_traced = len(self.traced_modules)
        self.guard.begin(m)
        try:
            out = super().call_module(m, forward, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure inside means "make it a leaf"
            self.guard.end()
            out, failure = None, exc
        else:
            changed = self.guard.end()
            failure = _ChangesState(changed) if changed else None
        if failure is not None:
            self._rollback(tail)
            self.module_stack = module_stack
            self.num_calls = num_calls
            del self.traced_modules[n_traced:]
            self.leaf_failures[path] = (
                str(failure)
                if isinstance(failure, _ChangesState)
                else (f"{type(failure).__name__}: {first_line(failure)}")
            )
            return super().call_module(m, forward, args, kwargs)
        if path not in self.traced_modules:
            self.traced_modules.append(path)
        return out

    def _rollback(self, tail: fx.Node) -> None:
        nodes = []
        node = self.graph._root.prev
        while node is not tail:
            nodes.append(node)
            node = node.prev
        for node in nodes:  # newest first, so users go before their inputs
            self.graph.erase_node(node)


def _plain_forward(m: nn.Module):
    """`m`'s forward without Module.__call__; for an optimized module, its original class's forward."""
    original = getattr(type(m), "_fxfuse_original_class", None)
    if original is not None and "forward" not in m.__dict__:
        return functools.partial(original.forward, m)
    return m.forward


class _ChangesState(Exception):
    def __init__(self, names: list[str]) -> None:
        super().__init__(
            f"its forward changes {', '.join(names)} in a way torch.fx cannot record (assignment, a write "
            f"into a dict or list attribute, or an in-place write to a tensor that is not a registered "
            f"buffer); buffers updated in place are recorded"
        )


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def trace(root: nn.Module, forward_class: type | None = None) -> TraceResult:
    """Trace `root`; raises whatever torch.fx raises when root's own forward cannot be traced.

    `forward_class`: trace that class's forward instead of `type(root).forward` (an
    optimized module traces the forward of its original class).
    """
    guard = StateGuard(root)
    tracer = FxFuseTracer(guard)
    cls = root.__class__
    root.__class__ = forward_class or cls
    guard.begin(root)
    try:
        graph = tracer.trace(root)
    finally:
        root.__class__ = cls
        changed = guard.end()
    if changed:
        raise TracingError(f"{type(root).__name__}: {_ChangesState(changed)}")
    return TraceResult(graph, [""] + tracer.traced_modules, dict(tracer.leaf_failures), dict(tracer.hooked))


def compile_graph(graph: fx.Graph):
    """Python function `fn(module, *args, **kwargs)` running `graph` with `module` as `self`.

    Unlike a GraphModule, it copies nothing: every parameter, buffer and submodule is
    looked up on the live module at call time, so `.to()`, `.double()`, `load_state_dict`
    and parameter swaps act on what the graph uses.
    """
    code = graph.python_code(root_module="self")
    fn = fx.graph_module._forward_from_src(code.src, code.globals)
    return fn
