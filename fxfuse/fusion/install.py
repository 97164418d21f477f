"""Install: make the user's module run its rewritten graphs, and keep them current.

The optimized model is the user's own module object: its class is swapped for a
generated subclass whose `forward` runs the rewritten graph, and the graph looks
up every parameter, buffer and submodule on the live module at call time. So
state_dict keys, parameter order, optimizers, custom methods and train()/eval()
overrides are untouched.

FX bakes `self.training` reads into the graph, so the optimized forward keys its
compiled graphs on the `training` flags of the modules it traced through and
traces again when they change (e.g. after `.eval()`).

Module hooks: a submodule with hooks is a leaf of the trace and no fused site takes
it, so `Module.__call__` runs its hooks with eager's tensors; the graphs are also
keyed on which submodules have hooks, so hooks registered or removed after `optimize`
take effect at the next call. While global module hooks
(`torch.nn.modules.module.register_module_forward_hook` and the like) are registered,
the forward runs as written, unfused: they fire for every module call. So does the
forward of a module with a non-full (`register_backward_hook`) backward hook, which
sees the gradients of its forward's last op.

The graphs also bake in which module sits at each path and what the Python read while
tracing: a submodule replaced, wrapped or deleted after `optimize` (a LoRA wrapper, another
activation, ultralytics' `fuse()`), or an attribute of a HF-style `config` changed (e.g.
`config.output_hidden_states = True`), drops every graph, which are then built again at the
next call from the model as it is then.

At optimize time, `install` takes the graphs of the model's roots (roots.py), rewritten with
the plan (apply.py), and swaps each root's class. Every graph built later, at call time (the
other train/eval mode, at optimize time too; new hooks, flags or input shapes), is built the
same way from a fresh capture: where the module's own forward cannot be traced then, it runs
as written and the roots within it (its submodules) are optimized instead, so no torch.fx
error reaches the user. A model whose capture needs its inputs' shapes and got none is
`defer`red to its first call.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.nn.modules import module as _nn_module
from torch.utils.module_tracker import ModuleTracker

from .. import measure
from ..ops import rebuild
from ..ops.higher_order import transformed
from . import graphs, layout, parametrized, roots, tracing
from .apply import Applied, apply, apply_roots
from .capture import Capture, call_pattern, capture
from .plan import Findings, Options
from .report import FusionReport, skipped_site
from .roots import Root
from .tracing import CallPattern

_STATE = tracing.OPTIMIZED_STATE


@dataclass
class _State:
    """What an optimized module carries (in its __dict__, outside the module tree)."""

    options: Options
    key_modules: list[nn.Module]
    key_flags: list[tuple[nn.Module, str]] = field(default_factory=list)  # checkpointing switches of traced modules
    graphs: dict[tuple, Callable] = field(default_factory=dict)
    found: dict[tuple, Findings] = field(default_factory=dict)  # what the passes found on each graph
    fx_graphs: dict[tuple, object] = field(default_factory=dict)  # the rewritten graphs (region costing reads them)
    last_key: tuple = ()
    last_pattern: Optional[CallPattern] = None  # the call pattern of the last graph built
    # Shape-dependent Python was traced with the example inputs' shapes (tracing.py): graphs are then
    # keyed on the inputs' shapes too, and `example` (meta tensors) rebuilds them after pickling.
    specialized: bool = False
    example: Optional[tuple] = None
    # The module tree the graphs were built from (_tree, the root first): which of its submodules have
    # hooks is in the key. `children`: each one's `_modules` then (the graphs call those submodules).
    tree: list[nn.Module] = field(default_factory=list)
    children: list[dict] = field(default_factory=list)
    configs: list[tuple[Any, dict]] = field(default_factory=list)  # each `config` object and its attributes then
    # Optimized at its first call (`defer`): deferred(module, inputs) optimizes it with that call's inputs.
    deferred: Optional[Callable[[nn.Module, Optional[tuple]], None]] = None


# The switches timm (`set_grad_checkpointing`) and HF transformers (`gradient_checkpointing_enable`) read in
# forward to call torch.utils.checkpoint: like `training`, tracing bakes them into the graph.
_CHECKPOINT_FLAGS = ("grad_checkpointing", "gradient_checkpointing")


def _key(
    state: _State,
    args: Sequence[Any] = (),
    kwargs: Optional[dict] = None,
    pattern: Optional[CallPattern] = None,
    hooked: Optional[tuple[int, ...]] = None,
) -> tuple:
    """The key of the graph a call `(*args, **kwargs)` runs: the training flags and checkpointing switches
    it baked in, which modules have hooks (`_hooked`, given as `hooked` where it is known), the call's pattern
    (tracing.CallPattern: given as `pattern` where it is known) and, for a shape-specialized graph, its
    inputs' shapes."""
    pattern = pattern if pattern is not None else CallPattern.of(args, kwargs)
    flags = tuple([m.training for m in state.key_modules] + [getattr(m, a) for m, a in state.key_flags])
    key = (flags, _hooked(state.tree) if hooked is None else hooked, pattern)
    if state.specialized:
        leaves = torch.utils._pytree.tree_leaves((tuple(args), kwargs or {}))
        key += (tuple(tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor)),)
    return key


