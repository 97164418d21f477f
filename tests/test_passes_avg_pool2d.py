"""AvgPool2d / F.avg_pool2d ⇒ fxfuse::avg_pool2d (passes/avg_pool2d.py): what it takes, what it leaves,
exactness, and the bytes it frees."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxfuse
from fxfuse import measure
from fxfuse.testing import assert_equivalent


def _ops(model):
    return sorted(s.op for s in model.fxfuse_report.fused)


class Transition(nn.Module):
    """A DenseNet transition between two BN→ReLU→conv layers: the pooled conv output is kept by nothing else."""

    def __init__(self, c=8, functional=False):
        super().__init__()
        self.norm, self.conv = nn.BatchNorm2d(c), nn.Conv2d(c, c, 1, bias=False)
        self.pool = nn.AvgPool2d(2, 2)
        self.norm2, self.conv2 = nn.BatchNorm2d(c), nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.functional = functional

    def forward(self, x):
        y = self.conv(F.relu(self.norm(x)))
        y = F.avg_pool2d(y, 2, 2, ceil_mode=True) if self.functional else self.pool(y)
        return self.conv2(F.relu(self.norm2(y)))


def _x(c=8):
    return torch.randn(2, c, 10, 10).contiguous(memory_format=torch.channels_last)


def _kept_like_input(model, x):
    """Tensors of the input's shape that autograd keeps during a forward, other than the input itself."""
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        model(x)
    return [t for t in kept if t.shape == x.shape and t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()]


@pytest.mark.parametrize("functional", [False, True])
@pytest.mark.parametrize("mode", ["fast", "memory", "auto"])
def test_exact_and_frees_the_pooled_input(mode, functional):
    model, x = Transition(functional=functional), _x()
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,), mode=mode)
    assert "fxfuse::avg_pool2d" in _ops(optimized)
    assert_equivalent(model, optimized, x, dtype=torch.float64)
    assert_equivalent(model, optimized, x)
    assert _kept_like_input(optimized, x) == []  # the conv output, which eager's pool keeps
    if not functional:
        without = fxfuse.optimize(copy.deepcopy(model), (x,), mode=mode)
        without.pool.register_forward_hook(lambda *a: None)  # a hooked pool stays eager's
        freed = measure.saved_activation_bytes(without, (x,)) - measure.saved_activation_bytes(optimized, (x,))
        assert freed == 2 * 8 * 10 * 10 * 4


def test_reported_with_the_bytes_it_frees():
    model, x = Transition(), _x()
    optimized = fxfuse.optimize(model, (x,), mode="memory")
    (site,) = [s for s in optimized.fxfuse_report.fused if s.op == "fxfuse::avg_pool2d"]
    assert site.saved_bytes == 2 * 8 * 10 * 10 * 4
    assert "keeps none of the input" in site.reason


def test_input_kept_elsewhere_frees_nothing():
    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(8, 1, 1))

        def forward(self, x):
            y = (x * self.w).sigmoid()
            return F.avg_pool2d(y, 2).sum() + y.sum()

    class Shared(Both):
        def forward(self, x):
            y = (x * self.w).exp()  # exp keeps its output, which is also the pooled input
            return F.avg_pool2d(y, 2)

    x = _x()
    optimized = fxfuse.optimize(Shared(), (x,), mode="memory")
    assert "fxfuse::avg_pool2d" in _ops(optimized)
    assert measure.saved_activation_bytes(optimized, (x,)) == measure.saved_activation_bytes(Shared(), (x,))
    assert_equivalent(Shared(), optimized, x, dtype=torch.float64)
    both = fxfuse.optimize(Both(), (x,))
    (site,) = [s for s in both.fxfuse_report.fused if s.op == "fxfuse::avg_pool2d"]
    assert site.saved_bytes == 0  # the sigmoid's output has two users: the estimate does not count it
    assert_equivalent(Both(), both, x, dtype=torch.float64)


def test_hooked_pool_stays_a_module_call():
    model, x = Transition(), _x()
    calls = []
    model.pool.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,), mode="memory")
    assert "fxfuse::avg_pool2d" not in _ops(optimized)
    optimized(x)
    assert calls == [(2, 8, 5, 5)]


def test_subclass_with_its_own_forward_is_traced_through():
    class Pool(nn.AvgPool2d):
        def forward(self, x):
            return super().forward(x) * 1.0

    model, x = Transition(), _x()
    model.pool = Pool(2, 2)
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,), mode="memory")
    assert "fxfuse::avg_pool2d" in _ops(optimized)
    assert_equivalent(model, optimized, x, dtype=torch.float64)


def test_eval_and_no_grad_are_eagers():
    model, x = Transition().eval(), _x()
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,))
    with torch.no_grad():
        assert torch.equal(optimized(x), model(x))


class Configured(Transition):
    """The transition with a pool whose settings change the output: as a module, or F.avg_pool2d with keywords."""

    def __init__(self, settings, functional):
        super().__init__()
        self.pool = nn.AvgPool2d(**settings)
        self.settings, self.functional = settings, functional

    def forward(self, x):
        y = self.conv(F.relu(self.norm(x)))
        y = F.avg_pool2d(y, **self.settings) if self.functional else self.pool(y)
        return self.conv2(F.relu(self.norm2(y)))


@pytest.mark.parametrize("functional", [False, True], ids=["module", "functional"])
@pytest.mark.parametrize(
    "settings",
    [
        dict(kernel_size=3, stride=2, ceil_mode=True),  # 10 → 5 rows, not floor's 4
        dict(kernel_size=3, stride=2, padding=1, count_include_pad=False),  # border windows: fewer elements
        dict(kernel_size=2, divisor_override=3),
    ],
    ids=["ceil_mode", "count_include_pad", "divisor_override"],
)
def test_pool_settings_are_kept(settings, functional):
    model, x = Configured(settings, functional), _x()
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,), mode="memory")
    assert "fxfuse::avg_pool2d" in _ops(optimized)
    assert optimized(x).shape == model(x).shape
    assert_equivalent(model, optimized, x, dtype=torch.float64)
