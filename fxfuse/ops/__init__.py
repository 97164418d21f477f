"""fxfuse's C++ operators as Python functions, with their fake kernels and autograd.

Importing this package loads fxfuse._C (which defines the schemas and the CPU and
device-generic kernels) and then registers, per op family, the fake kernels used by
FakeTensor/torch.compile and the autograd formulas.
"""
from .._extension import loaded as _loaded

if _loaded():
    from . import bn_act as _bn_act  # noqa: F401  (registers fake kernels and autograd)
    from . import conv_bn_act as _conv_bn_act  # noqa: F401
    from . import gelu_op as _gelu_op  # noqa: F401
    from . import linear_conv_act as _linear_conv_act  # noqa: F401

from .act_functional import conv_act, gelu, linear_act
from .functional import ACTIVATIONS, batch_norm_act, conv_bn_act

__all__ = ["ACTIVATIONS", "batch_norm_act", "conv_act", "conv_bn_act", "gelu", "linear_act"]
