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
   into the graph, so the optimized model keys its graphs on them;
 * the model's own `torch.utils.checkpoint` calls are traced as marked regions that
   stay checkpoint calls in the rewritten graph (user_checkpoint.py);
 * with example inputs, a module whose forward computes Python values from tensor shapes
   (`int(x.shape[-1])`, padding arithmetic, `if x.size(1) != c:`, iterating `chunk`'s
   result) is traced again with concrete shapes: every proxy carries a meta tensor, and
   inside such a module its shape reads return numbers. The graph is then specialized on
   the example inputs' shapes (TraceResult.specialized), and the optimized model keys its
   graphs on its inputs' shapes.
 * the root's optional arguments a call does not give are bound to their defaults, and the None,
   bool, int, float and str values a call gives are bound to those values (`CallPattern`), so that
   `if mask is None:` or `if output_hidden_states:` take the branch eager takes: torch.fx would make
   them placeholders, on which `is None` is always False and `if` raises. The optimized model keys
   its graphs on the call's pattern;
 * a dict subclass in the graph (HF's ModelOutput, an OrderedDict) keeps its type: torch.fx would
   make it a plain dict, and `model(x).last_hidden_state` would fail.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.fx as fx
from torch import nn
from torch.fx._symbolic_trace import _assert_is_none

from .. import measure
from ..errors import TracingError
from . import user_checkpoint
from .graphs import storage_family, storage_root
from .hooks import describe_hooks, has_hooks
from .known_modules import is_known_leaf
from .state_guard import StateGuard

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _library_forward(m: nn.Module) -> bool:
    forward_owner = getattr(type(m).forward, "__module__", "") or ""
    return forward_owner.startswith(("torch.nn", "torch.ao.nn")) and not isinstance(m, _CONTAINERS)


_BINDABLE = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class CallPattern:
    """How a forward is called: how many positional arguments, which keywords, and the values of those
    that are None, bool, int, float or str (position or keyword -> value), which the graph bakes in."""

    n_args: int
    keywords: tuple[str, ...] = ()
    values: tuple[tuple[Any, type, Any], ...] = ()

    @classmethod
    def of(cls, args: Sequence[Any], kwargs: Optional[dict] = None) -> CallPattern:
        kwargs = kwargs or {}
        values = tuple((i, type(a), a) for i, a in enumerate(args) if type(a) in _BINDABLE)
        values += tuple((k, type(kwargs[k]), kwargs[k]) for k in sorted(kwargs) if type(kwargs[k]) in _BINDABLE)
        return cls(len(args), tuple(sorted(kwargs)), values)

    @classmethod
    def for_call(cls, forward, example_inputs: Optional[Sequence[Any]]) -> CallPattern:
        """The example inputs' pattern, or without them `forward`'s required arguments alone."""
        return cls.of(example_inputs) if example_inputs is not None else cls.required(forward)

    @classmethod
    def required(cls, forward) -> CallPattern:
        """The call that gives a forward's required positional arguments only (`model(x)`)."""
        params = _parameters(forward)
        if params is None:
            return cls(0)
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        return cls(sum(1 for p in params if p.kind in kinds and p.default is inspect.Parameter.empty))


def _parameters(forward) -> Optional[list[inspect.Parameter]]:
    """A forward's parameters after `self` (None where its signature cannot be read)."""
    try:
        params = list(inspect.signature(inspect.unwrap(forward)).parameters.values())
    except (TypeError, ValueError):
        return None
    return params[1:]


def bindings(forward, pattern: CallPattern) -> dict[str, Any]:
    """The arguments of `forward` that a call of `pattern` fixes: the bindable values it gives, and the
    defaults (None, bool, int, float, str) of those it does not give."""
    params = _parameters(forward)
    if params is None:
        return {}
    given = {key: value for key, _, value in pattern.values}
    bound: dict[str, Any] = {}
    for i, p in enumerate(params):
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        positional = p.kind is not inspect.Parameter.KEYWORD_ONLY and i < pattern.n_args
        if positional and i in given:
            bound[p.name] = given[i]
        elif not positional and p.name in pattern.keywords:
            if p.name in given:
                bound[p.name] = given[p.name]
        elif not positional and p.default is not inspect.Parameter.empty and type(p.default) in _BINDABLE:
            bound[p.name] = p.default
    return bound


def in_signature_order(forward, args: Sequence[Any], kwargs: dict) -> Optional[tuple]:
    """The call `forward(*args, **kwargs)` as positional example inputs, one per parameter in the forward's
    order (defaults where not given): the order of its placeholders, which the tracer's concrete shapes
    follow. None where that is not one call's worth of positions (`*args`, an unknown name, a
    required argument missing). A `**kwargs` parameter is left empty, as the tracer leaves it."""
    params = _parameters(forward)
    if params is None or any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    params = [p for p in params if p.kind is not p.VAR_KEYWORD]
    if len(args) > len(params) or set(kwargs) - {p.name for p in params[len(args) :]}:
        return None
    values = list(args)
    for p in params[len(args) :]:
        if p.name in kwargs:
            values.append(kwargs[p.name])
        elif p.default is not inspect.Parameter.empty:
            values.append(p.default)
        else:
            return None
    return tuple(values)


def _unbind_checks(graph: fx.Graph, bound: dict[str, Any]) -> None:
    """torch.fx names a bound argument's placeholder `name_1` and checks its value in the graph; the
    graph is only run for calls of its pattern, so the checks go and the placeholder keeps the argument's
    name (a call passing it by keyword binds it)."""
    for node in list(graph.nodes):
        if node.op != "placeholder" or not node.target.endswith("_1") or node.target[:-2] not in bound:
            continue
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.eq:
                for check in list(user.users):
                    if check.target is torch._assert:
                        graph.erase_node(check)
                if not user.users:
                    graph.erase_node(user)
            elif user.op == "call_function" and user.target is _assert_is_none:
                graph.erase_node(user)
        node.target = node.target[:-2]


@dataclass
class TraceResult:
    graph: fx.Graph
    traced_modules: list[str]  # qualified names of modules traced through (root is "")
    leaf_failures: dict[str, str] = field(default_factory=dict)  # module path -> why it became a leaf
    user_checkpoints: list[user_checkpoint.Spec] = field(default_factory=list)  # the model's own checkpoint calls
    specialized: bool = False  # shape reads were answered with the example inputs' shapes
    hooked: dict[str, str] = field(default_factory=dict)  # module path -> its hooks (a leaf so that they fire)
    bound: dict[str, Any] = field(default_factory=dict)  # the root's arguments bound for the call pattern
    shape_failures: list[str] = field(default_factory=list)  # leaf failures after a symbolic shape read


class ShapeProxy(fx.Proxy):
    """A proxy that carries a meta tensor (`meta_value`) when the tracer propagates metadata; where the
    tracer is concrete, shape reads return numbers instead of graph nodes."""

    meta_value: Any = None

    def _concrete(self) -> bool:
        return self.tracer.concrete and isinstance(self.meta_value, torch.Tensor)

    def size(self, *args, **kwargs):
        if self._concrete():
            self.tracer.specialized = True
            return self.meta_value.size(*args, **kwargs)
        self.tracer.shape_reads += 1
        return self.tracer.create_proxy("call_method", "size", (self, *args), kwargs)

    def dim(self):
        if self._concrete():
            self.tracer.specialized = True  # `if x.dim() == 3: x = x.unsqueeze(0)`: the rank is baked in too
            return self.meta_value.dim()
        self.tracer.shape_reads += 1
        return self.tracer.create_proxy("call_method", "dim", (self,), {})

    @property
    def shape(self):
        if self._concrete():
            self.tracer.specialized = True
            return self.meta_value.shape
        self.tracer.shape_reads += 1
        return fx.proxy.Attribute(self, "shape")

    @property
    def ndim(self):
        return self.dim() if self._concrete() else fx.proxy.Attribute(self, "ndim")

    def __len__(self) -> int:
        if self.tracer.concrete and isinstance(self.meta_value, (torch.Tensor, tuple, list)):
            self.tracer.specialized = True
            return len(self.meta_value)
        self.tracer.shape_reads += 1
        return super().__len__()


def _augmented(op: Callable[[Any, Any], Any]) -> Callable[[ShapeProxy, Any], Any]:
    """`proxy op= other`: torch.fx records it as the out-of-place op and rebinds the name, where eager
    writes into the tensor; the tracer notes the pair so that a trace whose graph would differ (another
    name still reads the tensor: _augmented_problem) is refused."""

    def method(self: ShapeProxy, other: Any) -> Any:
        result = op(self, other)
        noted = getattr(self.tracer, "augmented", None)
        if isinstance(result, fx.Proxy) and noted is not None:
            noted.append((self.node, result.node, op.__name__))
        return result

    return method


# `a op= b` by the operator module's name of `op`, and its symbol (for the refusal's message).
_AUGMENTED = {
    "add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%", "pow": "**", "matmul": "@",
    "and_": "&", "or_": "|", "xor": "^", "lshift": "<<", "rshift": ">>",
}  # fmt: skip
for _name in _AUGMENTED:
    setattr(ShapeProxy, f"__i{_name.rstrip('_')}__", _augmented(getattr(operator, _name)))


def meta_of(proxy: fx.Proxy) -> Any:
    """The meta value a proxy carries (an attribute proxy's, from its owner's), or None."""
    if isinstance(proxy, fx.proxy.Attribute):
        owner = meta_of(proxy.root)
        return None if owner is None else getattr(owner, proxy.attr, None)
    return vars(proxy).get("meta_value")


class FxFuseTracer(fx.Tracer):
    def __init__(self, guard: StateGuard, example_inputs: Optional[Sequence[Any]] = None) -> None:
        super().__init__()
        self.record_stack_traces = True
        self.proxy_buffer_attributes = True
        self.guard = guard
        self.leaf_failures: dict[str, str] = {}
        self.traced_modules: list[str] = []
        self.user_checkpoints: list[user_checkpoint.Spec] = []
        self.hooked: dict[str, str] = {}
        self.augmented: list[tuple[fx.Node, fx.Node, str]] = []  # (tensor, result, op) of each `a op= b`
        # Concrete shapes (see the module doc): metas of the example inputs, a meta copy of the
        # root to run modules on, the module paths to trace concretely ("" the root), and whether
        # any shape read was answered with a number.
        self.example_metas = None if example_inputs is None else list(measure.to_meta(example_inputs))
        self.meta_root: Optional[nn.Module] = None
        self.concrete_paths: frozenset[str] = frozenset()
        self.concrete = False
        self.specialized = False
        # Symbolic reads of a shape, a length or the items of a proxy: a forward that fails after one may
        # trace with concrete shapes (`needs_shapes`); `shape_failures` are the leaves that did.
        self.shape_reads = 0
        self.shape_failures: list[str] = []
        self.computing_meta = False
        self._tensor_names_root: Optional[nn.Module] = None  # getattr's map: the root it was built for
        self._tensor_names: tuple[dict, dict] = ({}, {})  # id -> (name, tensor): parameters, buffers

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return ShapeProxy(node, self)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        if self.meta_root is not None and isinstance(proxy, ShapeProxy):
            proxy.meta_value = self._meta_of(kind, target, args, kwargs)
        return proxy

    def _meta_of(self, kind, target, args, kwargs) -> Any:
        """What the node computes, on meta tensors (None where that fails or an input has none)."""
        if kind == "placeholder":
            if target.startswith("**"):  # forward(..., **kwargs): called with the example's (none)
                return {}
            if target.startswith("*"):  # forward(..., *args): the example's remaining positional inputs
                rest, self.example_metas = tuple(self.example_metas or ()), []
                return rest
            return self.example_metas.pop(0) if self.example_metas else None
        if kind == "get_attr":
            previous, self.computing_meta = self.computing_meta, True  # the meta copy's attributes (getattr)
            try:
                return functools.reduce(getattr, target.split("."), self.meta_root)
            except AttributeError:
                return None
            finally:
                self.computing_meta = previous
        missing = []

        def meta(a):
            if isinstance(a, fx.Proxy):
                value = meta_of(a)
                if value is None:
                    missing.append(a)
                return value
            return a

        margs, mkwargs = fx.node.map_aggregate(args, meta), fx.node.map_aggregate(kwargs, meta)
        if missing or kind not in ("call_function", "call_method", "call_module"):
            return None
        previous, self.computing_meta = self.computing_meta, True
        try:
            with torch.no_grad():
                if kind == "call_function":
                    return target(*margs, **mkwargs)
                if kind == "call_method":
                    return getattr(margs[0], target)(*margs[1:], **mkwargs)
                return self.meta_root.get_submodule(target)(*margs, **mkwargs)
        except Exception:  # noqa: BLE001 - no metadata for this node: its shape reads stay symbolic
            return None
        finally:
            self.computing_meta = previous

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        """torch.fx's getattr, with the root's parameters and buffers found by identity in a map built once per
        trace instead of a scan of `named_parameters()`/`named_buffers()` at every tensor attribute read
        (quadratic: 13 of the 37 s of one smp DeepLabV3+ optimize). Same names, same proxies."""
        if not isinstance(attr_val, torch.Tensor):
            return attr_val
        if self.computing_meta:  # the meta copy's tensors: never the root's, which a scan would find none of
            return attr_val
        if self._tensor_names_root is not self.root:
            self._tensor_names_root = self.root
            self._tensor_names = ({}, {})
            for table, named in zip(self._tensor_names, (self.root.named_parameters(), self.root.named_buffers())):
                for name, tensor in named:
                    table.setdefault(id(tensor), (name, tensor))
        params, buffers = self._tensor_names
        found = params.get(id(attr_val)) if isinstance(attr_val, nn.Parameter) else None
        if found is None and self.proxy_buffer_attributes:
            found = buffers.get(id(attr_val))
        if found is None or found[1] is not attr_val:  # not the root's (a plain tensor attribute): fx's own scan
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        name = found[0]
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]

    def keys(self, obj):
        """`**proxy` (a forward's own **kwargs passed on): its keys, where the concrete trace knows them."""
        value = meta_of(obj)
        if self.concrete and isinstance(value, dict):
            self.specialized = True
            return list(value)
        self.shape_reads += 1
        return super().keys(obj)

    def iter(self, obj):
        """Iterating a proxy (`list(x.chunk(2, 1))`): its items, where the concrete trace knows how many."""
        value = meta_of(obj)
        if self.concrete and isinstance(value, (torch.Tensor, tuple, list)):
            self.specialized = True
            return iter([obj[i] for i in range(len(value))])
        self.shape_reads += 1
        return super().iter(obj)

    def create_arg(self, a: Any):
        if isinstance(a, dict) and type(a) is not dict and not isinstance(a, fx.immutable_collections.immutable_dict):
            return self.create_node("call_function", _typed_dict_of(type(a)), (super().create_arg(dict(a)),), {})
        return super().create_arg(a)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_failures or has_hooks(m):
            return True
        return super().is_leaf_module(m, module_qualified_name) or _library_forward(m) or is_known_leaf(m)

    def call_module(self, m, forward, args, kwargs):
        if self.computing_meta:  # a meta copy's module runs as it is, outside the graph
            return forward(*args, **kwargs)
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
        n_augmented = len(self.augmented)
        shape_reads = self.shape_reads
        concrete = self.concrete
        self.concrete = concrete or path in self.concrete_paths
        self.guard.begin(m)
        try:
            out = super().call_module(m, forward, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure inside means "make it a leaf"
            self.guard.end()
            out, failure = None, exc
        else:
            changed = self.guard.end()
            failure = _ChangesState(changed) if changed else None
        finally:
            self.concrete = concrete
        if failure is not None:
            self._rollback(tail)
            self.module_stack = module_stack
            self.num_calls = num_calls
            del self.traced_modules[n_traced:]
            del self.augmented[n_augmented:]
            if not isinstance(failure, _ChangesState) and self.shape_reads > shape_reads:
                self.shape_failures.append(path)
            self.leaf_failures[path] = (
                str(failure)
                if isinstance(failure, _ChangesState)
                else (f"{type(failure).__name__}: {first_line(failure)}")
            )
            out = super().call_module(m, forward, args, kwargs)
            if isinstance(failure, _ChangesState) and isinstance(out, fx.Proxy):
                out.node.meta[CHANGES_STATE_META] = failure.names  # a recompute region must not run it again
            return out
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


_TYPED_DICT: dict[type, Any] = {}


def _typed_dict_of(cls: type):
    """The graph's call that rebuilds a `cls` (a dict subclass) from its items: a dataclass (HF's
    ModelOutput) by keyword, others as `cls(items)`."""
    if cls not in _TYPED_DICT:
        by_keyword = dataclasses.is_dataclass(cls)

        def rebuild(items: dict) -> dict:
            return cls(**items) if by_keyword else cls(items)

        rebuild.__name__ = rebuild.__qualname__ = f"{cls.__name__}_from_items"
        _TYPED_DICT[cls] = rebuild
    return _TYPED_DICT[cls]


_APPLY: dict[type, Any] = {}


def _apply_of(cls: type):
    """The graph's call of `cls.apply` (a Python function, which torch.fx's code generation can name)."""
    if cls not in _APPLY:

        def apply(*args, **kwargs):
            return cls.apply(*args, **kwargs)

        apply.__name__ = apply.__qualname__ = f"{cls.__name__}_apply"
        _APPLY[cls] = apply
    return _APPLY[cls]


@contextlib.contextmanager
def _functions_as_calls(tracer: FxFuseTracer):
    """While tracing, a custom `torch.autograd.Function.apply` on proxies is one graph call of it.

    torch.fx would otherwise run the Function's forward on the proxies and record its ops, so that
    its own backward (a straight-through estimator, a memory-efficient activation) were lost and
    autograd differentiated those ops instead: silently different gradients."""
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        proxies = []
        fx.node.map_aggregate((args, kwargs), lambda a: proxies.append(a) if isinstance(a, fx.Proxy) else None)
        if not proxies or tracer.computing_meta:
            return original.__func__(cls, *args, **kwargs)
        return tracer.create_proxy("call_function", _apply_of(cls), args, kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = original


def _plain_forward(m: nn.Module):
    """`m`'s forward without Module.__call__; for an optimized module, its original class's forward."""
    original = getattr(type(m), "_fxfuse_original_class", None)
    if original is not None and "forward" not in m.__dict__:
        return functools.partial(original.forward, m)
    return m.forward


def _augmented_problem(graph: fx.Graph, augmented: list[tuple[fx.Node, fx.Node, str]]) -> str:
    """Why an `a op= b` of the trace would compute other values than eager's in-place op, or "".

    The graph computes `a op b` into a new node and later code reads that; eager writes into `a`, so any
    other reference to `a`'s storage read after it (an alias, a view, the tensor it is a view of, or the
    caller's input) sees the change in eager and not in the graph."""
    if not augmented:
        return ""
    order = {node: i for i, node in enumerate(graph.nodes)}
    for old, new, op in augmented:
        if old not in order or new not in order:
            continue
        base = storage_root(old)
        read_later = any(order[u] > order[new] for member in storage_family(base) for u in member.users)
        if read_later or base.op == "placeholder":
            what = "the caller's input" if base.op == "placeholder" else f"'{base.name}'"
            return (
                f"`{old.name} {_AUGMENTED[op]}= ...` writes into {what} in eager, which torch.fx "
                "records as a new tensor; the tensor is read again afterwards (an alias or a view of it), "
                "so the traced graph would compute other values. Write `x = x + y` (a new tensor), or "
                "`x.add_(y)` (an in-place op the trace records)"
            )
    return ""


_CHANGES_STATE = "its forward changes"
# node.meta key of a leaf call whose module changes state in forward: what it changes (regions/graph.py)
CHANGES_STATE_META = "fxfuse_changes_state"


class _ChangesState(Exception):
    def __init__(self, names: list[str]) -> None:
        self.names = names
        super().__init__(
            f"{_CHANGES_STATE} {', '.join(names)} in a way torch.fx cannot record (assignment, a write "
            f"into a dict or list attribute, or an in-place write to a tensor that is not a registered "
            f"buffer); buffers updated in place are recorded"
        )


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def trace(
    root: nn.Module,
    forward_class: type | None = None,
    example_inputs: Optional[Sequence[Any]] = None,
    pattern: Optional[CallPattern] = None,
) -> TraceResult:
    """Trace `root`; raises whatever torch.fx raises when root's own forward cannot be traced.

    `forward_class`: trace that class's forward instead of `type(root).forward` (an
    optimized module traces the forward of its original class). With `example_inputs`,
    what failed symbolically (root or submodules) is traced again with concrete shapes.
    `pattern`: the call the graph is for (by default the example inputs', else the
    forward's required arguments alone).
    """
    forward = (forward_class or type(root)).forward
    bound = bindings(forward, pattern or CallPattern.for_call(forward, example_inputs))
    try:
        first = _trace(root, forward_class, None, frozenset(), bound)
    except TracingError:
        raise
    except Exception:
        if example_inputs is None:
            raise
        return _trace(root, forward_class, example_inputs, frozenset({""}), bound)
    retry = _retried(first)
    if example_inputs is None or not retry:
        return first
    second = _trace(root, forward_class, example_inputs, retry, bound)
    return second if len(second.leaf_failures) < len(first.leaf_failures) else first


def _retried(first: TraceResult) -> frozenset[str]:
    """The leaves of a trace without example inputs that a trace with them does again, with concrete shapes."""
    return frozenset(path for path, why in first.leaf_failures.items() if not why.startswith(_CHANGES_STATE))


# Marks the error of a symbolic trace that failed after reading a shape.
_SHAPE_FAILURE = "_fxfuse_after_shape_read"


def needs_shapes(traced: Union[TraceResult, BaseException]) -> list[str]:
    """What of a trace without example inputs (its result, or the error it raised) may trace as part of the
    graph with concrete shapes, as `trace` does with example inputs: the root ("") where its own forward
    failed, else the submodules it kept as leaves, in both cases after reading a shape, a length or a proxy's
    items (`int(x.shape[-1])`, `if x.size(1) != c:`, `list(x.chunk(2, 1))`): not a branch on a tensor's
    values, which concrete shapes do not trace either. Empty where example inputs would change nothing."""
    if isinstance(traced, BaseException):
        return [""] if getattr(traced, _SHAPE_FAILURE, False) else []
    return list(traced.shape_failures)


# Where install keeps an optimized module's graphs and options: in its own __dict__.
OPTIMIZED_STATE = "_fxfuse_state"


@contextlib.contextmanager
def copied_plain(root: nn.Module):
    """While `root` is deep-copied (a meta copy to run a traced graph or find shapes on), its optimized
    modules copy as their original classes, without their graphs. An optimized module pickles and
    deep-copies as its original class optimized again, a full optimize per copy, where these copies only
    serve shapes: a graph built at call time (a new call pattern, hooks, a changed config) traced every
    optimized module below the root again."""
    swapped = []
    for m in root.modules():
        if OPTIMIZED_STATE in m.__dict__:
            swapped.append((m, type(m), m.__dict__.pop(OPTIMIZED_STATE)))
            m.__class__ = getattr(type(m), "_fxfuse_original_class", type(m))
    try:
        yield
    finally:
        for m, cls, state in swapped:
            m.__dict__[OPTIMIZED_STATE] = state
            m.__class__ = cls


# How many times a model was traced (each run of the tracer over a root): one `optimize` call
# traces each captured module once per train/eval mode (tests/test_capture.py).
trace_count = 0


def _trace(
    root: nn.Module, forward_class, example_inputs, concrete_paths: frozenset[str], bound: dict[str, Any]
) -> TraceResult:
    global trace_count
    trace_count += 1
    guard = StateGuard(root)
    tracer = FxFuseTracer(guard, example_inputs)
    tracer.concrete_paths = concrete_paths
    tracer.concrete = "" in concrete_paths
    cls = root.__class__
    root.__class__ = forward_class or cls
    guard.begin(root)
    try:
        if example_inputs is not None:
            with copied_plain(root):
                tracer.meta_root = measure.meta_copy(root)
        with user_checkpoint.intercepting(tracer, tracer.user_checkpoints), _functions_as_calls(tracer):
            try:
                graph = tracer.trace(root, concrete_args=bound or None)
            except Exception as exc:
                if tracer.shape_reads and not tracer.concrete:
                    with contextlib.suppress(AttributeError):
                        setattr(exc, _SHAPE_FAILURE, True)
                raise
        _unbind_checks(graph, bound)
    finally:
        root.__class__ = cls
        changed = guard.end()
    if changed:
        raise TracingError(f"{type(root).__name__}: {_ChangesState(changed)}")
    problem = _augmented_problem(graph, tracer.augmented)
    if problem:
        raise TracingError(f"{type(root).__name__}: {problem}")
    return TraceResult(
        graph,
        [""] + tracer.traced_modules,
        dict(tracer.leaf_failures),
        tracer.user_checkpoints,
        tracer.specialized,
        dict(tracer.hooked),
        dict(bound),
        list(tracer.shape_failures),
    )
