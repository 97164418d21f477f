"""fxfuse.optimize / fxfuse.explain: trace, find patterns, rewrite, install.

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

Where a module's own forward cannot be traced (with some training flags or hooks),
it runs as written and its submodules are optimized instead, at optimize time and
at call time alike: no torch.fx error reaches the user.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.nn.modules import module as _nn_module
from torch.utils.module_tracker import ModuleTracker

from .. import _extension, measure
from ..errors import ConfigurationError, TracingError
from ..ops.higher_order import transformed
from . import example_inputs as _example_inputs
from . import graphs, layout, policy, region_costs, shapes, tracing, user_checkpoint
from .passes import PassContext, regions, run_passes
from .passes.driver import SITE_META
from .report import FusionReport, SkippedSite

_STATE = "_fxfuse_state"

# What users pass as mode=: the passes see "memory" or "fast" (Options.pass_mode).
MODES = ("memory", "fast", "auto")


@dataclass
class Options:
    mode: str = "memory"  # what the user asked for: "memory", "fast" or "auto"
    allowed: Optional[frozenset] = None  # sites a policy selected (None: all)
    memory_budget: Optional[float] = None
    channels_last: bool = False  # the forward converts 4-D floating inputs to channels_last (fusion.layout)
    regions: tuple = ()  # groups of region names (passes/regions.py) the policy chose to recompute
    flat_links: frozenset = frozenset()  # (first, second) links of those groups run as one region

    @property
    def pass_mode(self) -> str:
        """The passes' mode: auto and budgets pick among the sites of mode="memory"."""
        return "fast" if self.mode == "fast" else "memory"

    def scoped(self, path: str) -> Options:
        """These options for the submodule at `path` (site names relative to it)."""
        if self.allowed is None or not path:
            return self
        return Options(
            self.mode,
            frozenset(_scoped_names(self.allowed, path)),
            self.memory_budget,
            self.channels_last,
            tuple(_scoped_names(self.regions, path)),
            frozenset(_scoped_names(self.flat_links, path)),
        )


def _scoped_names(name_tuples, path: str) -> list[tuple[str, ...]]:
    """The tuples of `name_tuples` whose names all lie under `path`, relative to it, in order."""
    inner = (tuple(_unprefix(n, path) for n in names) for names in name_tuples)
    return [names for names in inner if all(n is not None for n in names)]


def _unprefix(name: str, path: str) -> Optional[str]:
    if name.startswith(path + "."):
        return name[len(path) + 1 :]
    if name.startswith(path + ":"):
        return name[len(path) :]
    return None


@dataclass
class _State:
    """What an optimized module carries (in its __dict__, outside the module tree)."""

    options: Options
    key_modules: list[nn.Module]
    key_flags: list[tuple[nn.Module, str]] = field(default_factory=list)  # checkpointing switches of traced modules
    watched: list[nn.Module] = field(default_factory=list)  # every submodule: which of them have hooks is in the key
    graphs: dict[tuple, Callable] = field(default_factory=dict)
    reports: dict[tuple, FusionReport] = field(default_factory=dict)
    fx_graphs: dict[tuple, object] = field(default_factory=dict)  # the rewritten graphs (region costing reads them)
    last_leaf_failures: dict[str, str] = field(default_factory=dict)
    last_hooked: dict[str, str] = field(default_factory=dict)  # hooked leaves of the last trace
    last_key: tuple = ()
    # Shape-dependent Python was traced with the example inputs' shapes (tracing.py): graphs are then
    # keyed on the inputs' shapes too, and `example` (meta tensors) rebuilds them after pickling.
    specialized: bool = False
    example: Optional[tuple] = None


# The switches timm (`set_grad_checkpointing`) and HF transformers (`gradient_checkpointing_enable`) read in
# forward to call torch.utils.checkpoint: like `training`, tracing bakes them into the graph.
_CHECKPOINT_FLAGS = ("grad_checkpointing", "gradient_checkpointing")


def _key(state: _State, args: Sequence[Any] = (), kwargs: Optional[dict] = None) -> tuple:
    flags = tuple(m.training for m in state.key_modules) + tuple(getattr(m, a) for m, a in state.key_flags)
    key = (flags, _hooked(state.watched))
    if state.specialized:
        key += (_input_signature(args, kwargs or {}),)
    return key


