"""State shared by the passes over one traced graph."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch.fx as fx
from torch import nn

from ..report import FusionReport


@dataclass
class PassContext:
    graph: fx.Graph
    root: nn.Module
    mode: str  # "memory" or "fast" (Options.pass_mode): which passes run
    report: FusionReport
    # Fake-propagated tensor metadata of the traced graph, when example inputs were given.
    shapes: dict[fx.Node, object] = field(default_factory=dict)
    # Sites (tuples of module names) the policy excludes; None means every site is allowed.
    allowed: Optional[set[tuple[str, ...]]] = None

    def __post_init__(self) -> None:
        self.modules = dict(self.root.named_modules())

    def get_attr(self, target: str) -> fx.Node:
        return self.graph.get_attr(target)
