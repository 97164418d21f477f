"""`checkpointed(fn, recompute_context, *args)`: non-reentrant checkpoint, doing only what a region needs.

It keeps torch.utils.checkpoint's protocol (use_reentrant=False): forward runs `fn` with
a saved-tensor hook pair that keeps an index for each tensor its ops save; the first unpack
in a backward (one per graph task, or per `GraphExecGroup`) runs `fn` again under
`enable_grad` with the forward's RNG and autocast state, keeps what it saves, detached, and
stops once it has as many tensors as the forward saved; each unpack hands one over and lets go
of it. An unpack outside a backward recomputes each time, as torch's does.

Torch's version pays, each call, for generality a region does not need: the device type
inferred through a tree_map of the arguments, the device-context and autocast state captured
into context managers that the recompute always enters, a weakly referenced holder and a
shape/dtype/device record (under `no_grad`) per saved tensor, per-graph-task dictionaries, and
a dynamo-disable wrapper built anew for every recompute. Here the recompute enters an autocast
context only where the state differs from the forward's, and a tensor's metadata is not
recorded: a region is a fixed fx graph run again on the same inputs and buffers, so only the
count is checked. As in torch, the frame holds each saved tensor's slot weakly, so a recompute in
a later backward keeps nothing for nodes an earlier backward freed.

Whatever that leaner path does not handle goes to torch.utils.checkpoint itself: functorch
transforms, an active torch-function or dispatch mode (device contexts, fake tensors, tracing,
selective checkpoint), saved-tensor hooks already installed (the user's, offloading, or an
outer checkpoint, whose nesting torch resolves), hooks disabled, an argument that is not a
plain tensor, and checkpoint's global debug or early-stop switches.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointError

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_MISSING: Any = object()


class _Stop(Exception):
    pass


def checkpointed(fn: Callable, recompute_context: Callable[[], ContextManager], *args: Any) -> Any:
    """`fn(*args)`, keeping only `args` for backward. `recompute_context()` is entered around each
    recompute (a fresh one each time)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    if not _lean_applies(args):
        return torch_checkpoint.checkpoint(_RecomputesUnder(fn, recompute_context), *args, use_reentrant=False)
    frame = _Frame(fn, recompute_context, args)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
        out = fn(*args)
    if frame.devices is None and _device_initialized(frame.device_type):
        raise RuntimeError(
            "PyTorch's device state was initialized in the forward pass "
            "of a Checkpoint, which is not allowed. Please open an issue "
            "if you need this feature."
        )
    return out


class _RecomputesUnder:
    """`fn`, run under `recompute_context()` from its second call on: torch's checkpoint calls it once
    in forward, then once per recompute. (Its `context_fn` would do the same, but its debug mode refuses one.)"""

    def __init__(self, fn: Callable, recompute_context: Callable[[], ContextManager]) -> None:
        self.fn = fn
        self.recompute_context = recompute_context
        self.forward_ran = False

    def __call__(self, *args: Any) -> Any:
        if not self.forward_ran:
            self.forward_ran = True
            return self.fn(*args)
        with self.recompute_context():
            return self.fn(*args)


def _lean_applies(args: tuple) -> bool:
    if not SUPPORTED:
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    if torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack():
        return False
    autograd = torch._C._autograd
    if not autograd._saved_tensors_hooks_is_enabled():
        return False
    top = autograd._top_saved_tensors_default_hooks(False)
    if top is not None and type(getattr(top[0], "__self__", None)) not in _OWN_HOOKS:
        return False
    if torch_checkpoint._checkpoint_debug_enabled or torch_checkpoint._enable_checkpoint_early_stop is not None:
        return False
    return all(type(a) in _PLAIN for a in args if isinstance(a, torch.Tensor))


def _device_type(args: tuple) -> str:
    """The device whose RNG state is kept, as torch's checkpoint picks it: CUDA if any argument is there, else
    the first argument's device off the CPU, else the default device type."""
    found = None
    for a in args:
        if isinstance(a, torch.Tensor) and not a.is_cpu:
            if a.is_cuda:
                return "cuda"
            found = found or a.device.type
    return found or torch_checkpoint.DefaultDeviceType.get_device_type()


