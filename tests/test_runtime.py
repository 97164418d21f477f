"""fxfuse.fusion.runtime's reads of a module's tensors: what the module's own forward reads, by the
fast path (its parameter and buffer tables) where that is the same and by getattr where it is not;
and the thin path of its fused calls: taken where it applies, exact where it does not."""

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from fxfuse import _extension
from fxfuse.fusion import runtime
from fxfuse.fusion.runtime import bn_tensors, layer_tensors

needs_ext = pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")


class _Double(nn.Module):
    def forward(self, w):
        return 2 * w


@pytest.mark.parametrize(
    "layer", [nn.Conv2d(4, 4, 3), nn.Conv2d(4, 4, 1, bias=False), nn.Linear(4, 3), nn.LayerNorm(4)], ids=repr
)
def test_a_plain_layer_gives_its_parameters(layer):
    weight, bias = layer_tensors(layer)
    assert weight is layer.weight and bias is layer.bias


def test_a_parametrized_weight_is_what_forward_reads():
    conv = nn.Conv2d(4, 4, 3)
    parametrize.register_parametrization(conv, "weight", _Double())
    weight, bias = layer_tensors(conv)
    assert torch.equal(weight, 2 * conv.parametrizations.weight.original) and bias is conv.bias


def test_a_weight_set_as_an_attribute_is_what_forward_reads():
    conv = nn.Linear(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.nn.utils.weight_norm(conv)  # moves `weight` out of _parameters, sets it before each forward
    conv(torch.randn(1, 4))
    weight, _ = layer_tensors(conv)
    assert weight is conv.__dict__["weight"]


def test_batch_norm_tensors_plain_and_parametrized():
    bn = nn.BatchNorm2d(4)
    assert bn_tensors(bn) == (bn.weight, bn.bias, bn.running_mean, bn.running_var)
    parametrize.register_parametrization(bn, "weight", _Double())
    weight, bias, mean, var = bn_tensors(bn)
    assert torch.equal(weight, 2 * bn.parametrizations.weight.original)
    assert (bias, mean, var) == (bn.bias, bn.running_mean, bn.running_var)


def test_a_batch_norm_weight_set_as_an_attribute_is_what_forward_reads():
    bn = nn.BatchNorm2d(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.nn.utils.weight_norm(bn, dim=0)  # moves `weight` out of _parameters, sets it before each forward
    bn(torch.randn(2, 4, 3, 3))
    weight, bias, mean, var = bn_tensors(bn)
    assert weight is bn.__dict__["weight"]
    assert (bias, mean, var) == (bn.bias, bn.running_mean, bn.running_var)


def _modules():
    torch.manual_seed(0)
    return nn.ModuleList([nn.Conv2d(4, 6, 3, padding=1), nn.BatchNorm2d(6), nn.Conv2d(6, 6, 1), nn.BatchNorm2d(6)])


# Each site: eager's layers and the runtime's fused call, over the modules of `_modules()`.
SITES = {
    "conv_bn_act": (
        lambda m, t: torch.relu(m[1](m[0](t))),
        lambda m, t: runtime.conv_bn_act_module(t, m[0], m[1], "relu", 0.0),
    ),
    "bn_act_conv": (
        lambda m, t: m[2](torch.relu(m[1](t))),
        lambda m, t: runtime.bn_act_conv_module(t, m[1], "relu", 0.0, m[2]),
    ),
    "bn_act_conv, epilogue": (
        lambda m, t: torch.relu(m[3](m[2](torch.relu(m[1](t))))),
        lambda m, t: runtime.bn_act_conv_module(t, m[1], "relu", 0.0, m[2], m[3], "relu", 0.0),
    ),
}


def _same_as_eager(name, x, edit=None):
    eager, fused = SITES[name]
    ours, theirs = _modules().double(), _modules().double()
    for step, train in enumerate((True, True, False)):
        if edit is not None and step == 1:
            edit(ours), edit(theirs)
        ours.train(train), theirs.train(train)
        xo, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_o, out_e = fused(ours, xo), eager(theirs, xe)
        torch.testing.assert_close(out_o, out_e, rtol=1e-12, atol=1e-12)
        out_o.square().sum().backward()
        out_e.square().sum().backward()
        torch.testing.assert_close(xo.grad, xe.grad, rtol=1e-12, atol=1e-12)
        for a, b in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
        for a, b in zip(ours.buffers(), theirs.buffers()):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _input(name):
    return torch.randn(3, 4 if name == "conv_bn_act" else 6, 5, 5, dtype=torch.float64)


@needs_ext
@pytest.mark.parametrize("name", list(SITES))
def test_a_plain_call_takes_the_thin_path_and_computes_what_eager_does(name, monkeypatch):
    def refuse(*args):
        raise AssertionError("the full checks ran")

    for check in ("kernels_apply", "layer_kernels_apply", "layer_params_apply", "conv_geometry"):
        monkeypatch.setattr(runtime, check, refuse)
    _same_as_eager(name, _input(name))


@needs_ext
@pytest.mark.parametrize("name", list(SITES))
def test_a_conv_changed_between_calls_is_read_again(name):
    def edit(m):
        for conv in (m[0], m[2]):
            conv.padding, conv.stride = (2, 2), (2, 1)

    _same_as_eager(name, _input(name), edit)


@needs_ext
@pytest.mark.parametrize("name", list(SITES))
def test_a_call_the_thin_path_declines_takes_the_full_checks(name):
    # Module.float() converts parameters through `param.data`: the same objects, another dtype. A float32
    # BN on float64 activations, at the first call or after calls the thin path took: eager raises.
    eager, fused = SITES[name]
    ours, theirs = _modules().double(), _modules().double()
    x = _input(name)
    for first in (True, False):
        if not first:
            ours, theirs = _modules().double(), _modules().double()
            fused(ours, x), eager(theirs, x)
        ours[1].float(), theirs[1].float()
        with pytest.raises(RuntimeError) as theirs_error:
            eager(theirs, x)
        with pytest.raises(type(theirs_error.value)):
            fused(ours, x)


def _under_autocast(name):
    """The site under CPU bfloat16 autocast, fed as in a model: BN-first sites read a conv's (bfloat16) output."""
    eager, fused = SITES[name]
    if name == "conv_bn_act":
        return eager, fused
    return (lambda m, t: eager(m, m[0](t))), (lambda m, t: fused(m, m[0](t)))


def _run_twice(fn, modules, x):
    out = fn(modules, x)
    out.float().square().sum().backward()
    return out, [p.grad for p in modules.parameters()], [b.clone() for b in modules.buffers()]


@needs_ext
@pytest.mark.parametrize("name", list(SITES))
def test_under_autocast_the_thin_path_computes_the_full_checks_bits(name, monkeypatch):
    _, fused = _under_autocast(name)
    x = torch.randn(3, 4, 5, 5)
    results = []
    for thin in (True, False):
        with monkeypatch.context() as patch:
            if thin:
                for check in ("kernels_apply", "layer_kernels_apply", "layer_params_apply", "conv_geometry"):
                    patch.setattr(runtime, check, lambda *a: pytest.fail("the full checks ran"))
            else:
                patch.setattr(runtime, "quiet_modes", lambda: False)
            modules = _modules()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                results.append(_run_twice(fused, modules, x))
    (out_thin, grads_thin, stats_thin), (out_full, grads_full, stats_full) = results
    assert out_thin.dtype == torch.bfloat16
    torch.testing.assert_close(out_thin, out_full, rtol=0, atol=0)
    for a, b in zip(grads_thin + stats_thin, grads_full + stats_full):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
