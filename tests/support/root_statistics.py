"""A model whose root holds a parameter and running statistics of its own, used between convolutions (a
ViT's pos_embed, a layer-scale gamma): a recompute region around them reads the root's tensors, whose
module path is "" (tests/test_regions.py, tests/test_higher_order.py)."""

import torch
import torch.nn.functional as F
from torch import nn


class RootStatistics(nn.Module):
    def __init__(self, c=4):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c)
        self.conv2, self.conv3 = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)
        self.bn3 = nn.BatchNorm2d(c)
        self.register_buffer("running_mean", torch.zeros(c))
        self.register_buffer("running_var", torch.ones(c))
        self.weight = nn.Parameter(torch.rand(c) + 0.5)
        self.fc = nn.Linear(c, 2)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.conv2(y)
        y = F.batch_norm(y, self.running_mean, self.running_var, self.weight, None, self.training, 0.1, 1e-5)
        y = F.relu(self.bn3(self.conv3(F.relu(y))))
        return self.fc(y.mean((2, 3)))
