"""Graph helpers every later step uses: a graph compiled into a function of the live module
(tracing's result, the recompute regions, the model's own checkpoint regions), a copy of some
of a graph's nodes as a graph of their own, the metadata a node put in another's place keeps, and
which nodes may share a tensor's storage."""

from __future__ import annotations

import operator
import re
from typing import Any, Callable, Optional, Sequence

import torch.fx as fx
from torch import nn

# Where a node came from: the module stack regions and reports read, and the source line.
PROVENANCE = ("nn_module_stack", "stack_trace")


def provenance(node: fx.Node, *extra: str) -> dict:
    """The metadata a node put in `node`'s place carries over: PROVENANCE, and `extra` keys."""
    return {k: v for k, v in node.meta.items() if k in PROVENANCE or k in extra}


def compile_graph(graph: fx.Graph, owner: Optional[nn.Module] = None):
    """Python function `fn(module, *args, **kwargs)` running `graph` with `module` as `self`.

    Unlike a GraphModule, it copies nothing: every parameter and buffer is looked up on the
    live module at call time, so `.to()`, `.double()`, `load_state_dict` and parameter swaps
    act on what the graph uses. So is every submodule, unless `owner` is given: the submodules
    are then `owner`'s as they are now (`bind_submodules`), and the caller must drop `fn` when
    owner's module tree changes.
    """
    if owner is not None:
        graph = bind_submodules(graph, owner)
    code = graph.python_code(root_module="self")
    fn = fx.graph_module._forward_from_src(code.src, code.globals)
    return fn


def bind_submodules(graph: fx.Graph, owner: nn.Module) -> fx.Graph:
    """A copy of `graph` that reads and calls `owner`'s submodules as they are now, not through
    `getattr(getattr(self.features, "3").conv, "1")`: each step of such a path is a call of
    nn.Module.__getattr__ (~1 us), and a rewritten MobileNetV2 reads ~120 submodules a forward.
    The code indexes one list of them (`submodules[3]`, no Python call). Parameters and buffers stay
    looked up at call time."""
    copy = fx.Graph()
    copy._codegen = graph._codegen
    copy.output(copy.graph_copy(graph, {}))
    bound: list[nn.Module] = []
    table = None
    for node in list(copy.nodes):
        if node.op not in ("get_attr", "call_module"):
            continue
        target = _attribute(owner, str(node.target))
        if not isinstance(target, nn.Module):
            continue
        name = node.name  # FX's name for the node (its path): what the generated code calls it
        if node.op == "get_attr":
            if table is None:
                placeholders = [n for n in copy.nodes if n.op == "placeholder"]
                with copy.inserting_after(placeholders[-1]) if placeholders else copy.inserting_before(node):
                    table = copy.call_function(_constant(bound, "submodules"))
            with copy.inserting_before(node):
                module = copy.create_node("call_function", operator.getitem, (table, len(bound)), name=name)
            bound.append(target)
        else:  # a function of its own (dynamo breaks its graph at operator.call)
            with copy.inserting_before(node):
                caller = _caller(target, re.sub(r"\W", "_", str(node.target)))
                module = copy.create_node("call_function", caller, node.args, node.kwargs, name=name)
        module.meta = node.meta
        node.replace_all_uses_with(module)
        copy.erase_node(node)
    return copy


def _attribute(owner: nn.Module, path: str) -> Any:
    for part in path.split("."):
        owner = getattr(owner, part)
    return owner


def _constant(value: Any, name: str) -> Callable[[], Any]:
    def get():
        return value

    get.__name__ = get.__qualname__ = name
    return get


def _caller(module: nn.Module, name: str) -> Callable[..., Any]:
    def call(*args, **kwargs):
        return module(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


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


# Ops whose result may share its first argument's storage: views, and ops that may return their input
# (`contiguous()`, `to()`, `reshape()`); `getattr` of ALIASING_ATTRIBUTES too (`.data` is the same storage
# without autograd's version counter). A write into any of them is a write into the others.
ALIASING_OPS = frozenset(
    {"view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze", "transpose",
     "permute", "t", "narrow", "select", "chunk", "split", "tensor_split", "split_with_sizes", "unbind", "expand",
     "expand_as", "contiguous", "detach", "movedim", "moveaxis", "as_strided", "diagonal", "swapaxes", "swapdims",
     "unfold", "to", "type", "type_as", "float", "double", "half", "bfloat16", "getitem", "real", "imag",
     "view_as_real", "view_as_complex"}
)  # fmt: skip
ALIASING_ATTRIBUTES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})


def aliased(node: fx.Node) -> Optional[fx.Node]:
    """The node whose storage `node` may share (its first argument), where `node` is an aliasing op."""
    if node.op not in ("call_method", "call_function") or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.op == "call_function" and node.target is getattr:
        return node.args[0] if len(node.args) == 2 and node.args[1] in ALIASING_ATTRIBUTES else None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return node.args[0] if name in ALIASING_OPS else None


def storage_root(node: fx.Node) -> fx.Node:
    """The node at the start of `node`'s chain of aliasing ops."""
    while (source := aliased(node)) is not None:
        node = source
    return node


def storage_family(node: fx.Node) -> list[fx.Node]:
    """`node` and every node that may share its storage through a chain of aliasing ops from it."""
    found, todo = {node: None}, [node]
    while todo:
        for user in todo.pop().users:
            if user not in found and aliased(user) in found:
                found[user] = None
                todo.append(user)
    return list(found)
