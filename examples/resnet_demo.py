"""`make demo`: optimize a torchvision ResNet on synthetic data; print the fusion report's summary and
a memory/time table against eager, measured side by side in this process. Eager runs in both
layouts (NCHW and channels_last) and the faster one is the baseline; fxfuse runs in channels_last.

    python examples/resnet_demo.py [--model resnet18] [--batch 8] [--size 128]
"""

from __future__ import annotations

import argparse

import torch
import torchvision

from fxfuse import bench


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=128)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = torchvision.models.get_model(args.model, weights=None)
    x = torch.randn(args.batch, 3, args.size, args.size)
    layout = torch.channels_last
    variants = {
        name: bench.make_variant(name, model, (x,), memory_format=layout)
        for name in ("eager", bench.EAGER_CHANNELS_LAST, "memory")
    }
    report = variants["memory"].fxfuse_report
    print(report.summary())
    print("each site: print(model.fxfuse_report); its full reason: model.fxfuse_report.explain(name)\n")
    rows = bench.compare(variants, (x,), repeats=3, memory_format=layout)
    print(
        f"{args.model}, batch {args.batch}, {args.size}x{args.size}, float32, CPU ({torch.get_num_threads()} threads)"
    )
    print("memory = fxfuse.optimize(mode='memory') in channels_last; ratios to the faster eager layout:")
    print(bench.render_narrow(rows))


if __name__ == "__main__":
    main()
