"""An untraceable forward never crashes optimize nor a forward (issue 33 §4).

Every place that traces takes the fallback for a module whose own forward torch.fx
cannot trace: optimize in train or eval mode, the build of the other mode, rebuilds at
call time after `.train()`/`.eval()`, after hooks change and after mixed training
flags, with and without example inputs. The fallback runs that forward as written and
optimizes its submodules; the report says so. The models are wrappers whose forward
iterates a submodule's output, as users wrap ultralytics' YOLO (a dict of feature maps
in train mode): a Proxy where the submodule is a leaf of the trace.
"""

import copy
import io

import pytest
import torch
from torch import nn

import fxfuse
from fxfuse.fusion.optimize import is_optimized
from fxfuse.testing import assert_equivalent


def _conv_bn_relu(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class Backbone(nn.Module):
    """Traceable: feature maps in a dict of lists."""

    def __init__(self):
        super().__init__()
        self.b1, self.b2 = _conv_bn_relu(3, 4), _conv_bn_relu(4, 4)

    def forward(self, x):
        f1 = self.b1(x)
        return {"feats": [f1, self.b2(f1)]}


class DataDependentHead(nn.Module):
    """Untraceable (Python control flow on a size): a leaf of any trace, so its output is a Proxy."""

    def __init__(self):
        super().__init__()
        self.block = _conv_bn_relu(4, 4)

    def forward(self, feats):
        y = self.block(feats[-1])
        if y.shape[0] > 0:
            y = y + 0
        return {"feats": [feats[0], y], "logits": y.mean((2, 3))}


class Detector(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone, self.head = Backbone(), DataDependentHead()

    def forward(self, x):
        return self.head(self.backbone(x)["feats"])


class TrainLossWrapper(nn.Module):
    """Iterates the detector's output in train mode (untraceable there), returns logits in eval (traceable)."""

    def __init__(self):
        super().__init__()
        self.model = Detector()

    def forward(self, x):
        out = self.model(x)
        if self.training:
            return sum(f.square().mean() for f in out["feats"])
        return out["logits"]


class IteratingWrapper(nn.Module):
    """Iterates a submodule's output in every mode: traceable while the backbone is traced through,
    not once it is a leaf (a hook on it)."""

    def __init__(self):
        super().__init__()
        self.backbone = Backbone()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return sum(self.fc(f.mean((2, 3))) for f in self.backbone(x)["feats"])


def _model(cls):
    torch.manual_seed(0)
    return cls().double()


def _x():
    return torch.randn(2, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _notes(model):
    return " ".join(model.fxfuse_report.notes)


@pytest.mark.parametrize("with_inputs", [False, True])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_wrapper_untraceable_in_one_mode(mode, with_inputs):
    x = _x()
    model = _model(TrainLossWrapper).train(mode == "train")
    fxfuse.optimize(model, x if with_inputs else None)
    if with_inputs:
        # With example inputs the list is iterated with concrete shapes (tracing.py): one graph per mode.
        assert "traced for inputs of shape" in _notes(model)
    else:
        # The head reads a shape (`y.shape[0] > 0`), so it is captured at the first call (fusion/roots.py).
        assert "captures it at its first call" in _notes(model) and not model.fxfuse_report.fused
    assert_equivalent(_model(TrainLossWrapper), model, x, dtype=torch.float64)  # on copies of both
    reference = _model(TrainLossWrapper)
    for training in (True, False, True, False):  # switching modes after optimize
        model.train(training)
        reference.train(training)
        with torch.no_grad():
            assert torch.allclose(model(x), reference(x), rtol=1e-12, atol=1e-12)
    assert "traced for inputs of shape" in _notes(model)


def test_wrapper_with_a_memory_budget_and_explain():
    x = _x()
    model = _model(TrainLossWrapper).eval()
    report = fxfuse.explain(model, x, memory_budget=0.9)
    # Traced with concrete shapes where example inputs are given (tracing.py), else a leaf: never an error.
    assert "traced for inputs of shape" in " ".join(report.notes)
    fxfuse.optimize(model, x, memory_budget=0.9)
    assert_equivalent(_model(TrainLossWrapper), model, x, dtype=torch.float64)


class ValueBranchWrapper(nn.Module):
    """Branches on a tensor's value in train mode (untraceable there, with example inputs or without)."""

    def __init__(self):
        super().__init__()
        self.backbone = Backbone()

    def forward(self, x):
        feats = self.backbone(x)["feats"]
        if self.training and feats[1].mean() > 0:
            return feats[1].sum()
        return feats[1].mean((2, 3))


def test_the_other_mode_failing_is_reported():
    x = _x()
    model = fxfuse.optimize(_model(ValueBranchWrapper).eval())
    notes = model.fxfuse_report.notes
    assert any(n.startswith("in train mode: ValueBranchWrapper: forward is not traceable") for n in notes), notes
    assert is_optimized(model.backbone)  # the train-mode fallback optimized it on its own
    assert_equivalent(_model(ValueBranchWrapper).eval(), model, x, dtype=torch.float64)


def test_a_hook_that_makes_the_forward_untraceable_falls_back_at_call_time():
    x = _x()
    eager, model = _model(IteratingWrapper), fxfuse.optimize(_model(IteratingWrapper))
    assert not any("not traceable" in n for n in model.fxfuse_report.notes)
    seen = {"eager": [], "fused": []}
    for name, m in (("eager", eager), ("fused", model)):
        m(x)
        m.backbone.register_forward_hook(lambda mod, args, out, rec=seen[name]: rec.append(out["feats"][1].clone()))
    assert is_optimized(model.backbone) is False
    for m in (eager, model):
        m(x).sum().backward()
    assert is_optimized(model.backbone)  # the fallback optimized it on its own
    assert any(
        n.startswith("graph built at a later call: IteratingWrapper: forward is not traceable")
        for n in model.fxfuse_report.notes
    )
    assert len(seen["fused"]) == len(seen["eager"]) == 1
    assert torch.allclose(seen["fused"][0], seen["eager"][0], rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-12), name


def test_mixed_training_flags_rebuild_without_a_raw_fx_error():
    x = _x()
    eager, model = _model(TrainLossWrapper), fxfuse.optimize(_model(TrainLossWrapper).eval())
    for m in (eager, model):
        m.eval()
        m.model.backbone.b1.train()  # a key fxfuse has no graph for yet
    with torch.no_grad():
        assert torch.allclose(model(x), eager(x), rtol=1e-12, atol=1e-12)


def test_deepcopy_and_pickle_of_a_wrapper_optimized_in_eval():
    x = _x()
    model = fxfuse.optimize(_model(TrainLossWrapper).eval())
    for clone in (copy.deepcopy(model), torch.load(_saved(model), weights_only=False)):
        assert_equivalent(_model(TrainLossWrapper), clone, x, dtype=torch.float64)


def _saved(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return buffer


class Residual(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.body = nn.Sequential(_conv_bn_relu(c, c), nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        return torch.relu(x + self.body(x))


class GradBranchingRoot(nn.Module):
    """Its own forward is not traceable, with or without shapes (a branch on `requires_grad`), but runs on
    the meta device; its stages are captured one by one."""

    def __init__(self):
        super().__init__()
        self.stem = _conv_bn_relu(3, 4)
        self.s1 = nn.Sequential(Residual(4), Residual(4))
        self.s2 = nn.Sequential(Residual(4), Residual(4))

    def forward(self, x):
        y = self.s1(self.stem(x))
        if y.requires_grad:
            y = y * 1.0
        return self.s2(y)


def test_a_budget_ranks_the_regions_of_every_captured_root_together():
    x = _x()
    model = fxfuse.optimize(_model(GradBranchingRoot), x, memory_budget=0.3)
    report = model.fxfuse_report
    assert "forward is not traceable" in _notes(model) and "not traced as one graph" not in _notes(model)
    assert is_optimized(model.s1) and is_optimized(model.s2) and not is_optimized(model)
    chosen = {r.name for r in report.regions}
    assert chosen and all(name.split(".")[0] in ("stem", "s1", "s2") for name in chosen), chosen
    assert report.budget_met, report
    assert_equivalent(_model(GradBranchingRoot), model, x, dtype=torch.float64)
