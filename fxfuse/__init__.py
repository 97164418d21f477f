"""fxfuse: memory-saving fused Conv→BN→activation and GELU ops for PyTorch training,
applied to any model by torch.fx passes; and a channels_last auditor."""

from . import ops
from .audit import ChannelsLastReport, audit_channels_last, restore_channels_last
from .errors import ExtensionNotLoadedError, FxFuseError, TracingError
from .fusion import explain, optimize
from .fusion.report import FusionReport
from .verify import VerifyReport, verify

__version__ = "0.1.0"

__all__ = [
    "ChannelsLastReport",
    "ExtensionNotLoadedError",
    "FusionReport",
    "FxFuseError",
    "TracingError",
    "VerifyReport",
    "audit_channels_last",
    "explain",
    "ops",
    "optimize",
    "restore_channels_last",
    "verify",
]
