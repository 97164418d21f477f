"""fusion/counts.py: meta-device counts of a plan, on the roots' captured graphs and without tracing again."""

import copy

import torch
from torch import nn

import fxfuse
from fxfuse import measure
from fxfuse.fusion import roots, tracing
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
    counts = Counts(model, inputs, [roots.find(model, inputs, Captures())])
    before = tracing.trace_count
    eager, nothing, every = counts.eager_bytes(), counts.plan_bytes(Plan(frozenset())), counts.plan_bytes(Plan())
    peak, every_peak = counts.eager_peak(), counts.plan_peak(Plan())
    profile = counts.profile(frozenset())
    assert tracing.trace_count == before
    assert nothing == eager and every < eager and every_peak <= peak
    optimized = fxfuse.optimize(copy.deepcopy(model), inputs)
    assert every == measure.saved_activation_bytes_meta(optimized, inputs)
    assert [r.name for r in profile.regions if r.kind != "chain"] == ["0…0", "1.0", "1.1", "2…2"]


class GradBranching(nn.Module):
    """Not traceable (a branch on `requires_grad`), but runs on the meta device."""

    def __init__(self, stages=True):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.stages = nn.ModuleList([nn.Sequential(Block(), Block()), nn.Sequential(Block())] if stages else [])

    def forward(self, x):
        x = self.conv(x)
        if x.requires_grad:
            x = x * 1.0
        for stage in self.stages:
            x = stage(x)
        return x


def test_the_regions_of_every_captured_root_join_one_profile_named_in_the_model():
    model, inputs = GradBranching(), (torch.randn(2, 4, 6, 6),)
    profile = Counts(model, inputs, [roots.find(model, inputs, Captures())]).profile(frozenset())
    assert [r.name for r in profile.regions if r.kind != "chain"] == ["stages.0.0", "stages.0.1"]
    assert [(link.first, link.second) for link in profile.links] == [("stages.0.0", "stages.0.1")]
    assert set(profile.problems) == {"stages.1.0"}  # the whole graph of its root
    assert all(m.startswith("stages.0.") for r in profile.regions if r.kind != "chain" for m in r.modules)
    # chains inside the other root are named in the model too (its whole graph is no region, a part of it is)
    assert all(r.name.startswith("stages.") for r in profile.regions)


def test_a_model_without_a_captured_root_has_no_profile():
    model, inputs = GradBranching(stages=False), (torch.randn(2, 4, 6, 6),)
    assert Counts(model, inputs, [roots.find(model, inputs, Captures())]).profile(frozenset()) is None
