"""Host cost: what fxfuse's calls cost the CPU beyond their kernels, against eager's layers.

    python benchmarks/host_cost.py [--sites] [--steps] [--rounds 7] [--calls 200] [--instructions]

On a GPU the step waits on the host when a fused call costs more Python and dispatch than the
eager layers it replaces (docs/gpu_results.md). Here the tensors are tiny, one thread, so kernels
cost next to nothing and what is timed is the path to them:

* sites: each op family's fused call (the runtime function a rewritten graph calls, with the
  user's modules) against the eager layers it replaces, forward + backward, µs a call; and against
  eager plus the recompute the fused op's backward runs by design (the conv, linear, activation or
  layer norm it does not keep), timed alone: what the fused call costs beyond the plan's choice;
* steps: a train step (forward, loss, backward) of ResNet-50, EfficientNet-B0, MobileNetV2 at
  2×3×16×16 and a plain CNN of Conv-BN-ReLU blocks, NCHW: eager against fxfuse `fast`, `memory`
  and `memory_budget=0.5`, all built in this process and timed interleaved.

Ratios are medians over interleaved rounds (each round times every variant once), to eager, of the
thread's CPU time (time.thread_time). `--instructions` counts instead the instructions each variant
executes, under valgrind's callgrind (benchmarks/instructions.py): slower (minutes), but the same
count whatever else the machine runs; not time, since cache misses cost time and no instructions.
It also splits off the instructions run inside the compute kernels (oneDNN's convolutions, the BLAS
gemm): the "host" columns are the rest, what a GPU's host would run. Tiny inputs do not make the
kernels cheap everywhere: on ResNet-50 at 2×3×16×16 they are 70% of eager's step (the weights set
their size), and a recompute's arithmetic would otherwise count as host cost.
"""

from __future__ import annotations

import argparse
import copy
import textwrap
from typing import Callable, Optional

import instructions
import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch import nn

import fxfuse
from fxfuse.fusion import runtime


def _train(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], None]:
    def step():
        fn(x).sum().backward()

    return step


