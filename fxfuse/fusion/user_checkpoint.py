"""The model's own activation checkpointing, kept through `fxfuse.optimize`.

A forward that calls `torch.utils.checkpoint.checkpoint` (directly, through a partial
such as HF transformers' `_gradient_checkpointing_func`, through `checkpoint_sequential`
or timm's `checkpoint_seq`) reaches `torch.utils.checkpoint._checkpoint_impl` (torch >= 2.14), and
on every torch `CheckpointFunction.apply` or the non-reentrant generator. While fxfuse
traces, those are replaced (`intercepting`): the checkpointed function is
traced inline between two marker nodes, and its nodes are tagged with the region's
index (`KEY`). The fusing passes then run over the whole graph, refusing any site whose
nodes lie in different regions (`one_region`), so every fused op stays on its side of
the boundary. `extract` finally compiles each region's nodes into a function of its
own and puts a `CheckpointCall` node in their place, which runs that function under
`torch.utils.checkpoint.checkpoint` with the user's own arguments (`use_reentrant`,
`preserve_rng_state`, `context_fn`, `determinism_check`, `debug`, `early_stop`, ...).

So the region keeps what eager's keeps, and its recompute runs the region's forward a
second time exactly as eager's does: BatchNorm's running statistics and
`num_batches_tracked` advance twice per step, as in eager. The tensors the user passed
are passed as the checkpoint's arguments in the same order (reentrant checkpointing
detaches exactly those); tensors the function reads otherwise (a closure, keyword
arguments) go in one tuple, which reentrant checkpointing keeps as a constant, as it
keeps eager's closure. Nested checkpoints nest the same way.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from .graphs import compile_graph, provenance, subgraph

KEY = "fxfuse_user_checkpoint"  # node.meta: index of the innermost user checkpoint region the node was traced in
WINS = (
    "it holds the model's own torch.utils.checkpoint region: the model's checkpoint wins, and fxfuse does not "
    "recompute around it"
)
CROSSES = "it crosses the boundary of the model's own torch.utils.checkpoint region, which is kept as it is"


@dataclass
class Spec:
    """One checkpoint call met while tracing."""

    index: int
    what: str  # the module the checkpointed function runs, for the report ("": not a module)
    options: dict[str, Any] = field(default_factory=dict)  # the keyword options given to checkpoint
    function: str = ""  # the checkpointed function's name


def begin(index: int, *args: Any) -> None:
    """Marker (removed by `extract`): a region starts; its args are the user's tensor arguments."""


def end(index: int) -> None:
    """Marker (removed by `extract`): a region ends."""


def _check_like_eager(kwargs: dict, options: dict) -> None:
    """The ValueErrors torch.utils.checkpoint raises for these arguments, raised while tracing too
    (the calling module then stays a leaf, so eager raises them at run time)."""
    reentrant = options.get("use_reentrant")
    reentrant = True if reentrant is None else reentrant
    if kwargs and reentrant:
        raise ValueError("Unexpected keyword arguments: " + ",".join(kwargs))
    if reentrant and (
        options.get("context_fn", torch_checkpoint.noop_context_fn) is not torch_checkpoint.noop_context_fn
        or options.get("debug", False) is not False
        or options.get("respect_saved_tensors_hooks") is not None
    ):
        raise ValueError(
            "Passing `context_fn`, `debug`, or `respect_saved_tensors_hooks` "
            "is only supported when use_reentrant=False."
        )


# Where checkpoint calls are intercepted: "impl" patches `_checkpoint_impl`, which every entry point of
# torch >= 2.14 reaches; "parts" patches what both kinds of checkpoint reach on every torch since 2.4
# (`CheckpointFunction.apply`, and the non-reentrant generator). None: "impl" where this torch has it.
ROUTE: str | None = None


_GENERATORS = ("_checkpoint_without_reentrant_generator_impl", "_checkpoint_without_reentrant_generator")


@contextlib.contextmanager
def intercepting(tracer: fx.Tracer, specs: list[Spec]):
    """While tracing with `tracer`, checkpoint calls trace their function inline as a marked region.
    On a torch with none of the functions this patches, tracing stops with the reason: traced
    through unmarked, a checkpoint would vanish from the model (its BatchNorms would then update
    their statistics once a step where eager's recompute updates them twice)."""
    route = ROUTE or ("impl" if hasattr(torch_checkpoint, "_checkpoint_impl") else "parts")
    if route == "parts" and not (
        hasattr(torch_checkpoint, "CheckpointFunction") and any(hasattr(torch_checkpoint, n) for n in _GENERATORS)
    ):
        raise RuntimeError(
            f"fxfuse cannot keep torch.utils.checkpoint regions on torch {torch.__version__}: it has none of "
            f"_checkpoint_impl, CheckpointFunction or {' / '.join(_GENERATORS)}. fxfuse is tested on torch 2.11 "
            "and 2.14; use one of those, or report the torch version"
        )
    # The patches are process-wide: one trace at a time patches and restores (optimize in several
    # threads), and checkpoint calls from other threads meanwhile go to torch's own functions.
    with _LOCK, _impl_route(tracer, specs) if route == "impl" else _parts_route(tracer, specs):
        yield


