"""A Hugging Face `Trainer` callback that runs the model's network through `fxfuse.optimize`.

    trainer = transformers.Trainer(model, args, train_dataset=..., callbacks=[FxfuseCallback()])

The HF Trainer shows callbacks no batch, so the callback watches the model's first training call
(a forward pre-hook, removed at once) and optimizes the network there, with that call's main input
(`model.main_input_name`, "pixel_values" for vision models) as the example input. By default the
network is the model's backbone (`model.base_model`: `resnet`, `convnext`, `mobilenet_v2`, ...),
a submodule of the model called, so it runs fused from the first step on; the classification
head and the loss stay as they are. `module_name` names another submodule whose forward takes
the main input, or "" for the model itself, which then runs fused from its second call on (the
first call had already started when the hook ran).

Everything the Trainer does to the model before training (moving it, TrainingArguments
`gradient_checkpointing=True`, which sets the modules' `gradient_checkpointing` switches) comes
first; fxfuse keys its graphs on those switches, so turning them later rebuilds the graph rather
than running a stale one. Checkpoints save the model's state_dict and config as without fxfuse.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from transformers import TrainerCallback

from ..errors import ConfigurationError
from .settings import Settings, submodule


class FxfuseCallback(TrainerCallback):
    """Optimize the model's network with `fxfuse.optimize` at its first training call.

    mode, memory_budget, peak_budget, memory_format: as `fxfuse.optimize` takes them.
    module_name: the network's path in the model; None: `model.base_model`; "": the model itself.
    After the first step, `report` holds the FusionReport (also `network.fxfuse_report`).
    """

    def __init__(
        self,
        mode: str = "memory",
        memory_budget: Optional[float] = None,
        peak_budget: Optional[float] = None,
        memory_format: str = "preserve",
        module_name: Optional[str] = None,
    ) -> None:
        self.settings = Settings(mode, memory_budget, peak_budget, memory_format)
        self.module_name = module_name
        self.report = None
        self._hook = None
        self._network: Optional[nn.Module] = None

    def network(self, model: nn.Module) -> nn.Module:
        """The module this callback optimizes in `model`."""
        if self.module_name is None:
            base = getattr(model, "base_model", model)
            return base if isinstance(base, nn.Module) else model
        return submodule(model, self.module_name) if self.module_name else model

    def on_train_begin(self, args, state, control, model: Optional[nn.Module] = None, **kwargs) -> None:
        if model is None:
            return
        network = self.network(model)
        if self._network is network and "fxfuse_report" in network.__dict__:
            return  # a second train() of the same model: already optimized
        self._remove_hook()
        self._network = network
        self._hook = model.register_forward_pre_hook(self._first_call, with_kwargs=True)

    def _first_call(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        if not model.training:
            return
        self._remove_hook()  # before optimize copies the model
        name = getattr(model, "main_input_name", None)
        inputs = kwargs.get(name) if name in kwargs else (args[0] if args else None)
        if not isinstance(inputs, torch.Tensor):
            raise ConfigurationError(
                f"FxfuseCallback: the model's first training call has no {name or 'first'} tensor argument "
                "to size the network with; optimize it yourself before Trainer.train: "
                "fxfuse.optimize(model.base_model, example_inputs)"
            )
        self.settings.optimize(self._network, inputs)
        self.report = self._network.__dict__.get("fxfuse_report")

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def on_train_end(self, args, state, control, **kwargs: Any) -> None:
        self._remove_hook()
