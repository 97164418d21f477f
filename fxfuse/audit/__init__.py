"""channels_last memory-format audit: find the ops that silently return NCHW, and restore the format."""

from .channels_last import audit_channels_last
from .report import ChannelsLastReport, Finding, TensorMeta
from .restore import restore_channels_last

__all__ = ["audit_channels_last", "restore_channels_last", "ChannelsLastReport", "Finding", "TensorMeta"]
