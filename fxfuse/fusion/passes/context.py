"""State shared by the passes over one traced graph."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch.fx as fx
from torch import nn

from ..plan import Findings


@dataclass
class PassContext:
    graph: fx.Graph
    root: nn.Module
    mode: str  # "memory" or "fast" (Options.pass_mode): which passes run
    found: Findings  # the sites rewritten and skipped
    # Fake-propagated tensor metadata of the traced graph, when example inputs were given.
    shapes: dict[fx.Node, object] = field(default_factory=dict)
    # The sites (tuples of names) the plan lets the passes rewrite; None means every site.
    allowed: Optional[set[tuple[str, ...]]] = None
    # BN→activation outputs are rebuilt in backward for the ops that keep them (passes/rebuild.py).
    rebuild: bool = False

    def __post_init__(self) -> None:
        self.modules = dict(self.root.named_modules())

    def get_attr(self, target: str) -> fx.Node:
        return self.graph.get_attr(target)
