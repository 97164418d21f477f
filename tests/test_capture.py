"""fusion/capture.py: one trace per module and train/eval mode, and copies that leave the capture alone."""

import copy

import pytest
import torch
import torchvision
from torch import nn

import fxfuse
from fxfuse.fusion import tracing
from fxfuse.fusion.capture import Captures, call_pattern, capture
from fxfuse.fusion.tracing import CallPattern
from fxfuse.testing import assert_equivalent


def _resnet():
    """ResNet-50's structure (bottlenecks, downsampling), one block per stage, narrow."""
    return torchvision.models.resnet.ResNet(torchvision.models.resnet.Bottleneck, [1, 1, 1, 1], width_per_group=16)


def _traces(fn) -> int:
    before = tracing.trace_count
    fn()
    return tracing.trace_count - before


@pytest.mark.parametrize("training", [True, False])
def test_optimize_with_a_budget_traces_once_per_mode(single_thread, training):
    model, x = _resnet().train(training), torch.randn(2, 3, 32, 32)
    traces = _traces(lambda: fxfuse.optimize(model, x, memory_budget=0.3))
    assert traces <= 2, f"{traces} traces"
    report = model.fxfuse_report
    assert report.budget_met and report.regions, report
    assert _traces(lambda: model(x)) == 0
    assert _traces(lambda: model.train(not training)(x)) == 0  # the other mode was built at optimize time


def test_optimize_with_a_budget_stays_exact(single_thread):
    model, x = _resnet(), torch.randn(2, 3, 32, 32)
    optimized = fxfuse.optimize(copy.deepcopy(model), x, memory_budget=0.3)
    assert optimized.fxfuse_report.regions
    assert_equivalent(model, optimized, x, dtype=torch.float64)


def test_captures_trace_each_module_once_per_training_flags():
    model, captures = _resnet(), Captures()
    assert _traces(lambda: captures.get(model, "", None)) == 1
    assert _traces(lambda: captures.get(model, "", None)) == 0
    model.eval()
    assert _traces(lambda: captures.get(model, "", None)) == 1


class Untraceable(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # control flow on a tensor value
            return x
        return -x


def test_captures_remember_what_cannot_be_traced():
    captures, model, raised = Captures(), Untraceable(), []
    for expected in (1, 0):
        before = tracing.trace_count
        with pytest.raises(Exception) as info:
            captures.get(model, "", None)
        assert tracing.trace_count - before == expected
        raised.append(info.value)
    assert raised[0] is raised[1]


class _Optional(nn.Module):
    def forward(self, x, mask=None, *, flag=False):
        return x if mask is None or flag else x * mask


def test_a_capture_is_for_a_call_pattern():
    """The pattern given, else the example inputs', else the forward's required arguments: `Captures`
    reuses a capture for the same pattern only."""
    model, x = _Optional(), torch.randn(2, 3)
    assert call_pattern(model, None) == CallPattern(1)
    assert call_pattern(model, (x, None)) == CallPattern(2, (), ((1, type(None), None),))
    assert call_pattern(model, (x,), CallPattern.of((x,), {"flag": True})) == CallPattern(
        1, ("flag",), (("flag", bool, True),)
    )
    captures = Captures()
    assert _traces(lambda: captures.get(model, "", (x,))) == 1
    assert _traces(lambda: captures.get(model, "", None)) == 0  # model(x) either way
    assert _traces(lambda: captures.get(model, "", (x, None))) == 1
    assert captures.get(model, "", (x, None)).traced.bound == {"mask": None, "flag": False}


def test_call_patterns_tell_bool_from_int_and_bind_only_plain_values():
    x = torch.randn(2)
    assert CallPattern.of((x, True)) != CallPattern.of((x, 1))
    assert CallPattern.of((x, [x])) == CallPattern(2)  # a list (of tensors) stays a placeholder
    assert tracing.bindings(_Optional.forward, CallPattern.of((x, x), {"flag": True})) == {"flag": True}
    assert tracing.bindings(_Optional.forward, CallPattern(1)) == {"mask": None, "flag": False}


class _ShapeChecked(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU())

    def forward(self, x, scale=None):
        if x.shape[1] != 3:  # Python on a shape: graphs are traced for the example's shapes
            raise ValueError("3 channels")
        return self.body(x) if scale is None else self.body(x) * scale


def test_a_graph_built_at_call_time_traces_the_model_alone():
    """A new call pattern builds a graph at call time, from a meta copy of the optimized model: the copy is
    plain, not the model optimized again (which pickling an optimized model does: 6 traces, not 2)."""
    model, x = _ShapeChecked(), torch.randn(2, 3, 8, 8)
    fxfuse.optimize(model, x)
    assert _traces(lambda: model(x, scale=None)) == _traces(lambda: capture(_ShapeChecked(), (x,))) == 2
    assert _traces(lambda: model(x, scale=None)) == 0
    assert fxfuse.fusion.is_optimized(model) and type(model) is not _ShapeChecked  # put back after the copy
