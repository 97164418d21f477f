"""Recompute regions: find them in a fused graph, and turn the chosen ones into one checkpointed call.

A region is a run of consecutive graph nodes with one output: a *block* (every node
traced inside one residual block: a traced-through module that is an item of an
nn.Sequential/ModuleList/ModuleDict and not itself a container, e.g. ResNet's
`layer1.0`; in a model with no such item, each child of the root it was traced through,
e.g. timm DLA's `level2`), or a *run* (the consecutive nodes between blocks that belong to none,
e.g. ResNet's stem `conv1…maxpool`). A run is named after the first and last module
it uses, so the name is the same whichever form its sites were fused in.

`apply` compiles each chosen region's nodes into a function of its own and puts a
`recompute.RegionCall` node in their place, which keeps only the region's inputs for
backward. Inside a region, a plain BatchNorm2d without an activation (ResNet's bn3
and downsample BN, which mode="fast" leaves to eager) also runs fxfuse's kernel, with
activation "none": it keeps the same tensors (its input and statistics), and it runs
twice per step in a region, where eager's is slow (8x256x56x56 channels_last float32
on CPU: 67 ms forward + backward against eager's 108 ms, forward alone 24 ms against 56).

A *group* of consecutive regions (a chain) is then wrapped once more: it
keeps only the first member's inputs, and backward rebuilds the inputs of the other
members by running the members before them again (each member still keeps only its
own inputs inside). A *flat* link joins two members into one region instead: one
recompute runs both, so the first is not run a third time, but its recomputed tensors
are held while the second one's backward runs (a higher peak, which a peak budget may
allow: fusion/policy.py).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch.fx as fx
from torch import nn

from .. import parametrized, runtime, user_checkpoint
from ..graphs import compile_graph, provenance, subgraph
from ..hooks import describe_hooks, has_hooks
from ..passes.driver import SITE_META
from ..passes.inplace_add import plain_batch_norm
from ..tracing import CHANGES_STATE_META
from . import recompute

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


@dataclass
class Region:
    name: str
    kind: str  # "block", "run" or "chain"
    nodes: list[fx.Node]  # in graph order; get_attr nodes are not members (each region reads its own)
    inputs: list[fx.Node] = field(default_factory=list)
    output: Optional[fx.Node] = None
    modules: tuple[str, ...] = ()  # module paths it uses, in first-use order
    problem: Optional[str] = None  # why it cannot be recomputed as one region
    parent: str = ""  # an inner region or a chain: the region it lies in (one or the other is recomputed)


def _traced_through(graph: fx.Graph) -> set[str]:
    """Modules the tracer entered: those with a node traced inside them (not only a call of them as a leaf)."""
    paths = set()
    for node in graph.nodes:
        stack = [path for path, _ in node.meta.get("nn_module_stack", {}).values()]
        paths.update(stack[:-1])
    return paths


def _is_block(path: str, modules: dict[str, nn.Module], traced: set[str], stages: bool = False) -> bool:
    """An item of a container that is not one itself; with `stages`, any child of the root."""
    module = modules.get(path)
    if module is None or path not in traced or not path:
        return False
    if stages:
        return "." not in path
    if type(module) in _CONTAINERS:
        return False
    parent = modules.get(path.rsplit(".", 1)[0] if "." in path else "")
    return isinstance(parent, _CONTAINERS)


def _block_of(node: fx.Node, modules: dict[str, nn.Module], traced: set[str], stages: bool) -> Optional[str]:
    """The outermost block the node was traced inside."""
    for path, _ in node.meta.get("nn_module_stack", {}).values():
        if _is_block(path, modules, traced, stages):
            return path
    return None


def _members(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]


def _with_users_keys(members: list[fx.Node], keys: dict[fx.Node, Any]) -> dict[fx.Node, Any]:
    """Nodes the passes added without a module stack (metadata stand-ins) go with their first user."""
    for node in reversed(members):
        if node not in keys:
            users = [u for u in node.users if u in keys]
            keys[node] = keys[users[0]] if users else None
    return keys


def _keys(members: list[fx.Node], modules: dict[str, nn.Module], traced: set[str]) -> dict[fx.Node, Optional[str]]:
    """Each member node's block (None: not in one)."""
    stacked = [n for n in members if "nn_module_stack" in n.meta]
    keys: dict[fx.Node, Optional[str]] = {n: _block_of(n, modules, traced, False) for n in stacked}
    if not any(keys.values()):
        # A model without container items (DLA's `level0`…`level5` are attributes of the root) would be
        # one run: its blocks are then the root's children it was traced through.
        keys = {n: _block_of(n, modules, traced, True) for n in stacked}
    return _with_users_keys(members, keys)


