"""What recomputing a region costs (forward FLOPs, bytes moved, ops) and frees (bytes saved for
backward), measured once; time_model.py turns the costs into seconds.

One forward of a meta-device copy, fused with pointwise sites only (what a chosen
region runs inside), through an fx.Interpreter that notes for every node the FLOPs it
runs (FlopCounterMode), the bytes its ops read and write (measure/traffic.py) and the
storages autograd saves while it runs (the same unique storages `fxfuse.measure` counts).
A region frees the storages saved only by its own nodes, less what it keeps: its inputs,
where nothing else keeps them already.

A *chain* is kept as a candidate only where it costs next to nothing (CHAIN_FLOPS_PER_BYTE).
A region whose last conv is not run again (regions/graph.py `tail_conv`) counts its costs without it.

A *link* joins two consecutive regions into a chain: the second no longer keeps its
input (the first one's output), which backward rebuilds by running the first again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ...measure.memory import storage_key, tensors
from ...measure.traffic import OpCosts
from . import graph as region_graph

# A chain (regions/graph.py) is a candidate when recomputing it costs at most this many FLOPs per byte
# it frees (pointwise ops count none; a squeeze-excite gate's 1x1 convs on pooled values 10 FLOP/B at
# VoVNet's last stage, a 3x3 depthwise conv about 4; a lone 1x1 conv on 64 channels, 32, is left to the
# regions and site upgrades), and frees at least CHAIN_MIN_SHARE of what the whole graph saves: hundreds
# of chains free a few KiB (a gate's pooled values), and would fill the report.
CHAIN_FLOPS_PER_BYTE = 16.0
CHAIN_MIN_SHARE = 0.002


@dataclass
class RegionCost:
    name: str
    kind: str  # "block" or "run"
    modules: tuple[str, ...]
    flops: int  # one forward of the region: the recompute
    freed_bytes: int  # saved for backward without it, less what it keeps (its inputs)
    parent: str = ""  # an inner region or a chain: the region it lies in (regions/graph.py)
    nodes: frozenset = frozenset()  # its nodes' names in the profiled graph: which regions contain which
    moved: int = 0  # bytes its recompute reads and writes (measure/traffic.py)
    ops: int = 0  # ops its recompute runs


@dataclass
class LinkCost:
    first: str
    second: str
    flops: int  # running `first` again to rebuild `second`'s input
    freed_bytes: int  # `second`'s input, no longer kept
    moved: int = 0  # bytes running `first` again reads and writes
    ops: int = 0


@dataclass
class Profile:
    regions: list[RegionCost]
    links: list[LinkCost]
    problems: dict[str, str]  # region name -> why it cannot be a region


class _NodeRecorder(fx.Interpreter):
    """Runs the graph, noting each node's FLOPs, the storages saved while it runs and its outputs."""

    def __init__(self, module: nn.Module, graph: fx.Graph, exclude: set) -> None:
        super().__init__(module, graph=graph)
        self.exclude = exclude
        self.current: Optional[fx.Node] = None
        self.flops: dict[fx.Node, int] = {}
        self.moved: dict[fx.Node, int] = {}
        self.ops: dict[fx.Node, int] = {}
        self.savers: dict[tuple, set] = {}
        self.outputs: dict[fx.Node, list[tuple]] = {}
        self.held: list[Any] = []  # every value stays alive, so no storage identity is reused

    def pack(self, t: torch.Tensor):
        key = storage_key(t)
        if key not in self.exclude and key[2] > 0:
            self.savers.setdefault(key, set()).add(self.current)
        self.held.append(t)
        return t

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        with FlopCounterMode(display=False) as counter, OpCosts() as traffic:
            out = super().run_node(n)
        self.flops[n] = counter.get_total_flops()
        self.moved[n] = traffic.moved
        self.ops[n] = traffic.data_ops
        self.outputs[n] = [storage_key(t) for t in tensors(out)]
        self.held.append(out)
        return out


