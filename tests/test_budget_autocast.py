"""Budgets counted in the precision the model trains in (optimize inside torch.autocast, or autocast=):
the meta-device counts run on fake tensors of the inputs' device type under that autocast
(measure.counting_under), so what is counted is what eager keeps there and the budget holds there.

Measured as the user would: saved bytes of a forward under the same autocast. The weights' autocast
copies are part of both eager's and the plan's counts (autocast makes them once per forward)."""

import copy

import pytest
import torch
import torchvision
from torch import nn

import fxfuse
from fxfuse import measure

BF16 = torch.bfloat16


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for cin, cout in ((3, 16), (16, 32), (32, 32), (32, 64)):
        layers += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).train()


def _vit() -> nn.Module:
    return torchvision.models.vit_b_16(image_size=32)


MODELS = {
    "resnet50": (torchvision.models.resnet50, 32),
    "efficientnet_b0": (torchvision.models.efficientnet_b0, 32),
    "convnext_tiny": (torchvision.models.convnext_tiny, 32),
    "vit_b_16": (_vit, 32),
}


def _saved_under_autocast(model: nn.Module, x: torch.Tensor) -> int:
    with torch.autocast("cpu", dtype=BF16):
        return measure.saved_activation_bytes(model, (x,))


def _optimized_inside_autocast(model: nn.Module, x: torch.Tensor, **kwargs) -> nn.Module:
    with torch.autocast("cpu", dtype=BF16):
        return fxfuse.optimize(copy.deepcopy(model), x, **kwargs)


def _check_budget_met_and_counted(model: nn.Module, x: torch.Tensor, budget: float) -> None:
    eager = _saved_under_autocast(model, x)
    fused = _optimized_inside_autocast(model, x, memory_budget=budget)
    report = fused.fxfuse_report
    saved = _saved_under_autocast(fused, x)
    assert report.budget_met, str(report)
    assert saved <= budget * eager * 1.005, (saved / eager, str(report))
    assert report.eager_saved_bytes == pytest.approx(eager, rel=0.02)
    assert report.selected_saved_bytes == pytest.approx(saved, rel=0.02)


def _check_peak_budget_met(model: nn.Module, x: torch.Tensor, peak_budget: float) -> None:
    fused = _optimized_inside_autocast(model, x, peak_budget=peak_budget)
    report = fused.fxfuse_report
    assert report.peak_budget_met, str(report)
    with measure.counting_under(measure.Autocast("cpu", BF16)):
        eager_peak = measure.step_peak_bytes_meta(model, (x,))
    assert report.eager_peak_bytes == eager_peak
    assert report.selected_peak_bytes <= peak_budget * eager_peak
    # The counted saved bytes of the chosen plan are what the optimized model keeps under autocast.
    assert report.selected_saved_bytes == pytest.approx(_saved_under_autocast(fused, x), rel=0.02)


def test_the_counts_are_what_eager_keeps_under_autocast_not_in_float32():
    model, x = _cnn(), torch.randn(4, 3, 16, 16)
    eager = _saved_under_autocast(model, x)
    float32 = measure.saved_activation_bytes(model, (x,))
    with measure.counting_under(measure.Autocast("cpu", BF16)):
        counted = measure.saved_activation_bytes_meta(model, (x,))
    # Within the per-channel BN statistics: torch's fake kernel of a bf16 batch_norm makes them bf16, where
    # the CPU kernel keeps float32 (576 bytes of 664 KB here).
    assert counted == pytest.approx(eager, rel=1e-3)
    assert counted < 0.8 * float32  # bf16 activations: the float32 count would be the wrong one
    assert measure.saved_activation_bytes_meta(model, (x,)) == float32  # outside counting_under: as before


