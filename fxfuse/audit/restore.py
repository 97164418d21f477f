"""restore_channels_last: an FX pass that converts back to channels_last right after each forward loss."""

from __future__ import annotations

import copy
import inspect
import warnings
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_leaves, tree_map_only

from .formats import CONTIGUOUS, memory_format_of
from .rules import is_channels_last


def restore_channels_last(model: torch.nn.Module, *example_inputs: Any) -> torch.nn.Module:
    """Return a channels_last copy of `model` that converts back to channels_last after each loss.

    The copy is traced with `torch.fx.symbolic_trace` and run once on `example_inputs`
    (4-D tensors converted to channels_last); every node that takes a channels_last input
    and returns a new NCHW-contiguous 4-D tensor gets a `.contiguous(memory_format=
    torch.channels_last)` after it. Views are left alone: they copy nothing. Each conversion
    is kept only if the model still runs and returns the same values (checked in eval mode).

    When the whole model cannot be traced, its submodules are restored one by one where they
    can be, with a warning. `model` itself is not changed.
    """
    restored = copy.deepcopy(model).to(memory_format=torch.channels_last)
    inputs = tree_map_only(torch.Tensor, _channels_last_copy, example_inputs)
    return _restore(restored, inputs, {}, path="")


def _channels_last_copy(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dim() == 4:
        return tensor.detach().clone(memory_format=torch.channels_last)
    return tensor.detach().clone()


def _restore(module: torch.nn.Module, args: tuple, kwargs: dict, path: str) -> torch.nn.Module:
    try:
        graph_module = torch.fx.symbolic_trace(module)
    except Exception as exc:
        return _restore_children(module, args, kwargs, path, exc)
    candidates = _losing_nodes(graph_module, args, kwargs)
    if candidates:
        _insert_conversions(graph_module, _accepted(graph_module, candidates, args, kwargs))
    return graph_module


def _restore_children(module: torch.nn.Module, args: tuple, kwargs: dict, path: str, exc: Exception):
    children = _first_child_calls(module, args, kwargs)
    warnings.warn(
        f"restore_channels_last: cannot trace {path or type(module).__name__} ({type(exc).__name__}: {exc}); "
        f"restoring its traceable submodules only",
        stacklevel=3,
    )
    for name, (child_args, child_kwargs) in children.items():
        child_path = f"{path}.{name}" if path else name
        setattr(module, name, _restore(getattr(module, name), child_args, child_kwargs, child_path))
    return module


def _first_child_calls(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, tuple[tuple, dict]]:
    """The arguments each direct child receives the first time `module` calls it."""
    probe = copy.deepcopy(module)
    calls: dict[str, tuple[tuple, dict]] = {}
    handles = []
    for name, child in probe.named_children():

        def record(child, child_args, child_kwargs, name=name):
            calls.setdefault(name, (child_args, child_kwargs))

        handles.append(child.register_forward_pre_hook(record, with_kwargs=True))
    with torch.no_grad():
        probe(*args, **kwargs)
    for handle in handles:
        handle.remove()
    return calls


class _LossFinder(torch.fx.Interpreter):
    """Runs the graph and collects the nodes that turn a channels_last input into a fresh NCHW tensor.

    Each loss is converted back on the spot, as the restored graph will do, so that losses
    it causes downstream (a cat that now mixes formats) are not collected too. A node that
    fails on a converted input (a `.view()` that needs NCHW strides) gets the original back,
    and that conversion is dropped.
    """

    def __init__(self, module: torch.fx.GraphModule):
        super().__init__(module)
        self.losing: list[str] = []
        self._unconverted: dict[torch.fx.Node, torch.Tensor] = {}

    def run_node(self, node: torch.fx.Node) -> Any:
        try:
            result = super().run_node(node)
        except Exception:
            converted_inputs = [n for n in node.all_input_nodes if n in self._unconverted]
            if not converted_inputs:
                raise
            for converted in converted_inputs:
                self.env[converted] = self._unconverted.pop(converted)
                self.losing.remove(converted.name)
            result = super().run_node(node)
        if node.op in ("call_function", "call_method", "call_module") and _is_new_nchw(result):
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            shares_storage = any(_same_storage(result, t) for t in inputs)
            if not shares_storage and any(is_channels_last(t) for t in inputs):
                self.losing.append(node.name)
                self._unconverted[node] = result
                return result.contiguous(memory_format=torch.channels_last)
        return result


def _is_new_nchw(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 4 and memory_format_of(value) == CONTIGUOUS


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _positional(graph_module: torch.fx.GraphModule, args: tuple, kwargs: dict) -> tuple:
    bound = inspect.signature(graph_module.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.args


def _losing_nodes(graph_module: torch.fx.GraphModule, args: tuple, kwargs: dict) -> list[str]:
    finder = _LossFinder(copy.deepcopy(graph_module))  # the probe run may update BN statistics
    with torch.no_grad():
        finder.run(*_positional(graph_module, args, kwargs))
    return finder.losing


def _insert_conversions(graph_module: torch.fx.GraphModule, node_names: list[str]) -> None:
    nodes = {node.name: node for node in graph_module.graph.nodes}
    graph = graph_module.graph
    for name in node_names:
        node = nodes[name]
        with graph.inserting_after(node):
            converted = graph.call_method("contiguous", (node,), {"memory_format": torch.channels_last})
        node.replace_all_uses_with(converted, delete_user_cb=lambda user, converted=converted: user is not converted)
    graph.lint()
    graph_module.recompile()


def _accepted(graph_module: torch.fx.GraphModule, candidates: list[str], args: tuple, kwargs: dict) -> list[str]:
    """The candidates whose conversion keeps the module running with unchanged outputs.

    A later `.view()` may need the NCHW strides; those conversions are dropped.
    """
    reference = _eval_outputs(graph_module, [], args, kwargs)
    if _matches(reference, _eval_outputs(graph_module, candidates, args, kwargs)):
        return candidates
    accepted: list[str] = []
    for name in candidates:
        if _matches(reference, _eval_outputs(graph_module, accepted + [name], args, kwargs)):
            accepted.append(name)
    return accepted


def _eval_outputs(graph_module: torch.fx.GraphModule, conversions: list[str], args: tuple, kwargs: dict):
    trial = copy.deepcopy(graph_module).eval()
    if conversions:
        _insert_conversions(trial, conversions)
    try:
        with torch.no_grad():
            # forward() rather than __call__: GraphModule.__call__ prints the generated code on errors.
            return trial.forward(*args, **kwargs)
    except Exception as exc:
        return exc


def _matches(reference: Any, outputs: Any) -> bool:
    if isinstance(outputs, Exception) or isinstance(reference, Exception):
        return False
    ref_leaves, out_leaves = tree_leaves(reference), tree_leaves(outputs)
    if len(ref_leaves) != len(out_leaves):
        return False
    for ref, out in zip(ref_leaves, out_leaves):
        if isinstance(ref, torch.Tensor):
            if not isinstance(out, torch.Tensor) or ref.shape != out.shape:
                return False
            if not torch.allclose(ref, out, rtol=1e-5, atol=1e-6, equal_nan=True):
                return False
        elif ref != out:
            return False
    return True
