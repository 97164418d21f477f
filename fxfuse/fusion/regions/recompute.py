"""What a rewritten graph calls for a recompute region: run it keeping only its inputs.

A region (regions/graph.py) is a run of graph nodes compiled into a function of its
own, `fn(owner, *inputs)`. `RegionCall` runs it checkpointed (regions/checkpointed.py:
torch's non-reentrant protocol at about half torch.utils.checkpoint's host cost, torch's
own where a transform, a mode or the user's hooks are active): forward keeps only the
region's inputs, and backward runs the region's forward again (fxfuse's fused kernels
included) to rebuild what its backward needs, stopping once it has. The RNG state is
restored for the recompute, so dropout draws the same mask. A custom autograd.Function
that runs the forward under no_grad and backpropagates through a recompute in its
backward was measured no faster than torch's checkpoint (ResNet-50, 8x3x224x224,
memory_budget=0.3: 2.35 s per train step against 2.31 s, same gradients), and it cannot
stop the recompute early. A call costs a fixed part (benchmarks/region_overhead.py: ~160 µs
here, forward + backward, against torch's 250-370) and a part per op it runs again (~30 µs a
conv + ReLU pair, their recompute and the hooks of what they save, against torch's 55-90):
small beside a recompute at 224², most of a region's cost on tiny inputs. The ranking
prices the fixed part (ranking.REGION_CALL_OPS).

The recompute must not change module state a second time: BatchNorm's running
statistics and `num_batches_tracked`, or any buffer the region updates in place.
While it runs, every buffer of the modules the region uses is swapped for a copy,
so the recompute reads the same values as the forward did and writes into the copies,
which are then dropped; the real buffers are neither read nor written by it.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from fxfuse.fusion.regions.checkpointed import checkpointed


class RegionCall:
    """`self(components, *inputs)`: the region's output, computed by `fn` under checkpoint.

    `components` are the live objects (modules, parameters) named by the first part of
    every attribute path the region reads (`layer1` for `layer1.0.conv1`), looked up by
    the caller's graph at call time; `module_paths` are the modules whose buffers the
    recompute must leave alone. An instance is a graph node's target, so it carries a
    `__name__` for the generated code.
    """

    def __init__(self, name: str, fn: Callable, component_names: Sequence[str], module_paths: Sequence[str]) -> None:
        self.name = name
        self.fn = fn
        self.component_names = tuple(component_names)
        self.module_paths = tuple(module_paths)
        self.__name__ = "recompute_region"
        self.__qualname__ = "recompute_region"
        self.__module__ = __name__
        self._resolved: Optional[tuple] = None  # (the components, _modules' answer for them)

    def owner(self, components: Sequence[Any]) -> types.SimpleNamespace:
        return types.SimpleNamespace(**dict(zip(self.component_names, components)))

    # Under torch.compile a region runs as it does eagerly, between compiled graphs: dynamo
    # takes no context_fn but a selective-checkpoint one (so no buffer swap), and a plain
    # checkpoint left the running statistics updated twice.
    @torch.compiler.disable
    def __call__(self, components: Sequence[Any], *inputs: Any) -> Any:
        owner = self.owner(components)
        return checkpointed(
            self.fn,
            lambda: _buffers_swapped(self._modules(owner), owner if "" in self.module_paths else None),
            owner,
            *inputs,
        )

    def _modules(self, owner: types.SimpleNamespace) -> list[nn.Module]:
        # Resolved once per set of components: the graph that calls this region is dropped, and this with it,
        # when a module of the tree changes its children (install.py), so the same components give the same
        # modules.
        components = tuple(vars(owner).values())
        resolved = self._resolved
        if resolved is not None and len(resolved[0]) == len(components):
            if all(a is b for a, b in zip(resolved[0], components)):
                return resolved[1]
        modules = self._resolve(owner)
        self._resolved = (components, modules)
        return modules

    def _resolve(self, owner: types.SimpleNamespace) -> list[nn.Module]:
        modules = []
        for path in self.module_paths:
            if not path:  # the root: its own tensors are `owner`'s attributes (_buffers_swapped swaps them there)
                continue
            head, *rest = path.split(".")
            module = getattr(owner, head)
            if rest:
                module = module.get_submodule(".".join(rest))
            modules.append(module)
        return modules

    def __repr__(self) -> str:
        return f"RegionCall({self.name})"


class _buffers_swapped:
    """Every buffer of `modules` and their submodules replaced by a copy while the block runs (the copies
    are dropped after).

    Re-entrant: a backward with create_graph=True runs the recompute once more for the second
    backward, with the same context object.

    `owner`, where the region reads the root's own tensors: the root is no component (the region
    gets those tensors themselves as `owner`'s attributes), so its buffers are swapped there: each
    tensor attribute that is not a Parameter."""

    def __init__(self, modules: Sequence[nn.Module], owner: Optional[types.SimpleNamespace] = None) -> None:
        self.modules = modules
        self.owner = owner
        self.entered: list[list] = []

    def __enter__(self) -> None:
        originals = []
        # A module the region calls as a leaf (one that could not be traced through) updates the
        # buffers of its submodules too: a BatchNorm inside it would count a step twice.
        owners = dict.fromkeys(sub for module in self.modules for sub in module.modules())
        for module in owners:
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    originals.append((module, name, buffer))
                    module._buffers[name] = buffer.clone()
        if self.owner is not None:
            for name, value in list(vars(self.owner).items()):
                if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                    originals.append((self.owner, name, value))
                    setattr(self.owner, name, value.clone())
        self.entered.append(originals)

    def __exit__(self, *exc) -> None:
        for holder, name, buffer in self.entered.pop():
            if isinstance(holder, nn.Module):
                holder._buffers[name] = buffer
            else:
                setattr(holder, name, buffer)
