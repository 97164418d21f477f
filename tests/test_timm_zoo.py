"""timm zoo: per model, optimize() leaves the state untouched, fuses >= 95% of the Conv→BN sites
that exist, and trains exactly like eager in float64 (two SGD steps, then eval).

The representative part (timm_zoo.FAST) runs in `make test`; the rest is marked `zoo`
(`make zoo` runs all of it). The models are listed in tests/support/timm_zoo.py.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import pytest
import torch
from support.conv_bn_sites import Census, Coverage, coverage, existing_sites
from support.timm_zoo import FAST, ZOO, ZooModel
from torch import nn

import fxfuse
from fxfuse.testing import assert_equivalent

MIN_COVERAGE = 0.95
pytestmark = pytest.mark.usefixtures("single_thread")


@dataclass
class Optimized:
    entry: ZooModel
    model: nn.Module  # eager, untouched
    x: torch.Tensor
    state_before: dict[str, torch.Tensor]  # clones of the copy's state_dict before optimize
    optimized: nn.Module
    census: Census
    coverage: Coverage
    seconds: float


def _params():
    return [pytest.param(e, id=e.name, marks=() if e.name in FAST else pytest.mark.zoo) for e in ZOO]


@pytest.fixture(scope="module", params=_params())
def case(request) -> Optimized:
    # Module scope groups each model's tests together, so the model is built and optimized once.
    entry: ZooModel = request.param
    torch.manual_seed(0)
    model = entry.build()
    x = entry.example_input()
    census = existing_sites(model, (x,))
    candidate = copy.deepcopy(model)
    state_before = {k: v.clone() for k, v in candidate.state_dict().items()}
    start = time.perf_counter()
    optimized = fxfuse.optimize(candidate, (x,))
    seconds = time.perf_counter() - start
    return Optimized(
        entry, model, x, state_before, optimized, census, coverage(census.sites, optimized.fxfuse_report), seconds
    )


def test_optimize_leaves_parameters_and_buffers_bit_identical(case):
    after = case.optimized.state_dict()
    assert list(after) == list(case.state_before)
    changed = [k for k, v in case.state_before.items() if not torch.equal(v, after[k])]
    assert not changed, f"optimize() changed {changed}"


def test_conv_bn_sites_are_fused(case):
    if not case.entry.conv_bn:
        assert not case.census.sites, f"{case.entry.name} is listed without Conv→BN sites"
        return
    assert case.census.sites, "no Conv→BN site found: the census is broken or the model changed"
    assert case.coverage.ratio >= MIN_COVERAGE, case.coverage.describe()


def test_trains_and_evaluates_exactly_like_eager_in_float64(case):
    assert_equivalent(case.model, case.optimized, case.x, steps=2, dtype=torch.float64)
