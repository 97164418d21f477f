"""Memory of fxfuse's ops against eager's ATen composition of the same work, measured with the
CPU allocator (fxfuse.measure's profiler memory events): shared by tests/test_generic_path.py
(generic path <= eager) and benchmarks/generic_peaks.py (the README's table).

Per op family, a training call `out = op(...)` and `backward(out, dy)` on inputs that exist
before it:
  * forward peak: the most bytes the forward held at once (its output and saved tensors
    included);
  * saved: what the forward left for backward (retained bytes minus the output's);
  * backward peak: the most bytes held during backward above what existed before the
    forward (saved bytes and the output included), i.e. what the step needs on top of the
    inputs and parameters.
Primitive ops (bn_stats, bn_act, bn_act_backward and the in-place forms) are measured as one
call each against the ATen calls eager runs for that work.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import fxfuse.ops as fo
from fxfuse.measure.memory import _allocator_deltas
from fxfuse.ops.checks import apply_activation

CPU = torch.device("cpu")


@dataclasses.dataclass
class Usage:
    forward_peak: int
    saved: int
    backward_peak: int


def _peak(deltas: list[int]) -> tuple[int, int]:
    """(peak, final) of the running sum of allocator deltas."""
    held = peak = 0
    for d in deltas:
        held += d
        peak = max(peak, held)
    return peak, held


def measure_step(fn: Callable[[], torch.Tensor], leaves: list[torch.Tensor], dy: torch.Tensor) -> Usage:
    for t in leaves:
        t.grad = None
    keep: list[torch.Tensor] = []
    forward_peak, retained = _peak(_allocator_deltas(lambda: keep.append(fn()), CPU))
    out_bytes = keep[0].numel() * keep[0].element_size()
    backward_growth, _ = _peak(_allocator_deltas(lambda: torch.autograd.backward(keep[0], dy), CPU))
    keep.clear()
    for t in leaves:
        t.grad = None
    return Usage(forward_peak, retained - out_bytes, retained + backward_growth)


def _call(fn: Callable[[], object]) -> tuple[int, int]:
    """(peak, final) bytes held during one call, its results kept."""
    keep: list[object] = []
    return _peak(_allocator_deltas(lambda: keep.append(fn()), CPU))


def measure_call(fn: Callable[[], object]) -> int:
    """Peak bytes held during one call (its results included)."""
    return _call(fn)[0]


class EveryFamily(nn.Module):
    """A model with every op family fxfuse rewrites under mode="memory": conv_bn_act, bn_act_conv
    with an epilogue, conv_layer_norm_linear, act_linear_scale, conv_act, batch_norm_act,
    linear_act / act_linear (tests/test_generic_path.py, tests/test_cuda.py)."""

    def __init__(self, c=8):
        super().__init__()
        self.stem, self.bn0 = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.bn1, self.conv1, self.bn2 = nn.BatchNorm2d(c), nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.dw, self.ln = nn.Conv2d(c, c, 7, padding=3, groups=c), nn.LayerNorm(c)
        self.fc1, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.gamma = nn.Parameter(torch.full((c,), 0.5))
        self.conv3, self.bn3 = nn.Conv2d(c, c, 1), nn.BatchNorm2d(c)
        self.head1, self.head2 = nn.Linear(c, 16), nn.Linear(16, 4)

    def forward(self, x):
        x = F.relu(self.bn0(self.stem(x)))
        y = F.gelu(self.bn2(self.conv1(F.silu(self.bn1(x)))))
        h = self.fc2(F.gelu(self.fc1(self.ln(self.dw(y).permute(0, 2, 3, 1)))))
        y = y + (h * self.gamma).permute(0, 3, 1, 2)
        y = F.relu6(self.bn3(F.hardswish(self.conv3(y))))
        return self.head2(F.gelu(self.head1(y.mean((2, 3)))))


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_()


@dataclasses.dataclass
class StepCase:
    """One op family's training call: `fused()` (fxfuse's op) and `eager()` (eager's ops)."""

    name: str
    fused: Callable[[], torch.Tensor]
    eager: Callable[[], torch.Tensor]
    leaves: list[torch.Tensor]
    dy: torch.Tensor
    # The matmul fxfuse's backward runs again (linear_act recomputes its pre-activation) and
    # eager's backward does not; None where the backward recomputes none.
    recomputed_matmul: Callable[[], torch.Tensor] | None = None


def matmul_scratch(fn: Callable[[], torch.Tensor] | None) -> int:
    """Bytes ATen's matmul held beyond its result while computing it: zero where the matmul writes
    its result directly, a float32 accumulator of the result's shape for a bfloat16 matmul on CPUs
    without native bfloat16 arithmetic. A backward that recomputes the matmul needs it again, where
    eager needed it only in the forward."""
    if fn is None:
        return 0
    peak, held = _call(fn)
    return peak - held


def step_cases(
    dtype: torch.dtype = torch.float32, channels_last: bool = False, size: int = 16, device: torch.device = CPU
) -> list[StepCase]:
    """The op families at a ResNet/ConvNeXt-like shape scaled by `size` (the spatial extent), on
    `device` (tests/test_cuda.py runs them against eager on CUDA)."""
    g = torch.Generator().manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64).mul(scale).to(device, dtype)

    N, C = 4, 32
    x = _leaf(randn(N, C, size, size).contiguous(memory_format=fmt))
    w3 = _leaf(randn(C, C, 3, 3, scale=0.1))
    wdw = _leaf(randn(C, 1, 7, 7, scale=0.1))
    bn_w, bn_b = _leaf(randn(C).abs() + 0.5), _leaf(randn(C, scale=0.1))
    bn2_w, bn2_b = _leaf(randn(C).abs() + 0.5), _leaf(randn(C, scale=0.1))
    conv_b = _leaf(randn(C, scale=0.1))
    stats = [torch.zeros(C, dtype=dtype, device=device), torch.ones(C, dtype=dtype, device=device)]
    stats2 = [torch.zeros(C, dtype=dtype, device=device), torch.ones(C, dtype=dtype, device=device)]
    tokens = _leaf(randn(N, size * size, C))
    fc1, fc1_b = _leaf(randn(4 * C, C, scale=0.1)), _leaf(randn(4 * C, scale=0.1))
    fc2, fc2_b = _leaf(randn(C, 4 * C, scale=0.1)), _leaf(randn(C, scale=0.1))
    ln_w, ln_b = _leaf(randn(C).abs() + 0.5), _leaf(randn(C, scale=0.1))
    ls = _leaf(randn(C).abs() + 0.1)

    def bn(t, params=(bn_w, bn_b), running=stats):
        return F.batch_norm(t, *running, *params, True, 0.1, 1e-5)

    cases: list[tuple[str, Callable, Callable, list]] = []
    for act in ("relu", "gelu", "silu"):
        cases.append(
            (
                f"batch_norm_act[{act}]",
                lambda act=act: fo.batch_norm_act(x, *stats, bn_w, bn_b, True, 0.1, 1e-5, act),
                lambda act=act: apply_activation(bn(x), act),
                [x, bn_w, bn_b],
            )
        )
    for act in ("relu", "silu"):
        cases.append(
            (
                f"conv_bn_act[{act}]",
                lambda act=act: fo.conv_bn_act(x, w3, None, 1, 1, 1, 1, *stats, bn_w, bn_b, True, 0.1, 1e-5, act),
                lambda act=act: apply_activation(bn(F.conv2d(x, w3, None, 1, 1)), act),
                [x, w3, bn_w, bn_b],
            )
        )
    cases += [
        (
            "bn_act_conv[relu]",
            lambda: fo.bn_act_conv(x, *stats, bn_w, bn_b, True, 0.1, 1e-5, "relu", 0.0, w3, None, 1, 1),
            lambda: F.conv2d(F.relu(bn(x)), w3, None, 1, 1),
            [x, w3, bn_w, bn_b],
        ),
        (
            "bn_act_conv[relu, epilogue]",
            lambda: fo.bn_act_conv(
                x,
                *stats,
                bn_w,
                bn_b,
                True,
                0.1,
                1e-5,
                "relu",
                0.0,
                w3,
                None,
                1,
                1,
                epilogue=True,
                running_mean=stats2[0],
                running_var=stats2[1],
                bn_weight=bn2_w,
                bn_bias=bn2_b,
                training=True,
                act="relu",
            ),
            lambda: F.relu(bn(F.conv2d(F.relu(bn(x)), w3, None, 1, 1), (bn2_w, bn2_b), stats2)),
            [x, w3, bn_w, bn_b, bn2_w, bn2_b],
        ),
        (
            "conv_act[gelu]",
            lambda: fo.conv_act(x, w3, conv_b, 1, 1, 1, 1, "gelu"),
            lambda: F.gelu(F.conv2d(x, w3, conv_b, 1, 1)),
            [x, w3, conv_b],
        ),
        (
            "conv2d[depthwise 7x7]",
            lambda: fo.conv2d(x, wdw, conv_b, 1, 3, 1, C),
            lambda: F.conv2d(x, wdw, conv_b, 1, 3, 1, C),
            [x, wdw, conv_b],
        ),
        ("gelu", lambda: fo.gelu(x), lambda: F.gelu(x), [x]),
        (
            "avg_pool2d[of a conv]",
            lambda: fo.avg_pool2d(F.conv2d(x, w3, conv_b, 1, 1), 2),
            lambda: F.avg_pool2d(F.conv2d(x, w3, conv_b, 1, 1), 2),
            [x, w3, conv_b],
        ),
        (
            "linear_act[gelu]",
            lambda: fo.linear_act(tokens, fc1, fc1_b, "gelu"),
            lambda: F.gelu(F.linear(tokens, fc1, fc1_b)),
            [tokens, fc1, fc1_b],
        ),
        (
            "act_linear[gelu]",
            lambda: fo.act_linear(F.linear(tokens, fc1, fc1_b), fc2, fc2_b, "gelu"),
            lambda: F.linear(F.gelu(F.linear(tokens, fc1, fc1_b)), fc2, fc2_b),
            [tokens, fc1, fc1_b, fc2, fc2_b],
        ),
        (
            "act_linear_scale[gelu]",
            lambda: fo.act_linear_scale(F.linear(tokens, fc1, fc1_b), fc2, fc2_b, ls, "gelu"),
            lambda: F.linear(F.gelu(F.linear(tokens, fc1, fc1_b)), fc2, fc2_b) * ls,
            [tokens, fc1, fc1_b, fc2, fc2_b, ls],
        ),
        (
            "layer_norm_linear",
            lambda: fo.layer_norm_linear(tokens, (C,), ln_w, ln_b, 1e-6, fc1, fc1_b),
            lambda: F.linear(F.layer_norm(tokens, (C,), ln_w, ln_b, 1e-6), fc1, fc1_b),
            [tokens, ln_w, ln_b, fc1, fc1_b],
        ),
        (
            "conv_layer_norm_linear",
            lambda: fo.conv_layer_norm_linear(x, wdw, conv_b, 1, 3, 1, C, (C,), ln_w, ln_b, 1e-6, fc1, fc1_b),
            lambda: F.linear(
                F.layer_norm(F.conv2d(x, wdw, conv_b, 1, 3, 1, C).permute(0, 2, 3, 1), (C,), ln_w, ln_b, 1e-6),
                fc1,
                fc1_b,
            ),
            [x, wdw, conv_b, ln_w, ln_b, fc1, fc1_b],
        ),
    ]
    recomputed = {"linear_act[gelu]": lambda: F.linear(tokens.detach(), fc1.detach(), fc1_b.detach())}
    out = []
    for name, fused, eager, leaves in cases:
        with torch.no_grad():
            dy = torch.randn(eager().shape, generator=g, dtype=torch.float64).to(device, dtype)
        out.append(StepCase(name, fused, eager, leaves, dy, recomputed.get(name)))
    return out


