"""Example inputs that eager rejects are a one-line ConfigurationError; the remaining fallbacks say why.

Every place where fxfuse.optimize catches an exception and carries on is tested here
with an input that makes it fail: it either raises, or leaves a note in the report.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from torch import nn

import fxfuse
from fxfuse.errors import ConfigurationError


def snapshot(model: nn.Module):
    return type(model), model.training, {k: v.clone() for k, v in model.state_dict().items()}


def assert_unchanged(model: nn.Module, before) -> None:
    cls, training, state = before
    assert type(model) is cls and model.training == training and not hasattr(model, "fxfuse_report")
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "call",
    [
        dict(fn="optimize"),
        dict(fn="optimize", memory_budget=0.5),
        dict(fn="optimize", mode="auto"),
        dict(fn="explain"),
        dict(fn="explain", memory_budget=0.5),
        dict(fn="explain", mode="auto"),
    ],
)
def test_inputs_eager_rejects_raise_one_line_and_print_nothing(call, capfd):
    kwargs = dict(call)
    fn = getattr(fxfuse, kwargs.pop("fn"))
    model = torchvision.models.resnet18()
    before = snapshot(model)
    with pytest.raises(ConfigurationError) as info:
        fn(model, torch.randn(1, 4, 32, 32), **kwargs)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("example_inputs do not fit ResNet: eager PyTorch raises RuntimeError: ")
    assert "expected input[1, 4, 32, 32] to have 3 channels, but got 4 channels instead" in message
    assert capfd.readouterr() == ("", "")
    assert_unchanged(model, before)


def test_wrong_number_of_arguments_is_eagers_type_error():
    with pytest.raises(
        ConfigurationError, match=r"example_inputs do not fit Sequential: eager PyTorch raises TypeError"
    ):
        fxfuse.optimize(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), (torch.randn(1, 3, 8, 8), 2))


def test_an_already_optimized_model_stays_optimized_when_the_inputs_are_bad():
    model = fxfuse.optimize(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()))
    cls = type(model)
    with pytest.raises(ConfigurationError):
        fxfuse.optimize(model, torch.randn(1, 5, 8, 8))
    assert type(model) is cls and fxfuse.fusion.is_optimized(model)


class UniqueTail(nn.Module):
    """Traceable, and fine in eager, but torch.unique has no meta or fake shape: shapes need real data."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, bias=False)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return y.mean() + torch.unique(y.detach().round()).numel()


def test_inputs_only_a_real_forward_can_run_are_accepted_and_shape_estimates_are_skipped_with_a_note(capfd):
    model = UniqueTail()
    before = snapshot(model)
    report = fxfuse.explain(model, torch.randn(2, 3, 8, 8))
    assert_unchanged(model, before)
    assert [s.op for s in report.fused] == ["fxfuse::conv_bn_act"]
    assert any(note.startswith("could not propagate shapes from the example inputs") for note in report.notes)
    assert capfd.readouterr() == ("", "")  # FX ShapeProp's traceback print is swallowed


def test_a_budget_that_cannot_be_counted_on_the_meta_device_is_an_error():
    model = UniqueTail()
    before = snapshot(model)
    with pytest.raises(ConfigurationError, match=r"memory_budget=0\.5 cannot be applied to UniqueTail: .*meta device"):
        fxfuse.optimize(model, torch.randn(2, 3, 8, 8), memory_budget=0.5)
    assert_unchanged(model, before)


def test_untraceable_forward_falls_back_to_submodules_and_says_so():
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU())

        def forward(self, x):
            return self.block(x) if x.sum() > 0 else self.block(-x)  # control flow: not traceable

    report = fxfuse.explain(Branchy(), torch.randn(2, 3, 8, 8))
    assert report.fused and any(
        "forward is not traceable" in n and "optimizing its submodules" in n for n in report.notes
    )


def test_a_batch_of_one_is_a_fine_example_size_in_train_mode():
    """Example inputs size the model: a batch of one, which training-mode BatchNorm rejects after global
    pooling, is accepted (the check runs in eval mode), and the model stays in train mode, where the
    optimized model then rejects that batch as eager does, with eager's error."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 4), nn.BatchNorm1d(4),
    ).double().train()  # fmt: skip
    reference = copy.deepcopy(model)
    one = torch.randn(1, 3, 8, 8, dtype=torch.double)
    optimized = fxfuse.optimize(model, one)
    assert optimized.training and all(m.training for m in optimized.modules())
    assert [s.op for s in optimized.fxfuse_report.fused] == ["fxfuse::conv_bn_act"]
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        reference(one)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        optimized(one)
    x = torch.randn(2, 3, 8, 8, dtype=torch.double)
    torch.testing.assert_close(optimized(x), reference(x), rtol=1e-12, atol=1e-12)
