"""The wild zoo (tests/support/wild_zoo.py): models from HF transformers, ultralytics, segmentation_models_pytorch,
efficientnet_pytorch and torchvision's auxiliary-output models, each exact in float64 over two train steps
plus eval (every parameter, gradient, buffer and output), with >= 95% of its existing Conv→BN sites fused.
`make test` runs the representative part; `make zoo` all of it. optimize()'s time is a benchmark
(benchmarks/zoo_coverage.py --zoo wild), not a test."""

from __future__ import annotations

import copy

import pytest
import torch
from support.conv_bn_sites import coverage, existing_sites
from support.wild_zoo import BY_NAME, WILD

import fxfuse
from fxfuse import measure
from fxfuse.testing import assert_equivalent

# One model per library in make test; the rest under the zoo marker.
REPRESENTATIVE = (
    "efficientnet_pytorch_b0",
    "hf_mobilenet_v2_tf_padding",
    "yolov8n",
    "smp_unet_resnet18",
    "googlenet_aux",
)
# Sites fxfuse cannot yet reach, each with the reason a user would read in the report.
KNOWN_GAPS: dict[str, str] = {}


def _params():
    for entry in WILD:
        marks = [] if entry.name in REPRESENTATIVE else [pytest.mark.zoo]
        if entry.name in KNOWN_GAPS:
            marks.append(pytest.mark.xfail(reason=KNOWN_GAPS[entry.name], strict=True))
        yield pytest.param(entry.name, marks=marks, id=entry.name)


def _build(name):
    entry = BY_NAME[name]
    pytest.importorskip(entry.library)
    torch.manual_seed(0)
    return entry, entry.build().train()


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("name", list(_params()))
def test_wild_model_is_covered_and_exact(name):
    entry, model = _build(name)
    x = entry.example_input()
    census = existing_sites(model, (x,))
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,))
    cov = coverage(census.sites, optimized.fxfuse_report)
    assert census.sites, "the model has Conv→BN sites to fuse"
    assert len(cov.fused) >= 0.95 * len(census.sites), cov.reasons()
    assert_equivalent(model, optimized, x, dtype=torch.float64)


def test_yolov8n_train_mode_meets_a_memory_budget_of_0_3():
    """The root and every C2f block trace whole with concrete shapes, so the budget applies to the whole model:
    the counted plan is the one the model runs (issue 30's target: batch 4, 256², budget 0.3)."""
    entry, model = _build("yolov8n")
    x = entry.example_input(batch=4, size=256)
    eager = measure.saved_activation_bytes(copy.deepcopy(model), (x,))
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,), memory_budget=0.3)
    notes = " ".join(optimized.fxfuse_report.notes)
    assert "memory budget 0.30× met" in notes and "not found" not in notes, notes
    assert measure.saved_activation_bytes(optimized, (x,)) <= 0.3 * eager
