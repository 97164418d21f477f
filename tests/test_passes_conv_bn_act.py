"""Conv→BN(→act) sites whose conv output is also read for its metadata only (rank, shape, dtype, device)."""

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
