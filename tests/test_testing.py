"""fxfuse.testing: the comparison engine and assert_equivalent (no fxfuse.optimize needed).

The checker must be able to fail, so most tests here hand it a deliberately broken
candidate and check that it fails, naming the tensor.
"""

from __future__ import annotations

import collections
import copy
import math

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from support.planted_defects import DEFECTS, plant
from torch import nn

from fxfuse.errors import ConfigurationError
from fxfuse.testing import (
    FP64_MULTIPLIER,
    assert_equivalent,
    compare_models,
    compare_tensors,
    default_tolerance,
    fp64_floor,
)

F64 = torch.float64


# --------------------------------------------------------------------------- models


class ConvNet(nn.Module):
    """conv-BN-ReLU-dropout, conv-BN-ReLU, pooled into a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.conv2 = nn.Conv2d(4, 6, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(6)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        x = self.drop(F.relu(self.bn1(self.conv1(x))))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean((2, 3)))


def conv_net() -> ConvNet:
    torch.manual_seed(0)
    return ConvNet()


def image(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, 6, 6, generator=torch.Generator().manual_seed(1))


def broken_copy(model: nn.Module, break_fn) -> nn.Module:
    candidate = copy.deepcopy(model)
    break_fn(candidate)
    return candidate


# --------------------------------------------------------------------------- passing


@pytest.mark.parametrize("dtype", [None, F64], ids=["float32", "float64"])
def test_identical_models_pass(dtype):
    model = conv_net()
    assert_equivalent(model, copy.deepcopy(model), image(), dtype=dtype)


def test_dropout_runs_from_the_same_rng_state_in_both_models():
    model = conv_net()
    assert_equivalent(model, copy.deepcopy(model), image(), steps=3)


def test_dropout_masks_matter_so_the_shared_rng_state_is_needed():
    class ExtraDraw(ConvNet):
        def forward(self, x):
            torch.rand(1)  # shifts the RNG stream before dropout
            return super().forward(x)

    model = conv_net()
    candidate = ExtraDraw()
    candidate.load_state_dict(model.state_dict())
    with pytest.raises(AssertionError, match=r"output 'output' differs at step 1"):
        assert_equivalent(model, candidate, image())


def test_models_are_left_untouched():
    model, other = conv_net(), conv_net()
    model.eval()
    loss = model(image()).sum()
    loss.backward()
    before = {name: t.clone() for name, t in [*model.state_dict().items(), *_grads(model)]}
    rng = torch.get_rng_state()

    assert_equivalent(model, other, image())

    assert not model.training and other.training
    after = {name: t for name, t in [*model.state_dict().items(), *_grads(model)]}
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name
    assert all(p.grad is None for p in other.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def _grads(model):
    return [(f"{name}.grad", p.grad) for name, p in model.named_parameters()]


class NestedOutputs(nn.Module):
    Pair = collections.namedtuple("Pair", ["mean", "scaled"])

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        y = self.bn(self.fc(x))
        return {"logits": y, "aux": (y.relu(), [self.Pair(y.mean(), 2 * y)]), "count": 3}


def test_nested_outputs_pass():
    torch.manual_seed(0)
    model = NestedOutputs()
    assert_equivalent(model, copy.deepcopy(model), torch.randn(5, 4), dtype=F64)


def test_nested_output_failure_names_the_leaf():
    class Broken(NestedOutputs):
        def forward(self, x):
            out = super().forward(x)
            pair = out["aux"][1][0]
            out["aux"][1][0] = pair._replace(scaled=pair.scaled + 1e-3)
            return out

    torch.manual_seed(0)
    model = NestedOutputs()
    candidate = Broken()
    candidate.load_state_dict(model.state_dict())
    with pytest.raises(AssertionError, match=r"output 'output\['aux'\]\[1\]\[0\]\.scaled' differs at step 1"):
        assert_equivalent(model, candidate, torch.randn(5, 4), dtype=F64)


class Indexed(nn.Module):
    """Takes an int64 index tensor and a Python int next to the floating input."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x, index, repeats):
        return self.fc(x + self.embed(index)).repeat(repeats, 1)


