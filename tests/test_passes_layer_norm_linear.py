"""LayerNorm → Linear merge (passes/layer_norm_linear.py): what it takes, what it leaves, exactness and bytes."""

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


class PreNorm(nn.Module):
    """A pre-norm residual branch: x + fc(norm(x))."""

    def __init__(self, width=16, norm=None, fc=None):
        super().__init__()
        self.norm = norm if norm is not None else nn.LayerNorm(width)
        self.fc = fc if fc is not None else nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class FunctionalNorm(nn.Module):
    """timm's LayerNorm traced through: F.layer_norm of get_attr parameters, then F.linear."""

    def __init__(self, width=16):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(width)), nn.Parameter(torch.randn(width))
        self.w = nn.Parameter(torch.randn(8, width) / 4)

    def forward(self, x):
        return F.linear(F.layer_norm(x, (16,), self.weight, self.bias, 1e-6), self.w)


class Attention(nn.Module):
    """timm's Attention reads the shape of its input next to the qkv Linear."""

    def __init__(self, width=16):
        super().__init__()
        self.norm, self.qkv = nn.LayerNorm(width), nn.Linear(width, 3 * width)

    def forward(self, x):
        y = self.norm(x)
        batch, tokens, width = y.shape
        return self.qkv(y).reshape(batch, tokens, 3, width).sum(2) * y.dim()


NORMS = [
    nn.LayerNorm(16),
    nn.LayerNorm(16, elementwise_affine=False),
    nn.LayerNorm(16, bias=False),
    nn.LayerNorm(16, eps=1e-6),
]


@pytest.mark.parametrize("mode", ["fast", "memory"])
@pytest.mark.parametrize("norm", NORMS, ids=["affine", "bare", "no-bias", "eps"])
def test_layer_norm_merges_into_the_next_linear(mode, norm):
    model, x = PreNorm(norm=norm), torch.randn(2, 5, 16)
    optimized = fxfuse.optimize(copy.deepcopy(model), x, mode=mode)
    assert _ops(optimized) == ["fxfuse::layer_norm_linear"]
    (site,) = optimized.fxfuse_report.fused
    assert site.modules == ("norm", "fc") and site.pattern == "layer_norm→linear"
    assert_equivalent(model, optimized, x, dtype=torch.float64)
    assert_equivalent(model, optimized, x)
    freed = measure.saved_activation_bytes(model, (x,)) - measure.saved_activation_bytes(optimized, (x,))
    # The layer norm's output (eager also keeps its mean and rstd, one value per row each).
    assert freed >= site.saved_bytes == 2 * 5 * 16 * 4


def test_functional_form_and_shape_reads():
    for model, x in ((FunctionalNorm(), torch.randn(4, 16)), (Attention(), torch.randn(2, 3, 16))):
        optimized = fxfuse.optimize(copy.deepcopy(model), x, mode="fast")
        assert _ops(optimized) == ["fxfuse::layer_norm_linear"], type(model).__name__
        assert_equivalent(model, optimized, x, dtype=torch.float64)


def test_functional_keywords_and_run_time_eps():
    class Keywords(FunctionalNorm):
        def forward(self, x):
            y = F.layer_norm(input=x, normalized_shape=(16,), weight=self.weight, bias=self.bias)
            return F.linear(input=y, weight=self.w)

    class RunTimeEps(FunctionalNorm):
        def forward(self, x):
            eps = x.shape[0] * 1e-6
            return F.linear(F.layer_norm(input=x, normalized_shape=(16,), weight=self.weight, eps=eps), self.w)

    x = torch.randn(4, 16)
    optimized = fxfuse.optimize(copy.deepcopy(model := Keywords()), x, mode="fast")
    assert _ops(optimized) == ["fxfuse::layer_norm_linear"]
    assert_equivalent(model, optimized, x, dtype=torch.float64)
    report = fxfuse.optimize(RunTimeEps(), None, mode="fast").fxfuse_report
    assert not report.fused
    (skipped,) = report.skipped
    assert "eps is not a constant number" in skipped.reason