def _bytes(keys) -> int:
    return sum(k[2] for k in keys)


def profile(module: nn.Module, graph: fx.Graph, inputs: Sequence[Any]) -> Profile:
    """Costs of every region of `graph` (the pointwise-fused graph of `module`, both on the meta device)."""
    exclude = {storage_key(t) for t in (*module.parameters(), *module.buffers(), *tensors(inputs))}
    recorder = _NodeRecorder(module, graph, exclude)
    with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
        recorder.run(*inputs)
    found = region_graph.find(graph, module)
    modules = dict(module.named_modules())
    everything = sum(len(r.nodes) for r in found if not r.parent)
    saved_anywhere = set(recorder.savers)
    minimum = CHAIN_MIN_SHARE * _bytes(saved_anywhere)
    costs, problems = [], {}
    whole: dict[str, tuple[int, int, int]] = {}  # a region's forward, its last conv included: what a link runs again

    def total(nodes) -> tuple[int, int, int]:
        """FLOPs, bytes moved and ops of running `nodes` again."""
        return tuple(sum(d.get(n, 0) for n in nodes) for d in (recorder.flops, recorder.moved, recorder.ops))

    for region in found:
        if region.problem is None and len(region.nodes) == everything:
            region.problem = "it is the whole graph: its recompute would hold all of eager's activations at once"
        if region.problem:
            problems[region.name] = region.problem
            continue
        inside = set(region.nodes)
        internal = {k for k, nodes in recorder.savers.items() if nodes <= inside}
        kept = {k for n in region.inputs for k in recorder.outputs.get(n, ()) if k not in exclude}
        freed = _bytes(internal - kept) - _bytes(kept - saved_anywhere)
        whole[region.name] = total(region.nodes)
        # A last conv the recompute stops before (region_graph.tail_conv) is not run again.
        rerun = region.nodes[:-1] if region_graph.tail_conv(region.nodes[-1], modules) else region.nodes
        flops, moved, ops = total(rerun)
        if region.kind == "chain" and not (minimum < freed and flops <= CHAIN_FLOPS_PER_BYTE * freed):
            continue  # a chain is offered for what costs almost nothing
        nodes = frozenset(n.name for n in region.nodes)
        costs.append(
            RegionCost(region.name, region.kind, region.modules, flops, freed, region.parent, nodes, moved, ops)
        )
    by_name = {r.name: r for r in found}
    links = []
    outer = [c for c in costs if not c.parent]
    for first, second in zip(outer, outer[1:]):
        a, b = by_name[first.name], by_name[second.name]
        if b.inputs != [a.output] or any(u not in b.nodes for u in a.output.users):
            continue
        freed = _bytes(k for k in set(recorder.outputs.get(a.output, ())) if k not in exclude)
        flops, moved, ops = whole[first.name]
        links.append(LinkCost(first.name, second.name, flops, freed, moved, ops))
    return Profile(costs, links, problems)


def _joined_name(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def joined(parts: list[tuple[str, Profile]]) -> Profile:
    """The profiles of several roots (by their path in the model) as one: every name prefixed with its
    root's path, so that a plan scoped to that root (plan.Plan.scoped) names its own regions."""
    regions, links, problems = [], [], {}
    for path, part in parts:
        for r in part.regions:
            modules = tuple(_joined_name(path, m) if m else path for m in r.modules)
            parent = _joined_name(path, r.parent) if r.parent else ""
            nodes = frozenset(f"{path}/{n}" for n in r.nodes)
            name = _joined_name(path, r.name)
            regions.append(dataclasses.replace(r, name=name, modules=modules, parent=parent, nodes=nodes))
        for link in part.links:
            first, second = _joined_name(path, link.first), _joined_name(path, link.second)
            links.append(dataclasses.replace(link, first=first, second=second))
        problems.update({_joined_name(path, name): why for name, why in part.problems.items()})
    return Profile(regions, links, problems)