def _device_initialized(device_type: str) -> bool:
    return getattr(torch_checkpoint._get_device_module(device_type), "_initialized", False)


def _autocast_state(device_type: str) -> tuple:
    device = (
        (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        if torch.amp.is_autocast_available(device_type)
        else None
    )
    return device, torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled()


class _Frame:
    __slots__ = ("fn", "recompute_context", "inputs", "slots", "recomputed", "left", "device_type", "autocast")
    __slots__ += ("cpu_rng", "devices", "device_rng")

    def __init__(self, fn: Callable, recompute_context: Callable[[], ContextManager], args: tuple) -> None:
        self.fn = fn
        self.recompute_context = recompute_context
        saved = torch._C._autograd._make_saved_tensor
        self.inputs = [saved(a, is_output=False) if isinstance(a, torch.Tensor) else a for a in args]
        self.slots: list[weakref.ref] = []  # what each saved tensor was packed as, held by its SavedVariable
        # graph task (or GraphExecGroup) -> the recomputed tensors not yet handed over, None once all were
        self.recomputed: dict[Any, Optional[list]] = {}
        self.left: dict[Any, int] = {}  # graph task -> how many of its tensors are not yet handed over
        self.device_type = _device_type(args)
        self.autocast = _autocast_state(self.device_type)
        self.cpu_rng = torch.get_rng_state()
        self.devices: Optional[list] = None
        self.device_rng: list = []
        if _device_initialized(self.device_type):
            self.devices, self.device_rng = torch_checkpoint.get_device_states(*args)

    def pack(self, x: torch.Tensor) -> _Slot:
        slot = _Slot(len(self.slots))
        self.slots.append(weakref.ref(slot))
        return slot

    def unpack(self, slot: _Slot) -> torch.Tensor:
        index = slot.index
        gid = torch._C._get_graph_exec_group()
        if gid is None:
            gid = torch._C._current_graph_task_id()
            if gid == -1:
                return self._recompute()[0][index]
        tensors = self.recomputed.get(gid, _MISSING)
        if tensors is _MISSING:
            tensors, self.left[gid] = self._recompute()
            self.recomputed[gid] = tensors
        x = tensors[index] if tensors is not None else None
        if x is None:
            raise CheckpointError(
                "torch.utils.checkpoint: Unpack is being triggered for a tensor that was already "
                "unpacked once. If you are calling ctx.saved_tensors in backward, make sure "
                "to do so only once. Otherwise please open an issue with details on your use case."
            )
        tensors[index] = None
        left = self.left[gid] = self.left[gid] - 1
        if not left:
            self.recomputed[gid] = None
        return x

    def _recompute(self) -> tuple[list, int]:
        """What the forward saved, rebuilt (None where its slot is gone), and how many were kept."""
        recompute = _Recompute(self.slots)
        args = [a.unpack() if isinstance(a, _SavedTensor) else a for a in self.inputs]
        with _forward_rng(self), _forward_autocast(self.device_type, self.autocast), self.recompute_context():
            try:
                with torch.autograd.graph.saved_tensors_hooks(recompute.pack, _identity), torch.enable_grad():
                    _run_without_dynamo(self.fn, args)
            except _Stop as stop:
                if stop.args[0] is not recompute:
                    raise
        saved = recompute.saved
        if len(saved) != len(self.slots):
            raise CheckpointError(
                "torch.utils.checkpoint: A different number of tensors was saved "
                "during the original forward and recomputation.\n"
                f"Number of tensors saved during forward: {len(self.slots)}\n"
                f"Number of tensors saved during recomputation: {len(saved)}."
            )
        return saved, recompute.kept


class _Recompute:
    """The recompute's pack hook: keeps what is saved, detached, and stops the recompute at the count. A tensor
    whose slot is gone (its node ran in an earlier backward that freed it) is not kept, as torch's weakly
    held holders do."""

    __slots__ = ("saved", "slots", "kept")

    def __init__(self, slots: list) -> None:
        self.saved: list = []
        self.slots = slots
        self.kept = 0

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        saved = self.saved
        x = x.detach() if x.requires_grad else x
        slots = self.slots
        if slots[len(saved)]() is not None:
            saved.append(x)
            self.kept += 1
        else:
            saved.append(None)
        if len(saved) == len(slots):
            raise _Stop(self)
        # Packed too, as torch's recompute hook does: a backward inside `fn` (torch.autograd.grad in the
        # region) runs on the graph its recompute builds.
        return x


class _Slot:
    """What a saved tensor is packed as: its index in the frame, weakly referenced by the frame."""

    __slots__ = ("index", "__weakref__")

    def __init__(self, index: int) -> None:
        self.index = index


def _identity(x: Any) -> Any:
    return x


@torch.compiler.disable
def _run_without_dynamo(fn: Callable, args: list) -> None:
    fn(*args)


class _forward_rng:
    """The RNG state of the frame's forward while the block runs, and the current one restored after
    (torch.random.fork_rng with the states torch's checkpoint keeps: the CPU's and its device's)."""

    def __init__(self, frame: _Frame) -> None:
        self.frame = frame

    def __enter__(self) -> None:
        frame = self.frame
        self.cpu = torch.get_rng_state()
        self.device_states = None
        if frame.devices:
            module = torch_checkpoint._get_device_module(frame.device_type)
            self.device_states = []
            for device in frame.devices:
                with module.device(device):
                    self.device_states.append(module.get_rng_state())
            torch_checkpoint.set_device_states(frame.devices, frame.device_rng, device_type=frame.device_type)
        torch.set_rng_state(frame.cpu_rng)

    def __exit__(self, *exc: Any) -> None:
        torch.set_rng_state(self.cpu)
        if self.device_states is not None:
            frame = self.frame
            torch_checkpoint.set_device_states(frame.devices, self.device_states, device_type=frame.device_type)


def _forward_autocast(device_type: str, state: tuple) -> ContextManager:
    if _autocast_state(device_type) == state:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    device, cpu_enabled, cpu_dtype, cache = state
    if device is not None:
        enabled, dtype = device
        stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache))
    stack.enter_context(torch.autocast("cpu", dtype=cpu_dtype, enabled=cpu_enabled, cache_enabled=cache))
    return stack


