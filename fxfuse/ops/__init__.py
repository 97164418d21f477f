"""fxfuse's C++ operators as Python functions, one module per op, named as the op.

Each op module (`avg_pool2d`, `batch_norm_act`, `conv_bn_act`, `bn_act_conv`, `conv2d`, `conv_act`,
`linear_act`, `act_linear`, `act_linear_scale`, `gelu`, `layer_norm_linear`,
`conv_layer_norm_linear`, `max_pool2d`) holds its wrapper with eager semantics and eager fallback and
its fake kernels (every op's Autograd kernel is C++, fxfuse/csrc/autograd/); `cat_input` the
variants of four of them that take their input's concatenated pieces and keep those instead
(cat_batch_norm_act, cat_conv_bn_act, cat_bn_act_conv, cat_conv2d); `checks` holds what they
share, `higher_order` when eager's ops run instead (torch.func, forward AD), `linear_common` what
linear_act and act_linear share, and `activations` the registry of the
activations they apply. Importing this package loads fxfuse._C (which defines the schemas and
the CPU and device-generic kernels and the Autograd kernels) and then registers every op's fake
kernels.
`rebuild` is the saved-tensor-hooks scope in which a budget rebuilds BN→activation outputs for
the ops that keep them (not an op). `compiled` holds the opt-in ATen compositions the wrappers run
under torch.compile; `flops`
the ops' formulas for torch.utils.flop_counter; `routing` the switch (`generic_path()`) that
runs the device-generic implementations on CPU; `running_stats` the running-statistics update the BN ops
and their compositions share; `direct` the ops' calls from Python without torch.ops' boxed path.

As in torchvision.ops, the package attribute of an op's name is the op's function, not its
module: reach a module through `from fxfuse.ops.<op> import ...` or sys.modules.
"""

import sys

from .. import _extension
from . import (
    activations,
    cat_input,
    compiled,
    direct,
    flops,
    routing,  # noqa: F401  (fxfuse.ops.routing: the generic_path switch)
    running_stats,
)
from .act_linear import act_linear
from .act_linear_scale import act_linear_scale
from .activations import ACTIVATIONS
from .avg_pool2d import avg_pool2d
from .batch_norm_act import batch_norm_act
from .bn_act_conv import bn_act_conv
from .cat_input import cat_batch_norm_act, cat_bn_act_conv, cat_conv2d, cat_conv_bn_act
from .conv2d import conv2d
from .conv_act import conv_act
from .conv_bn_act import conv_bn_act
from .conv_layer_norm_linear import conv_layer_norm_linear
from .gelu import gelu
from .layer_norm_linear import layer_norm_linear
from .linear_act import linear_act
from .max_pool2d import max_pool2d
from .routing import generic_path

OPS = (
    "act_linear",
    "act_linear_scale",
    "avg_pool2d",
    "batch_norm_act",
    "bn_act_conv",
    "conv2d",
    "conv_act",
    "conv_bn_act",
    "conv_layer_norm_linear",
    "gelu",
    "layer_norm_linear",
    "linear_act",
    "max_pool2d",
)

if _extension.loaded():
    for _op in OPS:
        sys.modules[f"{__name__}.{_op}"].register()
    cat_input.register()  # on the ops' autograd: the cat_ variants of four of them
    flops.register()
    running_stats.register()  # fxfuse::update_running_stats_, which the BN ops call
    direct.register()  # fxfuse._C's direct calls into the ops the runtime calls per site

__all__ = [
    "ACTIVATIONS",
    "act_linear",
    "act_linear_scale",
    "activations",
    "avg_pool2d",
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
    "max_pool2d",
]
