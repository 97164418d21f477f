"""An experiment: recompute every pointwise op and keep every conv output, as torch.compile's
activation_memory_budget=0.5 plan does on DLA-34, in eager, with a selective checkpoint.

    python benchmarks/sac_pointwise.py [--model timm.models.dla:dla34] [--blocks base_layer,level0,...,level5]
        [--budget 0.45] [--rounds 9]

The listed top-level children run as one non-reentrant `torch.utils.checkpoint` whose selective-
checkpoint policy keeps the output of every op with a FLOP formula (convolutions, matmuls, fxfuse's
conv and linear ops: `torch.utils.flop_counter.flop_registry`) and recomputes every other op in
backward; the modules' buffers are swapped for copies during the recompute by fxfuse's regions' own
swap (`regions.recompute`), so running statistics are updated once. Variants, in one process, model
and input channels_last, batch 8 at 224²: eager; the checkpoint around eager's modules; the
checkpoint around `fxfuse.optimize(model, mode="fast")` (fxfuse's pointwise kernels inside); and
`fxfuse.optimize(model, memory_budget=BUDGET)`. Prints each variant's bytes held at the end of
forward (the checkpoint's kept outputs are not saved tensors, so `saved_tensors_hooks` miss them)
and its step peak, as ratios to eager's, the largest float64 gradient and buffer difference from
eager on a small input, and the median train step over interleaved rounds
(`fxfuse.measure.median_step_times`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.utils.flop_counter import flop_registry

import fxfuse
from fxfuse.commands._common import load_model
from fxfuse.fusion.regions.recompute import _buffers_swapped
from fxfuse.measure import memory

DLA = "base_layer,level0,level1,level2,level3,level4,level5"


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op._overloadpacket in flop_registry else CheckpointPolicy.PREFER_RECOMPUTE


class PointwiseRecomputed(nn.Module):
    """`block`, keeping only its inputs and its FLOP ops' outputs for backward."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def _contexts(self):
        forward, recompute = create_selective_checkpoint_contexts(_policy)
        stack = contextlib.ExitStack()
        block = self.block

        class Recompute:  # the buffer swap outside the policy's mode, which would see its clones
            def __enter__(self):
                stack.enter_context(_buffers_swapped(list(block.modules())))
                stack.enter_context(recompute)

            def __exit__(self, *exc):
                stack.close()

        return forward, Recompute()

    def forward(self, *args):
        return checkpoint(self.block, *args, use_reentrant=False, context_fn=self._contexts)


def pointwise_recomputed(model: nn.Module, blocks: list[str]) -> nn.Module:
    """`model` with its top-level children `blocks` (consecutive, each one's output the next one's
    input) run as one PointwiseRecomputed module."""
    model = copy.deepcopy(model)
    chained = nn.Sequential(*[getattr(model, name) for name in blocks])
    for name in blocks[1:]:
        setattr(model, name, nn.Identity())
    setattr(model, blocks[0], PointwiseRecomputed(chained))
    return model


def _largest_differences(model: nn.Module, candidate: nn.Module) -> tuple[float, float]:
    reference, candidate = copy.deepcopy(model).double(), copy.deepcopy(candidate).double()
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    for m in (reference, candidate):
        m(x).square().sum().backward()
    grads = max((p.grad - q.grad).abs().max().item() for p, q in zip(reference.parameters(), candidate.parameters()))
    buffers = max(
        (p.double() - q.double()).abs().max().item() for p, q in zip(reference.buffers(), candidate.buffers())
    )
    return grads, buffers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="timm.models.dla:dla34")
    parser.add_argument("--blocks", default=DLA)
    parser.add_argument("--budget", type=float, default=0.45)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.manual_seed(0)
    blocks = args.blocks.split(",")
    base = load_model(args.model).to(memory_format=torch.channels_last)
    x = torch.randn(8, 3, 224, 224).to(memory_format=torch.channels_last)
    variants = {
        "eager": base,
        "pointwise recompute, eager ops": pointwise_recomputed(base, blocks),
        "pointwise recompute, fxfuse fast": PointwiseRecomputed(
            fxfuse.optimize(copy.deepcopy(base), (x,), mode="fast")
        ),
        f"fxfuse memory_budget={args.budget:g}": fxfuse.optimize(copy.deepcopy(base), (x,), memory_budget=args.budget),
    }
    print(f"{args.model}, 8x3x224x224, channels_last, float32; checkpointed: {','.join(blocks)}")
    # Before any step: eager and the checkpointed copy start from the same buffers.
    grads, buffers = _largest_differences(base, variants["pointwise recompute, eager ops"])
    print(f"largest float64 differences from eager: gradients {grads:.3g}, buffers {buffers:.3g}")
    held = memory.forward_allocated_bytes(base, (x,))
    peak = memory.step_allocated_peak_bytes(lambda: memory.train_step(base, (x,)))
    for name, model in variants.items():
        memory.train_step(model, (x,))
        h = memory.forward_allocated_bytes(model, (x,)) / held
        p = memory.step_allocated_peak_bytes(lambda m=model: memory.train_step(m, (x,))) / peak
        print(f"{name:36s} held at end of forward {h:.3f}  step peak {p:.3f}")
    steps = {name: (lambda m=model: memory.train_step(m, (x,))) for name, model in variants.items()}
    times = memory.median_step_times(steps, repeats=args.rounds)
    for name, median in times.items():
        print(f"{name:36s} median step {median * 1000:7.1f} ms  {median / times['eager']:.3f}x")


if __name__ == "__main__":
    main()
