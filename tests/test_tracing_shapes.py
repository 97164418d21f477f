"""Shape-dependent Python traced with concrete shapes (fusion/tracing.py): TF-style padding from the input's
size, a branch on a channel count, iterating `chunk`'s result, and a root forward taking *args/**kwargs."""

import copy
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxfuse
from fxfuse.fusion import install, tracing
from fxfuse.testing import assert_equivalent


class TFPaddedConv(nn.Module):
    """HF MobileNetV2's tf_padding: the padding is computed with int() and math.ceil from the input's shape."""

    def __init__(self, cin, cout, stride=2):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride=stride, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        h, w = x.shape[-2:]
        s = self.conv.stride[0]
        pad_h = max((math.ceil(int(h) / s) - 1) * s + 3 - int(h), 0)
        pad_w = max((math.ceil(int(w) / s) - 1) * s + 3 - int(w), 0)
        x = F.pad(x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))
        return F.relu6(self.bn(self.conv(x)))


class C2f(nn.Module):
    """ultralytics' C2f: `list(cv1(x).chunk(2, 1))`, extended by a loop, concatenated."""

    def __init__(self, c):
        super().__init__()
        self.cv1 = nn.Sequential(nn.Conv2d(c, 2 * c, 1, bias=False), nn.BatchNorm2d(2 * c), nn.SiLU())
        self.m = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.SiLU()) for _ in range(2)
        )
        self.cv2 = nn.Sequential(nn.Conv2d(4 * c, c, 1, bias=False), nn.BatchNorm2d(c), nn.SiLU())

    def forward(self, x):
        y = list(self.cv1(x).chunk(2, 1))
        y.extend(m(y[-1]) for m in self.m)
        return self.cv2(torch.cat(y, 1))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = TFPaddedConv(3, 8)
        self.block = C2f(8)
        self.proj = nn.Conv2d(8, 16, 1)

    def forward(self, x, *args, **kwargs):
        y = self.block(self.stem(x))
        if y.size(dim=1) != 16:  # a branch on a channel count
            y = self.proj(y)
        return y.mean((2, 3))


def _fused_graph(optimized, *args) -> bool:
    """Whether the optimized model runs a rewritten graph with a fused conv for the call `optimized(*args)`."""
    graph = install.graph_for(optimized, *args)
    return graph is not None and any("conv_bn_act" in str(n.target) for n in graph.nodes)


def _bn_names(report):
    return {m for site in report.fused for m in site.modules if "bn" in m or m.endswith((".1", "1"))}


def test_symbolic_tracing_fails_and_concrete_tracing_succeeds():
    model, x = Net(), torch.randn(2, 3, 17, 15)
    with pytest.raises(Exception):  # noqa: B017 - whatever torch.fx raises on shape arithmetic
        tracing.trace(model)
    traced = tracing.trace(model, example_inputs=(x,))
    assert traced.specialized and not traced.leaf_failures


def test_shape_dependent_model_is_fused_and_exact():
    model, x = Net(), torch.randn(2, 3, 17, 15)
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,))
    report = optimized.fxfuse_report
    assert len([s for s in report.fused if s.op in ("fxfuse::conv_bn_act", "fxfuse::bn_act_conv")]) >= 4
    assert any("traced it again" in n or "traced for inputs of shape" in n for n in report.notes)
    assert_equivalent(model, optimized, x, dtype=torch.float64)


def test_a_new_input_shape_traces_again_and_stays_exact():
    model, x = Net().double(), torch.randn(2, 3, 17, 15, dtype=torch.double)
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,))
    for shape in ((2, 3, 17, 15), (3, 3, 20, 21), (2, 3, 17, 15)):
        x = torch.randn(shape, dtype=torch.double)
        torch.testing.assert_close(optimized(x), model(x), rtol=1e-9, atol=1e-9)
        # traced again for this shape and fused, not run as written (which would be exact too)
        assert _fused_graph(optimized, x), shape
    assert_equivalent(model, optimized, torch.randn(3, 3, 20, 21), dtype=torch.float64)


