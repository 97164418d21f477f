"""The conv-BN fusion tutorial's network, trained with and without fxfuse: memory compared.

The tutorial ("Fusing Convolution and Batch Norm using Custom Function") hand-writes a
FusedConvBN layer for bias-free, stride-1 convs and BN without affine or running stats.
Here the *unfused* network is written the ordinary way and fxfuse.optimize fuses it.
Synthetic MNIST-shaped data (no downloads). It reports the activation bytes autograd keeps
for backward and the resident memory at the end of forward, like the tutorial's
"memory allocated at the end of the forward pass" (it reported 0.96 GB unfused, 0.59 GB fused
on CUDA at batch 2048), and the largest batch each trains within a memory cap (counted on a
meta-device copy, `fxfuse.measure.largest_batch`).

    python examples/conv_bn_tutorial.py [--batch 2048] [--steps 3] [--cap 4GiB]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":  # freed blocks must return to the OS for RSS
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import fxfuse  # noqa: E402
from fxfuse import measure  # noqa: E402
from fxfuse.measure import fit  # noqa: E402


class Net(nn.Module):
    """The tutorial's unfused network (fused=False branch), unchanged."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(32, affine=False, track_running_stats=False)
        self.conv2 = nn.Conv2d(32, 64, 3, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(64, affine=False, track_running_stats=False)
        self.fc1 = nn.Linear(9216, 128)
        self.dropout = nn.Dropout(0.5)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = self.bn1(x)
        F.relu_(x)
        x = self.conv2(x)
        x = self.bn2(x)
        F.relu_(x)
        x = F.max_pool2d(x, 2)
        F.relu_(x)
        x = x.flatten(1)
        x = self.fc1(x)
        x = self.dropout(x)
        F.relu_(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def train(model, batches, lr=0.01):
    optimizer = torch.optim.Adadelta(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = F.nll_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cap", type=fit.parse_size, default="4GiB", help="memory cap for the largest batch")
    args = parser.parse_args()

    torch.manual_seed(0)
    eager = Net()
    fused = fxfuse.optimize(copy.deepcopy(eager), torch.randn(args.batch, 1, 28, 28))
    print(fused.fxfuse_report, end="\n\n")

    x = torch.randn(args.batch, 1, 28, 28)
    rows = {}
    for name, model in (("unfused", eager), ("fxfuse", fused)):
        saved = measure.saved_activation_bytes(model, (x,))
        measure.forward_resident_bytes(model, (x,))
        rss = min(measure.forward_resident_bytes(model, (x,)) for _ in range(2))
        rows[name] = (saved, rss)
    for name, (saved, rss) in rows.items():
        print(f"{name:8s} saved for backward {saved / 1e9:.3f} GB   resident at end of forward {rss / 1e9:.3f} GB")
    print(
        f"ratio    saved {rows['fxfuse'][0] / rows['unfused'][0]:.3f}   resident "
        f"{rows['fxfuse'][1] / rows['unfused'][1]:.3f}"
    )

    fits = {
        name: measure.largest_batch(model, (x,), args.cap) for name, model in (("unfused", eager), ("fxfuse", fused))
    }
    print(
        f"largest batch within {args.cap / 2**30:.2f} GiB (counted): unfused {fits['unfused']}, "
        f"fxfuse {fits['fxfuse']} ({fits['fxfuse'] / max(fits['unfused'], 1):.2f}x)"
    )

    batches = [(torch.randn(args.batch, 1, 28, 28), torch.randint(0, 10, (args.batch,))) for _ in range(args.steps)]
    with torch.random.fork_rng():
        loss_eager = train(eager, batches)
    with torch.random.fork_rng():
        loss_fused = train(fused, batches)
    print("training losses, unfused:", " ".join(f"{v:.5f}" for v in loss_eager))
    print("training losses, fxfuse: ", " ".join(f"{v:.5f}" for v in loss_fused))


if __name__ == "__main__":
    main()
