"""A model whose forward reads a flag from a HF-style `config` object (tests/test_install.py, tests/test_compile.py)."""

from __future__ import annotations

import torch
from torch import nn


class Config:
    """As HF's PretrainedConfig: every flag an instance attribute, set in __init__."""

    def __init__(self):
        self.extra = False


class ConfigFlagNet(nn.Module):
    """conv→BN→ReLU, returning one tensor, or two when `config.extra` is set."""

    def __init__(self):
        super().__init__()
        self.config = Config()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return (y, y.mean()) if self.config.extra else (y,)