# A region called inside another's forward or recompute (a link's chain) nests as torch's checkpoints do:
# its inputs are kept by the enclosing frame's hooks, and rebuilt by its recompute.
_OWN_HOOKS = (_Frame, _Recompute)


def _probe() -> bool:
    """Whether this torch has every private API the lean path calls (2.14 has): where one is missing, every
    call goes to torch.utils.checkpoint, the same results at torch's cost."""
    try:
        autograd = torch._C._autograd
        autograd._make_saved_tensor, autograd.SavedTensor  # noqa: B018
        autograd._top_saved_tensors_default_hooks(False)
        autograd._saved_tensors_hooks_is_enabled()
        torch._C._functorch.peek_interpreter_stack()
        torch._C._len_torch_function_stack() + torch._C._len_torch_dispatch_stack()
        torch._C._get_graph_exec_group()
        torch._C._current_graph_task_id()
        torch_checkpoint._checkpoint_debug_enabled, torch_checkpoint._enable_checkpoint_early_stop  # noqa: B018
        torch_checkpoint._get_device_module(torch_checkpoint.DefaultDeviceType.get_device_type())
        torch_checkpoint.get_device_states, torch_checkpoint.set_device_states  # noqa: B018
        torch.amp.is_autocast_available("cpu") and torch.get_autocast_dtype("cpu")
    except (AttributeError, TypeError):
        return False
    return True


SUPPORTED = _probe()
_SavedTensor = getattr(torch._C._autograd, "SavedTensor", ())
