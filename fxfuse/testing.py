"""Check that two models train identically, tensor by tensor.

`compare_models` is the comparison engine behind both `fxfuse.verify` (the original
model against its fxfuse-optimized copy) and `assert_equivalent` (any two models, for
a user's pytest suite). It first compares the ``state_dict`` keys
(``state_dict_keys``) and the ``named_parameters()`` order (``param_order``); then
runs both models side by side for a few SGD steps from the same RNG state and
compares, at every step:

 * the parameters going into the step (``param``),
 * the outputs (``output``), under any nesting of tuples, lists, dicts and namedtuples,
 * the gradients of the floating example inputs (``input_grad``) and of every
   parameter, by name (``param_grad``),
 * every buffer after the forward and backward, running statistics included (``buffer``);

and last, in eval mode, the trained parameters and buffers and the outputs
(``eval_output``).

With a float64 reference (``reference64``, what `assert_equivalent` and
`fxfuse.verify` use by default) a third model, the reference cast to float64, runs in
lockstep with the two, and each tensor of the candidate is held to the reference's own
error against it (`FP64_MULTIPLIER`, `fp64_floor`), the method of
``torch._dynamo.utils.same(..., fp64_ref=...)``: float32 rounding that eager itself
makes no longer reads as a difference, and a candidate clearly worse than eager at
its own dtype still fails.

The backward is taken of a fixed random projection of the outputs, not of their sum:
``out.sum()`` sends the same gradient to every element, and gradient terms that
cancel for a constant upstream gradient (batch norm's mean-subtraction terms, say)
would then go unchecked.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import textwrap
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from .errors import ConfigurationError, FxFuseError

__all__ = [
    "Check",
    "TensorComparison",
    "Tolerance",
    "assert_equivalent",
    "compare_models",
    "compare_tensors",
    "default_tolerance",
    "few_value_norms",
    "float64_copy",
    "fp64_floor",
]

# Each step is plain SGD with the learning rate that moves the reference's largest
# parameter element by MAX_UPDATE: big enough that a candidate ignoring the update
# (stale cached weights, say) shows, small enough that tiny-batch BatchNorm gradients
# (easily 1e4 or more) do not blow the models up with a fixed learning rate.
MAX_UPDATE = 1e-2
FALLBACK_LR = 0.1  # when the reference has no finite, nonzero gradient
_PROJECTION_SEED = 1234


# --------------------------------------------------------------------------- tolerances


@dataclass(frozen=True)
class Tolerance:
    """Two tensors match when ``max|ref - cand| <= atol + rtol * max|ref|``.

    ``rtol`` is relative to the scale of the whole reference tensor, not element by
    element, so elements near zero do not make the check flaky; ``atol`` is a floor for
    tensors that are all (nearly) zero, e.g. gradients that cancel to rounding noise.
    With a float64 reference the same two numbers are the floor added to
    ``FP64_MULTIPLIER`` times the reference model's own error.
    """

    rtol: float
    atol: float


_DEFAULT_TOLERANCES = {
    torch.float64: Tolerance(rtol=1e-9, atol=1e-10),
    torch.float32: Tolerance(rtol=2e-4, atol=1e-5),
    torch.float16: Tolerance(rtol=5e-3, atol=1e-3),
    torch.bfloat16: Tolerance(rtol=3e-2, atol=1e-2),
}
_EXACT = Tolerance(rtol=0.0, atol=0.0)

# Against a float64 reference, a candidate tensor passes when its error is at most
# FP64_MULTIPLIER times the reference model's own error at the same dtype, plus a floor:
# rtol, about 80 rounding steps of the dtype relative to the tensor's scale, for
# tensors that the reference happens to get (nearly) exact; and atol, the dtype's
# smallest normal number, for values near zero, where rounding is absolute. The
# floor is not larger on purpose: an untrained network's outputs can be 1e-10 in size
# and still hold a real difference. Chosen by measurement (docs/verify.md): correct
# rewrites of five torchvision models needed at most 3.2x, planted defects are caught
# hundreds of times over.
FP64_MULTIPLIER = 5.0
_FP64_FLOORS = {
    dtype: Tolerance(rtol=rtol, atol=torch.finfo(dtype).tiny)
    for dtype, rtol in ((torch.float32, 1e-5), (torch.float16, 1e-2), (torch.bfloat16, 8e-2))
}


def _real_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype.to_real() if dtype.is_complex else dtype


def default_tolerance(dtype: torch.dtype) -> Tolerance:
    """The tolerance used for tensors of `dtype` unless rtol/atol are given (no float64 reference).

    Integer and bool tensors must match exactly; complex ones use their real dtype's.
    """
    dtype = _real_dtype(dtype)
    if not dtype.is_floating_point:
        return _EXACT
    return _DEFAULT_TOLERANCES.get(dtype, _DEFAULT_TOLERANCES[torch.float32])


def fp64_floor(dtype: torch.dtype) -> Tolerance:
    """The floor added to FP64_MULTIPLIER x the reference's own error, for tensors of `dtype`."""
    dtype = _real_dtype(dtype)
    if not dtype.is_floating_point:
        return _EXACT
    return _FP64_FLOORS.get(dtype, _FP64_FLOORS[torch.float32])


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class TensorComparison:
    """One tensor (or one structural property) compared between reference and candidate.

    Without a float64 reference, `max_abs_diff` is max|reference - candidate|. With one,
    it is max|reference64 - candidate| and `reference_abs_diff` is the reference model's
    own max|reference64 - reference|; `scale` is then max|reference64|.
    `problem` is set when the two could not be compared numerically (missing tensor,
    shape or dtype mismatch, different keys); the comparison then fails.
    """

    name: str
    max_abs_diff: float = 0.0
    scale: float = 0.0  # max |reference| (|reference64| with a float64 reference), finite elements only
    rtol: float = 0.0
    atol: float = 0.0
    passed: bool = True
    problem: Optional[str] = None
    reference_abs_diff: Optional[float] = None  # the reference's own error against float64
    multiplier: float = 0.0

    @property
    def tolerance(self) -> float:
        """The absolute difference allowed: atol + rtol * scale (+ multiplier * the reference's own error)."""
        own = self.multiplier * self.reference_abs_diff if self.reference_abs_diff is not None else 0.0
        return own + self.atol + self.rtol * self.scale

    @property
    def rel_diff(self) -> float:
        """The worst difference relative to the reference tensor's scale."""
        if self.problem is not None:
            return math.nan
        return _relative(self.max_abs_diff, self.scale)

    @property
    def reference_rel_diff(self) -> Optional[float]:
        """The reference's own error against float64, relative to the scale (None without one)."""
        if self.reference_abs_diff is None or self.problem is not None:
            return None
        return _relative(self.reference_abs_diff, self.scale)

    @property
    def severity(self) -> float:
        """How far over its tolerance this comparison is; > 1 fails (inf: not comparable)."""
        if self.problem is not None or math.isnan(self.max_abs_diff):
            return math.inf
        if self.max_abs_diff == 0:
            return 0.0
        return self.max_abs_diff / self.tolerance if self.tolerance > 0 else math.inf

    def describe(self) -> str:
        """The size of the difference, in words."""
        if self.problem is not None:
            return self.problem
        if self.reference_abs_diff is None:
            return (
                f"max abs diff {self.max_abs_diff:.1e} (tolerance {self.rtol:.1e} relative to "
                f"scale {self.scale:.1e}, atol {self.atol:.1e})"
            )
        return (
            f"max abs diff {self.max_abs_diff:.1e} from the float64 reference, where the reference's own is "
            f"{self.reference_abs_diff:.1e} (allowed {self.multiplier:g} x {self.reference_abs_diff:.1e} "
            f"+ {self.rtol:.1e} x scale {self.scale:.1e} + atol {self.atol:.1e} = {self.tolerance:.1e})"
        )


