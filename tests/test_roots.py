"""fusion/roots.py: the model's tree of roots, walked once per optimize call, each with its capture or why it
has none; a model whose capture needs its inputs' shapes, optimized without example inputs, is captured at its
first call with that call's inputs and fuses what it fuses with example inputs (issue 56)."""

import copy
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from support.branching import Block, Holder, Untraceable
from torch import nn

import fxfuse
from fxfuse.errors import ConfigurationError
from fxfuse.fusion import apply, install, roots
from fxfuse.fusion.capture import Captures
from fxfuse.fusion.optimize import is_optimized
from fxfuse.testing import assert_equivalent


class SamePadConv(nn.Module):
    """TF-style padding computed from the input's size with int() (HF MobileNetV2's tf_padding)."""

    def __init__(self, cin, cout, stride=2):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride=stride, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        h = int(x.shape[-1])
        pad = max((math.ceil(h / 2) - 1) * 2 + 3 - h, 0)
        return F.relu(self.bn(self.conv(F.pad(x, (pad // 2, pad - pad // 2, pad // 2, pad - pad // 2)))))


class PaddedNet(nn.Module):
    """Its own forward traces; its padded convs only with concrete shapes."""

    def __init__(self):
        super().__init__()
        self.stem, self.down = SamePadConv(3, 8), SamePadConv(8, 8)
        self.head = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())

    def forward(self, x):
        return self.head(self.down(self.stem(x))).mean((2, 3))


class ChunkNet(nn.Module):
    """Its own forward iterates `chunk`'s result (ultralytics' C2f): untraceable without shapes."""

    def __init__(self):
        super().__init__()
        self.cv1 = nn.Sequential(nn.Conv2d(3, 8, 1, bias=False), nn.BatchNorm2d(8), nn.SiLU())
        self.m = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.SiLU())
        self.cv2 = nn.Sequential(nn.Conv2d(12, 4, 1, bias=False), nn.BatchNorm2d(4), nn.SiLU())

    def forward(self, x):
        y = list(self.cv1(x).chunk(2, 1))
        y.append(self.m(y[-1]))
        return self.cv2(torch.cat(y, 1))


class ValueBranch(nn.Module):
    """Branches on a tensor's value: no shape makes it traceable, so it is not deferred."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU())

    def forward(self, x):
        return self.block(x) if x.sum() > 0 else self.block(-x)


def _x(*shape, dtype=torch.float32):
    return torch.randn(*(shape or (2, 3, 11, 11)), dtype=dtype, generator=torch.Generator().manual_seed(0))


def _model(cls):
    torch.manual_seed(0)
    return cls()


def _names(report):
    return [s.modules for s in report.fused]


class Outer(nn.Module):
    """Traces, with a block that does not (kept as a leaf: its children are roots) and a hooked one."""

    def __init__(self):
        super().__init__()
        self.inner, self.hooked = Untraceable(), Block()
        self.hooked.register_forward_hook(lambda module, args, out: None)

    def forward(self, x):
        return self.hooked(self.inner(x))


def test_an_untraceable_model_has_its_children_as_roots_and_is_left_alone():
    model = Untraceable()
    captures = Captures()
    tree = roots.find(model, None, captures)
    assert tree.capture is None and "forward is not traceable" in tree.note
    assert [(r.path, r.capture is not None) for r in tree.inside] == [("a", True), ("b", True)]
    assert roots.captured([tree]) == 2
    assert [s.names[0] for s in apply.sites([tree], "memory")] == ["a.conv", "b.conv"]
    assert not any(is_optimized(m) for m in model.modules())
    assert roots.find(model, None, captures).inside[0].capture is tree.inside[0].capture  # captured once


def test_leaves_that_do_not_trace_and_hooked_modules_hold_roots_of_their_own():
    model = Outer()
    tree = roots.find(model, None, Captures())
    assert tree.capture is not None
    assert [r.path for r in roots.walk([tree])] == ["", "inner.a", "inner.b", "hooked"]
    on_copy = roots.on([tree], copy.deepcopy(model))
    assert [r.module is m for r, m in zip(roots.walk(on_copy), (model, model.inner.a))] == [False, False]


def shared_block_model():
    """One Block at two paths (`a.a` and `b.a`), inside two modules that do not trace."""
    model, block = Untraceable(), Block()
    model.a, model.b = Holder(block), Holder(block)
    return model


def test_a_module_at_two_paths_is_a_repeat_at_the_second():
    tree = roots.find(shared_block_model(), None, Captures())
    assert [(r.path, r.repeat) for r in roots.walk([tree])][4:6] == [("b", False), ("b.a", True)]
    assert [r.path for r in roots.walk([tree], installed=True) if r.capture] == ["a.a", "a.b", "b.b"]
    assert [s.names[0] for s in apply.sites([tree], "memory")] == ["a.a.conv", "a.b.conv", "b.a.conv", "b.b.conv"]


def test_needs_shapes_says_which_part_reads_shapes():
    why = roots.needs_shapes(_model(PaddedNet), Captures())
    assert why.startswith("stem and 1 more submodules do not trace without them (TypeError"), why
    assert roots.needs_shapes(_model(ChunkNet), Captures()).startswith("its forward does not trace without them")
    assert roots.needs_shapes(_model(ValueBranch), Captures()) is None
    assert roots.needs_shapes(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), Captures()) is None


@pytest.mark.parametrize("cls", [PaddedNet, ChunkNet])
def test_optimized_at_the_first_call_as_with_example_inputs(cls):
    model, x = _model(cls).double(), _x(dtype=torch.float64)
    optimized = fxfuse.optimize(copy.deepcopy(model))
    report = optimized.fxfuse_report
    assert not report.fused and "captures it at its first call" in report.notes[0], report.notes
    assert is_optimized(optimized) and install.fx_graph(optimized) is None
    assert_equivalent(model, optimized, x, dtype=torch.float64)  # a copy, optimized at its first call
    out = optimized(x)
    torch.testing.assert_close(out, model(x), rtol=1e-12, atol=1e-12)
    with_inputs = fxfuse.optimize(copy.deepcopy(model), (x,)).fxfuse_report
    assert _names(optimized.fxfuse_report) == _names(with_inputs) and with_inputs.fused
    assert optimized.fxfuse_report.notes[0].startswith(f"{cls.__name__}: optimized at its first call")
    assert install.fx_graph(optimized) is not None


def test_the_first_call_in_eval_under_no_grad_then_training_stays_exact():
    model, x = _model(PaddedNet).double(), _x(dtype=torch.float64)
    optimized = fxfuse.optimize(copy.deepcopy(model)).eval()
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model.eval()(x), rtol=1e-12, atol=1e-12)
    assert optimized.fxfuse_report.fused
    model.train(), optimized.train()
    assert_equivalent(model, optimized, x, dtype=torch.float64)


def test_a_keyword_first_call_is_captured_too():
    model, x = _model(PaddedNet), _x()
    optimized = fxfuse.optimize(copy.deepcopy(model))
    torch.testing.assert_close(optimized(x=x), model(x=x), rtol=0, atol=0)
    assert optimized.fxfuse_report.fused


def test_a_deferred_model_pickles_and_copies_deferred():
    model, x = _model(PaddedNet), _x()
    optimized = fxfuse.optimize(copy.deepcopy(model))
    for clone in (pickle.loads(pickle.dumps(optimized)), copy.deepcopy(optimized)):
        assert install.fx_graph(clone) is None and is_optimized(clone)
        clone(x)
        assert _names(clone.fxfuse_report) == _names(fxfuse.optimize(copy.deepcopy(model), (x,)).fxfuse_report)


def test_a_first_call_eager_rejects_raises_eagers_error():
    model = _model(PaddedNet)
    optimized = fxfuse.optimize(copy.deepcopy(model))
    bad = torch.randn(2, 5, 11, 11)  # 5 channels, the stem takes 3
    with pytest.raises(RuntimeError) as eager:
        model(bad)
    with pytest.raises(RuntimeError) as fused:
        optimized(bad)
    assert str(fused.value) == str(eager.value)
    assert "could not be captured with its first call's inputs" in optimized.fxfuse_report.notes[0]
    x = _x()
    torch.testing.assert_close(optimized(x), model(x), rtol=0, atol=0)


def test_explain_without_inputs_says_when_it_is_captured():
    report = fxfuse.explain(_model(PaddedNet))
    assert "captures it at its first call" in report.notes[0]
    assert "explain(model, example_inputs) shows what it fuses then" in report.notes[0]


def test_a_branch_on_values_is_optimized_at_once():
    model = fxfuse.optimize(_model(ValueBranch))
    assert is_optimized(model.block) and model.fxfuse_report.fused
    assert not any("first call" in n for n in model.fxfuse_report.notes)


def test_a_budget_without_inputs_keeps_its_error():
    with pytest.raises(ConfigurationError, match="needs example_inputs"):
        fxfuse.optimize(_model(PaddedNet), memory_budget=0.5)


def test_one_optimize_call_with_a_budget_walks_the_model_once(monkeypatch):
    walks = []
    find = roots.find
    monkeypatch.setattr(roots, "find", lambda *args: walks.append(args[0]) or find(*args))
    model, x = _model(PaddedNet).double(), _x(dtype=torch.float64)
    optimized = fxfuse.optimize(copy.deepcopy(model), x, memory_budget=0.5)
    assert len(walks) == 1 and optimized.fxfuse_report.budget_met is not None
    assert_equivalent(model, optimized, x, dtype=torch.float64)
