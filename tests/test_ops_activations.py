"""The activation registry (fxfuse/ops/activations.py): it agrees with the C++ table
(csrc/act.h), and each entry's eager function, forms and saves_input agree with eager PyTorch."""

from __future__ import annotations

import operator
import re

import pytest
import torch
import torch.fx as fx
from torch import nn

from fxfuse import _extension
from fxfuse.fusion.passes import estimates
from fxfuse.fusion.passes.matchers import Activation, activation_of, module_activation
from fxfuse.ops.activations import ACTIVATIONS, REGISTRY
from fxfuse.ops.checks import check_act

SPECS = list(REGISTRY.values())
ID = [spec.name for spec in SPECS]
SLOPE = 0.2  # act_param for the activations that take one


def _x():
    # float64, with values on both sides of every activation's kinks (0, ±3, 6)
    return torch.linspace(-8, 8, 37, dtype=torch.float64).reshape(1, 37)


def _setting(spec):
    """(keyword arguments selecting `spec` in a call or module constructor, the act_param it gives)."""
    if spec.argument is None:
        return {}, 0.0
    if spec.value is not None:
        return {spec.argument: spec.value}, 0.0
    return {spec.argument: SLOPE}, SLOPE


@pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")
def test_cpp_table_lists_the_python_registry():
    # Same names in the same order: csrc/act.h's Act enumerators index the same activations.
    assert _extension._C._activations() == ACTIVATIONS


@pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")
def test_unknown_activation_is_the_same_value_error_in_python_and_cpp():
    with pytest.raises(ValueError) as python:
        check_act("mish")
    x, w = torch.randn(2, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=re.escape(str(python.value))):
        torch.ops.fxfuse.linear_act(x, w, None, "mish", 0.0)


@pytest.mark.parametrize("spec", SPECS, ids=ID)
def test_saves_input_is_what_eager_autograd_saves(spec):
    x = _x().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        spec.eager(x, SLOPE)
    assert any(t.data_ptr() == x.data_ptr() for t in saved) == spec.saves_input
    assert (spec.name in estimates.SAVES_INPUT) == spec.saves_input


@pytest.mark.parametrize("spec", SPECS, ids=ID)
def test_module_forms_compute_the_entry(spec):
    kwargs, param = _setting(spec)
    for cls in spec.modules:
        m = cls(**kwargs)
        assert module_activation(m) == Activation(spec.name, param), cls
        x = _x()
        torch.testing.assert_close(m(x), spec.eager(x, param), rtol=0, atol=0)


def _traced(fn, *args, **kwargs) -> fx.Node:
    class Call(nn.Module):
        def forward(self, x):
            return fn(x, *args, **kwargs)

    graph = fx.symbolic_trace(Call()).graph
    (node,) = [n for n in graph.nodes if n.op in ("call_function", "call_method")]
    return node


@pytest.mark.parametrize("spec", SPECS, ids=ID)
def test_function_and_method_forms_compute_the_entry(spec):
    kwargs, param = _setting(spec)
    calls = [(fn, kwargs, param) for fn in spec.functions]
    if spec.argument is not None and spec.value in (None, spec.default):  # the default selects it too
        calls += [(fn, {}, spec.default if spec.value is None else 0.0) for fn in spec.functions]
    for fn, kw, p in calls:
        assert activation_of(_traced(fn, **kw), {}) == Activation(spec.name, p), (fn, kw)
        x = _x()
        torch.testing.assert_close(fn(x.clone(), **kw), spec.eager(x, p), rtol=0, atol=0)
    for method in spec.methods:
        assert activation_of(_traced(operator.methodcaller(method)), {}) == Activation(spec.name)
        x = _x()
        torch.testing.assert_close(getattr(x.clone(), method)(), spec.eager(x, 0.0), rtol=0, atol=0)


def test_settings_no_entry_selects_match_nothing():
    assert module_activation(nn.GELU(approximate="erf")) is None
    assert activation_of(_traced(torch.nn.functional.gelu, approximate="erf"), {}) is None


@pytest.mark.parametrize("spec", [s for s in SPECS if s.timm_forwards], ids=lambda s: s.name)
def test_timm_forms_compute_the_entry(spec):
    activations = pytest.importorskip("timm.layers.activations")
    for qualname in spec.timm_forwards:
        m = getattr(activations, qualname.split(".")[0])()
        assert type(m).forward.__qualname__ == qualname
        assert module_activation(m) == Activation(spec.name)
        x = _x()
        torch.testing.assert_close(m(x), spec.eager(x, 0.0), rtol=0, atol=0)
