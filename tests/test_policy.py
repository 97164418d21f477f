"""memory_budget= and mode="auto": the budget is met when reachable, choices are monotone, results exact."""

import copy
import pickle

import pytest
import torch
import torchvision
from torch import nn

import fxfuse
from fxfuse import measure
from fxfuse.errors import ConfigurationError
from fxfuse.fusion import policy
from fxfuse.testing import assert_equivalent


def _resnet():
    torch.manual_seed(0)
    return torchvision.models.resnet50(num_classes=10)


def _mixed():
    """Depthwise (cheap to recompute), 1x1 and dense 3x3 (expensive) Conv→BN→act sites."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1, groups=16),
        nn.BatchNorm2d(16),
        nn.SiLU(),
        nn.Conv2d(16, 32, 1),
        nn.BatchNorm2d(32),
        nn.GELU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    )


@pytest.fixture(scope="module")
def resnet_budgets():
    """ResNet-50 at 32x32 optimized under a range of budgets: (budget, eager bytes, real bytes, report)."""
    x = torch.randn(2, 3, 32, 32)
    eager = measure.saved_activation_bytes(_resnet(), (x,))
    results = []
    for budget in (1.0, 0.8, 0.7, 0.55, 0.2):
        model = fxfuse.optimize(_resnet(), x, memory_budget=budget)
        results.append((budget, eager, measure.saved_activation_bytes(model, (x,)), model.fxfuse_report))
    all_sites = measure.saved_activation_bytes(fxfuse.optimize(_resnet()), (x,))
    return results, all_sites


def test_budget_is_met_whenever_reachable(resnet_budgets):
    results, all_sites = resnet_budgets
    for budget, eager, real, report in results:
        reachable = all_sites <= budget * eager
        assert report.budget_met == reachable, (budget, real / eager, all_sites / eager)
        assert report.eager_saved_bytes == eager  # the meta-device count is the real count
        assert report.selected_saved_bytes == real
        if reachable:
            assert real <= budget * eager
        else:
            assert real == all_sites  # falls back to the most it can do
            assert any("not reachable" in note for note in report.notes)


def test_tighter_budget_never_saves_less(resnet_budgets):
    results, _ = resnet_budgets
    saved = [real for _, _, real, _ in results]
    assert saved == sorted(saved, reverse=True)
    chosen = [{s.modules for s in r.fused if s.op == "fxfuse::conv_bn_act"} for *_, r in results]
    for looser, tighter in zip(chosen, chosen[1:]):
        assert looser <= tighter


def test_budget_takes_cheapest_recompute_first(resnet_budgets):
    results, _ = resnet_budgets
    _, _, _, report = next(r for r in results if r[0] == 0.7)
    cost = {s.modules: s.recompute_flops / s.saved_bytes for s in report.fused if s.op == "fxfuse::conv_bn_act"}
    skipped = [s for s in report.skipped if s.reason.startswith("recompute not chosen")]
    assert cost and skipped
    rejected = [float(s.reason.split(": ")[1].split(" FLOP/B")[0]) for s in skipped]
    assert max(cost.values()) <= min(rejected) + 1e-6


def test_report_says_what_the_budget_chose(resnet_budgets):
    results, _ = resnet_budgets
    _, _, _, report = next(r for r in results if r[0] == 0.7)
    text = str(report)
    assert "why" in text and "budget 0.70×" in text and "met" in text
    assert report.to_dict()["budget_met"] is True


@pytest.mark.parametrize("budget", [0.9, 0.75, 0.6])
def test_budget_selection_is_exact(budget):
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    model = _mixed().double()
    fused = fxfuse.optimize(copy.deepcopy(model), x, memory_budget=budget)
    assert fused.fxfuse_report.fused
    assert_equivalent(model, fused, x, dtype=torch.float64)


def test_auto_recomputes_only_cheap_layers():
    x = torch.randn(2, 3, 16, 16)
    model = fxfuse.optimize(_mixed(), x, mode="auto")
    recomputed = {s.modules[0] for s in model.fxfuse_report.fused if s.op == "fxfuse::conv_bn_act"}
    # depthwise 3x3: 4.5 FLOP/B, 1x1 from 16 channels: 8 FLOP/B, first 3x3 from 3 channels: 13.5 FLOP/B;
    # the dense 3x3 from 32 channels costs 144 FLOP/B.
    assert recomputed == {"0", "3", "6"}
    pointwise = {s.modules for s in model.fxfuse_report.fused if s.op == "fxfuse::batch_norm_act"}
    assert pointwise == {("10", "11")}
    assert any(s.modules[0] == "9" and "auto limit" in s.reason for s in model.fxfuse_report.skipped)
    assert model.fxfuse_report.mode == "auto"
    # float64: in float32 a ReLU input within rounding of 0 can flip the kink in either model.
    assert_equivalent(_mixed(), model, x, dtype=torch.float64)


def test_auto_needs_no_example_inputs():
    with_inputs = fxfuse.explain(_mixed(), torch.randn(2, 3, 16, 16), mode="auto")
    without = fxfuse.explain(_mixed(), mode="auto")
    assert {s.modules for s in with_inputs.fused} == {s.modules for s in without.fused}


def test_selection_survives_pickle_and_deepcopy():
    x = torch.randn(2, 3, 16, 16)
    model = fxfuse.optimize(_mixed(), x, memory_budget=0.8)
    expected = measure.saved_activation_bytes(model, (x,))
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert measure.saved_activation_bytes(clone, (x,)) == expected
        assert {s.modules for s in clone.fxfuse_report.fused} == {s.modules for s in model.fxfuse_report.fused}


def test_budget_leaves_the_users_model_alone():
    model = _mixed()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fxfuse.explain(model, torch.randn(2, 3, 16, 16), memory_budget=0.7)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not fxfuse.fusion.is_optimized(model)


def test_budget_without_example_inputs_is_a_clear_error():
    with pytest.raises(ConfigurationError, match="example_inputs"):
        fxfuse.optimize(_mixed(), memory_budget=0.7)


@pytest.mark.parametrize("budget", [0, -0.5, 1.5, "0.7", True])
def test_budget_must_be_a_fraction(budget):
    with pytest.raises(ConfigurationError, match="fraction"):
        fxfuse.optimize(_mixed(), torch.randn(2, 3, 16, 16), memory_budget=budget)


def test_fast_mode_takes_no_budget():
    with pytest.raises(ConfigurationError, match="fast"):
        fxfuse.optimize(_mixed(), torch.randn(2, 3, 16, 16), mode="fast", memory_budget=0.7)


def test_auto_limit_is_documented_in_flops_per_byte():
    # A 1x1 conv from 128 channels in float32 sits exactly on the limit.
    conv = nn.Conv2d(128, 256, 1)
    site = fxfuse.fusion.report.FusedSite(("0",), "conv2d→batch_norm2d", "none", "fxfuse::conv_bn_act")
    assert policy._intrinsic_flops_per_byte(nn.Sequential(conv), site) == policy.AUTO_MAX_FLOPS_PER_BYTE