_LOCK = threading.RLock()


def _ours(tracer: fx.Tracer, owner: int) -> bool:
    """Whether a checkpoint call reaching a patched function belongs to this trace."""
    return threading.get_ident() == owner and not getattr(tracer, "computing_meta", False)


def _trace_region(tracer: fx.Tracer, specs: list[Spec], function, args, kwargs, options: dict):
    spec, start = _open_region(tracer, specs, function, args, options)
    out = function(*args, **kwargs)
    _close_region(tracer, spec, start)
    return out


def _open_region(tracer: fx.Tracer, specs: list[Spec], function, args, options: dict) -> tuple[Spec, fx.Node]:
    spec = Spec(len(specs), _describe(tracer, function), dict(options), _name_of(function))
    specs.append(spec)
    user_args = tuple(a.node for a in args if isinstance(a, fx.Proxy))
    return spec, tracer.graph.call_function(begin, (spec.index, *user_args))


def _close_region(tracer: fx.Tracer, spec: Spec, start: fx.Node) -> None:
    stop = tracer.graph.call_function(end, (spec.index,))
    node = start.next
    while node is not stop:
        node.meta.setdefault(KEY, spec.index)  # inner regions ended first: the innermost index wins
        node = node.next


@contextlib.contextmanager
def _impl_route(tracer: fx.Tracer, specs: list[Spec]):
    original = torch_checkpoint._checkpoint_impl
    owner = threading.get_ident()

    def traced(function, args, kwargs, **options):
        if not _ours(tracer, owner):  # another thread, or a module run on meta tensors for metadata only
            return original(function, args, kwargs, **options)
        _check_like_eager(kwargs, options)
        return _trace_region(tracer, specs, function, args, kwargs, options)

    torch_checkpoint._checkpoint_impl = traced
    try:
        yield
    finally:
        torch_checkpoint._checkpoint_impl = original


@contextlib.contextmanager
def _parts_route(tracer: fx.Tracer, specs: list[Spec]):
    """torch.utils.checkpoint.checkpoint has checked its arguments by the time it reaches these."""
    function_class = torch_checkpoint.CheckpointFunction
    own_apply = function_class.__dict__.get("apply")
    original_apply = function_class.apply
    name = next(n for n in _GENERATORS if hasattr(torch_checkpoint, n))
    original_generator = getattr(torch_checkpoint, name)
    signature = inspect.signature(original_generator)
    owner = threading.get_ident()

    def traced_apply(function, preserve_rng_state, *args):
        if not _ours(tracer, owner):
            return original_apply(function, preserve_rng_state, *args)
        options = {"use_reentrant": True, "preserve_rng_state": preserve_rng_state}
        return _trace_region(tracer, specs, function, args, {}, options)

    def traced_generator(*args, **kwargs):
        # checkpoint runs the function itself between the generator's two steps
        if not _ours(tracer, owner):
            yield from original_generator(*args, **kwargs)
            return
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        first, function = next(iter(given.items()))
        # every option this torch's generator takes, so one fxfuse does not know is passed on too
        options = {"use_reentrant": False, **{k: v for k, v in given.items() if k not in (first, "args", "kwargs")}}
        spec, start = _open_region(tracer, specs, function, given["args"], options)
        yield
        _close_region(tracer, spec, start)

    traced_generator.__signature__ = signature  # a nested trace binds torch's signature, not (*args, **kwargs)
    function_class.apply = traced_apply
    setattr(torch_checkpoint, name, traced_generator)
    try:
        yield
    finally:
        setattr(torch_checkpoint, name, original_generator)
        if own_apply is None:
            del function_class.apply
        else:
            function_class.apply = own_apply


def _describe(tracer: fx.Tracer, function: Any) -> str:
    """The module a checkpointed function runs (a module, its bound method, a partial of its class's method),
    else "" (extract then names the region by the modules it calls)."""
    owner = function
    while isinstance(owner, functools.partial):
        owner = owner.args[0] if owner.args and isinstance(owner.args[0], nn.Module) else owner.func
    owner = getattr(owner, "__self__", owner)
    if not isinstance(owner, nn.Module):
        return ""
    try:
        return tracer.path_of_module(owner) or "<root>"
    except NameError:  # a module that is not part of the model
        return type(owner).__name__


def one_region(nodes: Iterable[fx.Node]) -> bool:
    """Whether `nodes` were all traced in the same user checkpoint region (or all outside every one)."""
    return len({n.meta.get(KEY) for n in nodes}) <= 1


