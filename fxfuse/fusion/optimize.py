"""fxfuse.optimize / fxfuse.explain: one straight pipeline, a module per stage.

    roots     the model's tree walked once: each root with its capture, or why it has none
              (roots.py; a model whose capture needs its inputs' shapes and got none is optimized at
              its first call instead)
    sites     the passes on copies of the roots' captures, in mode="memory" and "fast" (apply.sites):
              the sites' data (plan.SiteData)
    plan      the policy turns those sites into a Plan (policy.py; a budget's meta-device counts apply
              plans to the same roots on a meta copy: counts.py)
    apply     the roots' captures rewritten with the Plan (apply.apply_roots)
    install   each root's class swapped to run its graph, with its other train/eval mode's graph
              (install.py)
    report    the FusionReport rendered from the final sites and the Plan (report.render)

Each stage calls only those after it. What the optimized module does at call time (rebuilds
when training flags, hooks or input shapes change; pickling) is install.py's.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Optional, Union

import torch
from torch import nn

from .. import _extension, measure
from ..errors import ConfigurationError, TracingError
from . import apply, layout, parametrized, policy, roots
from . import example_inputs as _example_inputs
from .capture import Captures
from .counts import Counts
from .install import _rebuild, any_optimized, is_optimized, uninstall  # noqa: F401 - _rebuild: older pickles name it here
from .install import defer as install_at_first_call
from .install import install as install_roots
from .plan import MODES, Findings, Options, Plan
from .regions import time_model
from .regions.time_model import Rates as TimeModel
from .report import FusionReport, render
from .roots import Root
from .tracing import first_line

AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


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


def _check(
    model, mode: str, memory_budget, example_inputs, memory_format: str = "preserve", peak_budget=None, autocast=None
) -> None:
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
    if autocast is not None and autocast not in AUTOCAST_DTYPES:
        raise ConfigurationError(
            f"autocast is the dtype the model trains in under torch.autocast, one of "
            f"{', '.join(map(str, AUTOCAST_DTYPES))}, e.g. autocast=torch.bfloat16; got {autocast!r}"
        )
    _extension.require()


def _check_example_inputs(model: nn.Module, example_inputs) -> None:
    """Inputs eager rejects are an error here, not a reason for every estimate to fail later."""
    inputs = _normalize_inputs(example_inputs)
    if inputs is not None:
        _example_inputs.check_accepted(model, inputs)


def _roots(model: nn.Module, inputs, captures: Captures) -> list[Root]:
    """The model's tree of roots, each with its capture (roots.py); an error where none traces."""
    tree = [roots.find(model, inputs, captures)]
    if roots.captured(tree) == 0:
        raise TracingError(
            f"fxfuse could not trace {type(model).__name__} nor any of its submodules, so nothing was optimized. "
            + " ".join(r.note for r in roots.walk(tree))
            + " Make the forward traceable by torch.fx (no Python control flow on tensor values), "
            "or optimize the traceable parts yourself: fxfuse.optimize(model.backbone)."
        )
    return tree


def _run(
    model: nn.Module, example_inputs, options: Options, install: bool, captures: Optional[Captures] = None
) -> Findings:
    """The stages after the plan, for `options` given: roots, apply, install (`install`). Tests and
    benchmarks that pick their own plan run this; returns what the passes found."""
    inputs = _normalize_inputs(example_inputs)
    tree = _roots(model, inputs, Captures() if captures is None else captures)
    applied = apply.apply_roots(tree, options, installed=install)
    return applied.findings(tree, install_roots(tree, applied, options, inputs) if install else {})


def _precision(inputs, autocast) -> tuple[Optional[measure.Autocast], str]:
    """The autocast the plan is counted under (`autocast=`, else the one enabled at the call for the example
    inputs' device), and the report's line for it."""
    if inputs is None:
        return None, ""
    if autocast is None:
        counted = measure.autocast_in_effect(inputs)
        origin = "enabled at the call"
    else:
        device_type = next((t.device.type for t in measure.memory.tensors(inputs)), "cpu")
        if device_type == "meta":
            raise ConfigurationError(
                "autocast= counts under torch.autocast on the example inputs' device, which has no autocast on "
                "meta: give example inputs on the device the model trains on (nothing is computed with them)"
            )
        counted, origin = measure.Autocast(device_type, autocast), "autocast="
    if counted is not None:
        return counted, f"counted under {counted} ({origin}), as the model trains"
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in measure.memory.tensors(inputs)})
    return None, f"counted in {', '.join(dtypes) or 'the inputs'} dtypes, without autocast"


