"""fxfuse's float32 / bfloat16-autocast error against eager's, both measured against float64.

    python benchmarks/accuracy_matrix.py [--models dla34,resnet50,efficientnet_b0] [--seeds 0,1]
        [--modes memory,fast] [--layouts nchw,nhwc] [--autocast] [--threads 1]

One line per (model, seed, mode, layout): the worst ratio fxfuse error / eager error over
every output, input gradient, parameter gradient and running statistic after one training
step (tests/test_accuracy.py's errors(); an eager error below FLOOR counts as FLOOR), the
tensor it is on, and how many tensors fail the test's criterion (as_accurate: 2x eager's
error plus FLOOR, 4x where eager's error exceeds the tensor itself). Run it under
ATEN_CPU_CAPABILITY=... to cover the other CPU kernel builds.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from support.timm_zoo import without_dropout  # noqa: E402
from test_accuracy import errors, summarize  # noqa: E402

# (builder, batch) at 64x64: the draws.
MODELS = {
    "dla34": (lambda: __import__("timm").create_model("dla34", pretrained=False), 2),
    "resnet50": (lambda: __import__("torchvision").models.resnet50(num_classes=10), 4),
    "efficientnet_b0": (lambda: __import__("torchvision").models.efficientnet_b0(num_classes=10), 4),
}


def build(name, seed):
    make, batch = MODELS[name]
    torch.manual_seed(seed)
    model = make()
    return without_dropout(model), torch.randn(batch, 3, 64, 64)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="dla34,resnet50,efficientnet_b0")
    p.add_argument("--seeds", default="0")
    p.add_argument("--modes", default="memory")
    p.add_argument("--layouts", default="nchw")
    p.add_argument("--autocast", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cap = torch.backends.cpu.get_cpu_capability()
    for name in args.models.split(","):
        for seed in map(int, args.seeds.split(",")):
            for mode in args.modes.split(","):
                for lay in args.layouts.split(","):
                    model, x = build(name, seed)
                    errs = errors(model, x, mode=mode, autocast=args.autocast, channels_last=lay == "nhwc", seed=seed)
                    ratio, tensor, failing, _ = summarize(errs)
                    dtype = "bf16" if args.autocast else "f32"
                    print(
                        f"{cap} {dtype} {name} seed={seed} {mode} {lay}: worst {ratio:.2f}x on {tensor} "
                        f"(eager {errs[tensor][0]:.2e}, fxfuse {errs[tensor][1]:.2e}); {len(failing)} tensors over 2x",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