def _tree(root: nn.Module) -> list[nn.Module]:
    """Every module below `root` (itself first), in a fixed order: what a graph's `get_submodule` lookups
    and traced-through forwards were built from. A walk of `_modules` (ResNet-50: ~160 us), not
    `named_modules`, which builds every path's name."""
    out, stack = [], [root]
    while stack:
        module = stack.pop()
        out.append(module)
        stack.extend(child for child in module._modules.values() if child is not None)
    return out


def _configs(tree: list[nn.Module]) -> list[tuple[Any, dict]]:
    """The distinct `config` objects of the tree's modules (HF transformers' PretrainedConfig and the like),
    each with a copy of its attributes: forward reads flags such as `output_hidden_states` from them, and
    tracing bakes what it read into the graph."""
    found: dict[int, tuple[Any, dict]] = {}
    for module in tree:
        config = module.__dict__.get("config")
        if config is None or id(config) in found or isinstance(config, (nn.Module, torch.Tensor)):
            continue
        try:
            found[id(config)] = (config, copy.deepcopy(vars(config)))
        except Exception:  # noqa: BLE001 - no __dict__, or one that does not copy: not watched
            continue
    return list(found.values())


def _snapshot(state: _State, tree: list[nn.Module]) -> None:
    """Record `tree` (a `_tree`) and its configs as what the graphs are built from."""
    state.tree = tree
    state.children = [dict(module._modules) for module in tree]
    state.configs = _configs(tree)


def _drop_stale_graphs(root: nn.Module, state: _State) -> tuple[int, ...]:
    """Drop every graph when the module tree or a config changed since they were built (their next call
    builds them again from the model as it is then); return `_hooked` of the tree as it is now.

    Every call asks, so it is one pass over the snapshot, reading each module's `__dict__` (MobileNetV2:
    ~40 us): the tree is unchanged while each of its modules has the children it had."""
    hooked = []
    position = 0
    for module, children in zip(state.tree, state.children):
        table = module.__dict__
        if table["_modules"] != children:
            break
        if position and (
            table["_forward_pre_hooks"]
            or table["_forward_hooks"]
            or table["_backward_hooks"]
            or table["_backward_pre_hooks"]
        ):
            hooked.append(position)
        position += 1
    else:
        if not any(vars(config) != attributes for config, attributes in state.configs):
            return tuple(hooked)
    for table in (state.graphs, state.fx_graphs, state.found):
        table.clear()
    _snapshot(state, _tree(root))
    return _hooked(state.tree)


def _new_state(module: nn.Module, options: Options) -> _State:
    state = _State(options, key_modules=[])
    _snapshot(state, _tree(module))
    return state


def _hooked(tree: list[nn.Module]) -> tuple[int, ...]:
    """The positions in `tree` of the submodules with hooks (the root's own hooks fire around the graph)."""
    return tuple(
        [
            i
            for i, m in enumerate(tree)
            if i and (m._forward_pre_hooks or m._forward_hooks or m._backward_hooks or m._backward_pre_hooks)
        ]
    )


def _global_hooks() -> bool:
    """Whether global module hooks that fire on every module call are registered (other than the
    bookkeeping of torch's own ModuleTracker, which FlopCounterMode uses: it only records which module
    runs, and a fused site then counts under the module that called it)."""
    hooks = (
        *_nn_module._global_forward_pre_hooks.values(),
        *_nn_module._global_forward_hooks.values(),
        *_nn_module._global_backward_pre_hooks.values(),
        *_nn_module._global_backward_hooks.values(),
    )
    return any(not isinstance(getattr(h, "__self__", None), ModuleTracker) for h in hooks)


_warned_global_hooks = False


def _warn_global_hooks(module: nn.Module) -> None:
    global _warned_global_hooks
    if not _warned_global_hooks:
        _warned_global_hooks = True
        warnings.warn(
            f"fxfuse: global module hooks are registered, so the optimized {type(module).__name__} runs its "
            "forward as written (unfused) while they are, and every module call fires them as in eager",
            stacklevel=2,
        )


