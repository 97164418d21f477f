"""Third-party modules fxfuse fuses as what they are, recognised by type.

timm builds its CNNs from `BatchNormAct2d` (a BatchNorm2d subclass whose forward is
batch norm, then `self.drop`, then `self.act`, with the counter and momentum rules
of `_BatchNorm.forward`) and `Conv2dSame` (a Conv2d that pads TF-style "same" from
the input size on every call, then convolves without padding). fxfuse does not
import timm: a class is recognised by the module and name of its `forward`, so a
subclass that overrides `forward` is not recognised and is traced like any module.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn


def _forward_is(m: nn.Module, module: str, qualname: str) -> bool:
    forward = type(m).forward
    return getattr(forward, "__module__", None) == module and getattr(forward, "__qualname__", None) == qualname


def is_norm_act(m: nn.Module) -> bool:
    """timm's BatchNormAct2d with its own forward."""
    return isinstance(m, nn.BatchNorm2d) and _forward_is(m, "timm.layers.norm_act", "BatchNormAct2d.forward")


def is_conv2d_same(m: nn.Module) -> bool:
    """timm's Conv2dSame with its own forward."""
    return isinstance(m, nn.Conv2d) and _forward_is(m, "timm.layers.conv2d_same", "Conv2dSame.forward")


def is_known_leaf(m: nn.Module) -> bool:
    """Modules the tracer keeps whole, so that the passes see them as one call."""
    return is_norm_act(m) or is_conv2d_same(m)


def pad_same(x: Tensor, conv: nn.Conv2d) -> Tensor:
    """What Conv2dSame pads `x` with before its convolution (timm.layers.padding.pad_same)."""
    pads = []
    for size, k, s, d in zip(x.shape[-2:], conv.weight.shape[-2:], conv.stride, conv.dilation):
        total = max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)
        pads.append((total // 2, total - total // 2))
    (top, bottom), (left, right) = pads
    return F.pad(x, (left, right, top, bottom))