def _time_model(inputs, autocast: Optional[measure.Autocast], spec) -> time_model.Rates:
    """The rates the ranking prices recomputes with, for the device and dtype of the example inputs (the
    autocast dtype where counted under one)."""
    first = next(iter(measure.memory.tensors(inputs)), None)
    device = first.device if first is not None else torch.device("cpu")
    dtype = autocast.dtype if autocast is not None else first.dtype if first is not None else torch.float32
    try:
        return time_model.resolve(spec, device, dtype)
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"time_model / ${time_model.ENV}: {exc}") from exc


def _plan(model: nn.Module, inputs, mode: str, memory_budget, peak_budget, tree: list[Root], autocast=None) -> Options:
    """Find the sites of both modes in the roots' captures, and let the policy choose among them."""
    if mode == "fast" and memory_budget is None and peak_budget is None:
        return Options(mode)
    memory = apply.sites(tree, "memory")
    fast = apply.sites(tree, "fast")
    if memory_budget is None and peak_budget is None:
        choose = policy.choose_auto if mode == "auto" else policy.choose_memory
        plan = choose(model, memory, fast)
    else:
        plan = policy.choose_budget(
            model,
            memory,
            fast,
            None if memory_budget is None else float(memory_budget),
            Counts(model, inputs, tree, autocast),
            peak_budget=None if peak_budget is None else float(peak_budget),
        )
    return Options(mode, plan, memory_budget)


@parametrized.keeping  # reading a parametrized weight may write its state
def _optimized(
    model: nn.Module,
    example_inputs,
    mode: str,
    memory_budget,
    memory_format: str,
    install: bool,
    peak_budget=None,
    autocast: Optional[torch.dtype] = None,
    time_model_spec=None,
    at_first_call: bool = True,
) -> FusionReport:
    """`at_first_call`: where the model's capture needs its inputs' shapes and none were given, install it to
    be optimized at its first call (roots.py)."""
    inputs = _normalize_inputs(example_inputs)
    chosen = layout.decide(model, inputs, memory_format)
    if chosen.channels_last and inputs is not None:
        inputs = layout.to_channels_last(inputs)
    counted_under, precision = _precision(inputs, autocast)
    layout_line = f"{'channels_last' if chosen.channels_last else 'as given'} ({chosen.reason})"
    rates = None
    if memory_budget is not None or peak_budget is not None:
        rates = _time_model(inputs, counted_under, time_model_spec)
    captures = Captures(counted_under)
    shapes_needed = roots.needs_shapes(model, captures) if inputs is None else None
    notes_first = []
    if shapes_needed is not None:
        if install and at_first_call:
            return _defer(model, mode, memory_format, autocast, shapes_needed, layout_line)
        captured_later = _FIRST_CALL.format(name=type(model).__name__, why=shapes_needed)
        notes_first.append(f"{captured_later}; explain(model, example_inputs) shows what it fuses then")
    tree = _roots(model, inputs, captures)  # roots
    with time_model.using(rates):
        options = _plan(model, inputs, mode, memory_budget, peak_budget, tree, counted_under)  # sites, plan
    options = dataclasses.replace(options, channels_last=chosen.channels_last)
    applied = apply.apply_roots(tree, options, installed=install)  # apply
    later = install_roots(tree, applied, options, inputs) if install else {}  # install
    found = applied.findings(tree, later)
    if install and chosen.channels_last:
        model.to(memory_format=torch.channels_last)
    own_rates = rates is not None and rates.source != time_model.BUILTIN_SOURCE
    notes = policy.device_notes(inputs, own_rates) if options.plan.choice is not None else []
    report = render(options.mode, found, options.plan, layout_line, notes)
    report.notes[:0] = notes_first
    report.precision = precision
    report.time_model = rates
    return report


_FIRST_CALL = (
    "{name}: its capture needs its inputs' shapes, which no example inputs gave: {why}; optimize(model) "
    "captures it at its first call, with that call's inputs (on meta copies: nothing is computed with them)"
)


