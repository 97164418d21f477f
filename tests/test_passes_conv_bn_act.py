"""Conv→BN(→act) sites: conv outputs also read for their metadata only (rank, shape, dtype, device), and mixed
forms (a conv traced to F.conv2d then a BN module; a conv module then F.batch_norm)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxfuse
from fxfuse.fusion import runtime
from fxfuse.testing import assert_equivalent

F64 = torch.float64


class Checked(nn.Module):
    """Reads every kind of metadata of the conv output before its BN, as timm's norm layers do."""

    def __init__(self, conv=None):
        super().__init__()
        self.conv = conv or nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        torch._assert(y.ndim == 4, "expected a 4-D conv output")
        torch._assert(y.dim() == 4, "dim")
        n, c, h, w = y.shape
        torch._assert(y.size(1) == 4, "channels")
        scale = torch.ones((), dtype=y.dtype, device=y.device)
        return F.relu(self.bn(y)) * scale + (h * w) / 16


class FunctionalChecked(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3, 3, 3))
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        y = F.conv2d(x, self.weight, None, 1, 1)
        torch._assert(y.shape[1] == 4, "channels")
        return F.batch_norm(y, self.bn.running_mean, self.bn.running_var, self.bn.weight, self.bn.bias, True)


@pytest.mark.parametrize(
    "model",
    [Checked, lambda: Checked(nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")), FunctionalChecked],
    ids=["module", "reflect", "functional"],
)
def test_metadata_reads_do_not_block_fusion_and_stay_exact(model):
    torch.manual_seed(0)
    model = model().to(F64)
    x = torch.randn(2, 3, 9, 9, dtype=F64)
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    report = optimized.fxfuse_report
    assert len(report.fused) == 1 and report.fused[0].op == "fxfuse::conv_bn_act", report
    assert not report.skipped
    assert_equivalent(model, optimized, x, steps=2)


@pytest.mark.parametrize("bad", [(3, 9, 9), (2, 5, 9, 9)], ids=["3-D", "channels"])
def test_checks_on_the_conv_output_still_raise_what_eager_raises(bad):
    model = Checked()
    optimized = fxfuse.optimize(copy.deepcopy(model))
    x = torch.randn(*bad)
    with pytest.raises(Exception) as eager:
        model(x)
    with pytest.raises(eager.type) as fused:
        optimized(x)
    if eager.type is AssertionError:
        assert str(fused.value) == str(eager.value)


def test_a_real_second_use_still_keeps_the_conv_output():
    class TwoUses(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

        def forward(self, x):
            y = self.conv(x)
            return self.bn(y) + y.sum()

    report = fxfuse.explain(TwoUses())
    assert [s.reason for s in report.skipped] == ["the conv output has other users, so it must be kept anyway"]


@pytest.mark.parametrize("autocast", [False, True])
def test_output_like_has_the_conv_outputs_metadata_and_no_data(autocast):
    conv = nn.Conv2d(3, 4, 3, stride=2, padding=1)
    x = torch.randn(2, 3, 9, 9)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        like = runtime.conv_module_output_like(x, conv)
        real = conv(x)
    assert (like.shape, like.dtype, like.device) == (real.shape, real.dtype, real.device)
    assert like.untyped_storage().nbytes() <= like.element_size()


class SamePaddingConv(nn.Conv2d):
    """efficientnet_pytorch's Conv2dStaticSamePadding shape: an nn.Conv2d subclass whose own forward pads and
    calls F.conv2d on its parameters, so fxfuse traces through it."""

    def __init__(self, cin, cout, k, stride=1, groups=1):
        super().__init__(cin, cout, k, stride=stride, groups=groups, bias=False)
        self.pad = nn.ZeroPad2d((k - 1) // 2)

    def forward(self, x):
        return F.conv2d(self.pad(x), self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class ConvSubclassThenBN(nn.Module):
    def __init__(self, act=nn.SiLU):
        super().__init__()
        self.conv1, self.bn1, self.act1 = SamePaddingConv(3, 8, 3), nn.BatchNorm2d(8), act()
        self.conv2, self.bn2 = SamePaddingConv(8, 8, 3, stride=2, groups=8), nn.BatchNorm2d(8, momentum=None)

    def forward(self, x):
        return self.bn2(self.conv2(self.act1(self.bn1(self.conv1(x))))).mean((2, 3))


class ConvModuleThenFunctionalBN(nn.Module):
    def __init__(self, padding_mode="zeros"):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, padding_mode=padding_mode)
        self.register_buffer("mean", torch.zeros(8))
        self.register_buffer("var", torch.ones(8))
        self.weight, self.bias = nn.Parameter(torch.rand(8) + 0.5), nn.Parameter(torch.randn(8))

    def forward(self, x):
        y = F.batch_norm(self.conv(x), self.mean, self.var, self.weight, self.bias, self.training, 0.1, 1e-5)
        return F.relu(y).mean((2, 3))


def _fused_ops(model):
    return [(s.modules, s.op) for s in model.fxfuse_report.fused]


@pytest.mark.parametrize(
    "make",
    [
        ConvSubclassThenBN,
        lambda: ConvSubclassThenBN(nn.ReLU),
        ConvModuleThenFunctionalBN,
        lambda: ConvModuleThenFunctionalBN("reflect"),
    ],
    ids=["conv-subclass-bn-module-silu", "conv-subclass-bn-module-relu", "conv-module-F.batch_norm", "reflect"],
)
def test_mixed_forms_are_fused_and_exact(make):
    model, x = make(), torch.randn(2, 3, 9, 9)
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,))
    ops_used = [op for _, op in _fused_ops(optimized)]
    assert ops_used and all(op == "fxfuse::conv_bn_act" for op in ops_used), optimized.fxfuse_report.skipped
    assert not [s for s in optimized.fxfuse_report.skipped if "conv2d" in s.pattern]
    assert_equivalent(model, optimized, x, dtype=torch.float64)


def test_mixed_form_reads_the_bn_module_at_call_time():
    model, x = ConvSubclassThenBN(), torch.randn(2, 3, 9, 9, dtype=torch.double)
    model = model.double()
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,))
    for m in (model, optimized):
        m.bn1.eps, m.bn1.momentum = 1e-3, 0.5
        with torch.no_grad():
            m.bn1.weight.mul_(2)
    assert_equivalent(model, optimized, x)
    optimized(x)
    assert optimized.bn1.num_batches_tracked.item() == 1 and optimized.bn2.num_batches_tracked.item() == 1