def _input_signature(args: Sequence[Any], kwargs: dict) -> tuple:
    """What a shape-specialized graph was traced for: the count of inputs and every tensor's shape."""
    leaves = torch.utils._pytree.tree_leaves((tuple(args), kwargs))
    return (len(args), tuple(sorted(kwargs)), tuple(tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor)))


def _new_state(module: nn.Module, options: Options) -> _State:
    return _State(options, key_modules=[], watched=[m for m in module.modules() if m is not module])


def _hooked(modules: list[nn.Module]) -> tuple[int, ...]:
    return tuple(
        [
            i
            for i, m in enumerate(modules)
            if m._forward_pre_hooks or m._forward_hooks or m._backward_hooks or m._backward_pre_hooks
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
    fn = state.graphs.get(_key(state, args, kwargs))
    if fn is None:
        fn = _build_or_fall_back(self, state, args if state.specialized and not kwargs else None, install=True)
        _note_call_time_build(self, state)
    return fn(self, *args, **kwargs)


def _note_call_time_build(module: nn.Module, state: _State) -> None:
    """Add to the report `optimize` attached what a graph built at call time (hooks or training
    flags changed since) left unfused or kept as a module call, and why."""
    report: Optional[FusionReport] = module.__dict__.get("fxfuse_report")
    later = state.reports.get(state.last_key)
    if report is None or later is None:
        return
    lines = list(later.notes)
    lines += [f"{s.name} ({s.pattern}) not fused: {s.reason}" for s in later.skipped if s not in report.skipped]
    for line in lines:
        line = f"graph built at a later call: {line}"
        if line not in report.notes:
            report.notes.append(line)


def _reduce_ex(self, protocol):
    # Generated classes and compiled graphs do not pickle: pickle (and deepcopy) the
    # module as its original class, and optimize it again when it is loaded.
    plain = type(self)._fxfuse_original_class.__new__(type(self)._fxfuse_original_class)
    plain.__dict__.update({k: v for k, v in self.__dict__.items() if k != _STATE})
    state: _State = self.__dict__[_STATE]
    return _rebuild, (plain, state.options, state.example)


def _rebuild(plain: nn.Module, options: Options, example: Optional[tuple] = None) -> nn.Module:
    _install(plain, options, example)
    return plain


_CLASSES: dict[type, type] = {}


def _fused_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(
            cls.__name__,
            (cls,),
            {
                "forward": _fused_forward,
                "__reduce_ex__": _reduce_ex,
                "_fxfuse_original_class": cls,
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
            },
        )
    return _CLASSES[cls]


def is_optimized(module: nn.Module) -> bool:
    return _STATE in module.__dict__


def _uninstall(module: nn.Module) -> None:
    for m in module.modules():
        if is_optimized(m):
            del m.__dict__[_STATE]
            m.__class__ = type(m)._fxfuse_original_class
    module.__dict__.pop("fxfuse_report", None)


def _build(root: nn.Module, state: _State, example_inputs: Optional[Sequence[Any]]) -> Callable:
    """Trace `root` with its current training flags, rewrite, compile and cache the graph."""
    traced = tracing.trace(
        root, forward_class=getattr(type(root), "_fxfuse_original_class", None), example_inputs=example_inputs
    )
    if traced.specialized:
        state.specialized = True
        state.example = measure.to_meta(example_inputs)
    modules = dict(root.named_modules())
    for path in traced.traced_modules:
        if all(modules[path] is not m for m in state.key_modules):
            state.key_modules.append(modules[path])
            state.key_flags.extend((modules[path], a) for a in _CHECKPOINT_FLAGS if hasattr(modules[path], a))
            state.graphs.clear()
    report = FusionReport(state.options.mode)
    for path, reason in traced.leaf_failures.items():
        report.notes.append(f"{path or type(root).__name__}: not traceable ({reason}); kept as a leaf")
    if traced.specialized:
        shapes_seen = ", ".join(str(tuple(t.shape)) for t in example_inputs if isinstance(t, torch.Tensor))
        report.notes.append(
            f"{type(root).__name__}: its forward computes Python values from tensor shapes, so it was traced "
            f"for inputs of shape {shapes_seen}; an input of another shape traces it again"
        )
    for path, hooks in traced.hooked.items():
        own = "" if _is_library_module(modules[path]) else "; its own forward is optimized on its own"
        report.notes.append(f"{path}: has {hooks}; kept as a module call so that its hooks fire as in eager{own}")
    shape_map = {}
    if example_inputs is not None:
        try:
            shape_map = shapes.propagate(root, traced.graph, example_inputs)
        except Exception as exc:  # noqa: BLE001 - estimates are optional
            report.notes.append(f"could not propagate shapes from the example inputs: {type(exc).__name__}: {exc}")
    ctx = PassContext(
        traced.graph,
        root,
        state.options.pass_mode,
        report,
        shape_map,
        set(state.options.allowed) if state.options.allowed is not None else None,
    )
    run_passes(ctx)
    if traced.user_checkpoints:
        report.notes.extend(user_checkpoint.extract(traced.graph, traced.user_checkpoints, SITE_META))
    if state.options.regions:
        report.notes.extend(regions.apply(traced.graph, root, state.options.regions, state.options.flat_links))
    key = _key(state, example_inputs or ())
    state.fx_graphs[key] = traced.graph
    fn = graphs.compile_graph(traced.graph)
    state.last_key = key
    state.graphs[key] = fn
    state.reports[key] = report
    state.last_leaf_failures = traced.leaf_failures
    state.last_hooked = traced.hooked
    return fn


def _build_or_fall_back(
    root: nn.Module, state: _State, example_inputs: Optional[Sequence[Any]], install: bool
) -> Callable:
    """`_build`, with what it leaves out optimized on its own (`install`): the submodules of leaves
    that could not be traced through, and hooked submodules. Where `root`'s own forward cannot be
    traced with the current training flags and hooks, that key runs the forward as written, with
    its submodules optimized instead, so nothing torch.fx raises reaches the caller."""
    try:
        fn = _build(root, state, example_inputs)
    except Exception as exc:  # noqa: BLE001 - tracing failures of arbitrary user code
        report = FusionReport(state.options.mode)
        report.notes.append(
            f"{type(root).__name__}: forward is not traceable ({type(exc).__name__}: {tracing.first_line(exc)}); "
            "it runs as written, with its submodules optimized instead"
        )
        if install:
            _optimize_children(root, "", state.options, report, install)
        key = _key(state, example_inputs or ())
        state.last_key = key
        state.graphs[key] = _original_forward
        state.reports[key] = report
        return _original_forward
    if install:
        _optimize_inside(root, state, "", state.options, state.reports[state.last_key], install)
    return fn


def _build_other_mode(
    root: nn.Module, state: _State, example_inputs: Optional[Sequence[Any]] = None
) -> Optional[tuple[str, FusionReport]]:
    """Also build the graph for the opposite train/eval mode of every traced module.

    So that switching between train() and eval() finds a compiled graph (and
    torch.compile never has to trace fxfuse's own tracing). Returns that mode's
    name and report.
    """
    flags = [m.training for m in state.key_modules]
    if len(set(flags)) != 1:
        return None
    try:
        for m in state.key_modules:
            m.training = not flags[0]
        _build_or_fall_back(root, state, example_inputs if state.specialized else None, install=True)
        return ("eval" if flags[0] else "train"), state.reports[state.last_key]
    finally:
        for m, flag in zip(state.key_modules, flags):
            m.training = flag


def _attach(
    module: nn.Module, state: _State, example_inputs: Optional[Sequence[Any]] = None
) -> Optional[tuple[str, FusionReport]]:
    """Make `module` run its fused graphs: build the other train/eval mode too, swap the class.
    Returns the other mode's name and report."""
    other = _build_other_mode(module, state, example_inputs)
    module.__dict__[_STATE] = state
    module.__class__ = _fused_class(type(module))
    return other


def _install(module: nn.Module, options: Options, example_inputs=None) -> _State:
    state = _new_state(module, options)
    _build_or_fall_back(module, state, example_inputs, install=True)
    _attach(module, state, example_inputs)
    return state


def _is_library_module(m: nn.Module) -> bool:
    return type(m).__module__.startswith(("torch.nn", "torch.ao.nn")) and not isinstance(
        m, (nn.Sequential, nn.ModuleList, nn.ModuleDict)
    )


def _prefixed(report: FusionReport, prefix: str) -> FusionReport:
    if not prefix:
        return report

    def names(ms):
        return tuple(f"{prefix}.{m}" if m and not m.startswith(":") else f"{prefix}{m}" for m in ms)

    return FusionReport(
        report.mode,
        [dataclasses.replace(s, modules=names(s.modules)) for s in report.fused],
        [SkippedSite(names(s.modules), s.pattern, s.reason) for s in report.skipped],
        [f"{prefix}.{n}" if not n.startswith(prefix) else n for n in report.notes],
    )


def _joined(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _optimize_children(module: nn.Module, path: str, options: Options, report: FusionReport, install: bool) -> int:
    """Optimize each child of `module` (at `path`) that is not a library module. Returns #roots optimized."""
    roots = 0
    for name, child in module.named_children():
        if not _is_library_module(child) and not (install and is_optimized(child)):
            roots += _optimize_tree(child, _joined(path, name), options.scoped(name), None, report, install)
    return roots


def _optimize_inside(
    module: nn.Module, state: _State, path: str, options: Options, report: FusionReport, install: bool
) -> int:
    """Optimize what the last trace of `module` kept as leaves: the children of leaves that could
    not be traced through, and hooked modules (their hooks need a module call; their forward
    can still be fused). Returns #roots optimized."""
    roots = 0
    for leaf_path in state.last_leaf_failures:
        leaf = module.get_submodule(leaf_path)
        roots += _optimize_children(leaf, _joined(path, leaf_path), options.scoped(leaf_path), report, install)
    for leaf_path in state.last_hooked:
        leaf = module.get_submodule(leaf_path)
        if not _is_library_module(leaf) and not (install and is_optimized(leaf)):
            roots += _optimize_tree(leaf, _joined(path, leaf_path), options.scoped(leaf_path), None, report, install)
    return roots


def _optimize_tree(
    module: nn.Module, path: str, options: Options, example_inputs, report: FusionReport, install: bool
) -> int:
    """Optimize `module` if it traces, else its largest traceable submodules. Returns #roots optimized."""
    state = _new_state(module, options)
    try:
        _build(module, state, example_inputs)
    except Exception as exc:  # noqa: BLE001 - tracing failures of arbitrary user code
        has_children = any(not _is_library_module(child) for child in module.children())
        report.notes.append(
            f"{path or type(module).__name__}: forward is not traceable ({type(exc).__name__}: "
            f"{tracing.first_line(exc)}); optimizing its submodules instead"
            + ("" if has_children else " (it has none that fxfuse could trace)")
        )
        return _optimize_children(module, path, options, report, install)
    merged = _prefixed(state.reports[state.last_key], path)
    report.fused.extend(merged.fused)
    report.skipped.extend(merged.skipped)
    report.notes.extend(merged.notes)
    roots = 1 + _optimize_inside(module, state, path, options, report, install)
    if install:
        other = _attach(module, state, example_inputs)
        if other is not None:
            mode, other_report = other
            for note in _prefixed(other_report, path).notes:
                if note not in report.notes:
                    report.notes.append(f"in {mode} mode: {note}")
    return roots


def _normalize_inputs(example_inputs) -> Optional[tuple]:
    if example_inputs is None:
        return None
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (list, tuple)):
        return tuple(example_inputs)
    raise ConfigurationError(
        f"example_inputs must be a tensor or a tuple of forward() arguments, got {type(example_inputs).__name__}"
    )


def _check_budget(model, name: str, value, of_what: str, example_inputs, mode: str) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value <= 1):
        raise ConfigurationError(f"{name} is a fraction of eager's {of_what} in (0, 1], e.g. 0.7; got {value!r}")
    if example_inputs is None:
        raise ConfigurationError(
            f"{name}={value} needs example_inputs to size every site: "
            f"fxfuse.optimize({type(model).__name__.lower()}, example_inputs=torch.randn(8, 3, 224, 224), "
            f"{name}={value}) (shapes only: no real compute is done with them)"
        )
    if mode == "fast":
        raise ConfigurationError(
            f"mode='fast' never recomputes convolutions, so a {name} cannot steer it; "
            f"use mode='memory' or mode='auto' with {name}"
        )


def _check(model, mode: str, memory_budget, example_inputs, memory_format: str = "preserve", peak_budget=None) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigurationError(f"fxfuse.optimize expects an nn.Module, got {type(model).__name__}")
    if memory_format not in layout.MEMORY_FORMATS:
        raise ConfigurationError(
            f"memory_format must be one of {', '.join(map(repr, layout.MEMORY_FORMATS))}, got {memory_format!r}"
        )
    if mode not in MODES:
        raise ConfigurationError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    _check_budget(model, "memory_budget", memory_budget, "saved activation bytes", example_inputs, mode)
    _check_budget(model, "peak_budget", peak_budget, "peak memory during a train step", example_inputs, mode)
    _extension.require()


def _check_example_inputs(model: nn.Module, example_inputs) -> None:
    """Inputs eager rejects are an error here, not a reason for every estimate to fail later."""
    inputs = _normalize_inputs(example_inputs)
    if inputs is not None:
        _example_inputs.check_accepted(model, inputs)


def _run(model: nn.Module, example_inputs, options: Options, install: bool) -> FusionReport:
    report = FusionReport(options.mode)
    roots = _optimize_tree(model, "", options, example_inputs, report, install)
    if roots == 0:
        raise TracingError(
            f"fxfuse could not trace {type(model).__name__} nor any of its submodules, so nothing was optimized. "
            + " ".join(report.notes)
            + " Make the forward traceable by torch.fx (no Python control flow on tensor values), "
            "or optimize the traceable parts yourself: fxfuse.optimize(model.backbone)."
        )
    return report


def _prepare(selection: policy.Selection, inputs: tuple) -> Callable[[nn.Module], Any]:
    """Optimize a (meta-device) trial copy with `selection`."""
    options = Options("memory", selection.allowed, regions=selection.groups, flat_links=selection.flat_links)
    # The inputs (as meta tensors) let shape-dependent code trace the way the final rewrite traces it.
    return lambda trial: _run(trial, measure.to_meta(inputs), options, install=True)


def _region_profile(model: nn.Module, inputs: tuple, pointwise: frozenset) -> Optional[region_costs.Profile]:
    """Region costs on a meta-device copy fused with pointwise sites only (None: not traced as one graph)."""
    trial = measure.meta_copy(model)
    _run(trial, measure.to_meta(inputs), Options("memory", pointwise), install=True)
    if not is_optimized(trial):
        return None
    state: _State = trial.__dict__[_STATE]
    return region_costs.profile(trial, state.fx_graphs[state.last_key], measure.to_meta(inputs))


def _counts(model: nn.Module, inputs: tuple) -> policy.Counts:
    return policy.Counts(
        eager_bytes=lambda: measure.saved_activation_bytes_meta(model, inputs),
        selection_bytes=lambda sel: measure.saved_activation_bytes_meta(model, inputs, prepare=_prepare(sel, inputs)),
        eager_peak=lambda: measure.step_peak_bytes_meta(model, inputs),
        selection_peak=lambda sel: measure.step_peak_bytes_meta(model, inputs, prepare=_prepare(sel, inputs)),
        profile=lambda pointwise: _region_profile(model, inputs, pointwise),
    )


def _decide(
    model: nn.Module, inputs, mode: str, memory_budget, peak_budget=None
) -> tuple[Options, Optional[policy.Decision]]:
    """Options for the final rewrite; for auto and budgets, the policy's selection too."""
    if mode == "fast" and memory_budget is None and peak_budget is None:
        return Options(mode), None
    memory = _run(model, inputs, Options("memory"), install=False)
    fast = _run(model, inputs, Options("fast"), install=False)
    if memory_budget is None and peak_budget is None:
        choose = policy.choose_auto if mode == "auto" else policy.choose_memory
        decision = choose(model, memory, fast)
    else:
        decision = policy.choose_budget(
            model,
            memory,
            fast,
            None if memory_budget is None else float(memory_budget),
            _counts(model, inputs),
            peak_budget=None if peak_budget is None else float(peak_budget),
        )
    options = Options(mode, decision.allowed, memory_budget, regions=decision.groups, flat_links=decision.flat_links)
    return options, decision


def _optimized(
    model: nn.Module, example_inputs, mode: str, memory_budget, memory_format: str, install: bool, peak_budget=None
) -> FusionReport:
    inputs = _normalize_inputs(example_inputs)
    chosen = layout.decide(model, inputs, memory_format)
    if chosen.channels_last and inputs is not None:
        inputs = layout.to_channels_last(inputs)
    options, decision = _decide(model, inputs, mode, memory_budget, peak_budget)
    options = dataclasses.replace(options, channels_last=chosen.channels_last)
    report = _run(model, inputs, options, install)
    if install and chosen.channels_last:
        model.to(memory_format=torch.channels_last)
    report.layout = f"{'channels_last' if chosen.channels_last else 'as given'} ({chosen.reason})"
    if decision is not None:
        policy.annotate(report, decision)
        report.notes.extend(policy.device_notes(inputs))
    return report


def optimize(
    model: nn.Module,
    example_inputs=None,
    *,
    mode: str = "memory",
    memory_budget: Optional[float] = None,
    memory_format: str = "preserve",
    peak_budget: Optional[float] = None,
) -> nn.Module:
    """Rewrite `model` in place so that its Conv→BN(→act), BN→act and Linear/Conv→act patterns run as fused ops.

    Returns `model` itself (now an instance of a generated subclass of its class) with
    the FusionReport attached as `model.fxfuse_report`. `example_inputs` (a tensor or a
    tuple of forward arguments) sizes every site; no real compute is done with them.

    mode="memory" recomputes convolutions (and linear layers before an activation) in
    backward to keep only their inputs, wherever that frees memory beyond the pointwise
    form (a conv whose BN→activation output feeds the next conv is not recomputed: the
    next conv rebuilds that output anyway); mode="fast" only recomputes pointwise work
    (BN-apply and the activation); mode="auto" recomputes only the layers that are cheap
    per byte freed (see fxfuse.policy).

    memory_budget=0.7 (needs example_inputs) keeps saved activations at or under 0.7×
    eager's with the least recompute; the report says whether the budget was met.
    Below what per-site fusion reaches, whole residual blocks (and runs of layers
    between them) keep only their inputs and run their forward again in backward.
    peak_budget=0.5 (needs example_inputs) keeps the peak memory of a train step at or
    under 0.5× eager's, counted on a meta-device copy; both can be given. The report
    shows both ratios and which regions were recomputed and why.

    memory_format="channels_last" converts the model's 4-D parameters to channels_last
    and makes its forward convert 4-D inputs (values are unchanged); "auto" does so
    only where fxfuse.audit_channels_last finds no format loss and it measures faster
    (needs example_inputs); "preserve" (default) leaves layouts alone. The report's
    `layout` says what was chosen and why.
    """
    _check(model, mode, memory_budget, example_inputs, memory_format, peak_budget)
    _check_example_inputs(model, example_inputs)
    if any(is_optimized(m) for m in model.modules()):
        _uninstall(model)
    report = _optimized(model, example_inputs, mode, memory_budget, memory_format, True, peak_budget)
    model.fxfuse_report = report
    return model


def explain(
    model: nn.Module,
    example_inputs=None,
    *,
    mode: str = "memory",
    memory_budget: Optional[float] = None,
    memory_format: str = "preserve",
    peak_budget: Optional[float] = None,
) -> FusionReport:
    """What `optimize` would fuse and skip (and why), without changing `model`."""
    _check(model, mode, memory_budget, example_inputs, memory_format, peak_budget)
    _check_example_inputs(model, example_inputs)
    target = model
    if any(is_optimized(m) for m in model.modules()):
        target = copy.deepcopy(model)
        _uninstall(target)
    return _optimized(target, example_inputs, mode, memory_budget, memory_format, False, peak_budget)
