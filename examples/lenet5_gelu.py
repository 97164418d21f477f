"""LeNet-5 with GELU (the C++ GELU lab's network), trained on synthetic MNIST-shaped data
with and without fxfuse: same losses, fewer bytes kept for backward.

    python examples/lenet5_gelu.py [--batch 256] [--steps 5]
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from torch import nn

import fxfuse
from fxfuse import measure


class LeNet5(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.gelu(self.conv1(x)), 2)
        x = F.max_pool2d(F.gelu(self.conv2(x)), 2)
        x = x.flatten(1)
        x = F.gelu(self.fc1(x))
        x = F.gelu(self.fc2(x))
        return self.fc3(x)


def train(model, batches):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    eager = LeNet5()
    x = torch.randn(args.batch, 1, 28, 28)
    fused = fxfuse.optimize(copy.deepcopy(eager), x)
    print(fused.fxfuse_report, end="\n\n")
    saved_eager = measure.saved_activation_bytes(eager, (x,))
    saved_fused = measure.saved_activation_bytes(fused, (x,))
    print(
        f"saved for backward: eager {saved_eager / 2**20:.2f} MiB, fxfuse {saved_fused / 2**20:.2f} MiB "
        f"({saved_fused / saved_eager:.3f}x)"
    )
    batches = [(torch.randn(args.batch, 1, 28, 28), torch.randint(0, 10, (args.batch,))) for _ in range(args.steps)]
    print("losses, eager: ", " ".join(f"{v:.6f}" for v in train(eager, batches)))
    print("losses, fxfuse:", " ".join(f"{v:.6f}" for v in train(fused, batches)))


if __name__ == "__main__":
    main()
