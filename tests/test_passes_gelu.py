"""Standalone GELU → fxfuse::gelu only where measured faster; and the report's per-site mode."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fxfuse
from fxfuse.fusion import runtime
from fxfuse.testing import assert_equivalent

# 2 * 8 * 256 * 256 elements: at the size threshold.
SHAPE = (2, 8, 256, 256)


@pytest.fixture
def avx2_aten(monkeypatch):
    """ATen's kernels as on an AVX2 CPU, where fxfuse::gelu measured faster (channels_last float32)."""
    monkeypatch.setattr(runtime, "aten_cpu_capability", lambda: "AVX2")


class ResidualGelu(nn.Module):
    """GELUs whose input comes from an add, so no Linear/Conv/BN pass takes them."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.act = nn.GELU()

    def forward(self, x):
        y = self.act(x + self.conv(x))
        return F.gelu(y * 2, approximate="tanh").mean() + F.gelu(F.avg_pool2d(y, 8)).mean()


class FxfuseGeluCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.fxfuse.gelu.default:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _gelu_calls(model, x):
    with FxfuseGeluCalls() as mode:
        model(x).backward()
    return mode.calls


def _sites(report):
    return (
        {s.modules: s for s in report.fused if s.op == "fxfuse::gelu"},
        [s for s in report.skipped if s.pattern.startswith("gelu")],
    )


def test_channels_last_example_input_rewrites_only_the_fast_site(avx2_aten):
    x = torch.randn(SHAPE).to(memory_format=torch.channels_last)
    model = ResidualGelu()
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    fused, skipped = _sites(optimized.fxfuse_report)
    assert list(fused) == [("act",)]
    assert "channels_last" in fused[("act",)].reason and fused[("act",)].mode == "memory"
    assert [s.modules for s in skipped] == [("gelu",), ("gelu",)]  # the two F.gelu calls
    assert "tanh" in skipped[0].reason
    assert "too few" in skipped[1].reason  # channels_last, but 2x8x32x32
    assert _gelu_calls(optimized, x) == 1
    assert_equivalent(model, optimized, x, dtype=torch.float32)


def test_contiguous_example_input_is_left_to_eager(avx2_aten):
    x = torch.randn(SHAPE)
    optimized = fxfuse.optimize(ResidualGelu(), x, mode="fast")
    fused, skipped = _sites(optimized.fxfuse_report)
    assert fused == {}
    assert "not channels_last" in skipped[0].reason and skipped[0].modules == ("act",)
    assert _gelu_calls(optimized, x) == 0


def test_without_example_inputs_the_call_picks_the_path_and_stays_exact(avx2_aten):
    model = ResidualGelu()
    optimized = fxfuse.optimize(copy.deepcopy(model))
    fused, _ = _sites(optimized.fxfuse_report)
    assert list(fused) == [("act",), ("gelu",)] and all("run time" in s.reason for s in fused.values())
    assert _gelu_calls(optimized, torch.randn(SHAPE)) == 0
    x = torch.randn(SHAPE).to(memory_format=torch.channels_last)
    assert _gelu_calls(optimized, x) == 1  # the pooled 2x8x32x32 GELU is too small
    for dtype in (torch.float32, torch.float64):
        assert_equivalent(model, optimized, x, dtype=dtype)


@pytest.mark.parametrize(
    "shape, fmt, dtype, approximate, expected",
    [
        (SHAPE, torch.channels_last, torch.float32, "none", True),
        (SHAPE, torch.channels_last, torch.float32, "tanh", False),
        (SHAPE, torch.contiguous_format, torch.float32, "none", False),
        (SHAPE, torch.channels_last, torch.float64, "none", False),
        ((2, 32, 8, 8), torch.channels_last, torch.float32, "none", False),
        ((4, 1, 512, 512), torch.channels_last, torch.float32, "none", False),  # also contiguous
    ],
)
def test_gelu_is_faster(shape, fmt, dtype, approximate, expected, avx2_aten):
    x = torch.randn(shape, dtype=dtype).to(memory_format=fmt)
    assert runtime.gelu_is_faster(x, approximate) is expected
    # fxfuse.ops.gelu's accuracy contract (F32_SPREAD in tests/support/op_checks.py: ATen's own
    # spread between CPU capabilities); eager's channels_last path rounds differently.
    t = 5.4e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(
        runtime.gelu_where_faster(x, approximate), F.gelu(x, approximate=approximate), rtol=t, atol=t
    )


@pytest.mark.parametrize("capability", ["AVX512", "not x86"])
def test_where_aten_has_faster_kernels_every_gelu_stays_eager(monkeypatch, capability):
    monkeypatch.setattr(runtime, "aten_cpu_capability", lambda: capability)
    x = torch.randn(SHAPE).to(memory_format=torch.channels_last)
    for example in ((x,), ()):
        optimized = fxfuse.optimize(ResidualGelu(), *example)
        fused, skipped = _sites(optimized.fxfuse_report)
        assert fused == {} and any(capability in s.reason for s in skipped)
        assert _gelu_calls(optimized, x) == 0


def test_gelu_module_with_hooks_is_skipped():
    model = ResidualGelu()
    model.act.register_forward_hook(lambda *a: None)
    report = fxfuse.explain(model)
    assert ("act",) not in _sites(report)[0]
    assert [s.modules for s in _sites(report)[1] if "hooks" in s.reason] == [("act",)]


def test_report_says_which_mode_chose_each_site():
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.GELU(), nn.Conv2d(8, 8, 3, padding=1), nn.GELU()
    )
    x = torch.randn(2, 3, 8, 8)
    memory, fast = fxfuse.explain(model, x), fxfuse.explain(model, x, mode="fast")
    assert [(s.op, s.mode) for s in memory.fused] == [("fxfuse::conv_bn_act", "memory"), ("fxfuse::conv_act", "memory")]
    assert "recomputes conv" in memory.fused[0].reason
    assert [(s.op, s.mode) for s in fast.fused] == [
        ("fxfuse::bn_act_conv", "fast")
    ]  # BN→act merged into the conv after it
    assert "no conv recompute" in fast.fused[0].reason
    for report in (memory, fast):
        table = str(report)
        assert "why" in table and f"(mode={report.mode})" in table.splitlines()[0]
        for site in report.fused:
            row = next(line for line in table.splitlines() if line.startswith(site.name))
            assert site.short in row and site.short.split(", ")[0] in site.reason  # the pass's first clause
            assert f"mode {report.mode}" in report.explain(site.name)
            assert " ".join(site.reason.split()) in " ".join(report.explain(site.name).split())
        assert report.to_dict()["fused"][0]["mode"] == report.mode


def test_off_the_cpu_gelu_stays_eager_and_says_why(avx2_aten):
    rewrite, why = runtime.gelu_rule("none", torch.float32, SHAPE, True, device="cuda")
    assert not rewrite and "measured faster on CPU only" in why
    meta = torch.empty(SHAPE, device="meta").to(memory_format=torch.channels_last)
    assert runtime.gelu_is_faster(meta, "none") is False
    optimized = fxfuse.optimize(ResidualGelu().to("meta"))
    fused, skipped = _sites(optimized.fxfuse_report)
    reasons = [s.reason for s in skipped]
    assert fused == {} and len(reasons) == 3
    assert all("on meta" in r for r in reasons if "tanh" not in r) and any("on meta" in r for r in reasons)