def _original_forward(self, *args, **kwargs):
    return type(self)._fxfuse_original_class.forward(self, *args, **kwargs)


def _fused_forward(self, *args, **kwargs):
    state: _State = self.__dict__[_STATE]
    if _global_hooks():
        _warn_global_hooks(self)
        return _original_forward(self, *args, **kwargs)
    if self._backward_hooks and not self._is_full_backward_hook:
        # A non-full backward hook sees the inputs of the grad_fn of the forward's last op: eager's ops.
        return _original_forward(self, *args, **kwargs)
    if state.options.channels_last:
        args = layout.to_channels_last(args)
    if transformed():  # torch.func / forward AD: the fused ops and regions have no rule for them
        return _original_forward(self, *args, **kwargs)
    if state.deferred is not None:
        _optimize_now(self, state, args, kwargs)
        return type(self).forward(self, *args, **kwargs)  # optimized now (or, where that failed, as written)
    hooked = _drop_stale_graphs(self, state)
    pattern = CallPattern.of(args, kwargs)
    key = _key(state, args, kwargs, pattern, hooked)
    fn = state.graphs.get(key)
    if fn is None:
        if torch.compiler.is_compiling():
            # Building a graph traces the model with torch.fx, which dynamo cannot trace: build it eagerly.
            torch._dynamo.graph_break(
                f"fxfuse: the optimized {type(self).__name__} needs a new graph (training flags, hooks, "
                "submodules or a config changed since the last one was built), which it builds outside the "
                "compiled region; under fullgraph=True, make the change before the first compiled call, or "
                "call the model once eagerly after it"
            )
        example = None
        if state.specialized:  # shapes were read in forward: trace with this call's
            forward = type(self)._fxfuse_original_class.forward
            example = tracing.in_signature_order(forward, args, kwargs) if kwargs else args
        fn = _build_or_fall_back(self, state, example, pattern=pattern)
        # A keyword call's example lists its tensors in signature order, the call in its own: one graph, both keys.
        for table in (state.graphs, state.fx_graphs, state.found):
            if state.last_key in table:
                table[key] = table[state.last_key]
        state.last_key = key
        _note_call_time_build(self, state)
    if state.options.plan.rebuild:
        with rebuild.Scope():
            return fn(self, *args, **kwargs)
    return fn(self, *args, **kwargs)


def _optimize_now(module: nn.Module, state: _State, args: tuple, kwargs: dict) -> None:
    """The first call of a module `defer`red: optimize it with this call's inputs as example inputs."""
    if torch.compiler.is_compiling():
        torch._dynamo.graph_break(
            f"fxfuse: the optimized {type(module).__name__} is captured at its first call (optimize had no "
            "example inputs), which it does outside the compiled region; give optimize example inputs, or "
            "call the model once eagerly before compiling it"
        )
    forward = type(module)._fxfuse_original_class.forward
    state.deferred(module, tracing.in_signature_order(forward, args, kwargs) if kwargs else tuple(args))


def defer(module: nn.Module, options: Options, at_first_call: Callable[[nn.Module, Optional[tuple]], None]) -> None:
    """Swap `module`'s class now and optimize it at its first call: `at_first_call(module, inputs)`, with that
    call's arguments in signature order (None where they have no such order), replaces this state."""
    state = _new_state(module, options)
    state.deferred = at_first_call
    module.__dict__[_STATE] = state
    module.__class__ = _fused_class(type(module))


def _note_call_time_build(module: nn.Module, state: _State) -> None:
    """Add to the report `optimize` attached what a graph built at call time (hooks or training
    flags changed since) left unfused or kept as a module call, and why."""
    report: Optional[FusionReport] = module.__dict__.get("fxfuse_report")
    later = state.found.get(state.last_key)
    if report is None or later is None:
        return
    lines = list(later.notes)
    skipped = [skipped_site(s) for s in later.skipped]
    lines += [f"{s.name} ({s.pattern}) not fused: {s.reason}" for s in skipped if s not in report.skipped]
    for line in lines:
        line = f"graph built at a later call: {line}"
        if line not in report.notes:
            report.notes.append(line)


def _as_original(module: nn.Module, leave_out: tuple[str, ...] = ()) -> nn.Module:
    """A module of `module`'s original class sharing its attributes, fxfuse's state and `leave_out` left out."""
    original = type(module)._fxfuse_original_class
    plain = original.__new__(original)
    plain.__dict__.update({k: v for k, v in module.__dict__.items() if k != _STATE and k not in leave_out})
    return plain


