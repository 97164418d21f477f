"""fxfuse: memory-saving fused Conv→BN→activation and GELU ops for PyTorch training,
applied to any model by torch.fx passes; and a channels_last auditor."""
from . import ops
from .errors import ExtensionNotLoadedError, FxFuseError, TracingError
from .optimize import explain, optimize
from .report import FusionReport
from .verify import VerifyReport, verify

__version__ = "0.1.0"

__all__ = ["ExtensionNotLoadedError", "FusionReport", "FxFuseError", "TracingError", "VerifyReport", "explain",
           "ops", "optimize", "verify"]
