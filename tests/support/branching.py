"""Models whose forward branches on a tensor's value, so that it does not trace, around Conv-BN-ReLU
blocks that do: the capture and install tests' cases of a module that stays a leaf."""

from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class Holder(nn.Module):
    """Branches on a value (does not trace) around a block it may share with another Holder."""

    def __init__(self, block):
        super().__init__()
        self.a, self.b = block, Block()

    def forward(self, x):
        return self.b(self.a(x) if x.sum() > 0 else self.a(-x))


class Untraceable(nn.Module):
    """Its own forward branches on a value; its blocks trace."""

    def __init__(self):
        super().__init__()
        self.a, self.b = Block(), Block()

    def forward(self, x):
        y = self.a(x)
        return self.b(y) if y.sum() > 0 else self.b(-y)
