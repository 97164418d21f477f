"""What the trainer callbacks share: the options they pass to `fxfuse.optimize`, checked when a
callback is built (a typo fails before training starts, not at its first batch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn

from ..errors import ConfigurationError
from ..fusion import MODES, optimize
from ..fusion.layout import MEMORY_FORMATS


@dataclass(frozen=True)
class Settings:
    """`fxfuse.optimize`'s keyword options, as a callback was given them."""

    mode: str = "memory"
    memory_budget: Optional[float] = None
    peak_budget: Optional[float] = None
    memory_format: str = "preserve"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigurationError(f"mode must be one of {', '.join(map(repr, MODES))}, got {self.mode!r}")
        if self.memory_format not in MEMORY_FORMATS:
            raise ConfigurationError(
                f"memory_format must be one of {', '.join(map(repr, MEMORY_FORMATS))}, got {self.memory_format!r}"
            )
        for name in ("memory_budget", "peak_budget"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ConfigurationError(f"{name} is a fraction of eager's in (0, 1], e.g. 0.7; got {value!r}")
            if self.mode == "fast":
                raise ConfigurationError(f"mode='fast' never recomputes convolutions, so a {name} cannot steer it")

    def optimize(self, network: nn.Module, example_inputs) -> nn.Module:
        return optimize(
            network,
            example_inputs,
            mode=self.mode,
            memory_budget=self.memory_budget,
            peak_budget=self.peak_budget,
            memory_format=self.memory_format,
        )


def submodule(root: nn.Module, name: str, option: str = "module_name") -> nn.Module:
    """`root.get_submodule(name)`, with the submodules there are when there is none of that name."""
    try:
        return root.get_submodule(name)
    except AttributeError:
        children = ", ".join(repr(n) for n, _ in root.named_children()) or "none"
        raise ConfigurationError(
            f"{option}={name!r}: {type(root).__name__} has no submodule of that name (its children: {children})"
        ) from None


def trainable_children(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of `root` that hold trainable parameters (not a loss, a metric, a frozen EMA copy)."""
    return [(n, c) for n, c in root.named_children() if any(p.requires_grad for p in c.parameters())]