def test_non_floating_inputs_pass_and_only_floating_inputs_get_grads():
    torch.manual_seed(0)
    model = Indexed()
    args = (torch.randn(3, 4), torch.tensor([1, 5, 7]), 2)
    assert_equivalent(model, copy.deepcopy(model), *args, dtype=F64)

    checks = compare_models(copy.deepcopy(model), copy.deepcopy(model), args)
    (input_grads,) = [c for c in checks if c.kind == "input_grad" and c.step == 1]
    assert [c.name for c in input_grads.comparisons] == ["input[0]"]


def test_bn_free_model_passes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Dropout(0.2), nn.Linear(8, 2))
    assert_equivalent(model, copy.deepcopy(model), torch.randn(3, 4))


def test_every_kind_is_checked_at_every_step():
    model = conv_net()
    checks = compare_models(copy.deepcopy(model), copy.deepcopy(model), (image(),), steps=2)
    assert all(c.passed for c in checks)
    kinds = [(c.step, c.kind) for c in checks]
    per_step = ["param", "output", "input_grad", "param_grad", "buffer"]
    assert kinds == [
        (None, "state_dict_keys"),
        (None, "param_order"),
        *[(1, k) for k in per_step],
        *[(2, k) for k in per_step],
        (None, "param"),
        (None, "buffer"),
        (None, "eval_output"),
    ]
    (grads,) = [c for c in checks if c.kind == "param_grad" and c.step == 2]
    assert [c.name for c in grads.comparisons] == [name for name, _ in model.named_parameters()]


# --------------------------------------------------------------------------- failing


def test_perturbed_bn_weight_fails_naming_it():
    def perturb(m):
        with torch.no_grad():
            m.bn1.weight[0] += 1e-3

    model = conv_net()
    with pytest.raises(AssertionError, match=r"'bn1\.weight' differs at step 1: max abs diff 1\.0e-03"):
        assert_equivalent(model, broken_copy(model, perturb), image(), dtype=F64)


def test_a_failure_by_small_differences_names_a_batchnorm_over_few_values():
    # 2×3×1×1: each BatchNorm normalizes over 2 values per channel, an ill-conditioned model.
    def nudge(m):
        with torch.no_grad():
            m.bn1.weight[0] += 1e-7

    def perturb(m):
        with torch.no_grad():
            m.bn1.weight[0] += 1e-3

    model = conv_net()
    x = torch.randn(2, 3, 1, 1)
    with pytest.raises(AssertionError, match=r"bn1 \(and 1 more\) normalizes over 2 values per channel"):
        assert_equivalent(model, broken_copy(model, nudge), x, dtype=F64)
    for candidate, inputs in ((broken_copy(model, nudge), image()), (broken_copy(model, perturb), x)):
        with pytest.raises(AssertionError) as failed:  # 2×6×6: 72 values; a 1e-3 difference: a bug
            assert_equivalent(model, candidate, inputs, dtype=F64)
        assert "values per channel" not in str(failed.value)


class BatchNormDroppingAGradTerm(nn.BatchNorm2d):
    """Exact forward; backward omits -x_hat * mean(dy * x_hat): invisible to out.sum()."""

    class _Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias, eps):
            mean = x.mean((0, 2, 3), keepdim=True)
            var = x.var((0, 2, 3), unbiased=False, keepdim=True)
            inv_std = (var + eps).rsqrt()
            x_hat = (x - mean) * inv_std
            ctx.save_for_backward(x_hat, weight, inv_std)
            return x_hat * weight[:, None, None] + bias[:, None, None]

        @staticmethod
        def backward(ctx, dy):
            x_hat, weight, inv_std = ctx.saved_tensors
            dx_hat = dy * weight[:, None, None]
            dx = inv_std * (dx_hat - dx_hat.mean((0, 2, 3), keepdim=True))  # the bug: one term short
            return dx, (dy * x_hat).sum((0, 2, 3)), dy.sum((0, 2, 3)), None

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        self.num_batches_tracked += 1
        with torch.no_grad():
            self.running_mean.lerp_(x.mean((0, 2, 3)), self.momentum)
            self.running_var.lerp_(x.var((0, 2, 3)), self.momentum)  # unbiased, like F.batch_norm
        return self._Function.apply(x, self.weight, self.bias, self.eps)


