"""fusion/counts.py: meta-device counts of a plan, on the captured graphs and without tracing again."""

import copy

import torch
from torch import nn

import fxfuse
from fxfuse import measure
from fxfuse.fusion import tracing
from fxfuse.fusion.capture import Captures
from fxfuse.fusion.counts import Counts
from fxfuse.fusion.plan import Plan


class Block(nn.Module):
    def __init__(self, c=4):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


def _net():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Sequential(Block(), Block()), nn.Conv2d(4, 2, 1))


def test_counts_match_the_optimized_model_and_do_not_trace():
    model, inputs = _net(), (torch.randn(2, 3, 8, 8),)
    captures = Captures()
    captures.get(model, "", inputs)
    counts = Counts(model, inputs, captures)
    before = tracing.trace_count
    eager, nothing, every = counts.eager_bytes(), counts.plan_bytes(Plan(frozenset())), counts.plan_bytes(Plan())
    peak, every_peak = counts.eager_peak(), counts.plan_peak(Plan())
    profile = counts.profile(frozenset())
    assert tracing.trace_count == before
    assert nothing == eager and every < eager and every_peak <= peak
    optimized = fxfuse.optimize(copy.deepcopy(model), inputs)
    assert every == measure.saved_activation_bytes_meta(optimized, inputs)
    assert [r.name for r in profile.regions] == ["0…0", "1.0", "1.1", "2…2"]


def test_a_model_not_captured_as_one_graph_has_no_profile():
    class Branches(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def forward(self, x):
            return self.block(x) if x.sum() > 0 else self.block(-x)

    model, inputs = Branches(), (torch.randn(2, 4, 6, 6),)
    assert Counts(model, inputs, Captures()).profile(frozenset()) is None
