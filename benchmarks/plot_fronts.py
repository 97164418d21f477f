"""Draws the memory/time fronts of several `fxfuse bench --json` runs side by side in one figure.

    fxfuse bench torchvision:resnet50 --input-shape 8,3,224,224 --modes memory \
        --frontier 0.7,0.5,0.4,0.3,0.25,0.2,0.15 --with compile-budget --json > resnet50.json
    python benchmarks/plot_fronts.py docs/fronts.svg resnet50.json efficientnet_b0.json densenet121.json

The README's figure is drawn this way from the runs kept in docs/fronts/.
"""

from __future__ import annotations

import argparse
import json
from typing import Optional

from fxfuse import bench, plot


def title(run: dict) -> str:
    shape = "x".join(map(str, run["input_shape"]))
    return f"{run['model'].split(':')[-1]}, {shape}, {run.get('memory_format') or 'NCHW'}, {run['device']}"


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the figure to write (.svg, .png, .pdf)")
    parser.add_argument("runs", nargs="+", help="JSON files written by `fxfuse bench --json`")
    args = parser.parse_args(argv)
    panels = []
    for path in args.runs:
        with open(path) as f:
            run = json.load(f)
        panels.append((title(run), bench.from_json(run["rows"])))
    plot.plot_fronts(panels, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
