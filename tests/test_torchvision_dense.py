"""torchvision segmentation models (train mode, dict outputs) and detection backbones
(FrozenBatchNorm2d, frozen early layers, OrderedDict outputs): optimize() leaves the state
untouched, fuses the Conv→BN sites that exist, and trains exactly like eager in float64.

FrozenBatchNorm2d is not a BatchNorm2d: whatever fxfuse does with it, its buffers must
come out of training unchanged and every output and gradient must match eager.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.conv_bn_sites import coverage, existing_sites
from support.dense_zoo import DETECTION_BACKBONES, SEGMENTATION
from torchvision.ops.misc import FrozenBatchNorm2d

import fxfuse
from fxfuse.testing import assert_equivalent, compare_models, copy_model, failure_summary

MIN_COVERAGE = 0.95
pytestmark = pytest.mark.usefixtures("single_thread")
SLOW = {"fcn_resnet50", "deeplabv3_mobilenet_v3_large", "resnet50_fpn_backbone"}  # run by `make zoo`


def _params(models):
    return [pytest.param(m, id=m.name, marks=pytest.mark.zoo if m.name in SLOW else ()) for m in models]


def _optimize_copy(model, x):
    """(optimized copy, state_dict clones of that copy taken before optimize)."""
    candidate = copy.deepcopy(model)
    before = {k: v.clone() for k, v in candidate.state_dict().items()}
    return fxfuse.optimize(candidate, (x,)), before


def _assert_state_unchanged(before, after):
    assert list(after) == list(before)
    changed = [k for k, v in before.items() if not torch.equal(v.to(after[k].dtype), after[k])]
    assert not changed, f"changed: {changed}"


@pytest.mark.parametrize("entry", _params(SEGMENTATION))
def test_segmentation_model_is_fused_and_exact(entry):
    torch.manual_seed(0)
    model, x = entry.build(), entry.example_input()
    census = existing_sites(model, (x,))
    optimized, before = _optimize_copy(model, x)
    _assert_state_unchanged(before, optimized.state_dict())
    cov = coverage(census.sites, optimized.fxfuse_report)
    assert census.sites and cov.ratio >= MIN_COVERAGE, cov.describe()
    assert_equivalent(model, optimized, x, steps=2, dtype=torch.float64)


@pytest.mark.parametrize("entry", _params(DETECTION_BACKBONES))
def test_detection_backbone_keeps_frozen_batch_norm_exact(entry):
    torch.manual_seed(0)
    model, x = entry.build(), entry.example_input()
    assert any(isinstance(m, FrozenBatchNorm2d) for m in model.modules())
    assert any(not p.requires_grad for p in model.parameters()), "expected frozen early layers"
    optimized, before = _optimize_copy(model, x)
    _assert_state_unchanged(before, optimized.state_dict())

    reference, candidate = copy_model(model, torch.float64), copy_model(optimized, torch.float64)
    checks = compare_models(reference, candidate, (x.double(),), steps=2)
    assert all(c.passed for c in checks), failure_summary(checks)
    # Training changed the parameters but no FrozenBatchNorm2d buffer.
    frozen = {
        f"{path}.{name}"
        for path, m in model.named_modules()
        if isinstance(m, FrozenBatchNorm2d)
        for name, _ in m.named_buffers()
    }
    trained = candidate.state_dict()
    frozen_before = {k: v for k, v in before.items() if k in frozen}
    _assert_state_unchanged(frozen_before, {k: trained[k] for k in frozen_before})