@dataclasses.dataclass
class CallCase:
    """One primitive op call (`fused`) against the ATen calls eager runs for the work (`eager`)."""

    name: str
    fused: Callable[[], object]
    eager: Callable[[], object]


def call_cases(dtype: torch.dtype = torch.float32, channels_last: bool = False, size: int = 16) -> list[CallCase]:
    g = torch.Generator().manual_seed(1)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    sd = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    N, C, eps = 4, 32, 1e-5
    x = torch.randn(N, C, size, size, generator=g, dtype=torch.float64).to(dtype).contiguous(memory_format=fmt)
    dy = torch.randn(x.shape, generator=g, dtype=torch.float64).to(dtype).contiguous(memory_format=fmt)
    w = torch.rand(C, generator=g, dtype=torch.float64).add(0.5).to(sd)
    b = torch.randn(C, generator=g, dtype=torch.float64).to(sd)
    mean, var = x.to(sd).mean((0, 2, 3)), x.to(sd).var((0, 2, 3), unbiased=False)
    invstd = (var + eps).rsqrt()
    ops = torch.ops.fxfuse
    cases = [
        CallCase(
            "bn_stats",
            lambda: ops.bn_stats(x),
            lambda: torch.batch_norm_update_stats(x, torch.zeros(C, dtype=sd), torch.zeros(C, dtype=sd), 1.0),
        )
    ]
    for act in ("relu", "gelu"):
        # eager: F.batch_norm's output, then the activation (saved BN output y for the backward)
        y = F.batch_norm(x, mean, var, w, b, False, 0.0, eps)
        x_copy = x.clone()

        def act_bwd(act=act, y=y):
            return torch.ops.aten.threshold_backward(dy, y, 0) if act == "relu" else torch.ops.aten.gelu_backward(dy, y)

        def eager_backward(act_bwd=act_bwd):
            return torch.ops.aten.native_batch_norm_backward(
                act_bwd(), x, w, None, None, mean, invstd, True, eps, [True] * 3
            )

        cases += [
            CallCase(
                f"bn_act[{act}]",
                lambda act=act: ops.bn_act(x, mean, var, w, b, eps, act, 0.0),
                lambda act=act: apply_activation(F.batch_norm(x, mean, var, w, b, False, 0.0, eps), act),
            ),
            CallCase(
                f"bn_act_[{act}]",
                lambda act=act, x_copy=x_copy: ops.bn_act_(x_copy, mean, var, w, b, eps, act, 0.0),
                lambda act=act: apply_activation(F.batch_norm(x, mean, var, w, b, False, 0.0, eps), act),
            ),
            CallCase(
                f"bn_act_backward[{act}]",
                lambda act=act: ops.bn_act_backward(dy, x, mean, var, w, b, eps, act, 0.0, True, [True] * 3),
                eager_backward,
            ),
            CallCase(
                f"bn_act_backward_[{act}]",
                lambda act=act, x_copy=x_copy: ops.bn_act_backward_(
                    dy, x_copy, mean, var, w, b, eps, act, 0.0, True, [True, True]
                ),
                eager_backward,
            ),
            CallCase(
                f"bn_act_backward_into_grad_[{act}]",
                lambda act=act, dy_copy=dy.clone(): ops.bn_act_backward_into_grad_(
                    dy_copy, x, mean, var, w, b, eps, act, 0.0, True, [True, True]
                ),
                eager_backward,
            ),
        ]
    return cases
