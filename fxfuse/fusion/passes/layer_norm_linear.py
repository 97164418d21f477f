"""LayerNorm → Linear  ⇒  fxfuse::layer_norm_linear (the layer norm's output is not kept).

Runs in every mode, after linear_conv_act. A layer norm over the last dimension (an
nn.LayerNorm module, or F.layer_norm with constant normalized_shape and eps, as timm's
LayerNorm calls it) whose output feeds one Linear and nothing else (reads of its shape
aside, which then read the layer norm's input: the same shape) becomes one call. Eager
keeps the layer norm's input and its output, the Linear's input; the fused op keeps the
input alone and runs the layer norm again in backward. In a transformer block (norm →
qkv, norm → MLP) and a ConvNeXt block that output is as wide as the model. No matmul
runs twice.

After linear_conv_act, so that in mode="memory" a LayerNorm → Linear → activation whose
activation output does not feed a Linear keeps the Linear's input and recomputes the
Linear (keeping the wide activation input is what that avoids) rather than merge here.
"""

from __future__ import annotations

import inspect
import numbers
from dataclasses import dataclass
from typing import Any, Optional

import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ... import ops
from .. import runtime
from . import estimates
from .calls import as_linear
from .context import PassContext
from .driver import FusionPass, Site
from .matchers import first_input, hooks_problem, reads_only_metadata, site_name

_LAYER_NORM_SIGNATURE = inspect.signature(F.layer_norm)


def _as_layer_norm(node: fx.Node, ctx: PassContext) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """F.layer_norm's arguments for a functional call, {"module": m} for a module call, or why not."""
    if node.op == "call_module":
        m = ctx.modules.get(node.target)
        if not isinstance(m, nn.LayerNorm):
            return None, None
        if type(m).forward is not nn.LayerNorm.forward:
            return None, f"{type(m).__name__} overrides LayerNorm.forward"
        if hooks_problem(m, "LayerNorm"):
            return None, hooks_problem(m, "LayerNorm")
        if len(m.normalized_shape) != 1:
            return None, "the layer norm is over more than the last dimension"
        if len(node.args) != 1 or node.kwargs:
            return None, "unexpected LayerNorm call arguments"
        return {"module": m}, None
    if node.op == "call_function" and node.target is F.layer_norm:
        try:
            bound = _LAYER_NORM_SIGNATURE.bind(*node.args, **node.kwargs)
        except TypeError:
            return None, "unrecognised F.layer_norm arguments"
        bound.apply_defaults()
        args = dict(bound.arguments)
        shape, eps = args["normalized_shape"], args["eps"]
        if not isinstance(eps, numbers.Real) or isinstance(eps, bool):
            return None, "F.layer_norm eps is not a constant number"
        if not (isinstance(shape, (tuple, list)) and len(shape) == 1 and type(shape[0]) is int):
            return None, "F.layer_norm normalized_shape is not one constant size (the last dimension)"
        return args, None
    return None, None


def _module_params(ctx: PassContext, path: str, module: nn.Module) -> dict[str, Any]:
    return {
        name: ctx.get_attr(f"{path}.{name}") if getattr(module, name) is not None else None
        for name in ("weight", "bias")
    }


@dataclass
class NormLinear:
    """A layer norm → Linear match: its nodes, the layer norm's input, and the fused op's arguments."""

    names: tuple[str, ...]
    norm: fx.Node
    linear: fx.Node
    source: fx.Node  # the layer norm's input
    shape_users: list  # reads of the layer norm output's shape, to redirect to `source`
    problem: Optional[str]
    _norm: Optional[dict] = None
    _linear_args: Optional[dict] = None

    def modules(self) -> Optional[tuple[str, str]]:
        """(norm path, linear path) when both are module calls."""
        if "module" in self._norm and self.linear.op == "call_module":
            return self.norm.target, self.linear.target
        return None

    def kwargs(self, ctx: PassContext) -> dict[str, Any]:
        """ops.layer_norm_linear's arguments after the input (get_attr nodes inserted at the insertion point)."""
        norm, args = self._norm, self._linear_args
        if "module" in norm:
            m = norm["module"]
            ln_params = _module_params(ctx, self.norm.target, m)
            ln = dict(normalized_shape=tuple(m.normalized_shape), eps=m.eps)
        else:
            ln_params = {"weight": norm["weight"], "bias": norm["bias"]}
            ln = dict(normalized_shape=tuple(norm["normalized_shape"]), eps=float(norm["eps"]))
        layer = _module_params(ctx, self.linear.target, ctx.modules[self.linear.target]) if not args else args
        return dict(
            ln, ln_weight=ln_params["weight"], ln_bias=ln_params["bias"], weight=layer["weight"], bias=layer["bias"]
        )


def norm_linear_at(node: fx.Node, ctx: PassContext) -> Optional[NormLinear]:
    """The layer norm → Linear starting at `node`, or None."""
    norm, problem = _as_layer_norm(node, ctx)
    if norm is None and problem is None:
        return None
    source = norm["input"] if norm is not None and "module" not in norm else first_input(node)
    # Reads of its shape or rank go to its input; not of its dtype: under autocast the layer norm's
    # output is float32 where its input may not be.
    shape_users = [u for u in node.users if reads_only_metadata(u, node, attributes=("shape", "ndim"))]
    others = [u for u in node.users if u not in shape_users]
    if not isinstance(source, fx.Node) or len(others) != 1:
        return None
    linear = others[0]
    args, linear_problem = as_linear(linear, ctx)
    if args is None and linear_problem is None:
        return None
    if linear.op == "call_module" and linear.args != (node,):
        return None
    if linear.op == "call_function" and (args.get("input") is not node or node in (args["weight"], args["bias"])):
        return None
    names = (site_name(node), site_name(linear))
    return NormLinear(names, node, linear, source, shape_users, problem or linear_problem, norm, args)


def redirect_shape_reads(match: NormLinear) -> None:
    for user in match.shape_users:
        user.replace_input_with(match.norm, match.source)


def match(node: fx.Node, ctx: PassContext) -> Optional[Site]:
    found = norm_linear_at(node, ctx)
    if found is None:
        return None
    pattern = ("layer_norm", "linear")
    if found.problem:
        return Site(found.names, pattern, found.problem)
    source, modules = found.source, found.modules()
    if modules is not None:

        def build():
            attrs = tuple(ctx.get_attr(path) for path in modules)
            return ctx.graph.call_function(runtime.layer_norm_linear_module, (source, *attrs))
    else:

        def build():
            return ctx.graph.call_function(ops.layer_norm_linear, (source,), found.kwargs(ctx))

    return Site(
        found.names,
        pattern,
        chain=[node, found.linear],
        build=build,
        prepare=lambda: redirect_shape_reads(found),
        op="fxfuse::layer_norm_linear",
        saved_bytes=estimates.nbytes(ctx.shapes, node),
        recompute_flops=0 if ctx.shapes else None,
        reason="keeps the layer norm's input; runs the layer norm again for the linear's weight gradient in backward",
    )


PASS = FusionPass(match)