def _relative(diff: float, scale: float) -> float:
    if diff == 0:
        return 0.0
    return diff / scale if scale > 0 else math.inf


@dataclass(frozen=True)
class Check:
    """One kind of tensor compared at one point of the run, e.g. the parameter
    gradients of step 1. Passes when every tensor in it does.

    `step` counts training steps from 1; it is None for the eval and structure phases.
    """

    phase: str  # "train", "eval" or "structure"
    step: Optional[int]
    kind: str  # param, output, input_grad, param_grad, buffer, eval_output, state_dict_keys, param_order
    comparisons: tuple[TensorComparison, ...]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.comparisons)

    @property
    def failures(self) -> list[TensorComparison]:
        return [c for c in self.comparisons if not c.passed]

    @property
    def worst(self) -> TensorComparison:
        """The comparison furthest over (or closest to) its tolerance."""
        return max(self.comparisons, key=lambda c: (not c.passed, c.severity))

    # The worst comparison's figures, so a Check reads like a row of the report.
    @property
    def name(self) -> str:
        return self.worst.name

    @property
    def max_abs_diff(self) -> float:
        return self.worst.max_abs_diff

    @property
    def rel_diff(self) -> float:
        return self.worst.rel_diff

    @property
    def tolerance(self) -> float:
        return self.worst.tolerance

    @property
    def where(self) -> str:
        """'at step 2' or 'in eval mode', for messages ('' for structure checks)."""
        if self.phase == "train":
            return f"at step {self.step}"
        return "in eval mode" if self.phase == "eval" else ""

    @property
    def label(self) -> str:
        """Short phase label for tables: 'step 1', 'eval', 'structure'."""
        return f"step {self.step}" if self.phase == "train" else self.phase

    def failure_message(self) -> str:
        """'<kind> '<name>' differs <where>: <size of the difference>' for the first failing tensor."""
        first = self.failures[0]
        if self.phase == "structure":
            return f"{self.kind}: {first.describe()}"
        message = f"{self.kind} '{first.name}' differs {self.where}: {first.describe()}"
        if len(self.failures) > 1:
            message += f" [{len(self.failures)} of {len(self.comparisons)} {self.kind} tensors differ"
            worst = self.worst
            if worst is not first:
                message += f"; worst '{worst.name}': {worst.describe()}"
            message += "]"
        return message


