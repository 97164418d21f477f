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

The backward is taken of a fixed random projection of the outputs, not of their sum:
``out.sum()`` sends the same gradient to every element, and gradient terms that
cancel for a constant upstream gradient (batch norm's mean-subtraction terms, say)
would then go unchecked.
"""
from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from .errors import ConfigurationError

__all__ = [
    "Check",
    "TensorComparison",
    "Tolerance",
    "assert_equivalent",
    "compare_models",
    "compare_tensors",
    "default_tolerance",
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


def default_tolerance(dtype: torch.dtype) -> Tolerance:
    """The tolerance used for tensors of `dtype` unless rtol/atol are given.

    Integer and bool tensors must match exactly; complex ones use their real dtype's.
    """
    if dtype.is_complex:
        dtype = dtype.to_real()
    if not dtype.is_floating_point:
        return _EXACT
    return _DEFAULT_TOLERANCES.get(dtype, _DEFAULT_TOLERANCES[torch.float32])


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class TensorComparison:
    """One tensor (or one structural property) compared between reference and candidate.

    `problem` is set when the two could not be compared numerically (missing tensor,
    shape or dtype mismatch, different keys); the comparison then fails.
    """

    name: str
    max_abs_diff: float = 0.0
    scale: float = 0.0  # max |reference|, finite elements only
    rtol: float = 0.0
    atol: float = 0.0
    passed: bool = True
    problem: Optional[str] = None

    @property
    def tolerance(self) -> float:
        """The absolute difference allowed for this tensor: atol + rtol * scale."""
        return self.atol + self.rtol * self.scale

    @property
    def rel_diff(self) -> float:
        """The worst difference relative to the reference tensor's scale."""
        if self.problem is not None:
            return math.nan
        if self.max_abs_diff == 0:
            return 0.0
        return self.max_abs_diff / self.scale if self.scale > 0 else math.inf

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
        return (
            f"max abs diff {self.max_abs_diff:.1e} (tolerance {self.rtol:.1e} relative to "
            f"scale {self.scale:.1e}, atol {self.atol:.1e})"
        )


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
    name: str, reference: Any, candidate: Any, rtol: Optional[float] = None, atol: Optional[float] = None
) -> TensorComparison:
    """Compare two values (normally tensors) under the tolerance for the reference's dtype.

    A NaN anywhere fails (the comparison would mean nothing); infinities must sit at the
    same places in both. Non-tensor values must be equal.
    """
    if reference is None or candidate is None:
        if reference is None and candidate is None:
            return TensorComparison(name)
        missing = "reference" if reference is None else "candidate"
        return TensorComparison(name, passed=False, problem=f"missing (None) in {missing}")
    if not isinstance(reference, Tensor) or not isinstance(candidate, Tensor):
        if isinstance(reference, Tensor) != isinstance(candidate, Tensor) or reference != candidate:
            return TensorComparison(name, passed=False, problem=f"{reference!r} vs {candidate!r}")
        return TensorComparison(name)
    if reference.shape != candidate.shape:
        return TensorComparison(
            name, passed=False, problem=f"shape {tuple(reference.shape)} vs {tuple(candidate.shape)}"
        )
    if reference.dtype != candidate.dtype:
        return TensorComparison(name, passed=False, problem=f"dtype {reference.dtype} vs {candidate.dtype}")

    default = default_tolerance(reference.dtype)
    rtol = default.rtol if rtol is None else rtol
    atol = default.atol if atol is None else atol
    if not (reference.is_floating_point() or reference.is_complex()):
        rtol = atol = 0.0
    ref, cand = _as_float64(reference), _as_float64(candidate.to(reference.device))
    max_abs_diff, scale = _max_abs_diff_and_scale(ref, cand)
    if math.isnan(max_abs_diff):
        side = "reference" if ref.isnan().any() else "candidate"
        return TensorComparison(name, passed=False, problem=f"NaN in {side}")
    passed = max_abs_diff <= atol + rtol * scale
    return TensorComparison(name, max_abs_diff, scale, rtol, atol, passed)


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


def validate_options(
    steps: int, dtype: Optional[torch.dtype], rtol: Optional[float], atol: Optional[float]
) -> None:
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