def test_backward_bug_hidden_by_sum_is_caught_by_the_projection():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4)).double()
    candidate = copy.deepcopy(model)
    candidate[1].__class__ = BatchNormDroppingAGradTerm
    x = image().double()

    # With .sum() as the loss, the buggy backward gives the same gradients...
    grads = []
    for m in (copy.deepcopy(model), copy.deepcopy(candidate)):
        m(x).sum().backward()
        grads.append(m[0].weight.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-9)

    # ...but not with the checker's random projection.
    with pytest.raises(AssertionError, match=r"input_grad 'input\[0\]' differs at step 1"):
        assert_equivalent(model, candidate, x)


def test_missing_running_stat_update_fails_naming_running_mean():
    def freeze_stats(m):
        m.bn1.momentum = 0.0

    model = conv_net()
    candidate = broken_copy(model, freeze_stats)
    with pytest.raises(AssertionError, match=r"buffer 'bn1\.running_mean' differs at step 1"):
        assert_equivalent(model, candidate, image(), dtype=F64)
    assert_equivalent(model, candidate, image(), dtype=F64, train=False)


class AlwaysTrainingBatchNorm(nn.BatchNorm2d):
    """Uses batch statistics even in eval mode."""

    def forward(self, x):
        if self.training:
            self.num_batches_tracked += 1
        return F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, True, self.momentum, self.eps
        )


def test_model_ignoring_eval_mode_fails_naming_eval_output():
    def ignore_eval(m):
        m.bn2.__class__ = AlwaysTrainingBatchNorm

    model = conv_net()
    candidate = broken_copy(model, ignore_eval)
    with pytest.raises(AssertionError, match=r"eval_output 'output' differs in eval mode"):
        assert_equivalent(model, candidate, image(), dtype=F64)
    assert_equivalent(model, candidate, image(), dtype=F64, eval=False)


class TwoLayers(nn.Module):
    def __init__(self, fc2_first: bool = False) -> None:
        super().__init__()
        if fc2_first:
            self.fc2 = nn.Linear(8, 2)
            self.fc1 = nn.Linear(4, 8)
        else:
            self.fc1 = nn.Linear(4, 8)
            self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def test_different_parameter_order_fails():
    model = TwoLayers()
    candidate = TwoLayers(fc2_first=True)
    candidate.load_state_dict(model.state_dict())
    with pytest.raises(AssertionError, match=r"param_order: parameter order differs at position 0: 'fc1\.weight'"):
        assert_equivalent(model, candidate, torch.randn(3, 4))


def test_missing_parameter_fails_on_state_dict_keys():
    model = TwoLayers()
    candidate = copy.deepcopy(model)
    candidate.fc2.bias = None
    with pytest.raises(AssertionError) as info:
        assert_equivalent(model, candidate, torch.randn(3, 4))
    message = str(info.value)
    assert message.startswith("state_dict_keys: state_dict keys differ: missing in candidate: 'fc2.bias'")
    assert "param 'fc2.bias' differs at step 1: missing in candidate" in message


class StaleWeightConv(nn.Conv2d):
    """Computes with the weight it first saw (a stale cache), though gradients reach the weight."""

    def forward(self, x):
        if not hasattr(self, "cached"):
            self.cached = self.weight.detach().clone()
        weight = self.weight + (self.cached - self.weight).detach()
        return self._conv_forward(x, weight, self.bias)


def test_ignored_parameter_update_shows_at_step_two():
    def stale(m):
        m.conv2.__class__ = StaleWeightConv

    model = conv_net()
    candidate = broken_copy(model, stale)
    assert_equivalent(model, candidate, image(), dtype=F64, steps=1, eval=False)
    with pytest.raises(AssertionError, match=r"output 'output' differs at step 2"):
        assert_equivalent(model, candidate, image(), dtype=F64, steps=2)