def _defer(model: nn.Module, mode: str, memory_format: str, autocast, why: str, layout_line: str) -> FusionReport:
    """Install `model` to be optimized at its first call; the report says so until then."""
    at_first_call = functools.partial(
        _optimize_at_first_call, mode=mode, memory_format=memory_format, autocast=autocast
    )
    install_at_first_call(model, Options(mode), at_first_call)
    note = _FIRST_CALL.format(name=type(model).__name__, why=why)
    return render(
        mode, Findings(notes=[f"{note}; model.fxfuse_report is this call's report until then"]), Plan(), layout_line
    )


def _optimize_at_first_call(
    model: nn.Module, inputs: Optional[tuple], mode: str, memory_format: str, autocast: Optional[torch.dtype]
) -> None:
    """What `optimize(model, inputs)` does, for a model `_defer`red to its first call (`inputs`: that call's
    arguments in signature order). Where that fails (inputs eager rejects, say: the call then raises eager's
    error), or the call's arguments have no order, what `optimize(model)` does without deferring."""
    name = type(model).__name__
    uninstall(model)
    report = None
    if inputs is not None:
        try:
            _check_example_inputs(model, inputs)
            report = _optimized(model, inputs, mode, None, memory_format, True, autocast=autocast)
            note = f"{name}: optimized at its first call, captured with that call's inputs (no example inputs given)"
        except Exception as exc:  # noqa: BLE001 - the call itself raises eager's error for inputs it rejects
            uninstall(model)
            note = (
                f"{name}: could not be captured with its first call's inputs ({type(exc).__name__}: "
                f"{first_line(exc)}); optimized as without example inputs"
            )
    else:
        note = (
            f"{name}: its first call's arguments have no order of its forward's parameters; optimized as "
            "without example inputs"
        )
    if report is None:
        try:
            report = _optimized(model, None, mode, None, memory_format, True, autocast=autocast, at_first_call=False)
        except TracingError as exc:
            uninstall(model)
            report = render(mode, Findings(notes=[str(exc)]), Plan())
    report.notes.insert(0, note)
    model.fxfuse_report = report


def optimize(
    model: nn.Module,
    example_inputs=None,
    *,
    mode: str = "memory",
    memory_budget: Optional[float] = None,
    memory_format: str = "preserve",
    peak_budget: Optional[float] = None,
    autocast: Optional[torch.dtype] = None,
    time_model: Optional[Union[str, dict, TimeModel]] = None,
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

    The counts are made in the precision the model trains in: under the torch.autocast enabled at
    this call for the example inputs' device (call optimize inside the training's autocast block),
    or under autocast=torch.bfloat16 / torch.float16 given here. Then the saved bytes counted are
    what eager keeps under that autocast (its casted copies, low-precision activations, float32
    statistics), and the budgets hold there. The report's `precision` says which it was.

    A budget's ranking prices recomputes with a time model of the example inputs' device and
    dtype (fusion/regions/time_model.py): on CPU its built-in rates, elsewhere the device's,
    measured once and cached. time_model= pins them (a path to a JSON file, inline JSON or a
    dict with seconds_per_flop, seconds_per_byte and op_seconds, as the report's
    to_dict()["time_model"] gives them; "measure"; "builtin"), as FXFUSE_TIME_MODEL does.
    """
    _check(model, mode, memory_budget, example_inputs, memory_format, peak_budget, autocast)
    _check_example_inputs(model, example_inputs)
    if any_optimized(model):
        uninstall(model)
    report = _optimized(
        model, example_inputs, mode, memory_budget, memory_format, True, peak_budget, autocast, time_model
    )
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
    autocast: Optional[torch.dtype] = None,
    time_model: Optional[Union[str, dict, TimeModel]] = None,
) -> FusionReport:
    """What `optimize` would fuse and skip (and why), without changing `model`."""
    _check(model, mode, memory_budget, example_inputs, memory_format, peak_budget, autocast)
    _check_example_inputs(model, example_inputs)
    target = model
    if any_optimized(model):
        target = copy.deepcopy(model)
        uninstall(target)
    return _optimized(
        target, example_inputs, mode, memory_budget, memory_format, False, peak_budget, autocast, time_model
    )
