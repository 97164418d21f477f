"""Audit torchvision models for channels_last losses (random weights, offline, CPU).

    python examples/audit_torchvision.py                      # convnext_tiny, 2x3x64x64, full report
    python examples/audit_torchvision.py mobilenet_v2 --size 96 --fake
    python examples/audit_torchvision.py --summary resnet18 vgg11 shufflenet_v2_x0_5   # one row per model

ConvNeXt is a good first subject: its NHWC permutes show up as info (views, no copy), and
the gradient of its global average pool comes back NCHW, which the last stage's backward
then pays for.
"""

import argparse
import collections
import time

import torch
import torchvision
from tabulate import tabulate

from fxfuse.audit import ChannelsLastReport, audit_channels_last


def summary_row(name: str, shape: tuple[int, ...], report: ChannelsLastReport, seconds: float) -> list:
    def sites_and_calls(phase: str) -> str:
        findings = report.losses(phase)
        return f"{len(findings)} / {sum(f.count for f in findings)}"

    top = collections.Counter()
    for finding in report.findings:
        top[f"{finding.op} ({finding.phase[0]})"] += finding.count
    top_ops = ", ".join(f"{op} x{n}" for op, n in top.most_common(2)) or "-"
    shape_text = "x".join(map(str, shape))
    return [
        name,
        shape_text,
        sites_and_calls("forward"),
        sites_and_calls("backward"),
        top_ops,
        len(report.info),
        len(report.ambiguous),
        f"{seconds:.1f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=["convnext_tiny"], help="torchvision classification models")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=64, help="input height and width")
    parser.add_argument("--fake", action="store_true", help="audit on fake tensors (no compute)")
    parser.add_argument("--summary", action="store_true", help="print one table row per model instead of reports")
    args = parser.parse_args()

    shape = (args.batch, 3, args.size, args.size)
    rows = []
    for name in args.models:
        torch.manual_seed(0)
        model = torchvision.models.get_model(name, weights=None)
        start = time.perf_counter()
        report = audit_channels_last(model, torch.randn(shape), fake=args.fake)
        seconds = time.perf_counter() - start
        if args.summary:
            rows.append(summary_row(name, shape, report, seconds))
            print(tabulate(rows[-1:], tablefmt="plain"), flush=True)
        else:
            print(report)
            print(f"\naudited in {seconds:.1f} s; ok={report.ok}\n")
    if args.summary:
        headers = [
            "model",
            "input",
            "forward losses (sites / calls)",
            "backward losses (sites / calls)",
            "top ops (f/b)",
            "info",
            "ambiguous",
            "seconds",
        ]
        print(tabulate(rows, headers=headers, tablefmt="github"))


if __name__ == "__main__":
    main()