def _reduce_ex(self, protocol):
    # Generated classes and compiled graphs do not pickle: pickle (and deepcopy) the
    # module as its original class, and optimize it again when it is loaded.
    plain = _as_original(self)
    state: _State = self.__dict__[_STATE]
    if state.deferred is not None:
        return _deferred_again, (plain, state.options, state.deferred)
    return _rebuild, (plain, state.options, state.example)


def _prepare_scriptable(self) -> nn.Module:
    # torch.jit.script cannot compile the generated forward (*args, **kwargs, fx graphs): it scripts the
    # module as its original class instead, sharing its parameters, buffers and submodules. The submodule
    # table is a copy, since torch.jit puts each submodule's own prepared form into it.
    plain = _as_original(self, leave_out=("fxfuse_report",))
    warnings.warn(
        f"fxfuse: torch.jit.script compiles {type(plain).__name__}'s own forward, unfused; torch.export and "
        "torch.compile keep fxfuse's fused ops",
        stacklevel=2,
    )
    plain.__dict__["_modules"] = dict(self._modules)
    return plain


def _deferred_again(plain: nn.Module, options: Options, at_first_call) -> nn.Module:
    defer(plain, options, at_first_call)
    return plain


def _rebuild(plain: nn.Module, options: Options, example: Optional[tuple] = None) -> nn.Module:
    _install(plain, options, example)
    return plain


_rebuild.__module__ = "fxfuse.fusion"  # what pickles name: fxfuse.fusion re-exports it

_CLASSES: dict[type, type] = {}


def _fused_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(
            cls.__name__,
            (cls,),
            {
                "forward": _fused_forward,
                "__reduce_ex__": _reduce_ex,
                "__prepare_scriptable__": _prepare_scriptable,
                "_fxfuse_original_class": cls,
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
            },
        )
    return _CLASSES[cls]


def is_optimized(module: nn.Module) -> bool:
    return _STATE in module.__dict__


def any_optimized(model: nn.Module) -> bool:
    """Whether `model` or a module in it is optimized."""
    return any(_STATE in m.__dict__ for m in model.modules())


def uninstall(module: nn.Module) -> None:
    for m in module.modules():
        if is_optimized(m):
            del m.__dict__[_STATE]
            m.__class__ = type(m)._fxfuse_original_class
    module.__dict__.pop("fxfuse_report", None)


def _take(
    root: nn.Module,
    state: _State,
    captured: Capture,
    graph: fx.Graph,
    found: Findings,
    example_inputs: Optional[Sequence[Any]],
    pattern: Optional[CallPattern] = None,
) -> Callable:
    """Cache `graph` (rewritten from `captured`, a capture of `root` for its current training flags and a
    call `pattern`, by default the capture's) as what `root` runs for that key, compiled; what it baked in
    joins the key."""
    pattern = pattern if pattern is not None else captured.pattern
    pattern = call_pattern(root, example_inputs, pattern) if pattern is None else pattern
    traced = captured.traced
    if traced.specialized:
        state.specialized = True
        state.example = measure.to_meta(example_inputs)
    modules = dict(root.named_modules())
    for traced_path in traced.traced_modules:
        if all(modules[traced_path] is not m for m in state.key_modules):
            state.key_modules.append(modules[traced_path])
            state.key_flags.extend(
                (modules[traced_path], a) for a in _CHECKPOINT_FLAGS if hasattr(modules[traced_path], a)
            )
            state.graphs.clear()
    key = _key(state, example_inputs or (), pattern=pattern)
    state.fx_graphs[key] = graph
    fn = graphs.compile_graph(graph, owner=root)
    state.last_key = key
    state.last_pattern = pattern
    state.graphs[key] = fn
    state.found[key] = found
    return fn


def _build(
    root: nn.Module, state: _State, example_inputs: Optional[Sequence[Any]], pattern: Optional[CallPattern] = None
) -> tuple[Callable, Capture]:
    """Capture `root` for its current training flags and a call `pattern` now, rewrite it with the state's
    plan and cache it (`_take`)."""
    pattern = call_pattern(root, example_inputs) if pattern is None else pattern
    with parametrized.kept(root):
        captured = capture(root, example_inputs, pattern)
        graph, found = apply(root, captured, state.options)
    return _take(root, state, captured, graph, found, example_inputs, pattern), captured