def site_variants() -> dict[str, tuple[Callable[[], None], Callable[[], None], Optional[Callable[[], None]]]]:
    """Each family: (eager layers, fxfuse's runtime call, the recompute its backward runs by design or
    None), the first two forward + backward on tiny tensors, the recompute alone without grad."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 4, 4, requires_grad=True)
    conv, bn, conv2, bn2 = (
        nn.Conv2d(8, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.Conv2d(8, 8, 1),
        nn.BatchNorm2d(8),
    )
    lin_x = torch.randn(2, 4, 16, requires_grad=True)
    lin, lin2, norm = nn.Linear(16, 16), nn.Linear(16, 16), nn.LayerNorm(16)
    mean, var = torch.zeros(8), torch.ones(8)

    def rebuilt_bn_act(t):  # what bn_act_conv's backward rebuilds: the conv input act(bn(y))
        return torch.ops.fxfuse.bn_act.default(t, mean, var, bn.weight, bn.bias, bn.eps, "relu", 0.0)

    families = {
        "conv_bn_act (conv→BN→ReLU)": (
            lambda t: F.relu(bn(conv(t))),
            lambda t: runtime.conv_bn_act_module(t, conv, bn, "relu", 0.0),
            lambda t: F.conv2d(t, conv.weight, None, 1, 1),
            x,
        ),
        "batch_norm_act (BN→ReLU)": (
            lambda t: F.relu(bn(t)),
            lambda t: runtime.batch_norm_act_module(t, bn, "relu", 0.0),
            None,
            x,
        ),
        "bn_act_conv (BN→ReLU→conv)": (
            lambda t: conv2(F.relu(bn(t))),
            lambda t: runtime.bn_act_conv_module(t, bn, "relu", 0.0, conv2),
            rebuilt_bn_act,
            x,
        ),
        "bn_act_conv + epilogue (BN→ReLU→conv→BN→ReLU)": (
            lambda t: F.relu(bn2(conv2(F.relu(bn(t))))),
            lambda t: runtime.bn_act_conv_module(t, bn, "relu", 0.0, conv2, bn2, "relu", 0.0),
            lambda t: F.conv2d(rebuilt_bn_act(t), conv2.weight, conv2.bias),
            x,
        ),
        "conv_act (conv→ReLU)": (
            lambda t: F.relu(conv(t)),
            lambda t: runtime.conv_act_module(t, conv, "relu", 0.0),
            lambda t: F.conv2d(t, conv.weight, None, 1, 1),
            x,
        ),
        "linear_act (Linear→GELU)": (
            lambda t: F.gelu(lin(t)),
            lambda t: runtime.linear_act_module(t, lin, "gelu", 0.0),
            lambda t: F.linear(t, lin.weight, lin.bias),
            lin_x,
        ),
        "act_linear (GELU→Linear)": (
            lambda t: lin2(F.gelu(t)),
            lambda t: runtime.act_linear_module(t, "gelu", 0.0, lin2),
            F.gelu,
            lin_x,
        ),
        "layer_norm_linear (LN→Linear)": (
            lambda t: lin(norm(t)),
            lambda t: runtime.layer_norm_linear_module(t, norm, lin),
            lambda t: F.layer_norm(t, norm.normalized_shape, norm.weight, norm.bias, norm.eps),
            lin_x,
        ),
    }
    return {
        name: (_train(eager, t), _train(fused, t), None if redo is None else _no_grad(redo, t))
        for name, (eager, fused, redo, t) in families.items()
    }


def _no_grad(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], None]:
    def call():
        with torch.no_grad():
            fn(x)

    return call


def sites(calls: int, rounds: int) -> list[list]:
    rows = []
    for name, (eager, fused, redo) in site_variants().items():
        variants = {"eager": eager, "fxfuse": fused}
        if redo is not None:
            variants["recompute"] = redo
        t = instructions.rounds(variants, calls, rounds)
        redone = t["recompute"][0] if redo is not None else 0.0
        row = [name.split(" (")[0], f"{t['eager'][0]:.0f}", f"{t['fxfuse'][0]:.0f}", f"{redone:.0f}"]
        row += [f"{t['fxfuse'][0] / t['eager'][0]:.2f}", f"{t['fxfuse'][0] / (t['eager'][0] + redone):.2f}"]
        rows.append(row)
    return rows


class PlainCNN(nn.Sequential):
    """Conv-BN-ReLU blocks: the shape of a fused site with nothing else around it."""

    def __init__(self, blocks: int = 8, width: int = 16):
        layers = [nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
        for _ in range(blocks - 1):
            layers += [nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
        super().__init__(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))


def step_models() -> dict[str, Callable[[], nn.Module]]:
    import torchvision.models as tvm

    return {
        "resnet50": lambda: tvm.resnet50(num_classes=10),
        "efficientnet_b0": lambda: tvm.efficientnet_b0(num_classes=10),
        "mobilenet_v2": lambda: tvm.mobilenet_v2(num_classes=10),
        "plain CNN": PlainCNN,
    }


def steps(calls: int, rounds: int, shape=(2, 3, 16, 16)) -> list[list]:
    rows = []
    for name, build in step_models().items():
        torch.manual_seed(0)
        model = build().train()
        x = torch.randn(*shape)
        if name.startswith("efficientnet"):  # dropout draws differ between variants: nothing to time there
            model.classifier[0].p = 0.0
        variants = {"eager": model}
        for label, options in (("fast", {"mode": "fast"}), ("memory", {"mode": "memory"}),
                               ("budget 0.5", {"memory_budget": 0.5})):  # fmt: skip
            variants[label] = fxfuse.optimize(copy.deepcopy(model), x, **options)
        t = instructions.rounds({label: _train(m, x) for label, m in variants.items()}, calls, rounds)
        row = [name, f"{t['eager'][0] / 1e3:.1f}"]
        for part in (0, 1) if instructions.active() else (0,):
            row += [f"{t[k][part] / t['eager'][part]:.2f}" for k in variants if k != "eager"]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", action="store_true", help="only the per-site table")
    parser.add_argument("--steps", action="store_true", help="only the train-step table")
    parser.add_argument("--calls", type=int, default=200, help="calls a round for sites (steps take a tenth)")
    parser.add_argument("--rounds", type=int, default=7)
    args = instructions.parse_args(parser)
    torch.set_num_threads(1)
    both = not (args.sites or args.steps)
    unit, step_unit = ("k instructions", "M instructions") if instructions.active() else ("µs", "ms")
    if args.sites or both:
        print(f"{unit} a call, forward + backward, 2×8×4×4 (linear: 2×4×16), one thread")
        legend = "; ".join(name.replace(" (", ": ").rstrip(")") for name in site_variants())
        print(textwrap.fill(f"{legend}. redo: the recompute the op's backward runs by design, alone.", 100))
        rows = sites(args.calls, args.rounds)
        headers = ["site", "eager", "fxfuse", "redo", "x eager", "x (eager + redo)"]
        print(tabulate(rows, headers=headers, tablefmt="github"))
    if args.steps or both:
        print(f"\ntrain step at 2×3×16×16, NCHW, one thread: {step_unit} for eager, then each variant's ratio")
        host = "; host: outside the compute kernels" if instructions.active() else ""
        print(f"(budget: memory_budget=0.5; plain CNN: 8 Conv-BN-ReLU blocks{host})")
        rows = steps(max(args.calls // 10, 5), args.rounds)
        headers = ["model", "eager", "fast", "memory", "budget"]
        if instructions.active():
            headers += ["host fast", "host memory", "host budget"]
        print(tabulate(rows, headers=headers, tablefmt="github"))


if __name__ == "__main__":
    main()