def _inner_paths(members: list[fx.Node], keys: dict[fx.Node, Optional[str]], traced: set[str]) -> dict[str, list]:
    """Every module traced through inside a block, with the member nodes traced inside it, in graph order."""
    stacked = {
        n: [path for path, _ in n.meta["nn_module_stack"].values()] for n in members if "nn_module_stack" in n.meta
    }
    stacks = _with_users_keys(members, stacked)
    paths: dict[str, list] = {}
    for node in members:
        block = keys.get(node)
        for path in stacks[node] or ():
            if block and path.startswith(block + ".") and path in traced:
                paths.setdefault(path, []).append(node)
    return paths


def _touched_modules(nodes: Sequence[fx.Node], graph_modules: dict[str, nn.Module]) -> tuple[str, ...]:
    paths: dict[str, None] = {}
    for node in nodes:
        refs = [node] if node.op == "call_module" else []
        refs += [n for n in node.all_input_nodes if n.op == "get_attr"]
        for ref in refs:
            target = str(ref.target)
            path = target if target in graph_modules else target.rsplit(".", 1)[0] if "." in target else ""
            if path in graph_modules:
                paths[path] = None
    return tuple(paths)


def _name(nodes: Sequence[fx.Node], graph_modules: dict[str, nn.Module]) -> Optional[str]:
    """A run's or chain's name: the first and last modules it uses, counting modules a pass rewrote
    into a call without parameters (a max pool, a GELU), which `_touched_modules` cannot see."""
    paths: dict[str, None] = {}
    for node in nodes:
        site = node.meta.get(SITE_META)
        if site is not None and not any(n.op == "get_attr" for n in node.all_input_nodes):
            paths.update((p, None) for p in site.names if p in graph_modules)
        else:
            paths.update((p, None) for p in _touched_modules([node], graph_modules))
    return f"{next(iter(paths))}…{list(paths)[-1]}" if paths else None


def _as_piece_only(node: fx.Node, user: fx.Node) -> bool:
    """`user` reads `node` only among the pieces it keeps in place of its concatenated input
    (passes/cat_input.py): a hint a region drops (`_drop_pieces`), not a use of the value."""
    if node not in (user.kwargs.get("pieces") or ()):
        return False
    other: list[fx.Node] = []
    fx.node.map_arg((user.args, {k: v for k, v in user.kwargs.items() if k != "pieces"}), other.append)
    return node not in other


def _drop_pieces(nodes: list[fx.Node], output: fx.Node) -> None:
    """Calls after the region that would keep its values as pieces keep their concatenation instead
    (the region frees those values; the op is exact either way). Its output lives on: a piece still."""
    inside = set(nodes)
    for node in nodes:
        if node is output:
            continue
        for user in list(node.users):
            if user not in inside and _as_piece_only(node, user):
                user.kwargs = {k: v for k, v in user.kwargs.items() if k != "pieces"}