# --------------------------------------------------------------------------- tensor comparison


def compare_tensors(
    name: str,
    reference: Any,
    candidate: Any,
    rtol: Optional[float] = None,
    atol: Optional[float] = None,
    *,
    reference64: Any = None,
) -> TensorComparison:
    """Compare two values (normally tensors).

    Without `reference64`: under the tolerance for the reference's dtype
    (`default_tolerance`). With `reference64` (the same value from a float64 copy of the
    reference): the candidate passes when ``max|reference64 - candidate| <=
    FP64_MULTIPLIER * max|reference64 - reference| + atol + rtol * max|reference64|``,
    with rtol/atol defaulting to `fp64_floor` of the candidate's dtype. Integer and bool
    tensors must match exactly either way.

    A NaN anywhere fails (the comparison would mean nothing); infinities must sit at the
    same places. Non-tensor values must be equal.
    """
    problem = _structure_problem(reference, candidate)
    if problem is None and reference64 is not None:
        problem = _structure_problem(reference64, reference, "float64 reference", "reference")
    if problem is not None:
        return TensorComparison(name, passed=False, problem=problem)
    if not isinstance(reference, Tensor):
        return TensorComparison(name)

    exact = not (reference.is_floating_point() or reference.is_complex())
    default = (default_tolerance if reference64 is None else fp64_floor)(reference.dtype)
    rtol = 0.0 if exact else default.rtol if rtol is None else rtol
    atol = 0.0 if exact else default.atol if atol is None else atol
    truth = _as_float64(reference if reference64 is None else reference64)
    max_abs_diff, scale = _max_abs_diff_and_scale(truth, _as_float64(candidate.to(truth.device)))
    own = multiplier = None
    if reference64 is not None:
        own, _ = _max_abs_diff_and_scale(truth, _as_float64(reference.to(truth.device)))
        multiplier = 0.0 if exact else FP64_MULTIPLIER
    for diff, side in ((max_abs_diff, "candidate"), (own, "reference")):
        if diff is not None and math.isnan(diff):
            if truth.isnan().any():
                side = "reference" if reference64 is None else "float64 reference"
            return TensorComparison(name, passed=False, problem=f"NaN in {side}")
    comparison = TensorComparison(name, max_abs_diff, scale, rtol, atol, True, None, own, multiplier or 0.0)
    if max_abs_diff > comparison.tolerance:
        comparison = dataclasses.replace(comparison, passed=False)
    return comparison


def _structure_problem(
    reference: Any, candidate: Any, reference_label: str = "reference", candidate_label: str = "candidate"
) -> Optional[str]:
    """Why two values cannot be compared numerically (None when they can, or are equal non-tensors)."""
    if reference is None or candidate is None:
        if reference is None and candidate is None:
            return None
        return f"missing (None) in {reference_label if reference is None else candidate_label}"
    if not isinstance(reference, Tensor) or not isinstance(candidate, Tensor):
        if isinstance(reference, Tensor) != isinstance(candidate, Tensor) or reference != candidate:
            return f"{reference!r} vs {candidate!r}"
        return None
    if reference.shape != candidate.shape:
        return f"shape {tuple(reference.shape)} vs {tuple(candidate.shape)}"
    if reference.is_floating_point() != candidate.is_floating_point() or (
        candidate_label == "candidate" and reference.dtype != candidate.dtype
    ):
        return f"dtype {reference.dtype} vs {candidate.dtype}"
    return None