class CheckpointCall:
    """`self(components, captured, *args)`: a region's outputs, computed under the user's checkpoint.

    `fn(owner, *args, *captured)` is the region's compiled graph; `components` are the
    live objects named by the first part of every attribute path it reads, looked up
    by the caller's graph at call time. A graph node's target, so it has a `__name__`.
    """

    def __init__(self, name: str, fn: Callable, component_names: tuple[str, ...], options: dict[str, Any]) -> None:
        self.name = name
        self.fn = fn
        self.component_names = component_names
        self.options = options
        self.__name__ = "user_checkpoint"
        self.__qualname__ = "user_checkpoint"
        self.__module__ = __name__

    def _body(self, owner: types.SimpleNamespace, captured: tuple, *args: Any) -> Any:
        return self.fn(owner, *args, *captured)

    def __call__(self, components: tuple, captured: tuple, *args: Any) -> Any:
        owner = types.SimpleNamespace(**dict(zip(self.component_names, components)))
        return torch_checkpoint.checkpoint(self._body, owner, captured, *args, **self.options)

    @property
    def reentrant(self) -> bool:
        return self.options.get("use_reentrant") is not False

    def __repr__(self) -> str:
        return f"CheckpointCall({self.name})"


def extract(graph: fx.Graph, specs: list[Spec], site_key: str, optimized_on_their_own: Iterable[str] = ()) -> list[str]:
    """Replace every marked region (innermost first) by a CheckpointCall node; returns report notes.

    `site_key`: the node.meta key of the fused sites, to count those inside each region.
    `optimized_on_their_own`: the paths of the graph's module calls whose forward (or children) fxfuse
    optimizes on its own (hooked modules, modules it could not trace through): they may hold fused calls too.
    """
    optimized_on_their_own = set(optimized_on_their_own)
    notes = []
    starts: dict[int, fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is begin:
            starts[node.args[0]] = node
        elif node.target is end:
            spec = specs[node.args[0]]
            start = starts.pop(spec.index)
            members = []
            cursor = start.next
            while cursor is not node:
                if cursor.op != "get_attr":
                    members.append(cursor)
                cursor = cursor.next
            fused = sum(1 for n in members if site_key in n.meta or _is_fxfuse_call(n))
            own = [n.target for n in members if n.op == "call_module" and n.target in optimized_on_their_own]
            user_args = list(start.args[1:])
            graph.erase_node(node)
            graph.erase_node(start)
            if not members:
                continue
            name = f"checkpoint({spec.what or _span(members) or spec.function})"
            call = _extract_one(graph, name, members, user_args, spec)
            kind = "reentrant" if call.reentrant else "non-reentrant"
            notes.append(
                f"{name}: the model's own torch.utils.checkpoint ({kind}) kept as a checkpoint region, "
                f"{fused} fused call(s) inside"
            )
            if (fused or own) and not call.reentrant and spec.options.get("early_stop", True):
                # fxfuse's BatchNorm ops update running statistics after saving their tensors: an early stop
                # right after the last save would skip that update, which eager's recompute makes. A module
                # call optimized on its own (own) may hold such ops too.
                call.options["early_stop"] = False
                where = f" (also those inside {', '.join(own)}, optimized on its own)" if own else ""
                notes.append(
                    f"{name}: its recompute runs to the region's end (early_stop=False), so that fxfuse's fused "
                    f"BatchNorm calls{where} update running statistics again as eager's do; an op after the "
                    "region's last saved tensor that changes state without saving one would run twice where "
                    "eager's early stop runs it once, and forward hooks there fire again"
                )
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    if notes:
        notes.append(
            "the model's own checkpoint regions win over fxfuse's recompute regions (memory_budget, peak_budget): "
            "fxfuse never recomputes a region that holds one"
        )
    return notes


def _name_of(function: Any) -> str:
    while isinstance(function, functools.partial):
        function = function.func
    return getattr(function, "__qualname__", type(function).__name__)


def _span(members: list[fx.Node]) -> str:
    """`first…last` of the outermost modules a region's nodes were traced in."""
    paths = []
    for node in members:
        stack = [path for path, _ in node.meta.get("nn_module_stack", {}).values()]
        outer = stack[0] if stack else str(node.target) if node.op == "call_module" else None
        if outer is not None and outer not in paths:
            paths.append(outer)
    if not paths:
        return ""
    return paths[0] if len(paths) == 1 else f"{paths[0]}…{paths[-1]}"


def _is_fxfuse_call(node: fx.Node) -> bool:
    return node.op == "call_function" and str(getattr(node.target, "__module__", "")).startswith("fxfuse.")


def _extract_one(graph, name, members, user_args, spec) -> CheckpointCall:
    inside = set(members)
    captured: dict[fx.Node, None] = {}
    for node in members:
        for arg in node.all_input_nodes:
            if arg not in inside and arg.op != "get_attr" and arg not in user_args:
                captured[arg] = None
    outputs = [n for n in members if any(u not in inside for u in n.users)]
    sub, components = subgraph(members, [*user_args, *captured], outputs)
    call = CheckpointCall(name, compile_graph(sub), components, dict(spec.options))
    with graph.inserting_before(members[-1].next):
        parts = tuple(graph.get_attr(c) for c in components)
        new = graph.call_function(call, (parts, tuple(captured), *user_args))
        results = [new]
        if len(outputs) > 1:
            results = [graph.call_function(operator.getitem, (new, i)) for i in range(len(outputs))]
    for output, result in zip(outputs, results):
        result.meta.update(provenance(output))
        output.replace_all_uses_with(result, delete_user_cb=lambda user: user not in inside)
    for node in reversed(members):
        graph.erase_node(node)
    return call