def _boundary(nodes: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    inside = set(nodes)
    inputs: dict[fx.Node, None] = {}
    outputs = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in inside and arg.op != "get_attr":
                inputs[arg] = None
        if any(u not in inside and not _as_piece_only(node, u) for u in node.users):
            outputs.append(node)
    return list(inputs), outputs


_IN_PLACE = (operator.iadd, operator.isub, operator.imul, operator.itruediv, runtime.add_into)


def _writes_into(node: fx.Node, modules: dict[str, nn.Module]) -> Optional[fx.Node]:
    """The value `node` overwrites in place (its first argument), if it does: `x += y`, `x.relu_()`,
    `F.relu(x, inplace=True)`, an `nn.ReLU(inplace=True)` call, fxfuse's add_into."""
    first = node.args[0] if node.args else None
    if not isinstance(first, fx.Node):
        return None
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        in_place = node.target in _IN_PLACE or node.kwargs.get("inplace") is True
        return first if in_place or (name.endswith("_") and not name.startswith("_")) else None
    if node.op == "call_method":
        return first if node.target.endswith("_") and not node.target.startswith("_") else None
    if node.op == "call_module":
        return first if getattr(modules.get(str(node.target)), "inplace", False) is True else None
    return None


def _changes_an_input(nodes: list[fx.Node], inputs: list[fx.Node], modules: dict[str, nn.Module]) -> Optional[str]:
    """Why the region's recompute would read an input other than its forward read, if it would: one of its
    nodes writes into an input in place, or a node after it does (checkpoint keeps a reference, not a copy)."""
    inside = set(nodes)
    for node in nodes:
        target = _writes_into(node, modules)
        if target is not None and target not in inside:
            return f"{node.name} writes into its input {target.name} in place"
    for value in inputs:
        for user in value.users:
            if user not in inside and _writes_into(user, modules) is value and _after(user, nodes[-1]):
                return f"{user.name}, after it, writes into its input {value.name} in place"
    return None


def _after(node: fx.Node, last: fx.Node) -> bool:
    walk = last.next
    while walk.op != "root":
        if walk is node:
            return True
        walk = walk.next
    return False


def _region(name: str, kind: str, nodes: list[fx.Node], modules: dict[str, nn.Module], parent: str = "") -> Region:
    inputs, outputs = _boundary(nodes)
    region = Region(name, kind, nodes, inputs, outputs[0] if len(outputs) == 1 else None, parent=parent)
    region.modules = _touched_modules(nodes, modules)
    if len(outputs) != 1:
        region.problem = f"{len(outputs)} of its values are used after it (a region has one output)"
    changed = _changes_an_input(nodes, inputs, modules)
    if changed:
        region.problem = f"{changed}, which its recompute would read changed"
    stateful = next((n for n in nodes if n.meta.get(CHANGES_STATE_META)), None)
    if stateful is not None:
        changes = ", ".join(stateful.meta[CHANGES_STATE_META])
        region.problem = f"{stateful.target} changes {changes} in forward, which its recompute would change again"
    if any(isinstance(n.target, user_checkpoint.CheckpointCall) for n in nodes):
        region.problem = user_checkpoint.WINS
    # (the root's own parameters are read, the root is not called: its hooks do not run in a region)
    called = [(p, m) for path in region.modules if path for p, m in modules[path].named_modules(prefix=path)]
    hooked = next((p for p, m in called if has_hooks(m)), None)
    if hooked is not None:
        region.problem = f"{hooked} has {describe_hooks(modules[hooked])}, which its recompute would run again"
    stateful_weight = next((f"{p}.{state}" for p, m in called if (state := parametrized.with_state(m))), None)
    if stateful_weight is not None:
        region.problem = f"{stateful_weight}, which its recompute would read updated"
    return region


def _runs(members: list[fx.Node], keys: dict[fx.Node, Optional[str]]) -> list[tuple[Optional[str], list[fx.Node]]]:
    groups: list[tuple[Optional[str], list[fx.Node]]] = []
    for node in members:
        key = keys[node]
        if groups and groups[-1][0] == key:
            groups[-1][1].append(node)
        else:
            groups.append((key, [node]))
    return groups


def find(graph: fx.Graph, root: nn.Module) -> list[Region]:
    """Every block and run of `graph`, in graph order (with a problem where one cannot be a region);
    then the *inner* regions: each module traced through inside a block whose nodes are consecutive,
    at least two, and not the same as an enclosing region's (DenseNet's `denseblock1.denselayer3`,
    VoVNet's `stages.0.blocks.0.conv_mid.1`), where it can be one."""
    modules = dict(root.named_modules())
    members = _members(graph)
    traced = _traced_through(graph)
    keys = _keys(members, modules, traced)
    regions, seen = [], {}
    for key, nodes in _runs(members, keys):
        if key is None:
            name = _name(nodes, modules) or f"run at {nodes[0].name}"
            regions.append(_region(name, "run", nodes, modules))
        elif key in seen:
            seen[key].problem = "its nodes are interleaved with others"
        else:
            seen[key] = _region(key, "block", nodes, modules)
            regions.append(seen[key])
    position = {n: i for i, n in enumerate(members)}
    spans = {block: (position[r.nodes[0]], len(r.nodes)) for block, r in seen.items()}
    for path, nodes in sorted(_inner_paths(members, keys, traced).items()):
        span = (position[nodes[0]], len(nodes))
        if len(nodes) < 2 or position[nodes[-1]] - span[0] + 1 != len(nodes) or span in spans.values():
            continue  # one node, interleaved with others, or the same nodes as an enclosing region
        parent = max((p for p in spans if path.startswith(p + ".")), key=len)
        region = _region(path, "block", nodes, modules, parent=parent)
        if region.problem is None:
            spans[path] = span
            regions.append(region)
    taken = {(r.nodes[0], len(r.nodes)) for r in regions}
    return regions + _chains([r for r in regions if not r.parent], modules, {r.name for r in regions}, taken)


# The most nodes a chain has: pointwise chains are short (BN→activation→a gate's four ops); 8 reaches
# from one BN→activation to the activation after the next conv→BN→add (CSP's bottleneck tail), which
# frees what the two shorter chains inside it do and that conv's output.
CHAIN_NODES = 8


def _chains(outer: list[Region], modules: dict[str, nn.Module], names: set[str], taken: set) -> list[Region]:
    """*Chains*: each run of 2 to CHAIN_NODES consecutive nodes inside one block or run whose last node is
    its one output, where no region has the same nodes: the candidates for recomputing what costs almost
    nothing (BN→activation kept for a squeeze-excite gate's multiply, a residual add and its activation).
    Which of them are worth it, the costs decide (regions/costs.py); a chain is named after the first and
    last modules it uses, and the first chain of a name is the one."""
    chains = []
    for region in outer:
        nodes = region.nodes
        for i in range(len(nodes) - 1):
            for j in range(i + 1, min(i + CHAIN_NODES, len(nodes) - (i == 0))):
                run = nodes[i : j + 1]
                _, outputs = _boundary(run)
                if outputs != [run[-1]] or (run[0], len(run)) in taken:
                    continue
                touched = _touched_modules(run, modules)
                if not touched:
                    continue
                name = _name(run, modules)
                if name in names:
                    continue
                names.add(name)
                chain = _region(name, "chain", run, modules, parent=region.name)
                if chain.problem is None:
                    chains.append(chain)
    return chains


def tail_conv(node: fx.Node, modules: dict[str, nn.Module]) -> Optional[str]:
    """The conv module `node` (a region's last node) ends in, where a region's recompute can stop before
    running it: a Conv2d module call, or fxfuse::bn_act_conv without an epilogue, which `split_tail` turns
    into BN→activation and that conv. Autograd saves a conv's inputs before it convolves, so
    non-reentrant checkpoint has every saved tensor back before the conv would run, and stops there
    (its early stop)."""
    if node.op == "call_module" and type(modules.get(str(node.target))) is nn.Conv2d:
        return str(node.target)
    if node.op != "call_function" or node.target is not runtime.bn_act_conv_module:
        return None
    if len(node.args) != 5 or set(node.kwargs) - {"pieces"}:
        return None
    conv = node.args[4]
    if not (isinstance(conv, fx.Node) and conv.op == "get_attr" and type(modules.get(str(conv.target))) is nn.Conv2d):
        return None
    return str(conv.target)


def split_tail(graph: fx.Graph, nodes: list[fx.Node], modules: dict[str, nn.Module]) -> list[fx.Node]:
    """`nodes` with the last one, where it is a `tail_conv`, run as BN→activation (fxfuse's kernel,
    keeping its input) and then the conv module: the conv keeps the activation output inside the
    region, which checkpoint does not keep, and the recompute stops before the conv runs again."""
    last = nodes[-1]
    target = tail_conv(last, modules)
    if target is None or last.op == "call_module":
        return nodes
    y, bn, act, act_param, _ = last.args
    with graph.inserting_before(last):
        pointwise = graph.call_function(runtime.batch_norm_act_module, (y, bn, act, act_param), dict(last.kwargs))
        conv = graph.call_module(target, (pointwise,))
    for new in (pointwise, conv):
        new.meta.update(provenance(last))
    last.replace_all_uses_with(conv)
    graph.erase_node(last)
    return [*nodes[:-1], pointwise, conv]


def _fuse_batch_norms(graph: fx.Graph, nodes: list[fx.Node], modules: dict[str, nn.Module]) -> list[fx.Node]:
    """`nodes` with each plain BatchNorm2d module call replaced by runtime.batch_norm_act_module(..., "none")."""
    out = []
    for node in nodes:
        if node.op == "call_module" and plain_batch_norm(modules.get(node.target)) and len(node.args) == 1:
            with graph.inserting_before(node):
                bn = graph.get_attr(node.target)
                fused = graph.call_function(runtime.batch_norm_act_module, (node.args[0], bn, "none", 0.0))
            fused.meta.update(node.meta)
            node.replace_all_uses_with(fused)
            graph.erase_node(node)
            node = fused
        out.append(node)
    return out


def extract(graph: fx.Graph, name: str, nodes: list[fx.Node], module_paths: Sequence[str]) -> fx.Node:
    """Replace the consecutive `nodes` (one output) by a RegionCall node running a compiled copy of them."""
    inputs, outputs = _boundary(nodes)
    (output,) = outputs
    _drop_pieces(nodes, output)
    sub, components = subgraph(nodes, inputs, outputs)
    call = recompute.RegionCall(name, compile_graph(sub), components, tuple(module_paths))
    with graph.inserting_before(nodes[0]):
        parts = tuple(graph.get_attr(c) for c in components)
        new = graph.call_function(call, (parts, *inputs))
    new.meta.update(provenance(output))
    inside = set(nodes)
    output.replace_all_uses_with(new, delete_user_cb=lambda user: user not in inside)
    for node in reversed(nodes):
        graph.erase_node(node)
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    return new


def segments(group: Sequence[str], flat_links: frozenset = frozenset()) -> list[tuple[str, ...]]:
    """`group` cut where its links are not flat: each segment runs as one region."""
    out = [[group[0]]]
    for first, second in zip(group, group[1:]):
        if (first, second) in flat_links:
            out[-1].append(second)
        else:
            out.append([second])
    return [tuple(s) for s in out]


def apply(
    graph: fx.Graph, root: nn.Module, groups: Sequence[tuple[str, ...]], flat_links: frozenset = frozenset()
) -> list[str]:
    """Recompute each group of regions (a 1-tuple: one region), its `flat_links` (pairs of consecutive
    members) joined into one region; returns notes on groups that could not be."""
    by_name = {r.name: r for r in find(graph, root)}
    notes, absent = [], []
    wanted = []
    for group in groups:
        missing = [n for n in group if n not in by_name or by_name[n].problem]
        if missing and all(n not in by_name for n in missing):
            absent.append("+".join(group))
        elif missing:
            reasons = "; ".join(f"{n}: {by_name[n].problem if n in by_name else 'not found'}" for n in missing)
            notes.append(f"region {'+'.join(group)} not recomputed: {reasons}")
        else:
            wanted.append(group)
    if absent:  # one line: in a graph where a module stays a leaf (YOLO's Detect head in eval mode) there are many
        notes.append(f"regions not recomputed, not found in this graph: {', '.join(absent)}")
    modules = dict(root.named_modules())

    def paths(names: Sequence[str]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p for n in names for p in by_name[n].modules))

    for group in wanted:
        calls = []
        for segment in segments(group, flat_links):
            nodes = [n for name in segment for n in _fuse_batch_norms(graph, by_name[name].nodes, modules)]
            nodes = split_tail(graph, nodes, modules)
            calls.append(extract(graph, "+".join(segment), nodes, paths(segment)))
        if len(calls) == 1:
            continue
        _, outputs = _boundary(calls)
        if not _consecutive(calls) or outputs != [calls[-1]]:
            notes.append(f"regions {'+'.join(group)} not chained: the later ones use more than the previous output")
            continue
        extract(graph, "+".join(group), calls, paths(group))
    return notes


def _consecutive(nodes: list[fx.Node]) -> bool:
    node = nodes[0]
    for expected in nodes[1:]:
        node = node.next
        while node.op == "get_attr":
            node = node.next
        if node is not expected:
            return False
    return True
