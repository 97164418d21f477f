"""Graph helpers every later step uses: a graph compiled into a function of the live module
(tracing's result, the recompute regions, the model's own checkpoint regions), a copy of some
of a graph's nodes as a graph of their own, and the metadata a node put in another's place keeps."""

from __future__ import annotations

from typing import Sequence

import torch.fx as fx

# Where a node came from: the module stack regions and reports read, and the source line.
PROVENANCE = ("nn_module_stack", "stack_trace")


def provenance(node: fx.Node, *extra: str) -> dict:
    """The metadata a node put in `node`'s place carries over: PROVENANCE, and `extra` keys."""
    return {k: v for k, v in node.meta.items() if k in PROVENANCE or k in extra}


def compile_graph(graph: fx.Graph):
    """Python function `fn(module, *args, **kwargs)` running `graph` with `module` as `self`.

    Unlike a GraphModule, it copies nothing: every parameter, buffer and submodule is
    looked up on the live module at call time, so `.to()`, `.double()`, `load_state_dict`
    and parameter swaps act on what the graph uses.
    """
    code = graph.python_code(root_module="self")
    fn = fx.graph_module._forward_from_src(code.src, code.globals)
    return fn


def subgraph(
    nodes: Sequence[fx.Node], inputs: Sequence[fx.Node], outputs: Sequence[fx.Node]
) -> tuple[fx.Graph, tuple[str, ...]]:
    """A graph of its own computing `nodes` from `inputs` (one placeholder each, in order; a node given twice
    is read from its first) and returning `outputs` (one node: itself, else a tuple), and the components:
    the first part of every attribute path it reads (`layer1` for `layer1.0.conv1`), which the caller passes
    as the compiled graph's owner."""
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, n in enumerate(inputs):
        env.setdefault(n, sub.placeholder(f"{n.name}_{i}"))
    components: dict[str, None] = {}

    def lookup(n: fx.Node) -> fx.Node:
        if n not in env:  # a get_attr: read through the owner's components
            components[str(n.target).split(".")[0]] = None
            env[n] = sub.get_attr(n.target)
        return env[n]

    for node in nodes:
        if node.op == "call_module":
            components[str(node.target).split(".")[0]] = None
        env[node] = sub.node_copy(node, lookup)
    sub.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    return sub, tuple(components)
