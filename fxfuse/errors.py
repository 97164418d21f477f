"""fxfuse's exception types. Every error fxfuse raises itself subclasses FxFuseError."""


class FxFuseError(Exception):
    """Base class of every error fxfuse raises itself (not errors that eager PyTorch would raise)."""


class ExtensionNotLoadedError(FxFuseError, RuntimeError):
    """fxfuse._C, the compiled operator library, could not be loaded."""


class TracingError(FxFuseError):
    """Nothing in the model could be traced, so nothing could be optimized."""


class ConfigurationError(FxFuseError, ValueError):
    """An argument to an fxfuse API is invalid."""


class AuditError(FxFuseError, RuntimeError):
    """The channels_last audit could not run the model on its example inputs."""
