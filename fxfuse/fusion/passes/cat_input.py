"""torch.cat(pieces, 1) → fused op  ⇒  the fused op keeps the pieces, and backward rebuilds the cat.

Runs last but `inplace_add`, in mode "memory" (so under mode="auto" and the budgets too: its sites
are not ranked, they are taken wherever they free bytes, since a copy costs far less per byte
freed than any recompute the ranking offers). A `torch.cat` / `torch.concat` along dim 1 whose
only user is a fused op that keeps its input for backward (BN→act, Conv→BN→act, BN→act→conv, or
a plain Conv2d, which becomes `runtime.conv2d_module`) gets `pieces=` on that call, so the op
keeps the pieces in place of the concatenation (fxfuse::cat_*, ops/cat_input.py) and backward
concatenates them again: a memory copy, no FLOPs.

It pays only where the pieces are kept anyway, so that keeping them costs nothing: a graph input
or parameter, the input of a layer that keeps its input (a fused op, a conv, linear, BN or max
pool), a view of such a tensor, or a piece of another rewritten cat (a DenseNet block's features
are pieces of every later layer's cat, each of which eager copies and keeps). Counted per
storage: a piece that is a view (a `chunk`, `split`) keeps all of its base. A cat is rewritten
where that frees bytes: its own size, less what it newly keeps (with example inputs, in bytes;
without, where some piece is kept anyway and the others are not views). Sites are decided
together: a cat stays rewritten while it frees bytes given the others.

Each site is reported with what it frees and its cost, the bytes the rebuild moves in backward
(`SiteData.recompute_bytes`: the pieces read and the concatenation written).
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ... import ops
from .. import runtime, user_checkpoint
from ..graphs import storage_family
from ..hooks import has_hooks
from ..known_modules import is_conv2d_same
from ..plan import SiteData, Skip
from ..report import format_bytes
from . import estimates
from .context import PassContext
from .matchers import conv_module_problem, site_name
from .rewrite import replace_chain

PATTERN = ("cat", "fused op")
CATS = (torch.cat, torch.concat, torch.concatenate)

# Fused calls that take `pieces=` for their input: the runtime module forms (input: args[0]) and the
# functional forms the passes write with keyword arguments (input: kwargs["input"]).
CONSUMERS = {
    runtime.batch_norm_act_module: "fxfuse::cat_batch_norm_act",
    runtime.conv_bn_act_module: "fxfuse::cat_conv_bn_act",
    runtime.conv_bn_act_bn_module: "fxfuse::cat_conv_bn_act",
    runtime.conv_bn_act_conv_module: "fxfuse::cat_conv_bn_act",
    runtime.bn_act_conv_module: "fxfuse::cat_bn_act_conv",
    runtime.conv2d_module: "fxfuse::cat_conv2d",
    ops.batch_norm_act: "fxfuse::cat_batch_norm_act",
    ops.conv_bn_act: "fxfuse::cat_conv_bn_act",
    ops.bn_act_conv: "fxfuse::cat_bn_act_conv",
    ops.conv2d: "fxfuse::cat_conv2d",
}

# Other fused calls that keep their input (args[0] or kwargs["input"]) for backward.
_KEEPERS = (
    runtime.conv_act_module,
    runtime.linear_act_module,
    runtime.act_linear_module,
    runtime.act_linear_scale_module,
    runtime.layer_norm_linear_module,
    ops.conv_act,
    ops.linear_act,
    ops.act_linear,
    ops.act_linear_scale,
    ops.layer_norm_linear,
    ops.conv_layer_norm_linear,
    F.conv2d,
    F.linear,
    F.batch_norm,
    F.max_pool2d,
)
_KEEPER_MODULES = (nn.Conv2d, nn.Linear, nn.modules.batchnorm._BatchNorm, nn.MaxPool2d)

# Ops whose outputs are views of their first argument (getitem of a chunk/split gives a view); not
# reshape or flatten, which may copy.
_VIEW_LISTS = frozenset({"chunk", "split", "tensor_split", "unbind", "split_with_sizes"})
_VIEWS = frozenset({"narrow", "view", "view_as", "permute", "transpose", "expand", "squeeze", "unsqueeze"})
_IN_PLACE_OPERATORS = frozenset(
    getattr(operator, f"i{name}")
    for name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift")
)


def _input_of(node: fx.Node) -> Optional[fx.Node]:
    """The tensor a fused call (or a keeping layer) reads as its input."""
    if node.op == "call_module":
        return node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    value = node.args[0] if node.args else node.kwargs.get("input")
    return value if isinstance(value, fx.Node) else None


def _keeps_input(node: fx.Node, modules: dict) -> bool:
    if node.op == "call_function":
        return node.target in CONSUMERS or node.target in _KEEPERS
    return node.op == "call_module" and isinstance(modules.get(node.target), _KEEPER_MODULES)


def _base(node: fx.Node) -> Optional[fx.Node]:
    """The tensor `node` is a view of, or None."""
    if node.op == "call_function" and node.target is operator.getitem:
        source = node.args[0]
        if isinstance(source, fx.Node) and _method(source) in _VIEW_LISTS:
            return source.args[0] if isinstance(source.args[0], fx.Node) else None
        return None
    if _method(node) in _VIEWS and node.args and isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None


def _method(node: fx.Node) -> Optional[str]:
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        return getattr(node.target, "__name__", None)
    return None


def _root(node: fx.Node) -> fx.Node:
    """The tensor whose storage `node` lives in (following views)."""
    while (base := _base(node)) is not None:
        node = base
    return node


def _writes_in_place(node: fx.Node, modules: dict) -> bool:
    """Whether `node` may write into its arguments: then a piece would change before backward reads it."""
    if node.kwargs.get("inplace") is True or node.kwargs.get("out") is not None:
        return True
    if node.op == "call_module":
        # A module fxfuse did not trace through (hooked, or not torch.nn's) may write its input unseen.
        module = modules.get(node.target)
        if module is None or has_hooks(module) or not type(module).__module__.startswith("torch.nn"):
            return True
        return getattr(module, "inplace", False) is True
    if node.op == "call_function" and node.target in _IN_PLACE_OPERATORS:
        return True
    name = _method(node) or ""
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")


def _cat_pieces(node: fx.Node) -> tuple[Optional[list[fx.Node]], Optional[str]]:
    """(pieces, None) for `torch.cat(pieces, 1)`, else (None, why not) for another cat, (None, None) for no cat."""
    if node.op != "call_function" or node.target not in CATS:
        return None, None
    names = ("tensors", "dim")
    bound = {**dict(zip(names, node.args)), **node.kwargs}
    if set(bound) - set(names) or len(node.args) > 2:
        return None, "cat with an out= argument"
    tensors, dim = bound.get("tensors"), bound.get("dim", 0)
    if dim != 1:
        return None, f"concatenates along dim {dim!r}, not the channels (dim 1)"
    if not isinstance(tensors, (list, tuple)) or not tensors or not all(isinstance(t, fx.Node) for t in tensors):
        return None, "its pieces are not a list of tensors in the graph"
    return list(tensors), None


class _Candidate:
    def __init__(self, cat: fx.Node, consumer: fx.Node, pieces: list[fx.Node]) -> None:
        self.cat, self.consumer, self.pieces = cat, consumer, pieces
        self.roots = list(dict.fromkeys(_root(p) for p in pieces))


def _plain_conv(node: fx.Node, modules: dict) -> bool:
    """A plain Conv2d module call that runtime.conv2d_module serves as is: zero padding given as numbers."""
    conv = modules.get(node.target) if node.op == "call_module" else None
    return (
        isinstance(conv, nn.Conv2d)
        and conv_module_problem(conv) is None
        and not is_conv2d_same(conv)
        and conv.padding_mode == "zeros"
        and not isinstance(conv.padding, str)
        and len(node.args) == 1
        and not node.kwargs
    )


def _consumer(cat: fx.Node, modules: dict) -> tuple[Optional[fx.Node], Optional[str]]:
    users = list(cat.users)
    if len(users) != 1:
        return None, f"the concatenation has {len(users)} users: it is kept or read elsewhere"
    user = users[0]
    if _plain_conv(user, modules):
        return user, None
    if user.op != "call_function" or user.target not in CONSUMERS:
        return None, None  # not a fused op's input: nothing to report
    if _input_of(user) is not cat or cat in user.kwargs.get("pieces", ()) or "pieces" in user.kwargs:
        return None, "the concatenation is not only the fused op's input"
    if sum(1 for a in (*user.args, *user.kwargs.values()) if a is cat) != 1:
        return None, "the concatenation is not only the fused op's input"
    return user, None


def _new_bytes(ctx: PassContext, candidate: _Candidate, free: set) -> Optional[int]:
    """Bytes the rewrite keeps that nothing else does (None: not known without example inputs)."""
    sizes = [estimates.nbytes(ctx.shapes, r) for r in candidate.roots if r not in free]
    return None if any(s is None for s in sizes) else sum(sizes)


def _frees(ctx: PassContext, candidate: _Candidate, free: set) -> tuple[bool, Optional[int]]:
    """(whether rewriting the cat frees memory given what is kept anyway (`free`), bytes freed where known)."""
    cat_bytes = estimates.nbytes(ctx.shapes, candidate.cat)
    new = _new_bytes(ctx, candidate, free)
    if cat_bytes is not None and new is not None:
        return cat_bytes - new > 0, cat_bytes - new
    # No shapes: a piece kept anyway frees its share of the concatenation; a piece that is not a view
    # costs no more than its share.
    own = all(r in free or r in candidate.pieces for r in candidate.roots)
    return own and any(r in free for r in candidate.roots), None


def run(ctx: PassContext) -> int:
    if ctx.mode != "memory":
        return 0
    candidates: list[_Candidate] = []
    for node in ctx.graph.nodes:
        pieces, problem = _cat_pieces(node)
        if pieces is None and problem is None:
            continue
        consumer, user_problem = _consumer(node, ctx.modules)
        if consumer is None and user_problem is None:
            continue  # not the input of a fused op that keeps it
        problem = problem or user_problem
        if problem is None and not user_checkpoint.one_region((node, consumer)):
            problem = user_checkpoint.CROSSES
        if problem is None and any(
            _writes_in_place(u, ctx.modules) for p in pieces for a in {p, *storage_family(_root(p))} for u in a.users
        ):
            problem = "a piece is written in place later: backward must not read the pieces"
        if problem is not None:
            ctx.found.skipped.append(Skip((site_name(node),), PATTERN, f"cat not rebuilt in backward: {problem}"))
            continue
        candidates.append(_Candidate(node, consumer, pieces))

    kept = {n for n in ctx.graph.nodes if n.op in ("placeholder", "get_attr")}
    kept |= {_input_of(n) for n in ctx.graph.nodes if _keeps_input(n, ctx.modules)}
    kept_roots = {_root(n) for n in kept if n is not None}
    chosen = list(candidates)
    while True:  # drop the cats that free nothing given the others, until none does
        decided = []
        for c in chosen:
            shared = {r for other in chosen if other is not c for r in other.roots}
            frees, _ = _frees(ctx, c, kept_roots | shared)
            decided.append((c, frees))
        still = [c for c, frees in decided if frees]
        if len(still) == len(chosen):
            break
        chosen = still
    for c in candidates:
        if c not in chosen:
            ctx.found.skipped.append(
                Skip(
                    (site_name(c.cat),),
                    PATTERN,
                    "cat not rebuilt in backward: its pieces are kept by nothing else, so keeping them instead of "
                    "the concatenation would free nothing",
                )
            )
    # What each site frees, with each tensor newly kept charged to the first site that keeps it, so
    # that the sites' bytes add up to what the rewrite frees.
    owner: dict[fx.Node, _Candidate] = {}
    for c in chosen:
        for r in c.roots:
            owner.setdefault(r, c)
    for c in chosen:
        cat_bytes = estimates.nbytes(ctx.shapes, c.cat)
        new = _new_bytes(ctx, c, kept_roots | {r for r in c.roots if owner[r] is not c})
        _rewrite(ctx, c, None if cat_bytes is None or new is None else cat_bytes - new)
    return len(chosen)


def _rewrite(ctx: PassContext, c: _Candidate, freed: Optional[int]) -> None:
    if c.consumer.op == "call_module":  # a plain Conv2d: fxfuse::conv2d, the same forward and saved tensors
        conv, target = c.consumer, c.consumer.target
        c.consumer = replace_chain(
            ctx.graph, [conv], lambda: ctx.graph.call_function(runtime.conv2d_module, (c.cat, ctx.get_attr(target)))
        )
        if conv in ctx.shapes:
            ctx.shapes[c.consumer] = ctx.shapes.pop(conv)
    c.consumer.kwargs = {**c.consumer.kwargs, "pieces": list(c.pieces)}
    op = CONSUMERS[c.consumer.target]
    cat_bytes = estimates.nbytes(ctx.shapes, c.cat)
    moved = None if cat_bytes is None else 2 * cat_bytes
    kept = f"its {len(c.pieces)} pieces" if len(c.pieces) > 1 else "its one piece"
    consumer = _consumer_name(c.consumer)
    reason = (
        f"{op} keeps {kept} in place of the concatenation ({format_bytes(cat_bytes)}), which backward rebuilds "
        f"for {consumer}: a copy, {format_bytes(moved)} moved, no FLOPs"
    )
    ctx.found.sites.append(
        SiteData(
            (site_name(c.cat),),
            PATTERN,
            op,
            saved_bytes=freed,
            recompute_flops=0,
            reason=reason,
            mode=ctx.mode,
            merged_into=consumer,
            recompute_bytes=moved,
        )
    )


def _consumer_name(consumer: fx.Node) -> str:
    """The fused op's first module (module forms), else its scope:function."""
    for arg in consumer.args:
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            return str(arg.target)
    return site_name(consumer)