def _forward_backward(
    model: nn.Module, inputs: tuple[Any, ...], seed: int, cuda_devices: list[int]
) -> _StepRecord:
    """Forward and projected backward; returns what to compare."""
    params = _named_clones(model.named_parameters())
    leaves, args = _fresh_inputs(inputs)
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        with _seeded_rng(seed, cuda_devices):
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
    """Builds Checks from pairs of named tensor lists, with the caller's rtol/atol overrides."""

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
    ) -> None:
        """Compare by name; names present on one side only fail. Adds nothing if both are empty."""
        ref, cand = dict(reference), dict(candidate)
        names = list(ref) + [name for name in cand if name not in ref]
        comparisons = []
        for name in names:
            if name not in cand or name not in ref:
                side = "candidate" if name not in cand else "reference"
                comparisons.append(TensorComparison(name, passed=False, problem=f"missing in {side}"))
            else:
                comparisons.append(compare_tensors(name, ref[name], cand[name], self.rtol, self.atol))
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
) -> list[Check]:
    """Run `reference` and `candidate` side by side and compare them (see the module doc).

    Both models are changed IN PLACE (trained for `steps` plain SGD steps, see
    MAX_UPDATE, then put in eval mode if `eval`): pass copies. `inputs` are the
    positional arguments of each forward; every forward gets fresh clones of them.
    rtol/atol override the per-dtype defaults (`default_tolerance`). Returns every
    Check, in the order they were made; the run does not stop at the first failure.
    """
    validate_options(steps, None, rtol, atol)
    inputs = tuple(inputs)
    cuda_devices = _cuda_devices((reference, candidate), inputs)
    compare = _Comparer(rtol, atol)
    # Structure first: a missing parameter is the root cause of the failures that follow.
    compare.structure("state_dict_keys", "state_dict()", _state_dict_keys_problem(reference, candidate))
    compare.structure("param_order", "named_parameters()", _param_order_problem(reference, candidate))

    if train:
        reference.train()
        candidate.train()
        for step in range(1, steps + 1):
            ref, cand = (_forward_backward(m, inputs, seed + step, cuda_devices) for m in (reference, candidate))
            compare.tensors("train", step, "param", ref.params, cand.params)
            compare.tensors("train", step, "output", ref.outputs, cand.outputs)
            compare.tensors("train", step, "input_grad", ref.input_grads, cand.input_grads)
            compare.tensors("train", step, "param_grad", ref.param_grads, cand.param_grads)
            compare.tensors("train", step, "buffer", ref.buffers, cand.buffers)
            lr = _sgd_lr(reference)  # the same step for both
            for model in (reference, candidate):
                torch.optim.SGD(model.parameters(), lr=lr).step()

    if eval:
        reference.eval()
        candidate.eval()
        compare.tensors("eval", None, "param", *(_named_clones(m.named_parameters()) for m in (reference, candidate)))
        compare.tensors("eval", None, "buffer", *(_named_clones(m.named_buffers()) for m in (reference, candidate)))
        compare.tensors(
            "eval", None, "eval_output", *(_eval_outputs(m, inputs, seed, cuda_devices) for m in (reference, candidate))
        )

    return compare.checks


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
) -> None:
    """Assert that `candidate` trains and evaluates like `reference` on `inputs`.

    The way to put fxfuse's equivalence check in your own pytest suite, for any two
    models (e.g. your model and a hand-fused or fxfuse-optimized copy of it)::

        import copy, torch, fxfuse
        from fxfuse.testing import assert_equivalent

        def test_fxfuse_keeps_my_model_exact():
            model, x = MyModel(), torch.randn(4, 3, 64, 64)
            optimized = fxfuse.optimize(copy.deepcopy(model), (x,))
            assert_equivalent(model, optimized, x, dtype=torch.float64)

    Both models are deep-copied (neither is changed) and, if `dtype` is given, cast to
    it along with the floating inputs. The state_dict keys and the named_parameters()
    order are always compared. With `train`, both run `steps` plain SGD steps (the
    same learning rate for both) from the same RNG state, comparing at each step the
    parameters, outputs, input gradients, parameter gradients (by name) and buffers.
    With `eval`, the trained state and the eval-mode outputs are compared. Tensors
    match when ``max|ref - cand| <= atol + rtol * max|ref|``; rtol/atol default by
    dtype (see `default_tolerance`). docs/verify.md has the details.

    Raises:
        AssertionError: naming the first differing tensor and the size of the
            difference, e.g. ``param_grad 'layer1.0.bn1.weight' differs at step 1:
            max abs diff 3.2e-02 (tolerance 2.0e-04 relative to scale 1.1e+00, ...)``.
        ConfigurationError: for invalid arguments.
    """
    validate_options(steps, dtype, rtol, atol)
    checks = compare_models(
        copy_model(reference, dtype),
        copy_model(candidate, dtype),
        cast_inputs(inputs, dtype),
        steps=steps,
        rtol=rtol,
        atol=atol,
        train=train,
        eval=eval,
    )
    if not all(c.passed for c in checks):
        raise AssertionError(failure_summary(checks))
