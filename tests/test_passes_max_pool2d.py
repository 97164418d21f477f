"""MaxPool2d / F.max_pool2d ⇒ fxfuse::max_pool2d (passes/max_pool2d.py): what it takes, what it leaves,
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


class Stem(nn.Module):
    """ResNet's stem: Conv→BN→ReLU, then a max pool that is the activation's only reader."""

    def __init__(self, c=8, how="module"):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.how = how

    def forward(self, x):
        y = F.relu(self.bn(self.conv(x)))
        if self.how == "module":
            y = self.pool(y)
        elif self.how == "functional":
            y = F.max_pool2d(y, 3, 2, 1)
        else:
            y = torch.max_pool2d(y, [3, 3], [2, 2], [1, 1])
        return F.relu(self.bn2(self.conv2(y)))


def _x():
    return torch.randn(2, 3, 12, 12).contiguous(memory_format=torch.channels_last)


def _int64_kept(model, x):
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        model(x)
    return [t for t in kept if t.dtype == torch.int64]


@pytest.mark.parametrize("how", ["module", "functional", "torch"])
@pytest.mark.parametrize("mode", ["fast", "memory", "auto"])
def test_exact_and_frees_the_indices_and_the_pooled_input(mode, how):
    model, x = Stem(how=how), _x()
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,), mode=mode)
    assert "fxfuse::max_pool2d" in _ops(optimized)
    assert_equivalent(model, optimized, x, dtype=torch.float64)
    assert_equivalent(model, optimized, x)
    assert _int64_kept(optimized, x) == [] and _int64_kept(model, x) != []
    if how == "module":
        without = fxfuse.optimize(copy.deepcopy(model), (x,), mode=mode)
        without.pool.register_forward_hook(lambda *a: None)  # a hooked pool stays eager's
        freed = measure.saved_activation_bytes(without, (x,)) - measure.saved_activation_bytes(optimized, (x,))
        out = 2 * 8 * 6 * 6
        # the int64 indices become bytes, and the pooled input (the fused BN→ReLU keeps its input) goes
        assert freed == out * 7 + 2 * 8 * 12 * 12 * 4


def test_reported_with_the_bytes_it_frees():
    model, x = Stem(), _x()
    optimized = fxfuse.optimize(model, (x,), mode="memory")
    (site,) = [s for s in optimized.fxfuse_report.fused if s.op == "fxfuse::max_pool2d"]
    assert site.saved_bytes == 2 * 8 * 12 * 12 * 4 + 2 * 8 * 6 * 6 * 7
    assert "one byte per output element" in site.reason


def test_return_indices_and_hooks_stay_eagers():
    class WithIndices(Stem):
        def forward(self, x):
            y, idx = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2, return_indices=True)
            return y * idx.float().mean()

    x, model = _x(), WithIndices()
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,), mode="memory")
    assert "fxfuse::max_pool2d" not in _ops(optimized)
    assert_equivalent(model, optimized, x, dtype=torch.float64)
    calls = []
    hooked = Stem()
    hooked.pool.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    optimized = fxfuse.optimize(copy.deepcopy(hooked), (x,), mode="memory")
    assert "fxfuse::max_pool2d" not in _ops(optimized)
    optimized(x)
    assert calls == [(2, 8, 6, 6)]
    assert any("hook" in s.reason for s in optimized.fxfuse_report.skipped if s.name == "pool")


def test_large_window_is_skipped_with_a_reason():
    class Big(nn.Module):
        def forward(self, x):
            return F.max_pool2d(x * 2, 17)

    x = torch.randn(1, 2, 20, 20)
    optimized = fxfuse.optimize(Big(), (x,), mode="memory")
    assert "fxfuse::max_pool2d" not in _ops(optimized)
    assert any("256" in s.reason for s in optimized.fxfuse_report.skipped)


def test_eval_and_no_grad_are_eagers():
    model, x = Stem().eval(), _x()
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,))
    with torch.no_grad():
        assert torch.equal(optimized(x), model(x))


class Configured(Stem):
    """The stem with a pool whose settings change the output: as a module, or F.max_pool2d with keywords."""

    def __init__(self, settings, functional):
        super().__init__()
        self.pool = nn.MaxPool2d(**settings)
        self.settings, self.functional = settings, functional

    def forward(self, x):
        y = F.relu(self.bn(self.conv(x)))
        y = F.max_pool2d(y, **self.settings) if self.functional else self.pool(y)
        return F.relu(self.bn2(self.conv2(y)))


@pytest.mark.parametrize("functional", [False, True], ids=["module", "functional"])
@pytest.mark.parametrize(
    "settings",
    [
        dict(kernel_size=3, stride=2, ceil_mode=True),  # 12 → 6 rows, not floor's 5
        dict(kernel_size=3, stride=1, padding=1, dilation=2),  # 12 → 10
        dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0)),
    ],
    ids=["ceil_mode", "dilation", "non-square"],
)
def test_pool_settings_are_kept(settings, functional):
    model = Configured(settings, functional)
    x = torch.randn(2, 3, 12, 12).contiguous(memory_format=torch.channels_last)
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,), mode="memory")
    assert "fxfuse::max_pool2d" in _ops(optimized)
    assert optimized(x).shape == model(x).shape
    assert_equivalent(model, optimized, x, dtype=torch.float64)


def test_module_returning_indices_stays_eagers():
    class Unpool(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.pool, self.unpool = nn.MaxPool2d(2, return_indices=True), nn.MaxUnpool2d(2)

        def forward(self, x):
            y, idx = self.pool(F.gelu(self.conv(x)))
            return self.unpool(y * 2, idx)

    model, x = Unpool(), _x()
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,), mode="memory")
    assert "fxfuse::max_pool2d" not in _ops(optimized)
    assert any("return_indices" in s.reason for s in optimized.fxfuse_report.skipped if s.name == "pool")
    assert_equivalent(model, optimized, x, dtype=torch.float64)


def test_input_read_elsewhere_frees_only_the_indices():
    class Both(Stem):
        def forward(self, x):
            y = F.relu(self.bn(self.conv(x)))
            return F.relu(self.bn2(self.conv2(self.pool(y)))).mean() + y.mean()

    model, x = Both(), _x()
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,), mode="memory")
    (site,) = [s for s in optimized.fxfuse_report.fused if s.op == "fxfuse::max_pool2d"]
    assert site.saved_bytes == 2 * 8 * 6 * 6 * 7  # the pooled input has another reader: only the indices count
    assert_equivalent(model, optimized, x, dtype=torch.float64)
