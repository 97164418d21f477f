"""Activation → Linear merge (passes/act_linear.py): what it takes, what it leaves, exactness and bytes."""

import copy

import pytest
import torch
import torch.nn.functional as F
import torchvision
from support.autocast_training import assert_trains_like_eager_autocast
from torch import nn

import fxfuse
from fxfuse import measure
from fxfuse.testing import assert_equivalent


def _ops(model):
    return sorted(s.op for s in model.fxfuse_report.fused)


class MLP(nn.Module):
    """A transformer / ConvNeXt MLP: fc1 → act → [between] → fc2, with a residual."""

    def __init__(self, width=16, act=None, between=()):
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.act = act or nn.GELU()
        self.between = nn.Sequential(*between)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(self.between(self.act(self.fc1(x))))


class FunctionalMLP(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4 * width, width) / 4)
        self.w2 = nn.Parameter(torch.randn(width, 4 * width) / 8)

    def forward(self, x):
        return F.linear(F.gelu(F.linear(x, self.w1), approximate="tanh"), self.w2)


ACTS = [nn.GELU(), nn.GELU(approximate="tanh"), nn.SiLU(), nn.Hardswish(), nn.LeakyReLU(0.2), nn.ReLU6()]


@pytest.mark.parametrize("mode", ["fast", "memory"])
@pytest.mark.parametrize("act", ACTS, ids=lambda a: type(a).__name__)
def test_mlp_activation_merges_into_the_next_linear(mode, act):
    model, x = MLP(act=act), torch.randn(2, 5, 16)
    optimized = fxfuse.optimize(copy.deepcopy(model), x, mode=mode)
    # In mode="memory" too: the same bytes as recomputing fc1 (linear_act), and no matmul twice.
    assert _ops(optimized) == ["fxfuse::act_linear"]
    (site,) = optimized.fxfuse_report.fused
    assert site.modules == ("act", "fc2")
    assert_equivalent(model, optimized, x, dtype=torch.float64)
    assert_equivalent(model, optimized, x)
    freed = measure.saved_activation_bytes(model, (x,)) - measure.saved_activation_bytes(optimized, (x,))
    assert freed == site.saved_bytes == 2 * 5 * 64 * 4  # the activation output, 4x the width


def test_through_identity_and_zero_dropout_modules():
    model, x = MLP(between=(nn.Dropout(0.0), nn.Identity())), torch.randn(3, 16)
    optimized = fxfuse.optimize(copy.deepcopy(model), x, mode="fast")
    assert _ops(optimized) == ["fxfuse::act_linear"]
    assert_equivalent(model, optimized, x, dtype=torch.float64)
    # A Dropout whose p changes after optimize runs as it is: eager semantics, same RNG draws.
    model.between[0].p = optimized.between[0].p = 0.5
    torch.manual_seed(0)
    ref = model(x)
    torch.manual_seed(0)
    torch.testing.assert_close(optimized(x), ref)


@pytest.mark.parametrize(
    "model",
    [
        MLP(act=nn.ReLU()),  # keeps its output, which fc2 keeps anyway: nothing to free
        MLP(act=nn.SiLU(inplace=True)),
        MLP(between=(nn.Dropout(0.1),)),  # the mask and dropout output are kept in training
    ],
    ids=["relu", "inplace", "dropout"],
)
def test_left_alone(model):
    optimized = fxfuse.optimize(copy.deepcopy(model), torch.randn(2, 16), mode="fast")
    assert "fxfuse::act_linear" not in _ops(optimized)


def test_activation_with_another_user_is_left_alone():
    class TwoUsers(MLP):
        def forward(self, x):
            a = self.act(self.fc1(x))
            return self.fc2(a) + a.sum(-1, keepdim=True)

    assert "fxfuse::act_linear" not in _ops(fxfuse.optimize(TwoUsers(), torch.randn(2, 16), mode="fast"))


def test_hooked_linear_is_reported_not_fused():
    model = MLP()
    model.fc2.register_forward_hook(lambda *a: None)
    report = fxfuse.optimize(model, torch.randn(2, 16), mode="fast").fxfuse_report
    assert "fxfuse::act_linear" not in [s.op for s in report.fused]
    assert ("act", "fc2") in [s.modules for s in report.skipped]


def test_functional_form():
    model, x = FunctionalMLP(), torch.randn(4, 16)
    optimized = fxfuse.optimize(copy.deepcopy(model), x, mode="fast")
    assert _ops(optimized) == ["fxfuse::act_linear"]
    assert_equivalent(model, optimized, x, dtype=torch.float64)


def test_first_linear_still_recomputes_where_its_activation_feeds_no_linear():
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.act = nn.Linear(16, 64), nn.GELU()

        def forward(self, x):
            return self.act(self.fc(x)).mean(-1)

    assert _ops(fxfuse.optimize(Head(), torch.randn(2, 16), mode="memory")) == ["fxfuse::linear_act"]


def test_vit_and_convnext_mlps():
    vit = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64
    )
    x = torch.randn(2, 3, 32, 32)
    optimized = fxfuse.optimize(copy.deepcopy(vit), x, mode="fast")
    assert _ops(optimized).count("fxfuse::act_linear") == 2  # GELU → Dropout(0) → Linear
    assert_equivalent(vit, optimized, x, dtype=torch.float64)
    convnext = torchvision.models.convnext_tiny()
    report = fxfuse.optimize(convnext, torch.randn(1, 3, 32, 32), mode="fast").fxfuse_report
    assert _ops(convnext).count("fxfuse::act_linear") == 18  # and 18 layer_norm_linear (test_passes_layer_norm_linear)
    assert report.fused[0].modules == ("features.1.0.block.4", "features.1.0.block.5")


def test_bfloat16_autocast_training_matches_eager_autocast():
    assert_trains_like_eager_autocast(MLP(), torch.randn(4, 16), exact=False)
