"""Conv2d→BatchNorm2d sites that exist in a model, found without fxfuse, and how many fxfuse fused.

A site exists when a BatchNorm2d-family module (timm's BatchNormAct2d included: it subclasses
nn.BatchNorm2d) receives, as its input, the very tensor object that an nn.Conv2d module (any
subclass: timm's Conv2dSame too) returned. Found by running the eager model once with forward
hooks, so the count does not depend on fxfuse's tracing. Convolutions that are not Conv2d
modules (timm's MixedConv2d concatenates several, CondConv2d reshapes F.conv2d's output) feed
no site by this definition: there is no Conv→BN pair to fuse there.

`coverage` then matches every existing site against a FusionReport: fused, skipped (with the
report's reason), or not seen by the pass at all. A site is fused in either form: as one Conv→BN
site (conv_bn_act), or with its BN fused on its own (batch_norm_act, bn_act_conv), which is what
every mode does where recomputing the conv would free nothing (fusion/policy.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import nn

CONV_BN_PATTERN = "conv2d→batch_norm2d"  # prefix of the conv_bn_act pass's pattern names
BN_PATTERN = "batch_norm2d→"  # prefix of the batch_norm_act pass's (BN fused on its own, conv kept)


@dataclass(frozen=True)
class Site:
    conv: str  # module path of the Conv2d
    bn: str  # module path of the BatchNorm2d


@dataclass(frozen=True)
class Census:
    bn_layers: tuple[str, ...]  # every BatchNorm2d module the forward called
    sites: tuple[Site, ...]  # those fed directly by a Conv2d module, with that conv


def existing_sites(model: nn.Module, inputs: Sequence[Any]) -> Census:
    """The BatchNorm2d layers and Conv2d→BatchNorm2d sites of `model`, in forward order
    (train mode, one forward of a copy)."""
    model = copy.deepcopy(model).train()
    produced: dict[int, tuple[torch.Tensor, str]] = {}  # id(output) -> (output kept alive, conv path)
    bn_layers: dict[str, None] = {}
    sites: dict[Site, None] = {}

    def conv_hook(path):
        def hook(module, args, output):
            if isinstance(output, torch.Tensor):
                produced[id(output)] = (output, path)

        return hook

    def bn_hook(path):
        def hook(module, args):
            bn_layers[path] = None
            if args and isinstance(args[0], torch.Tensor):
                seen = produced.get(id(args[0]))
                if seen is not None and seen[0] is args[0]:
                    sites[Site(seen[1], path)] = None

        return hook

    handles = []
    for path, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            handles.append(module.register_forward_hook(conv_hook(path)))
        elif isinstance(module, nn.BatchNorm2d):
            handles.append(module.register_forward_pre_hook(bn_hook(path)))
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    return Census(tuple(bn_layers), tuple(sites))


def _names(path: str, name: str) -> bool:
    """A report entry's module name refers to module `path`: the path itself (a module call)
    or 'path:function' (a functional call traced inside that module)."""
    return name == path or name.startswith(path + ":")


def _refers_to(modules: Sequence[str], site: Site) -> bool:
    return len(modules) >= 2 and _names(site.conv, modules[0]) and _names(site.bn, modules[1])


@dataclass
class Coverage:
    sites: list[Site]
    fused: list[Site]
    skipped: dict[Site, str]  # site -> the report's reason
    unseen: list[Site]  # existing, but neither fused nor skipped in the report

    @property
    def ratio(self) -> Optional[float]:
        return len(self.fused) / len(self.sites) if self.sites else None

    def reasons(self) -> dict[str, int]:
        """Distinct reasons a site was not fused, with counts."""
        counts: dict[str, int] = {}
        for reason in [*self.skipped.values(), *["not seen by the pass"] * len(self.unseen)]:
            counts[reason] = counts.get(reason, 0) + 1
        return counts

    def describe(self) -> str:
        lines = [f"{len(self.fused)}/{len(self.sites)} Conv→BN sites fused"]
        lines += [f"  skipped {s.conv} + {s.bn}: {reason}" for s, reason in self.skipped.items()]
        lines += [f"  not seen by the pass: {s.conv} + {s.bn}" for s in self.unseen]
        return "\n".join(lines)


def coverage(sites: Sequence[Site], report) -> Coverage:
    """Match existing `sites` against an fxfuse FusionReport's Conv→BN entries."""
    fused, skipped, unseen = [], {}, []
    for site in sites:
        if any(f.pattern.startswith(CONV_BN_PATTERN) and _refers_to(f.modules, site) for f in report.fused) or any(
            f.pattern.startswith(BN_PATTERN) and _names(site.bn, f.modules[0]) for f in report.fused
        ):
            fused.append(site)
            continue
        reason = next(
            (s.reason for s in report.skipped if s.pattern.startswith(CONV_BN_PATTERN) and _refers_to(s.modules, site)),
            None,
        )
        if reason is None:
            unseen.append(site)
        else:
            skipped[site] = reason
    return Coverage(list(sites), fused, skipped, unseen)