def _max_abs_diff_and_scale(ref: Tensor, cand: Tensor) -> tuple[float, float]:
    """max|ref - cand| (NaN if either has a NaN) and max|ref| over finite elements.

    Infinities count as equal where both sides have the same one.
    """
    if ref.numel() == 0:
        return 0.0, 0.0
    diff = (ref - cand).abs()
    max_abs_diff, scale = torch.stack([diff.max(), ref.abs().max()]).tolist()  # one sync
    if math.isfinite(max_abs_diff) and math.isfinite(scale):
        return max_abs_diff, scale
    if ref.isnan().any() or cand.isnan().any():
        return math.nan, math.nan
    diff = torch.where(ref == cand, torch.zeros_like(diff), diff.nan_to_num(nan=math.inf))  # inf - inf
    finite = ref[ref.isfinite()]
    return diff.max().item(), finite.abs().max().item() if finite.numel() else 0.0


def _as_float64(t: Tensor) -> Tensor:
    t = t.detach()
    if t.is_sparse:
        t = t.to_dense()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    return t.to(torch.float64)


# --------------------------------------------------------------------------- nested values


def flatten_named(value: Any, prefix: str) -> list[tuple[str, Any]]:
    """Leaves of any nesting of tuples/lists/dicts/namedtuples, named like
    ``output[0]['logits'].aux``. A bare leaf is named `prefix`."""
    if _is_namedtuple(value):
        return [item for field in value._fields for item in flatten_named(getattr(value, field), f"{prefix}.{field}")]
    if isinstance(value, (tuple, list)):
        return [item for i, v in enumerate(value) for item in flatten_named(v, f"{prefix}[{i}]")]
    if isinstance(value, dict):
        return [item for k, v in value.items() for item in flatten_named(v, f"{prefix}[{k!r}]")]
    return [(prefix, value)]


def map_tensors(fn, value: Any) -> Any:
    """`value` with `fn` applied to every tensor in its tuples/lists/dicts/namedtuples."""
    if isinstance(value, Tensor):
        return fn(value)
    if _is_namedtuple(value):
        return type(value)(*(map_tensors(fn, v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(fn, v) for v in value)
    if isinstance(value, dict):
        return type(value)((k, map_tensors(fn, v)) for k, v in value.items())
    return value


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


# --------------------------------------------------------------------------- preparing copies


def validate_options(steps: int, dtype: Optional[torch.dtype], rtol: Optional[float], atol: Optional[float]) -> None:
    """Raise ConfigurationError for arguments that verify/assert_equivalent cannot use."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigurationError(f"steps must be a non-negative int, got {steps!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ConfigurationError(f"dtype must be a floating torch.dtype such as torch.float64, got {dtype!r}")
    for label, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0):
            raise ConfigurationError(f"{label} must be a non-negative number, got {value!r}")


def copy_model(model: nn.Module, dtype: Optional[torch.dtype] = None) -> nn.Module:
    """A deep copy of `model`, its floating parameters and buffers cast to `dtype` if given."""
    if not isinstance(model, nn.Module):
        raise ConfigurationError(f"expected an nn.Module, got {type(model).__name__}")
    clone = copy.deepcopy(model)
    return clone.to(dtype) if dtype is not None else clone


def float64_copy(model: nn.Module) -> nn.Module:
    """A float64 deep copy of `model`, the reference of the float64-reference comparison."""
    if not isinstance(model, nn.Module):
        raise ConfigurationError(f"expected an nn.Module, got {type(model).__name__}")
    try:
        return copy.deepcopy(model).to(torch.float64)
    except Exception as exc:  # noqa: BLE001 - re-raised with the fix
        raise ConfigurationError(
            f"cannot copy {type(model).__name__} to float64 for the reference ({type(exc).__name__}: "
            f"{_first_line(exc)}); pass fp64_reference=False to compare at the models' own dtype"
        ) from exc


def needs_float64_reference(model: nn.Module, inputs: Sequence[Any]) -> bool:
    """Whether `model` computes in a floating dtype less precise than float64 (so a float64 reference helps)."""
    tensors = [*model.parameters(), *model.buffers(), *(t for _, t in flatten_named(tuple(inputs), ""))]
    return any(
        isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex()) and _real_dtype(t.dtype) != torch.float64
        for t in tensors
    )


def cast_inputs(inputs: Sequence[Any], dtype: Optional[torch.dtype] = None) -> tuple[Any, ...]:
    """`inputs` with floating tensors cast to `dtype` (all other values unchanged)."""
    if dtype is None:
        return tuple(inputs)
    return tuple(map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, inputs))


# --------------------------------------------------------------------------- running the models


@dataclass
class _StepRecord:
    """What one model did in one training step (detached copies)."""

    params: list[tuple[str, Tensor]]  # going into the step
    outputs: list[tuple[str, Any]]
    input_grads: list[tuple[str, Optional[Tensor]]]
    param_grads: list[tuple[str, Optional[Tensor]]]
    buffers: list[tuple[str, Tensor]]  # after forward and backward


def _fresh_inputs(inputs: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(leaves, args): clones of the inputs for one forward, floating ones requiring grad.

    The forward gets `args`, non-leaf copies of the leaves, so that a model may modify
    its inputs in place as it could outside the check; the gradients land on `leaves`.
    """
    leaves = map_tensors(lambda t: t.detach().clone().requires_grad_(t.is_floating_point()), inputs)
    args = map_tensors(lambda t: t.clone() if t.requires_grad else t, leaves)
    return leaves, args


@contextlib.contextmanager
def _seeded_rng(seed: int, cuda_devices: list[int]) -> Iterator[None]:
    """Same RNG state for both models' forwards (dropout); the caller's state is restored."""
    with torch.random.fork_rng(devices=cuda_devices):
        torch.manual_seed(seed)
        yield


def _cuda_devices(models: Sequence[nn.Module], inputs: tuple[Any, ...]) -> list[int]:
    tensors = [t for m in models for t in (*m.parameters(), *m.buffers())]
    tensors += [t for _, t in flatten_named(inputs, "") if isinstance(t, Tensor)]
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})


