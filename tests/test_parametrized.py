"""parametrized: optimize leaves a parametrization's state as it was, and regions leave out the
ones with state."""

import copy

import pytest
import torch
from support.blocks import Block
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import fxfuse
from fxfuse.fusion import parametrized
from fxfuse.testing import assert_equivalent


class _Double(nn.Module):
    def forward(self, w):
        return 2 * w


def _spectral_conv():
    torch.manual_seed(0)
    return parametrizations.spectral_norm(nn.Conv2d(3, 4, 3)).double()


def test_kept_puts_back_what_a_read_wrote():
    conv = _spectral_conv()
    before = {k: v.clone() for k, v in conv.state_dict().items()}
    with parametrized.kept(conv):
        conv.weight  # noqa: B018 - a training-mode read runs spectral_norm's power iteration
        assert not torch.equal(conv.parametrizations.weight[0]._u, before["parametrizations.weight.0._u"])
    for k, v in conv.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_kept_leaves_a_model_without_parametrizations_alone():
    conv = nn.Conv2d(3, 4, 3)
    written = conv.weight.detach() + 1
    with parametrized.kept(conv):
        conv.weight.data.add_(1)  # not a parametrization's: not kept's to put back
    assert torch.equal(conv.weight.detach(), written)


def test_with_state_names_a_parametrization_with_buffers_only():
    assert parametrized.with_state(_spectral_conv()) == "weight is parametrized by _SpectralNorm, with buffers _u, _v"
    assert parametrized.with_state(parametrizations.weight_norm(nn.Conv2d(3, 4, 3))) is None
    assert (
        parametrized.with_state(parametrize.register_parametrization(nn.Conv2d(3, 4, 3), "weight", _Double())) is None
    )
    assert parametrized.with_state(nn.Conv2d(3, 4, 3)) is None


def _net(parametrization):
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), Block(8), Block(8), Block(8)
    )
    for conv in (net[0], net[3].conv1, net[4].conv2):
        if parametrization == "spectral_norm":
            parametrizations.spectral_norm(conv)
        else:
            parametrizations.weight_norm(conv)
    return net


X = torch.randn(2, 3, 12, 12)
SETTINGS = {"fast": {"mode": "fast"}, "memory": {}, "budget": {"example_inputs": (X,), "memory_budget": 0.3}}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_optimize_leaves_spectral_norm_state_alone_and_trains_as_eager(setting):
    """Every read of a spectral-normed weight in training mode runs a step of power iteration. The passes
    read weights for their shapes: before, optimize left `_u` and `_v` ahead of eager's copy, and every
    output after differed from eager's."""
    net = _net("spectral_norm")
    before = copy.deepcopy(net.state_dict())
    optimized = fxfuse.optimize(copy.deepcopy(net), **SETTINGS[setting])
    for k, v in optimized.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert_equivalent(net, optimized, X, dtype=torch.float64)


def test_a_budget_recomputes_no_region_with_a_stateful_parametrization():
    """A region's recompute would start from the `_u` its forward updated, and compute another weight: the
    blocks with a spectral-normed conv are left out, with the reason in the report; the stateless
    weight_norm is recomputed as any weight."""
    spectral = fxfuse.optimize(_net("spectral_norm"), X, memory_budget=0.1)
    assert [r.name for r in spectral.fxfuse_report.regions] == ["5"]
    notes = "\n".join(spectral.fxfuse_report.notes)
    assert "3 (3.conv1.weight is parametrized by _SpectralNorm, with buffers _u, _v" in notes
    assert "4 (4.conv2.weight is parametrized by _SpectralNorm" in notes
    normed = fxfuse.optimize(_net("weight_norm"), X, memory_budget=0.1)
    assert {"0…1", "3", "4", "5"} <= {r.name for r in normed.fxfuse_report.regions}
    assert_equivalent(_net("weight_norm"), normed, X, dtype=torch.float64)


def test_a_graph_built_at_call_time_leaves_spectral_norm_state_alone():
    """A module tree changed after optimize is traced again at its next call (install.py), passes and all."""
    eager, optimized = _net("spectral_norm"), fxfuse.optimize(_net("spectral_norm"))
    for net in (eager, optimized):
        torch.manual_seed(1)
        net[5] = Block(8)
        parametrizations.spectral_norm(net[5].conv1)
    with torch.no_grad():
        torch.testing.assert_close(optimized(X), eager(X), rtol=0, atol=0)
    for (k, a), b in zip(eager.state_dict().items(), optimized.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_keeping_runs_a_function_of_the_model_inside_kept():
    conv = _spectral_conv()
    u = conv.parametrizations.weight[0]._u.clone()

    @parametrized.keeping
    def read_weight(model, scale, *, offset):
        return model.weight.sum() * scale + offset

    assert read_weight(conv, 2.0, offset=1.0).isfinite()
    assert torch.equal(conv.parametrizations.weight[0]._u, u)