def test_counts_under_autocast_leave_the_model_and_the_autocast_state_alone():
    model, x = _cnn(), torch.randn(2, 3, 16, 16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with measure.counting_under(measure.Autocast("cpu", BF16)):
        measure.step_peak_bytes_meta(model, (x,))
        assert measure.counting_autocast() == measure.Autocast("cpu", BF16)
    assert measure.counting_autocast() is None
    assert not torch.is_autocast_enabled("cpu")
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("budget", [0.7, 0.5, 0.3])
def test_budgets_are_met_under_autocast_and_counted_within_two_percent(budget):
    _check_budget_met_and_counted(_cnn(), torch.randn(4, 3, 48, 48), budget)


def test_the_autocast_argument_counts_as_optimize_inside_autocast_does():
    model, x = _cnn(), torch.randn(4, 3, 16, 16)
    inside = _optimized_inside_autocast(model, x, memory_budget=0.5).fxfuse_report
    given = fxfuse.optimize(copy.deepcopy(model), x, memory_budget=0.5, autocast=BF16).fxfuse_report
    assert given.selected_saved_bytes == inside.selected_saved_bytes
    assert given.eager_saved_bytes == inside.eager_saved_bytes
    assert [s.name for s in given.fused] == [s.name for s in inside.fused]
    assert "bfloat16 autocast on cpu" in inside.precision and "enabled at the call" in inside.precision
    assert "bfloat16 autocast on cpu" in given.precision and "autocast=" in given.precision
    assert f"precision: {given.precision}" in str(given)
    assert given.to_dict()["precision"] == given.precision


def test_without_autocast_the_counts_and_the_report_say_float32():
    model, x = _cnn(), torch.randn(4, 3, 16, 16)
    report = fxfuse.optimize(copy.deepcopy(model), x, memory_budget=0.5).fxfuse_report
    assert report.eager_saved_bytes == measure.saved_activation_bytes(model, (x,))
    assert report.precision == "counted in float32 dtypes, without autocast"


def test_a_bad_autocast_dtype_is_a_configuration_error():
    with pytest.raises(fxfuse.errors.ConfigurationError, match="autocast is the dtype"):
        fxfuse.optimize(_cnn(), torch.randn(2, 3, 16, 16), autocast=torch.float64)
    with pytest.raises(fxfuse.errors.ConfigurationError, match="autocast is the dtype"):
        fxfuse.optimize(_cnn(), torch.randn(2, 3, 16, 16), autocast="bf16")
    with pytest.raises(fxfuse.errors.ConfigurationError, match="no autocast on meta"):
        fxfuse.optimize(_cnn(), torch.empty(2, 3, 16, 16, device="meta"), memory_budget=0.5, autocast=BF16)


def test_peak_budget_is_met_under_autocast():
    _check_peak_budget_met(_cnn(), torch.randn(4, 3, 16, 16), 0.7)


def test_bottleneck_resnet_memory_budget_half_is_met_under_autocast():
    """The issue's case (ResNet-50 kept 0.561x of eager's saved bytes under bf16 autocast at budget 0.5) on
    ResNet-50's blocks, one bottleneck per stage (stem, 1x1-3x3-1x1, downsample branches, residual adds);
    ResNet-50 itself runs in make zoo (test_zoo_budgets_are_met_under_autocast[0.5-resnet50])."""
    torch.manual_seed(0)
    model = torchvision.models.resnet.ResNet(torchvision.models.resnet.Bottleneck, [1, 1, 1, 1]).train()
    _check_budget_met_and_counted(model, torch.randn(2, 3, 32, 32), 0.5)


@pytest.mark.zoo
@pytest.mark.parametrize("budget", [0.7, 0.5, 0.3])
@pytest.mark.parametrize("name", list(MODELS))
def test_zoo_budgets_are_met_under_autocast(name, budget):
    factory, size = MODELS[name]
    torch.manual_seed(0)
    _check_budget_met_and_counted(factory().train(), torch.randn(2, 3, size, size), budget)


@pytest.mark.zoo
@pytest.mark.parametrize("name", ["resnet50", "convnext_tiny"])
def test_zoo_peak_budget_is_met_under_autocast(name):
    # Larger inputs than the saved-bytes sweep: at 32x32 the parameters' gradients and the weights' bf16
    # copies are nearly all of the step peak, which no recompute lowers (ConvNeXt-T's floor there: 0.999x).
    factory, _ = MODELS[name]
    torch.manual_seed(0)
    _check_peak_budget_met(factory().train(), torch.randn(8, 3, 128, 128), 0.8)