def test_failure_message_counts_other_failures():
    def perturb(m):
        with torch.no_grad():
            m.conv1.weight.mul_(1.1)

    model = conv_net()
    with pytest.raises(AssertionError) as info:
        assert_equivalent(model, broken_copy(model, perturb), image())
    message = str(info.value)
    assert message.startswith("param 'conv1.weight' differs at step 1: max abs diff")
    assert "more failing check(s)" in message
    assert "param_grad" in message


# --------------------------------------------------------------------------- tolerances


def test_float64_catches_a_difference_that_float32_tolerates():
    def nudge(m):
        with torch.no_grad():
            m.fc.weight.mul_(1 + 1e-6)

    model = conv_net()
    candidate = broken_copy(model, nudge)
    assert_equivalent(model, candidate, image())
    with pytest.raises(AssertionError, match=r"param 'fc\.weight' differs at step 1"):
        assert_equivalent(model, candidate, image(), dtype=F64)


def test_explicit_tolerances_override_the_defaults():
    def nudge(m):
        with torch.no_grad():
            m.fc.weight.mul_(1 + 1e-3)

    model = conv_net()
    candidate = broken_copy(model, nudge)
    with pytest.raises(AssertionError):
        assert_equivalent(model, candidate, image())
    assert_equivalent(model, candidate, image(), rtol=0.5, atol=1e-3)


def test_default_tolerances_by_dtype():
    assert default_tolerance(torch.float64).rtol == pytest.approx(1e-9)
    assert default_tolerance(torch.float32).rtol == pytest.approx(2e-4)
    assert default_tolerance(torch.bfloat16).rtol > default_tolerance(torch.float16).rtol > 2e-4
    assert default_tolerance(torch.int64).rtol == default_tolerance(torch.int64).atol == 0


def test_relative_difference_is_relative_to_the_tensor_scale():
    ref = torch.tensor([1000.0, 1e-6])
    near_zero_off = compare_tensors("t", ref, torch.tensor([1000.0, 0.01]))
    assert near_zero_off.passed  # 0.01 is well within 2e-4 * 1000
    assert near_zero_off.scale == 1000.0
    assert near_zero_off.rel_diff == pytest.approx(1e-5, rel=1e-3)

    big_off = compare_tensors("t", ref, torch.tensor([1001.0, 1e-6]))
    assert not big_off.passed
    assert big_off.max_abs_diff == pytest.approx(1.0)


def test_atol_covers_all_zero_tensors():
    assert compare_tensors("t", torch.zeros(3), torch.full((3,), 1e-6)).passed
    assert not compare_tensors("t", torch.zeros(3), torch.full((3,), 1e-3)).passed


def test_nan_fails_and_matching_infinities_pass():
    nan = compare_tensors("t", torch.tensor([1.0, 2.0]), torch.tensor([1.0, math.nan]))
    assert not nan.passed and nan.problem == "NaN in candidate"
    assert not compare_tensors("t", torch.tensor([math.nan]), torch.tensor([math.nan])).passed
    inf = torch.tensor([1.0, math.inf, -math.inf])
    assert compare_tensors("t", inf, inf.clone()).passed
    assert not compare_tensors("t", inf, torch.tensor([1.0, math.inf, math.inf])).passed


def test_structural_mismatches_fail():
    assert compare_tensors("t", torch.zeros(2), torch.zeros(3)).problem == "shape (2,) vs (3,)"
    assert "dtype" in compare_tensors("t", torch.zeros(2), torch.zeros(2, dtype=F64)).problem
    assert not compare_tensors("t", torch.zeros(2), None).passed
    assert not compare_tensors("t", torch.tensor([1, 2]), torch.tensor([1, 3])).passed
    assert compare_tensors("t", None, None).passed


@pytest.mark.parametrize(
    "kwargs",
    [{"steps": -1}, {"steps": 1.5}, {"dtype": torch.int64}, {"dtype": "float64"}, {"rtol": -1.0}, {"atol": "x"}],
)
def test_bad_arguments_raise_configuration_error(kwargs):
    model = TwoLayers()
    with pytest.raises(ConfigurationError):
        assert_equivalent(model, model, torch.randn(3, 4), **kwargs)


