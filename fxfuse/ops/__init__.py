"""fxfuse's C++ operators as Python functions, one module per op family.

Each family module (`batch_norm`, `convolution`, `conv_batch_norm`, `batch_norm_conv`,
`layer_activation`, `norm_linear`, `gelu_activation`) holds its wrappers with eager semantics and eager fallback, its
fake kernels and its autograd formulas; `cat_input` the variants of four of their ops that take
their input's concatenated pieces and keep those instead; `checks` holds what they share, and `activations`
the registry of the activations they apply. Importing
this package loads fxfuse._C (which defines the schemas and the CPU and
device-generic kernels) and then registers every family's fake kernels and autograd.
`compiled` holds the opt-in ATen compositions the wrappers run under torch.compile;
`flops` the ops' formulas for torch.utils.flop_counter; `routing` the switch
(`generic_path()`) that runs the device-generic implementations on CPU.
"""

from .. import _extension
from . import (
    activations,
    batch_norm,
    batch_norm_conv,
    cat_input,
    compiled,
    conv_batch_norm,
    conv_norm_linear,
    convolution,
    flops,
    gelu_activation,
    layer_activation,
    norm_linear,
    routing,  # noqa: F401  (fxfuse.ops.routing: the generic_path switch)
)
from .activations import ACTIVATIONS
from .batch_norm import batch_norm_act
from .batch_norm_conv import bn_act_conv
from .cat_input import cat_batch_norm_act, cat_bn_act_conv, cat_conv2d, cat_conv_bn_act
from .conv_batch_norm import conv_bn_act
from .conv_norm_linear import conv_layer_norm_linear
from .convolution import conv2d
from .gelu_activation import gelu
from .layer_activation import act_linear, act_linear_scale, conv_act, linear_act
from .norm_linear import layer_norm_linear
from .routing import generic_path

if _extension.loaded():
    _FAMILIES = (
        batch_norm,
        batch_norm_conv,
        conv_batch_norm,
        conv_norm_linear,
        convolution,
        gelu_activation,
        layer_activation,
        norm_linear,
    )
    for _family in _FAMILIES:
        _family.register()
    cat_input.register()  # on the families' autograd: the cat_ variants of four of their ops
    flops.register()

__all__ = [
    "ACTIVATIONS",
    "act_linear",
    "act_linear_scale",
    "activations",
    "batch_norm_act",
    "bn_act_conv",
    "cat_batch_norm_act",
    "cat_bn_act_conv",
    "cat_conv2d",
    "cat_conv_bn_act",
    "compiled",
    "conv2d",
    "conv_act",
    "conv_bn_act",
    "conv_layer_norm_linear",
    "gelu",
    "generic_path",
    "layer_norm_linear",
    "linear_act",
]
