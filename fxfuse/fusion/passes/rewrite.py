"""The one way passes change a graph: put a new node where a chain of nodes was."""

from __future__ import annotations

from typing import Callable, Sequence

import torch.fx as fx

from ..graphs import provenance
from ..user_checkpoint import KEY


def replace_chain(
    graph: fx.Graph, chain: Sequence[fx.Node], build: Callable[[], fx.Node], also_replace: Sequence[fx.Node] = ()
) -> fx.Node:
    """Replace `chain` (producer first; only the last one has outside users) by `build()`.

    `build` runs with the insertion point just before the chain's last node, where all
    of the chain's inputs are defined. Uses of the last node and of `also_replace` go to
    the new node; the chain is then erased, newest first.
    """
    last = chain[-1]
    with graph.inserting_before(last):
        new = build()
    new.meta.update(provenance(last, KEY))
    for node in (last, *also_replace):
        node.replace_all_uses_with(new)
    for node in reversed(chain):
        graph.erase_node(node)
    return new
