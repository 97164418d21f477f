"""fxfuse.fusion.runtime's reads of a module's tensors: what the module's own forward reads, by the
fast path (its parameter and buffer tables) where that is the same and by getattr where it is not."""

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from fxfuse.fusion.runtime import bn_tensors, layer_tensors


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
