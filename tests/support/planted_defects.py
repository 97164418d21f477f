"""Defects planted into a copy of a model, which verify/assert_equivalent must catch at float32.

Each defect changes the first module of its kind in place (a class swap or a weight
edit) and says which check and tensor must then fail: `plant(name, model)` returns
(kind, tensor name) of the expected failure.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class NoRunningStatsBatchNorm(nn.BatchNorm2d):
    """Normalizes with batch statistics in training but never updates running_mean/running_var."""

    def forward(self, x):
        if not self.training:
            return super().forward(x)
        self.num_batches_tracked += 1
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)


class IgnoresEvalBatchNorm(nn.BatchNorm2d):
    """Uses batch statistics even in eval mode."""

    def forward(self, x):
        if self.training:
            self.num_batches_tracked += 1
        return F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, True, self.momentum, self.eps
        )


class FrozenCountBatchNorm(nn.BatchNorm2d):
    """Updates the running statistics but never counts the batch."""

    def forward(self, x):
        count = self.num_batches_tracked.clone()
        out = super().forward(x)
        self.num_batches_tracked.copy_(count)
        return out


class OwnGeneratorDropout(nn.Dropout):
    """Draws its mask from a private generator instead of the global RNG."""

    def forward(self, x):
        if not self.training or self.p == 0:
            return x
        if not hasattr(self, "generator"):
            self.generator = torch.Generator().manual_seed(1234)
        keep = torch.rand(x.shape, generator=self.generator) >= self.p
        return x * keep.to(x.dtype) / (1 - self.p)


class SlightlyOffConv(nn.Conv2d):
    """Its output is 1e-3 (relative) too large."""

    def forward(self, x):
        return super().forward(x) * (1 + 1e-3)


def _first(model: nn.Module, kind: type) -> tuple[str, nn.Module]:
    return next((name, m) for name, m in model.named_modules() if type(m) is kind)


def _following_batch_norm(model: nn.Module, conv: str) -> str | None:
    """The module registered right after `conv` if it is a BatchNorm2d (how torchvision builds Conv→BN)."""
    names = [name for name, _ in model.named_modules()]
    after = names[names.index(conv) + 1 :][:1]
    return after[0] if after and isinstance(model.get_submodule(after[0]), nn.BatchNorm2d) else None


def _swap(model: nn.Module, kind: type, cls: type) -> str:
    name, module = _first(model, kind)
    module.__class__ = cls
    return name


def _perturb_bn_weight(model: nn.Module) -> tuple[str, str]:
    name, bn = _first(model, nn.BatchNorm2d)
    with torch.no_grad():
        bn.weight[0] *= 1.01
    return "param", f"{name}.weight"


def _stale_running_stats(model: nn.Module) -> tuple[str, str]:
    return "buffer", f"{_swap(model, nn.BatchNorm2d, NoRunningStatsBatchNorm)}.running_mean"


def _ignores_eval(model: nn.Module) -> tuple[str, str]:
    _swap(model, nn.BatchNorm2d, IgnoresEvalBatchNorm)
    return "eval_output", "output"


def _frozen_count(model: nn.Module) -> tuple[str, str]:
    return "buffer", f"{_swap(model, nn.BatchNorm2d, FrozenCountBatchNorm)}.num_batches_tracked"


def _own_dropout_rng(model: nn.Module) -> tuple[str, str]:
    _swap(model, nn.Dropout, OwnGeneratorDropout)
    return "output", "output"


def _conv_off(model: nn.Module) -> tuple[str, str]:
    # A BatchNorm after the conv normalizes the scale away in training; what it lets through
    # is its running statistics.
    name = _swap(model, nn.Conv2d, SlightlyOffConv)
    bn = _following_batch_norm(model, name)
    return ("buffer", f"{bn}.running_mean") if bn is not None else ("output", "output")


DEFECTS = {
    "bn_weight_1pct": _perturb_bn_weight,
    "running_stats_not_updated": _stale_running_stats,
    "bn_ignores_eval": _ignores_eval,
    "num_batches_tracked_frozen": _frozen_count,
    "dropout_other_rng": _own_dropout_rng,
    "conv_output_1e-3": _conv_off,
}


def plant(name: str, model: nn.Module) -> tuple[str, str]:
    """Plant defect `name` into `model` in place; returns the (check kind, tensor name) that must fail."""
    return DEFECTS[name](model)