def _build_or_fall_back(
    root: nn.Module,
    state: _State,
    example_inputs: Optional[Sequence[Any]],
    pattern: Optional[CallPattern] = None,
) -> Callable:
    """`_build`, with the roots it leaves out optimized on their own (roots.inside: the submodules of leaves
    that could not be traced through, and hooked submodules). Where `root`'s own forward cannot be traced
    with the current training flags and hooks, that key runs the forward as written, with its submodules
    optimized instead (roots.children), so nothing torch.fx raises reaches the caller."""
    pattern = call_pattern(root, example_inputs, pattern)
    try:
        fn, captured = _build(root, state, example_inputs, pattern)
    except Exception as exc:  # noqa: BLE001 - tracing failures of arbitrary user code
        found = Findings()
        found.notes.append(
            f"{type(root).__name__}: forward is not traceable ({type(exc).__name__}: {tracing.first_line(exc)}); "
            "it runs as written, with its submodules optimized instead"
        )
        _install_now(roots.children(root, "", skip=is_optimized), state.options, found)
        key = _key(state, example_inputs or (), pattern=pattern)
        state.last_key = key
        state.last_pattern = pattern
        state.graphs[key] = _original_forward
        state.found[key] = found
        return _original_forward
    _install_now(roots.inside(root, "", captured.traced, skip=is_optimized), state.options, state.found[state.last_key])
    return fn


def _install_now(tree: list[Root], options: Options, found: Findings) -> None:
    """Capture, rewrite and install the roots of `tree` (below a module whose graph is built at call time), and
    add what their passes found to `found`."""
    applied = apply_roots(tree, options, installed=True)
    applied.findings(tree, install(tree, applied, options), found)


def _build_other_mode(
    root: nn.Module, state: _State, example_inputs: Optional[Sequence[Any]] = None
) -> Optional[tuple[str, Findings]]:
    """Also build the graph for the opposite train/eval mode of every traced module.

    So that switching between train() and eval() finds a compiled graph (and
    torch.compile never has to trace fxfuse's own tracing). Returns that mode's
    name and what its passes found.
    """
    flags = [m.training for m in state.key_modules]
    if len(set(flags)) != 1:
        return None
    pattern = state.last_pattern
    try:
        for m in state.key_modules:
            m.training = not flags[0]
        _build_or_fall_back(root, state, example_inputs if state.specialized else None, pattern=pattern)
        return ("eval" if flags[0] else "train"), state.found[state.last_key]
    finally:
        for m, flag in zip(state.key_modules, flags):
            m.training = flag


def _attach(
    module: nn.Module, state: _State, example_inputs: Optional[Sequence[Any]] = None, both_modes: bool = True
) -> Optional[tuple[str, Findings]]:
    """Make `module` run its fused graphs: build the other train/eval mode too (`both_modes`), swap the
    class. Returns the other mode's name and findings."""
    other = _build_other_mode(module, state, example_inputs) if both_modes else None
    module.__dict__[_STATE] = state
    module.__class__ = _fused_class(type(module))
    return other


def _install(module: nn.Module, options: Options, example_inputs=None) -> _State:
    state = _new_state(module, options)
    _build_or_fall_back(module, state, example_inputs)
    _attach(module, state, example_inputs)
    return state


def install(
    tree: Sequence[Root],
    applied: Applied,
    options: Options,
    example_inputs: Optional[Sequence[Any]] = None,
    both_modes: bool = True,
) -> dict[str, tuple[str, Findings]]:
    """Make every root of `tree` with a graph in `applied` run it (the model's own root, at path "", keyed
    with `example_inputs`), each root after the roots within it, each with its other train/eval mode's graph
    too (`both_modes`; not for the policy's meta-device trials, which run one forward). Returns, by root
    path, the other mode's name and what its passes found."""
    later: dict[str, tuple[str, Findings]] = {}
    for root in tree:
        if root.repeat:
            continue
        if root.path not in applied.graphs:  # its forward does not trace: the roots within it are its children
            later.update(install(root.inside, applied, options, None, both_modes))
            continue
        inputs = example_inputs if not root.path else None
        state = _new_state(root.module, options.scoped(root.path) if root.path else options)
        _take(root.module, state, root.capture, applied.graphs[root.path], applied.found[root.path], inputs)
        later.update(install(root.inside, applied, options, None, both_modes))
        other = _attach(root.module, state, inputs, both_modes)
        if other is not None:
            later[root.path] = other
    return later


def graph_for(module: nn.Module, *args, **kwargs) -> Optional[object]:
    """The rewritten graph an optimized `module` runs for a call `module(*args, **kwargs)` with its
    current training flags and hooks (None: none built yet)."""
    state: _State = module.__dict__[_STATE]
    return state.fx_graphs.get(_key(state, args, kwargs))


def fx_graph(module: nn.Module) -> Optional[object]:
    """The rewritten graph an optimized `module` runs now (None: not optimized as one graph)."""
    if not is_optimized(module):
        return None
    state: _State = module.__dict__[_STATE]
    return state.fx_graphs.get(state.last_key)
