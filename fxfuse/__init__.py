from .errors import FxFuseError