def test_left_alone_where_the_output_is_read_otherwise():
    class SecondUser(PreNorm):
        def forward(self, x):
            y = self.norm(x)
            return self.fc(y) + y

    class ReadsDtype(PreNorm):  # under autocast the layer norm's dtype is not its input's
        def forward(self, x):
            y = self.norm(x)
            return self.fc(y).to(y.dtype)

    class NormThenPool(PreNorm):
        def forward(self, x):
            return self.fc(self.norm(x).mean(0))

    for model in (SecondUser(), ReadsDtype(), NormThenPool()):
        report = fxfuse.optimize(model, torch.randn(2, 16), mode="fast").fxfuse_report
        assert not report.fused and not report.skipped, type(model).__name__


class CustomNorm(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x) * 2


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda m: m.norm.register_forward_hook(lambda *a: None), "the LayerNorm module has a forward hook"),
        (lambda m: m.fc.register_forward_pre_hook(lambda *a: None), "the Linear module has a forward pre hook"),
        (lambda m: setattr(m, "norm", nn.LayerNorm((3, 16))), "more than the last dimension"),
        (lambda m: setattr(m, "norm", CustomNorm(16)), None),  # traced through: its F.layer_norm feeds a mul
    ],
    ids=["hooked-norm", "hooked-linear", "two-dims", "subclass"],
)
def test_reported_not_fused(make, reason):
    model = PreNorm()
    make(model)
    x = torch.randn(2, 3, 16)
    optimized = fxfuse.optimize(copy.deepcopy(model), x, mode="fast")
    report = optimized.fxfuse_report
    assert not report.fused
    if reason is None:
        assert not report.skipped
    else:
        (skipped,) = report.skipped
        assert skipped.modules == ("norm", "fc") and reason in skipped.reason
    assert_equivalent(model, optimized, x, dtype=torch.float64)


def test_memory_mode_recomputes_a_linear_whose_activation_feeds_no_linear():
    # LayerNorm → Linear → GELU → (not a Linear): recomputing the Linear keeps its input (the layer
    # norm output, 1× wide), where merging the layer norm would leave GELU keeping its 4×-wide input.
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.fc, self.act = nn.LayerNorm(16), nn.Linear(16, 64), nn.GELU()

        def forward(self, x):
            return self.act(self.fc(self.norm(x))).mean(-1)

    x = torch.randn(2, 16)
    assert _ops(fxfuse.optimize(Head(), x, mode="memory")) == ["fxfuse::linear_act"]
    assert _ops(fxfuse.optimize(Head(), x, mode="fast")) == ["fxfuse::layer_norm_linear"]


def test_vit_and_convnext_blocks():
    vit = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64
    )
    x = torch.randn(2, 3, 32, 32)
    optimized = fxfuse.optimize(copy.deepcopy(vit), x, mode="fast")
    # ln_2 → MLP (ln_1 feeds nn.MultiheadAttention, a leaf); GELU → Dropout(0) → Linear.
    assert _ops(optimized) == ["fxfuse::act_linear"] * 2 + ["fxfuse::layer_norm_linear"] * 2
    assert_equivalent(vit, optimized, x, dtype=torch.float64)
    before = measure.saved_activation_bytes(vit, (x,))
    assert measure.saved_activation_bytes(optimized, (x,)) < before
    convnext = torchvision.models.convnext_tiny()
    x = torch.randn(1, 3, 32, 32)
    eager_bytes = measure.saved_activation_bytes(convnext, (x,))
    report = fxfuse.optimize(convnext, x, mode="fast").fxfuse_report
    assert _ops(convnext).count("fxfuse::layer_norm_linear") == 18
    sites = [s.modules for s in report.fused if s.op == "fxfuse::layer_norm_linear"]
    assert sites[0] == ("features.1.0.block.2", "features.1.0.block.3")
    freed = eager_bytes - measure.saved_activation_bytes(convnext, (x,))
    assert freed >= sum(s.saved_bytes for s in report.fused)


def test_bfloat16_autocast_training_matches_eager_autocast():
    assert_trains_like_eager_autocast(PreNorm(), torch.randn(4, 16))
