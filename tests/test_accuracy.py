"""Accuracy of the fused ops against float64: fxfuse's float32 (and bfloat16 autocast)
error is held to at most 2x eager's own error, per output, input gradient, parameter
gradient and running statistic, after one training step.

Error of a tensor t: max|t - t64| / max|t64|, where t64 is the same eager model run in
float64 on the same input and output gradient (running means: relative to the channels'
standard deviation where that is larger, see errors()).

ReLU and the kinks. A ReLU's gradient jumps at 0: a pre-activation that is 5e-6 in
float64 and whose float32 value lands on the other side of 0 moves that element's whole
gradient. In deep, low-resolution layers, where a BN channel sees 8 values, that one
element is 10% of a bias gradient. Eager float32 crosses some kinks itself; what matters
is that fxfuse crosses the same ones. When fxfuse's BN forward rounded differently from
ATen's (its statistics summed in double with a per-channel shift: more accurate, other
bits), which implementation crossed a kink was chance: timm dla34 at batch 2, 64x64 showed
fxfuse 170-6600x eager's error on some parameter gradients (level5.tree2.bn1, channel 501:
z = 5.3e-6 in float64, 3.3e-6 in eager float32, -7.9e-7 in fxfuse), resnet50 at batch 4
up to 25000x (layer4 BN bias gradients). Now fxfuse's CPU training forward is eager's bit
for bit (tests/test_bn_bitwise.py: same statistics, invstd and z = x * alpha + beta
rounding under each CPU capability), so whole-model forwards equal eager's exactly, every
ReLU mask is eager's, and the backward's rounding differences are smooth: dla34 and
resnet50 come out within 1.05x of eager's error on every tensor (benchmarks/accuracy_matrix.py).
The ReLU models below are checked as they are, kinks included. SiLU has no kink, but a
forward that rounds differently still draws fresh rounding noise in every later layer:
efficientnet_b0 was up to 2.4x eager's error while fxfuse's SiLU used its own exp, and is
within 1.5x now that the activation forward is eager's bit for bit too.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from support.threads import intra_op_threads
from support.timm_zoo import FAST, ZOO, without_dropout
from torch import nn

import fxfuse
from fxfuse import _extension

pytestmark = pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")

# Relative floor: 8 float32 ulps (2**-23 each) of the tensor's largest value, the
# rounding of a handful of operations on it. Tensors where eager itself is below this
# (running statistics, ~1e-7) then do not fail on a single extra rounding.
FLOOR = 8 * 2.0**-23


def _run(model, x, dy, autocast=False):
    model.train()
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    out.float().backward(dy)
    res = {"output": out.detach().float(), "input.grad": x.grad}
    res.update({f"{n}.grad": p.grad for n, p in model.named_parameters() if p.grad is not None})
    res.update({n: b for n, b in model.named_buffers() if b.is_floating_point()})
    return res


def errors(model, x, mode="memory", autocast=False, channels_last=False, seed=0, eager_threads=(1, 2)):
    """{tensor: (eager error, fxfuse error)} against the float64 eager run.

    Eager's own error is the larger of its errors at 1 and at 2 intra-op threads: both runs
    are eager, and their rounding differs (the conv backward's reduction order). On the
    ill-conditioned tensors of the zoo that spread alone is up to 1.8x (semnasnet_050's stem
    bn1.weight gradient, float32 1-5% off in eager) and 4x on gradients that are zero in
    exact arithmetic (the bias of a conv feeding a training-mode BatchNorm, rexnet_100);
    fxfuse's ratio to the 1-thread run alone reached 2.2x and 2.0x there. fxfuse runs at
    the caller's thread count."""
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        shape = copy.deepcopy(model).eval()(x).shape
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    ref = _run(copy.deepcopy(model).double(), x.double(), dy)
    eagers = []
    for n in eager_threads:
        with intra_op_threads(n):
            eagers.append(_run(copy.deepcopy(model), x, dy.float(), autocast))
    fused_model = fxfuse.optimize(copy.deepcopy(model), mode=mode)
    assert fused_model.fxfuse_report.fused, "nothing fused: the check would compare eager with eager"
    fused = _run(fused_model, x, dy.float(), autocast)
    out = {}
    for name, r in ref.items():
        scale = r.abs().max().item()
        if name.endswith("running_mean"):
            # Relative to the channels' spread too: a batch mean that is 0 in float64 (a
            # bias-free 1x1 conv of a fresh BN's zero-mean output, as in efficientnet_b0)
            # leaves float32 noise of 1e-9 "off" by 1e7 of its own size in eager and fxfuse.
            scale = max(scale, ref[name[: -len("mean")] + "var"].max().sqrt().item())
        eager_err, fused_err = (
            max((t[name].double() - r).abs().max().item() / (scale or 1.0) for t in runs) for runs in (eagers, [fused])
        )
        out[name] = (eager_err, fused_err)
    return out


def as_accurate(eager_err, fxfuse_err, floor=FLOOR):
    """fxfuse's error at most 2x eager's plus the floor. A tensor eager gets wrong by more
    than its own size (relative error > 1) is zero in exact arithmetic: a conv bias or BN
    shift feeding a training-mode BatchNorm, whose gradient is 1e-16 in float64 and float32
    rounding noise of ~1e-8 in eager and fxfuse alike. There is no value to be accurate
    about, and the ratio of two noise draws scatters: eager's own 2-thread run was 0.7-4x
    its 1-thread run on rexnet_100's SE biases. Such tensors may be 4x."""
    return fxfuse_err <= (4 if eager_err > 1 else 2) * eager_err + floor


def summarize(errs):
    """(worst ratio fxfuse / eager error, its tensor, the tensors not as_accurate, geometric
    mean of the ratios) for benchmarks/accuracy_*.py. An eager error below FLOOR counts as
    FLOOR in the ratio; the mean is over the tensors eager gets wrong by more than FLOOR
    (below it both are exact or nearly)."""
    ratios = {n: f / max(e, FLOOR) for n, (e, f) in errs.items()}
    worst = max(ratios, key=ratios.get)
    failing = [n for n, (e, f) in errs.items() if not as_accurate(e, f)]
    logs = [math.log(f / e) for e, f in errs.values() if e > FLOOR and f > 0]
    return ratios[worst], worst, failing, math.exp(sum(logs) / len(logs)) if logs else float("nan")


def assert_as_accurate(errs, floor=FLOOR):
    bad = {n: e for n, e in errs.items() if not as_accurate(*e, floor)}
    assert not bad, "fxfuse error > 2x eager's (eager, fxfuse): " + ", ".join(
        f"{n}: {e[0]:.2e}, {e[1]:.2e}" for n, e in sorted(bad.items())
    )


class Stack(nn.Module):
    """Conv->BN->act blocks at 2x2 spatial, batch 2: each BN sees 8 values per channel,
    on top of an input with a large mean (|mean| >> std), where a one-pass variance or a
    sum(dy * x) - mean * sum(dy) backward cancels."""

    def __init__(self, act=nn.SiLU, c=8, depth=4):
        super().__init__()
        layers = [nn.Conv2d(3, c, 1)]
        for _ in range(depth):
            layers += [nn.BatchNorm2d(c), act(), nn.Conv2d(c, c, 3, padding=1, bias=False)]
        layers += [nn.BatchNorm2d(c), act()]
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def _large_mean_input(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 2, 2, generator=g) * 0.5 + 300.0


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("mode", ["memory", "fast"])
@pytest.mark.parametrize("act", [nn.SiLU, nn.GELU, nn.ReLU], ids=["silu", "gelu", "relu"])
def test_tiny_bn_large_mean(act, mode, channels_last):
    torch.manual_seed(0)
    model, x = Stack(act), _large_mean_input()
    assert_as_accurate(errors(model, x, mode=mode, channels_last=channels_last))


def test_large_mean_cancels_in_float32():
    """The check above can fail: float32 statistics from sum(x^2)/n - mean^2 on this
    input are off by far more than 2x eager's error."""
    x = _large_mean_input() * 10
    x64 = x.double()
    var64 = x64.var(dim=(0, 2, 3), unbiased=False)
    one_pass = (x * x).mean(dim=(0, 2, 3)) - x.mean(dim=(0, 2, 3)) ** 2
    eager = x.var(dim=(0, 2, 3), unbiased=False)
    err = lambda v: ((v.double() - var64).abs().max() / var64.abs().max()).item()  # noqa: E731
    assert err(one_pass) > 2 * err(eager) + FLOOR


def test_bfloat16_autocast():
    torch.manual_seed(0)
    model = Stack(nn.SiLU, c=16)  # 8192 values a layer: some ReLU input would sit at a kink
    model.net[0] = nn.Conv2d(3, 16, 3, padding=1)
    x = torch.randn(2, 3, 16, 16)
    assert_as_accurate(errors(model, x, autocast=True))


def _model(name, seed):
    """The issue's draws at 64x64: timm dla34 at batch 2 (levels 4 and 5 run at 4x4 and
    2x2, 8 values per BN channel), torchvision resnet50 and efficientnet_b0 (SiLU) at
    batch 4."""
    torch.manual_seed(seed)
    if name == "dla34":
        model, batch = pytest.importorskip("timm").create_model("dla34", pretrained=False), 2
    else:
        model, batch = getattr(pytest.importorskip("torchvision").models, name)(num_classes=10), 4
    return without_dropout(model), torch.randn(batch, 3, 64, 64)


def _forward_is_eager(model, x, channels_last):
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model, x = model.to(memory_format=fmt), x.contiguous(memory_format=fmt)
    eager, fused = copy.deepcopy(model).train(), fxfuse.optimize(copy.deepcopy(model)).train()
    with torch.no_grad():
        assert torch.equal(fused(x), eager(x)), "the fused training forward is not eager's bit for bit"


@pytest.mark.parametrize(
    "seed,mode,channels_last",
    [(2, "memory", False), (0, "memory", False), (2, "fast", False), (2, "memory", True)],
    ids=["seed2-memory-nchw", "seed0-memory-nchw", "seed2-fast-nchw", "seed2-memory-nhwc"],
)
def test_dla34(seed, mode, channels_last):
    """Seed 2 was 6600x eager's error on level5 BN gradients before the forward was eager's."""
    model, x = _model("dla34", seed)
    _forward_is_eager(model, x, channels_last)
    assert_as_accurate(errors(model, x, mode=mode, channels_last=channels_last, seed=seed))


@pytest.mark.parametrize("seed", [1])
def test_resnet50(seed):
    """Seed 1 was 25000x eager's error on layer4.2.bn3.bias's gradient."""
    model, x = _model("resnet50", seed)
    _forward_is_eager(model, x, channels_last=False)
    assert_as_accurate(errors(model, x, seed=seed))


@pytest.mark.zoo
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("mode", ["memory", "fast"])
@pytest.mark.parametrize(
    "name,seed",
    [("dla34", s) for s in range(5)] + [("resnet50", s) for s in range(4)] + [("efficientnet_b0", s) for s in range(3)],
)
def test_models_all_draws(name, seed, mode, channels_last):
    model, x = _model(name, seed)
    assert_as_accurate(errors(model, x, mode=mode, channels_last=channels_last, seed=seed))


@pytest.mark.slow
def test_efficientnet_b0(seed=0):
    """Seed 0 was 2.4x eager's error on features.0.1.weight's gradient while fxfuse's SiLU
    forward used its own exp (one ulp off on some elements); with ATen's, whole-model
    forwards are eager's and the worst tensor is 1.3x (1.5x on seed 1)."""
    model, x = _model("efficientnet_b0", seed)
    _forward_is_eager(model, x, channels_last=False)
    assert_as_accurate(errors(model, x, seed=seed))


@pytest.mark.parametrize("name", ["dla34", "resnet50"])
def test_relu_models_bfloat16_autocast(name):
    """Eager bfloat16 itself is 40-130% off float64 on these gradients; fxfuse stays within
    2x of that (1.3-1.7x over three draws each)."""
    model, x = _model(name, 2)
    assert_as_accurate(errors(model, x, autocast=True, seed=2))


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize(
    "entry", [pytest.param(e, id=e.name, marks=() if e.name in FAST else pytest.mark.zoo) for e in ZOO]
)
def test_timm_zoo(entry):
    """Every model of the timm zoo (tests/support/timm_zoo.py) at its input, seed 0; `make test` runs
    the representative part. benchmarks/accuracy_zoo.py prints the worst ratio per model."""
    torch.manual_seed(0)
    model = without_dropout(entry.build())
    assert_as_accurate(errors(model, entry.example_input()))
