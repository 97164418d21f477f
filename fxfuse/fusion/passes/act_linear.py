"""Activation → Linear  ⇒  fxfuse::act_linear (the activation output is not kept).

Runs in every mode, after the BatchNorm passes and before linear_conv_act. An
activation whose eager backward keeps its input (GELU, SiLU, ...; estimates.SAVES_INPUT)
and whose output feeds one Linear and nothing else, possibly through nn.Identity or
nn.Dropout(p=0) modules (timm's and torchvision's MLPs; a Dropout's p and training flag
are checked again at call time, see runtime.act_linear_module), becomes one call. Eager keeps the activation's
input and its output, the Linear's input; the fused op keeps the input alone and
recomputes the activation, one pointwise pass, for the weight gradient. In a
transformer or ConvNeXt MLP that output is 4× the model width. No matmul runs twice.

In mode="memory" this takes the GELU of Linear → GELU → Linear before linear_conv_act
could: both keep the same bytes (the first Linear's input and one 4×-wide tensor),
and this one recomputes no matmul.
"""

from __future__ import annotations

from typing import Optional

import torch.fx as fx
from torch import nn

from ... import ops
from .. import runtime
from . import estimates
from .calls import as_linear, is_inplace
from .context import PassContext
from .driver import FusionPass, Site
from .matchers import activation_of, first_input, has_hooks, site_name

_IDENTITY_MODULES = (nn.Identity, nn.Dropout)


def passes_through(node: fx.Node, ctx: PassContext) -> bool:
    """A call of nn.Identity or of an nn.Dropout with p=0 (checked again at call time: runtime.act_linear_module)."""
    if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
        return False
    module = ctx.modules.get(node.target)
    if type(module) not in _IDENTITY_MODULES or has_hooks(module):
        return False
    return type(module) is nn.Identity or (module.p == 0 and not module.inplace)


def match(node: fx.Node, ctx: PassContext) -> Optional[Site]:
    act = activation_of(node, ctx.modules)
    source = first_input(node)
    if act is None or act.name not in estimates.SAVES_INPUT or source is None or is_inplace(node, ctx):
        return None
    chain, between = [node], []
    while len(chain[-1].users) == 1:
        user = next(iter(chain[-1].users))
        if not passes_through(user, ctx) or user.args[0] is not chain[-1]:
            break
        chain.append(user)
        between.append(user)
    if len(chain[-1].users) != 1:
        return None
    linear = next(iter(chain[-1].users))
    args, problem = as_linear(linear, ctx)
    if args is None and problem is None:
        return None
    if linear.op == "call_module" and linear.args != (chain[-1],):
        return None
    if linear.op == "call_function":
        if args.get("input") is not chain[-1] or chain[-1] in (args.get("weight"), args.get("bias")):
            return None
        if between:  # modules between an activation and a functional linear: not worth a form of its own
            return None
    names = (site_name(node), site_name(linear))
    pattern = (act.describe(), "linear")
    if problem:
        return Site(names, pattern, problem)
    name, param = act.name, act.param
    if linear.op == "call_module":

        def build():
            modules = [ctx.get_attr(linear.target), *(ctx.get_attr(b.target) for b in between)]
            return ctx.graph.call_function(runtime.act_linear_module, (source, name, param, *modules))
    else:

        def build():
            return ctx.graph.call_function(ops.act_linear, (), dict(args, input=source, act=name, act_param=param))

    return Site(
        names,
        pattern,
        chain=[*chain, linear],
        build=build,
        activation=act.describe(),
        op="fxfuse::act_linear",
        saved_bytes=estimates.nbytes(ctx.shapes, node),
        recompute_flops=0 if ctx.shapes else None,
        reason="keeps the activation input; recomputes the activation for the linear's weight gradient in backward",
    )


PASS = FusionPass(match)
