"""restore_channels_last: an FX pass converting back to channels_last after forward losses."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxfuse.audit import audit_channels_last, restore_channels_last


class Cascade(nn.Module):
    """cumsum returns NCHW; the cat that follows then mixes formats and loses channels_last again."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(4, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.branch = nn.Conv2d(8, 8, 1)
        self.head = nn.Conv2d(16, 8, 3, padding=1)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        y = x.cumsum(1)
        z = torch.cat([y, self.branch(x)], 1)
        return self.head(z).softmax(1)


def conversions(graph_module: torch.fx.GraphModule) -> list[str]:
    """Names of the nodes whose output the pass converts back to channels_last."""
    return [
        node.args[0].name
        for node in graph_module.graph.nodes
        if node.op == "call_method"
        and node.target == "contiguous"
        and node.kwargs.get("memory_format") == torch.channels_last
    ]


def forward_ops(model, example):
    return sorted(f.op for f in audit_channels_last(model, example, backward=False).findings)


def test_restore_converts_after_losses_and_removes_the_cascade():
    model, example = Cascade(), torch.randn(2, 4, 8, 8)
    restored = restore_channels_last(model, example)

    assert isinstance(restored, torch.fx.GraphModule)
    assert conversions(restored) == ["cumsum", "softmax"]
    before, after = forward_ops(model, example), forward_ops(restored, example)
    assert before == ["aten._softmax.default", "aten.cat.default", "aten.cumsum.default"]
    assert after == ["aten._softmax.default", "aten.cumsum.default"]  # cat now sees two channels_last inputs


def test_restored_model_returns_the_same_values_and_leaves_the_original_alone():
    model, example = Cascade(), torch.randn(2, 4, 8, 8)
    state = copy.deepcopy(model.state_dict())
    restored = restore_channels_last(model, example)

    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key
    assert model.stem.weight.is_contiguous()
    model.eval(), restored.eval()
    with torch.no_grad():
        expected = model(example)
        actual = restored(example.contiguous(memory_format=torch.channels_last))
    assert actual.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(actual, expected)


def test_conversion_that_would_break_a_later_view_is_dropped():
    class Flatten(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 8, 3, padding=1)

        def forward(self, x):
            y = self.conv(x).contiguous()
            return y.view(y.shape[0], -1)  # needs y's NCHW strides

    model, example = Flatten(), torch.randn(2, 4, 8, 8)
    restored = restore_channels_last(model, example)
    assert conversions(restored) == []
    torch.testing.assert_close(restored(example), model(example))


def test_untraceable_model_is_restored_submodule_by_submodule():
    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Cascade()

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: symbolic_trace fails here
                x = x * 2
            return self.block(x)

    model, example = Gate(), torch.rand(2, 4, 8, 8)
    with pytest.warns(UserWarning, match="cannot trace"):
        restored = restore_channels_last(model, example)
    assert type(restored) is Gate
    assert conversions(restored.block) == ["cumsum", "softmax"]
    assert forward_ops(restored, example) == ["aten._softmax.default", "aten.cumsum.default"]


def test_views_that_reorder_dims_are_not_converted():
    class NHWC(nn.Module):  # ConvNeXt-style permute: a view, nothing was copied
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 8, 3, padding=1)

        def forward(self, x):
            return self.conv(x).permute(0, 2, 3, 1) * 2

    assert conversions(restore_channels_last(NHWC(), torch.randn(2, 4, 8, 8))) == []


def test_conversion_that_changes_the_outputs_is_dropped():
    class ReadsNCHWMemory(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 8, 3, padding=1)

        def forward(self, x):
            y = self.conv(x).cumsum(1)
            return y.as_strided((y.shape[0], 8 * 8 * 8), (8 * 8 * 8, 1))  # assumes NCHW memory order

    model, example = ReadsNCHWMemory(), torch.randn(2, 4, 8, 8)
    restored = restore_channels_last(model, example)
    assert conversions(restored) == []
    torch.testing.assert_close(restored(example), model(example))