def _projection_loss(outputs: list[tuple[str, Any]]) -> Optional[Tensor]:
    """sum(out * w) over the floating outputs, with w fixed random tensors.

    Weights are drawn for every floating output, in order, from a private generator, so
    both models get the same weights as long as their outputs have the same structure.
    """
    generator = torch.Generator().manual_seed(_PROJECTION_SEED)
    terms = []
    for _, out in outputs:
        if not (isinstance(out, Tensor) and out.is_floating_point()):
            continue
        weight = torch.randn(out.shape, generator=generator).to(device=out.device, dtype=out.dtype)
        if out.requires_grad:
            terms.append((out * weight).sum())
    return sum(terms) if terms else None


def _named_clones(named: Iterator[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    return [(name, t.detach().clone()) for name, t in named]


def _detach(value: Any) -> Any:
    return value.detach() if isinstance(value, Tensor) else value


def _forward_backward(model: nn.Module, inputs: tuple[Any, ...], seed: int, cuda_devices: list[int]) -> _StepRecord:
    """Forward and projected backward; returns what to compare."""
    params = _named_clones(model.named_parameters())
    leaves, args = _fresh_inputs(inputs)
    model.zero_grad(set_to_none=True)
    # Backward under the same seeded state: a checkpoint with preserve_rng_state=False draws its
    # recompute's dropout masks there.
    with torch.enable_grad(), _seeded_rng(seed, cuda_devices):
        outputs = flatten_named(model(*args), "output")
        loss = _projection_loss(outputs)
        if loss is not None:
            loss.backward()
    return _StepRecord(
        params=params,
        outputs=[(name, _detach(out)) for name, out in outputs],
        input_grads=[
            (name, _detach(leaf.grad))
            for name, leaf in flatten_named(leaves, "input")
            if isinstance(leaf, Tensor) and leaf.requires_grad
        ],
        param_grads=[(name, _detach(p.grad)) for name, p in model.named_parameters()],
        buffers=_named_clones(model.named_buffers()),
    )


def _sgd_lr(model: nn.Module) -> float:
    """The learning rate whose SGD step changes no element of `model`'s parameters by more than MAX_UPDATE."""
    grads = [_as_float64(p.grad).abs().max() for p in model.parameters() if p.grad is not None and p.grad.numel()]
    largest = torch.stack([g.cpu() for g in grads]).max().item() if grads else 0.0
    return MAX_UPDATE / largest if math.isfinite(largest) and largest > 0 else FALLBACK_LR


def _eval_outputs(
    model: nn.Module, inputs: tuple[Any, ...], seed: int, cuda_devices: list[int]
) -> list[tuple[str, Any]]:
    """The outputs in whatever mode `model` is in (eval), without autograd."""
    args = map_tensors(lambda t: t.detach().clone(), inputs)
    with torch.no_grad(), _seeded_rng(seed, cuda_devices):
        return [(name, _detach(out)) for name, out in flatten_named(model(*args), "output")]


# --------------------------------------------------------------------------- the engine


class _Comparer:
    """Builds Checks from named tensor lists, with the caller's rtol/atol overrides."""

    def __init__(self, rtol: Optional[float], atol: Optional[float]) -> None:
        self.rtol = rtol
        self.atol = atol
        self.checks: list[Check] = []

    def tensors(
        self,
        phase: str,
        step: Optional[int],
        kind: str,
        reference: list[tuple[str, Any]],
        candidate: list[tuple[str, Any]],
        reference64: Optional[list[tuple[str, Any]]] = None,
    ) -> None:
        """Compare by name; names present on one side only fail. Adds nothing if both are empty.

        `reference64` comes from a float64 copy of the reference (same names).
        """
        ref, cand = dict(reference), dict(candidate)
        ref64 = dict(reference64) if reference64 is not None else None
        names = list(ref) + [name for name in cand if name not in ref]
        comparisons = []
        for name in names:
            if name not in cand or name not in ref:
                side = "candidate" if name not in cand else "reference"
                comparisons.append(TensorComparison(name, passed=False, problem=f"missing in {side}"))
            else:
                truth = ref64.get(name) if ref64 is not None else None
                comparisons.append(
                    compare_tensors(name, ref[name], cand[name], self.rtol, self.atol, reference64=truth)
                )
        if comparisons:
            self.checks.append(Check(phase, step, kind, tuple(comparisons)))

    def structure(self, kind: str, name: str, problem: Optional[str]) -> None:
        comparison = TensorComparison(name, passed=problem is None, problem=problem)
        self.checks.append(Check("structure", None, kind, (comparison,)))


def compare_models(
    reference: nn.Module,
    candidate: nn.Module,
    inputs: Sequence[Any],
    *,
    steps: int = 2,
    rtol: Optional[float] = None,
    atol: Optional[float] = None,
    train: bool = True,
    eval: bool = True,
    seed: int = 0,
    reference64: Optional[nn.Module] = None,
) -> list[Check]:
    """Run `reference` and `candidate` side by side and compare them (see the module doc).

    All models are changed IN PLACE (trained for `steps` plain SGD steps, see
    MAX_UPDATE, then put in eval mode if `eval`): pass copies. `inputs` are the
    positional arguments of each forward; every forward gets fresh clones of them.

    `reference64`, a float64 copy of `reference` (`float64_copy`), makes it the
    float64-reference comparison: it runs in lockstep on float64 copies of the inputs,
    and each candidate tensor is held to FP64_MULTIPLIER times the reference's own error
    against it, plus a floor (rtol/atol, by default `fp64_floor`). Without it, rtol/atol
    override the per-dtype defaults (`default_tolerance`). Returns every Check, in the
    order they were made; the run does not stop at the first failure.
    """
    validate_options(steps, None, rtol, atol)
    inputs = tuple(inputs)
    runs = [reference, candidate] if reference64 is None else [reference, candidate, reference64]
    run_inputs = [inputs, inputs, cast_inputs(inputs, torch.float64)][: len(runs)]
    cuda_devices = _cuda_devices(runs, inputs)
    compare = _Comparer(rtol, atol)
    # Structure first: a missing parameter is the root cause of the failures that follow.
    compare.structure("state_dict_keys", "state_dict()", _state_dict_keys_problem(reference, candidate))
    compare.structure("param_order", "named_parameters()", _param_order_problem(reference, candidate))

    if train:
        for model in runs:
            model.train()
        for step in range(1, steps + 1):
            records = [_forward_backward(m, x, seed + step, cuda_devices) for m, x in zip(runs[:2], run_inputs)]
            if reference64 is not None:
                with _float64_reference_errors():
                    records.append(_forward_backward(reference64, run_inputs[2], seed + step, cuda_devices))
            for kind, field_name in _STEP_KINDS:
                compare.tensors("train", step, kind, *(getattr(r, field_name) for r in records))
            # The same learning rate for all, from the most accurate gradients; each model then
            # steps with its own gradients, as it would in training.
            lr = _sgd_lr(runs[-1] if reference64 is not None else reference)
            for model in runs:
                torch.optim.SGD(model.parameters(), lr=lr).step()

    if eval:
        for model in runs:
            model.eval()
        compare.tensors("eval", None, "param", *(_named_clones(m.named_parameters()) for m in runs))
        compare.tensors("eval", None, "buffer", *(_named_clones(m.named_buffers()) for m in runs))
        with _float64_reference_errors():
            outputs = [_eval_outputs(m, x, seed, cuda_devices) for m, x in zip(runs, run_inputs)]
        compare.tensors("eval", None, "eval_output", *outputs)

    return compare.checks


@contextlib.contextmanager
def _float64_reference_errors() -> Iterator[None]:
    """A model that runs at its own dtype but not in float64 is a configuration problem, said as such."""
    try:
        yield
    except FxFuseError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with the fix
        raise ConfigurationError(
            f"the float64 copy of the reference could not run ({type(exc).__name__}: {_first_line(exc)}); "
            "pass fp64_reference=False to compare at the models' own dtype with fixed tolerances"
        ) from exc


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


_STEP_KINDS = (
    ("param", "params"),
    ("output", "outputs"),
    ("input_grad", "input_grads"),
    ("param_grad", "param_grads"),
    ("buffer", "buffers"),
)


def _state_dict_keys_problem(reference: nn.Module, candidate: nn.Module) -> Optional[str]:
    ref_keys, cand_keys = list(reference.state_dict()), list(candidate.state_dict())
    ref_set, cand_set = set(ref_keys), set(cand_keys)
    missing = [k for k in ref_keys if k not in cand_set]
    unexpected = [k for k in cand_keys if k not in ref_set]
    if not missing and not unexpected:
        return None
    parts = []
    if missing:
        parts.append(f"missing in candidate: {_short_list(missing)}")
    if unexpected:
        parts.append(f"unexpected in candidate: {_short_list(unexpected)}")
    return "state_dict keys differ: " + "; ".join(parts)


def _param_order_problem(reference: nn.Module, candidate: nn.Module) -> Optional[str]:
    """Optimizer state dicts refer to parameters by position, so the order matters."""
    ref_names = [name for name, _ in reference.named_parameters()]
    cand_names = [name for name, _ in candidate.named_parameters()]
    if ref_names == cand_names:
        return None
    for i, (r, c) in enumerate(zip(ref_names, cand_names)):
        if r != c:
            return f"parameter order differs at position {i}: {r!r} in reference, {c!r} in candidate"
    return f"parameter order differs: {len(ref_names)} parameters in reference, {len(cand_names)} in candidate"


def _short_list(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def failure_summary(checks: Sequence[Check], limit: int = 5) -> str:
    """The first failing check's message, then one line for each further failing check."""
    failing = [c for c in checks if not c.passed]
    if not failing:
        return "all checks passed"
    lines = [failing[0].failure_message()]
    if len(failing) > 1:
        lines.append(f"{len(failing) - 1} more failing check(s):")
        lines += [f"  {c.failure_message()}" for c in failing[1 : limit + 1]]
        if len(failing) > limit + 1:
            lines.append(f"  ... and {len(failing) - limit - 1} more")
    return "\n".join(lines)


# --------------------------------------------------------------------------- pytest helper


# BatchNorm over this few values per channel (N×H×W) makes training ill-conditioned: rounding grows from
# one step to the next, eager's own too. DenseNet-121 at 2×3×32×32 ends in BatchNorms over 2 values:
# there eager in NCHW and eager in channels_last, both float64, differed by 6e-8 of the gradients'
# scale after one step and 3e-4 after two (fxfuse's memory mode against eager: 5e-15, then 5e-8).
FEW_VALUES = 16
# Differences this small, relative to their tensor's scale, are what such rounding grows to; a wrong term
# or a missed update is off by 1e-3 or more (docs/verify.md).
SMALL_DIFF = 1e-4
_FEW_VALUES_HINT = (
    "hint: at these inputs {where} normalizes over {count} values per channel (N×H×W). BatchNorm over "
    "so few values amplifies rounding from one step to the next, eager's own included, so these small "
    "differences may be the model's conditioning, not the rewrite: check again with a larger input or "
    "batch."
)


def few_values_hint(norms: Sequence[tuple[str, int]]) -> str:
    """The hint a failure report ends with when `norms` (few_value_norms) is not empty, in 100 columns."""
    name, count = min(norms, key=lambda nc: nc[1])
    where = f"{name} (and {len(norms) - 1} more)" if len(norms) > 1 else name
    return textwrap.fill(_FEW_VALUES_HINT.format(where=where, count=count), 100)


def small_failures_only(checks: Sequence[Check]) -> bool:
    """Whether the failed checks are all numeric and small (below SMALL_DIFF of their tensor's scale): what
    an ill-conditioned model's rounding could explain. A structural failure or a large difference is not."""
    failures = [c for check in checks for c in check.failures]
    return bool(failures) and all(c.problem is None and c.rel_diff < SMALL_DIFF for c in failures)


def norms_behind(checks: Sequence[Check], model: nn.Module, inputs: Sequence[Any]) -> list[tuple[str, int]]:
    """few_value_norms(model, inputs) where it could explain `checks`' failures: they are all small and
    numeric (small_failures_only) and training steps ran; else nothing (and the model does not run)."""
    trained = any(check.phase == "train" for check in checks)
    return few_value_norms(model, inputs) if trained and small_failures_only(checks) else []


def few_value_norms(model: nn.Module, inputs: Sequence[Any]) -> list[tuple[str, int]]:
    """The BatchNorm layers of `model` that normalize over at most FEW_VALUES values per channel in a
    training forward on `inputs`, with that count. The forward runs on copies (of the model and of the
    inputs) without grad and with the caller's RNG state restored after: neither `model`, `inputs` nor
    the RNG change. Empty where that forward fails."""
    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return []
    counts: dict[str, int] = {}
    try:
        probe = copy.deepcopy(model).train()
        for name, module in probe.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):

                def count(module, args, name=name):
                    x = args[0] if args and isinstance(args[0], Tensor) else None
                    if x is not None and x.dim() >= 2 and x.shape[1] > 0:
                        counts[name] = min(counts.get(name, x.numel()), x.numel() // x.shape[1])

                module.register_forward_pre_hook(count)
        args = map_tensors(lambda t: t.detach().clone(), tuple(inputs))
        with torch.no_grad(), _seeded_rng(0, _cuda_devices([probe], args)):
            probe(*args)
    except Exception:  # a hint is not worth a crash: the report stands without it
        return []
    return [(name, n) for name, n in counts.items() if n <= FEW_VALUES]


def assert_equivalent(
    reference: nn.Module,
    candidate: nn.Module,
    *inputs: Any,
    steps: int = 2,
    dtype: Optional[torch.dtype] = None,
    rtol: Optional[float] = None,
    atol: Optional[float] = None,
    train: bool = True,
    eval: bool = True,
    fp64_reference: bool = True,
) -> None:
    """Assert that `candidate` trains and evaluates like `reference` on `inputs`.

    The way to put fxfuse's equivalence check in your own pytest suite, for any two
    models (e.g. your model and a hand-fused or fxfuse-optimized copy of it)::

        import copy, torch, fxfuse
        from fxfuse.testing import assert_equivalent

        def test_fxfuse_keeps_my_model_exact():
            model, x = MyModel(), torch.randn(4, 3, 64, 64)
            optimized = fxfuse.optimize(copy.deepcopy(model), (x,))
            assert_equivalent(model, optimized, x)

    Both models are deep-copied (neither is changed) and, if `dtype` is given, cast to
    it along with the floating inputs. The state_dict keys and the named_parameters()
    order are always compared. With `train`, both run `steps` plain SGD steps (the
    same learning rate for both) from the same RNG state, comparing at each step the
    parameters, outputs, input gradients, parameter gradients (by name) and buffers.
    With `eval`, the trained state and the eval-mode outputs are compared.

    With `fp64_reference` (the default) and models below float64, a float64 copy of
    `reference` runs alongside as the truth, and each candidate tensor may be off from
    it by at most FP64_MULTIPLIER times `reference`'s own error, plus a floor (rtol/atol,
    default `fp64_floor`). Otherwise tensors match when
    ``max|ref - cand| <= atol + rtol * max|ref|`` (rtol/atol default by dtype, see
    `default_tolerance`). docs/verify.md has the details.

    Raises:
        AssertionError: naming the first differing tensor and the size of the
            difference, e.g. ``param_grad 'layer1.0.bn1.weight' differs at step 1:
            max abs diff 3.2e-02 from the float64 reference, where the reference's own is ...``.
        ConfigurationError: for invalid arguments, or a reference that cannot run in
            float64 (pass ``fp64_reference=False``).
    """
    validate_options(steps, dtype, rtol, atol)
    reference = copy_model(reference, dtype)
    inputs = cast_inputs(inputs, dtype)
    checks = compare_models(
        reference,
        copy_model(candidate, dtype),
        inputs,
        steps=steps,
        rtol=rtol,
        atol=atol,
        train=train,
        eval=eval,
        reference64=float64_copy(reference) if fp64_reference and needs_float64_reference(reference, inputs) else None,
    )
    if not all(c.passed for c in checks):
        norms = norms_behind(checks, reference, inputs)
        raise AssertionError(failure_summary(checks) + (f"\n{few_values_hint(norms)}" if norms else ""))