# --------------------------------------------------------------------------- float64 reference


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_planted_defects_fail_at_float32_against_the_float64_reference(defect):
    model = conv_net()
    candidate = copy.deepcopy(model)
    kind, tensor = plant(defect, candidate)
    with pytest.raises(AssertionError) as info:
        assert_equivalent(model, candidate, image(4))  # float32, fp64_reference by default
    assert f"{kind} '{tensor}' differs" in str(info.value)
    assert "from the float64 reference" in str(info.value)


def test_float32_dropout_draws_the_float64_mask():
    """The float64 reference relies on this: the same seed gives the same dropout mask in both dtypes."""
    x = torch.ones(8, 16, 9, 9)
    masks = []
    for dtype in (torch.float32, F64):
        torch.manual_seed(3)
        masks.append(F.dropout(x.to(dtype), 0.3, training=True) != 0)
    assert torch.equal(*masks)


def test_candidate_is_held_to_a_multiple_of_the_references_own_error():
    truth = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    reference = (truth + torch.tensor([1e-3, 0.0, 0.0], dtype=F64)).float()  # eager's own error: 1e-3
    floor = fp64_floor(torch.float32)
    near = compare_tensors("t", reference, (truth + 4e-3).float(), reference64=truth)
    assert near.passed and near.reference_abs_diff == pytest.approx(1e-3, rel=1e-4)
    assert near.tolerance == pytest.approx(FP64_MULTIPLIER * 1e-3 + floor.rtol * 2.0 + floor.atol, rel=1e-4)
    far = compare_tensors("t", reference, (truth + 6e-3).float(), reference64=truth)
    assert not far.passed
    assert "where the reference's own is 1.0e-03" in far.describe()


def test_exact_reference_leaves_only_the_floor():
    truth = torch.tensor([1.0, 2.0], dtype=F64)
    assert compare_tensors("t", truth.float(), (truth * (1 + 1e-6)).float(), reference64=truth).passed
    assert not compare_tensors("t", truth.float(), (truth * (1 + 1e-4)).float(), reference64=truth).passed


def test_tiny_tensors_get_no_absolute_free_pass():
    """Untrained networks can output values of 1e-10; a difference of their own size must show."""
    truth = torch.tensor([1e-10, -2e-10], dtype=F64)
    assert not compare_tensors("t", truth.float(), (truth * 2).float(), reference64=truth).passed


def test_integer_buffers_must_match_exactly_against_the_float64_reference():
    count = torch.tensor(2)
    assert compare_tensors("n", count, count.clone(), reference64=count.clone()).passed
    off = compare_tensors("n", count, count + 1, reference64=count.clone())
    assert not off.passed and off.tolerance == 0


def test_float64_reference_is_skipped_for_float64_models():
    model = conv_net().double()
    checks = compare_models(copy.deepcopy(model), copy.deepcopy(model), (image().double(),), steps=1)
    assert all(t.reference_abs_diff is None for c in checks for t in c.comparisons)


def test_a_reference_that_cannot_run_in_float64_says_how_to_opt_out():
    class Float32Only(nn.Linear):
        def forward(self, x):
            if x.dtype == F64:
                raise RuntimeError("no float64 kernel")
            return super().forward(x)

    torch.manual_seed(0)
    model = Float32Only(4, 2)
    with pytest.raises(ConfigurationError, match=r"float64 copy of the reference could not run .*fp64_reference=False"):
        assert_equivalent(model, copy.deepcopy(model), torch.randn(3, 4))
    assert_equivalent(model, copy.deepcopy(model), torch.randn(3, 4), fp64_reference=False)


class _UnpreservedDropout(nn.Module):
    """Dropout inside a checkpoint that does not restore the RNG state: its recompute draws new masks in
    backward, from the generator's state there."""

    def __init__(self):
        super().__init__()
        self.conv, self.drop = nn.Conv2d(3, 4, 3), nn.Dropout(0.5)

    def forward(self, x):
        block = lambda t: self.conv(self.drop(t)).relu()  # noqa: E731
        return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, preserve_rng_state=False)


def test_the_backward_runs_under_the_seeded_generator_too():
    torch.manual_seed(0)
    model = _UnpreservedDropout().double()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    assert_equivalent(model, copy.deepcopy(model), x, dtype=torch.float64, steps=2)
