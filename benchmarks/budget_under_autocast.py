"""What fxfuse's plans keep under autocast, as a fraction of what eager autocast keeps.

    python benchmarks/budget_under_autocast.py [--model resnet18] [--shape 8,3,96,96] [--budgets 0.5,0.3]
        [--modes memory] [--model-args image_size=64] [--activations] [--no-channels-last]

Prints, for eager and for each `mode` and each `memory_budget`, the saved-for-backward bytes with
and without CPU bfloat16 autocast (fxfuse.measure.saved_activation_bytes), as ratios to eager's in
the same precision, and the bytes each plan frees (eager's minus its own): for plans made outside
autocast (counted in float32), and for plans made inside it (counted under bf16 autocast, as
optimize does when called there).
`--activations` counts activation bytes only: saved bytes at twice the batch minus saved bytes
at the batch, so that what does not grow with the batch (the weights' autocast copies) cancels.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torchvision

import fxfuse
from fxfuse import measure


def _value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--shape", default="8,3,96,96")
    parser.add_argument("--budgets", default="0.5,0.3", help="comma-separated memory_budget values ('' for none)")
    parser.add_argument("--modes", default="memory", help="comma-separated modes ('' for none)")
    parser.add_argument("--model-args", default="", help="key=value,... passed to the torchvision constructor")
    parser.add_argument("--activations", action="store_true", help="count saved(2 x batch) - saved(batch)")
    parser.add_argument("--no-channels-last", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    kwargs = dict((k, _value(v)) for k, v in (a.split("=") for a in args.model_args.split(",") if a))
    model = getattr(torchvision.models, args.model)(**kwargs)
    fmt = torch.contiguous_format if args.no_channels_last else torch.channels_last
    model = model.to(memory_format=fmt)
    shape = [int(s) for s in args.shape.split(",")]
    x = torch.randn(*shape).contiguous(memory_format=fmt)
    x2 = torch.randn(2 * shape[0], *shape[1:]).contiguous(memory_format=fmt)
    plans = [{"mode": m} for m in args.modes.split(",") if m]
    plans += [{"memory_budget": float(b)} for b in args.budgets.split(",") if b]

    def saved(m):
        if not args.activations:
            return measure.saved_activation_bytes(m, (x,))
        return measure.saved_activation_bytes(m, (x2,)) - measure.saved_activation_bytes(m, (x,))

    what = "activation bytes" if args.activations else "saved bytes"
    print(f"{args.model} {tuple(shape)} {kwargs or ''} {what}, fraction of eager's")
    for planned_under in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=planned_under):
            optimized = [fxfuse.optimize(copy.deepcopy(model), (x,), **plan) for plan in plans]
        print(f"plans made {'inside bf16 autocast' if planned_under else 'without autocast'}:")
        for amp in (False, True):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                eager = saved(model)
                kept = [saved(m) for m in optimized]
            label = "bf16 autocast" if amp else "no autocast  "
            cells = ", ".join(
                f"{k}={v}: {b / eager:.3f} (frees {(eager - b) / 2**20:.2f} MiB)"
                for p, b in zip(plans, kept)
                for k, v in p.items()
            )
            print(f"  {label}  eager {eager / 2**20:.1f} MiB  {cells}")


if __name__ == "__main__":
    main()
