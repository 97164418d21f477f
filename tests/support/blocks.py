"""A ResNet basic block for tests that need residual blocks (recompute regions, fused sites inside
a block)."""

import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """conv→BN→ReLU, conv→BN, + identity, ReLU (the add fused in place in eager)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + x)