def test_without_example_inputs_the_model_is_captured_at_its_first_call():
    model, x = Net(), torch.randn(2, 3, 17, 15)
    optimized = fxfuse.optimize(copy.deepcopy(model))
    notes = " ".join(optimized.fxfuse_report.notes)
    assert "captures it at its first call" in notes and not optimized.fxfuse_report.fused
    assert_equivalent(model, optimized, x, dtype=torch.float64)  # a copy of it, captured at its first call
    with torch.no_grad():
        optimized(x)
    assert _fused_graph(optimized, x)
    with_inputs = fxfuse.optimize(copy.deepcopy(model), (x,)).fxfuse_report
    assert [s.modules for s in optimized.fxfuse_report.fused] == [s.modules for s in with_inputs.fused]


def test_a_pickled_specialized_model_is_specialized_again():
    model, x = Net(), torch.randn(2, 3, 17, 15)
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,))
    restored = pickle.loads(pickle.dumps(optimized))
    assert len(restored.fxfuse_report.fused) == len(optimized.fxfuse_report.fused)
    # The report travels in __dict__ as it was: what the restored model runs is its graphs.
    assert _fused_graph(restored, x)
    assert_equivalent(model, restored, x, dtype=torch.float64)
    y = torch.randn(3, 3, 20, 21)
    torch.testing.assert_close(restored(y), optimized(y), rtol=0, atol=0)
    assert _fused_graph(restored, y)


def test_hooks_of_the_model_never_see_the_meta_run():
    model, x = Net(), torch.randn(2, 3, 17, 15)
    seen = []
    model.stem.bn.register_forward_hook(lambda m, i, o: seen.append(o.device.type))
    fxfuse.optimize(model, (x,))
    assert "meta" not in seen


def test_size_with_a_keyword_traces_symbolically_too():
    class Flatten(nn.Module):
        def forward(self, x):
            return x.reshape(x.size(dim=0), -1)

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), Flatten(), nn.Linear(4 * 6 * 6, 2))
    x = torch.randn(2, 3, 8, 8)
    optimized = fxfuse.optimize(copy.deepcopy(model))
    assert optimized.fxfuse_report.fused and not optimized.fxfuse_report.notes
    assert_equivalent(model, optimized, x, dtype=torch.float64)


class ReadsOneShape(nn.Module):
    """Conv→BN→ReLU, then Python computed from one kind of shape read: each kind alone must specialize the
    graph (key it on the inputs' shapes), or another shape runs a graph that baked in the example's value."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)

    def forward(self, x):
        if self.kind == "dim" and x.dim() == 3:  # an unbatched image
            x = x.unsqueeze(0)
        if self.kind == "ndim" and x.ndim == 3:
            x = x.unsqueeze(0)
        y = torch.relu(self.bn(self.conv(x)))
        if self.kind == "shape" and y.shape[-1] % 2:  # odd width (the example's, not the other input's)
            return y * 2
        if self.kind == "size" and y.size(-1) % 2:
            return y * 2
        if self.kind == "size-dim" and y.size(dim=2) % 2:  # odd height
            return y * 2
        if self.kind == "len":
            return y * len(y)
        if self.kind == "iter":
            return torch.stack([t * (i + 1) for i, t in enumerate(y)])
        return y


@pytest.mark.parametrize("kind", ["shape", "size", "size-dim", "len", "iter", "dim", "ndim"])
def test_each_kind_of_shape_read_alone_specializes_the_graph(kind):
    model, x = ReadsOneShape(kind).double(), torch.randn(2, 3, 9, 7, dtype=torch.double)
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,))
    assert optimized.fxfuse_report.fused
    other = torch.randn((3, 10, 12) if kind in ("dim", "ndim") else (3, 3, 10, 12), dtype=torch.double)
    for mode in ("train", "eval"):
        model.train(mode == "train"), optimized.train(mode == "train")
        for y in (x, other, x):
            torch.testing.assert_close(optimized(y), model(y), rtol=1e-9, atol=1e-9)
            assert _fused_graph(optimized, y), (mode, tuple(y.shape))
