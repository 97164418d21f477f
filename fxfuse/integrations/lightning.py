"""A PyTorch Lightning callback that runs the LightningModule's network through `fxfuse.optimize`.

    trainer = lightning.Trainer(callbacks=[FxfuseCallback(mode="memory", memory_budget=0.5)])

The network is optimized at the first training batch of each `fit` (resumed ones included), before
its first forward, with that batch's inputs as the example inputs: the LightningModule's
parameters, optimizer and state_dict are untouched (fxfuse rewrites the module in place, keeping
every parameter and buffer object), so checkpoints save and load as without fxfuse.

Which module is "the network" (`module_name`): given, `pl_module.get_submodule(module_name)`;
otherwise the LightningModule's one child holding trainable parameters (`self.model = resnet50()`:
the pattern where training_step calls either `self.model(x)` or `self(x)`, which both then run the
fused model); with none or several such children, the LightningModule itself, which must then define a
forward that training_step calls (`self(x)`). A network that the first training batch does not call is
reported with a warning naming `module_name`.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Optional

from torch import nn

from ..errors import ConfigurationError
from .settings import Settings, submodule, trainable_children

try:
    from lightning.pytorch import Callback, LightningModule
except ImportError:  # the standalone package
    from pytorch_lightning import Callback, LightningModule


def batch_inputs(batch: Any) -> Any:
    """The network's inputs in a batch, by the usual convention: the batch itself if it is a tensor,
    else its first element (`(x, y)`), else its "pixel_values", "image", "images", "x", "input" or
    "inputs" entry."""
    if isinstance(batch, (list, tuple)) and batch:
        return batch[0]
    if isinstance(batch, dict):
        for key in ("pixel_values", "image", "images", "x", "input", "inputs"):
            if key in batch:
                return batch[key]
        raise ConfigurationError(
            f"FxfuseCallback: no input entry among the batch's keys {sorted(batch)}; "
            "pass example_inputs=lambda batch: batch['...'] (what the network's forward takes)"
        )
    return batch


class FxfuseCallback(Callback):
    """Optimize the LightningModule's network with `fxfuse.optimize` at the first training batch.

    mode, memory_budget, peak_budget, memory_format: as `fxfuse.optimize` takes them.
    module_name: the network's path in the LightningModule ("model", "backbone.body"); None picks it
        as the module docstring says.
    example_inputs: `batch -> tensor or tuple of forward arguments`, the network's inputs in a
        training batch (shapes only: nothing is computed with them); None: `batch_inputs`.
    After the first batch, `report` holds the FusionReport (also `network.fxfuse_report`).
    """

    def __init__(
        self,
        mode: str = "memory",
        memory_budget: Optional[float] = None,
        peak_budget: Optional[float] = None,
        memory_format: str = "preserve",
        module_name: Optional[str] = None,
        example_inputs: Optional[Callable[[Any], Any]] = None,
    ) -> None:
        super().__init__()
        self.settings = Settings(mode, memory_budget, peak_budget, memory_format)
        self.module_name = module_name
        self.example_inputs = example_inputs if example_inputs is not None else batch_inputs
        self.report = None
        self._pending = False
        self._optimized: weakref.WeakSet = weakref.WeakSet()
        self._calls = 0
        self._hook = None

    def network(self, pl_module: nn.Module) -> nn.Module:
        """The module this callback optimizes in `pl_module`."""
        if self.module_name is not None:
            return submodule(pl_module, self.module_name)
        children = trainable_children(pl_module)
        if len(children) == 1:
            return children[0][1]
        if type(pl_module).forward is LightningModule.forward:
            names = ", ".join(repr(n) for n, _ in children) or "none"
            raise ConfigurationError(
                f"FxfuseCallback: {type(pl_module).__name__} has no forward of its own and {len(children)} children "
                f"with trainable parameters ({names}); name the one training_step calls: module_name=..."
            )
        return pl_module

    def on_fit_start(self, trainer, pl_module) -> None:
        self._pending = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self._pending:
            return
        self._pending = False
        network = self.network(pl_module)
        if network not in self._optimized:
            self.settings.optimize(network, self.example_inputs(batch))
            self._optimized.add(network)
        self.report = network.__dict__.get("fxfuse_report")
        self._calls = 0
        self._hook = network.register_forward_pre_hook(self._count_call)

    def _count_call(self, module, args) -> None:
        self._calls += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._hook is None:
            return
        self._hook.remove()
        self._hook = None
        if self._calls == 0:
            network = self.network(pl_module)
            children = ", ".join(repr(n) for n, _ in trainable_children(pl_module)) or "none"
            warnings.warn(
                f"FxfuseCallback optimized {type(network).__name__}, but the first training batch did not call it, "
                f"so training runs unfused: name the module training_step calls, "
                f"FxfuseCallback(module_name=...) (children with parameters: {children})",
                stacklevel=2,
            )
