"""passes/cat_input.py: a fused op whose input is `torch.cat(pieces, 1)` keeps the pieces instead,
where they are kept anyway, and backward rebuilds the concatenation."""

import copy

import pytest
import torch
import torchvision
from torch import nn

import fxfuse
from fxfuse.fusion import install as install_module
from fxfuse.fusion import passes
from fxfuse.fusion.passes import cat_input
from fxfuse.fusion.report import pattern_text
from fxfuse.measure import saved_activation_bytes
from fxfuse.testing import assert_equivalent

CAT_PATTERN = pattern_text(cat_input.PATTERN)  # as the report prints it

F64 = torch.float64
pytestmark = pytest.mark.usefixtures("single_thread")


def small_densenet():
    """torchvision's own DenseNet code (dense layers, transitions, norm5), two small blocks."""
    return torchvision.models.DenseNet(growth_rate=4, block_config=(3, 2), num_init_features=8, bn_size=2)


class ConvBNReLU(nn.Sequential):
    def __init__(self, cin, cout):
        super().__init__(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class UNetUp(nn.Module):
    """A U-Net decoder step: cat(skip, up(x)) → conv → BN → ReLU. The skip is also the input of the
    encoder's strided downsampling conv, which keeps it; the upsampled half is kept by nothing else.
    (A max pool would not keep it: fxfuse::max_pool2d keeps a byte per output.)"""

    def __init__(self, c=4):
        super().__init__()
        self.enc = ConvBNReLU(3, c)
        self.pool = nn.Conv2d(c, c, 2, stride=2)
        self.mid = ConvBNReLU(c, c)
        self.up = nn.Upsample(scale_factor=2)
        self.dec = ConvBNReLU(2 * c, c)

    def forward(self, x):
        skip = self.enc(x)
        return self.dec(torch.cat([skip, self.up(self.mid(self.pool(skip)))], dim=1))


class Fresh(nn.Module):
    """cat(a, b) → BN → ReLU → conv where a and b are kept by nothing else: rebuilding frees nothing."""

    def __init__(self, c=4):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, c, 1), nn.Conv2d(3, c, 1)
        self.bn, self.conv = nn.BatchNorm2d(2 * c), nn.Conv2d(2 * c, c, 1)

    def forward(self, x):
        return self.conv(torch.relu(self.bn(torch.cat([self.a(x), self.b(x)], 1))))


class CSP(nn.Module):
    """YOLOv8's C2f: the pieces are views (chunk) of a conv output another conv keeps, and one more output."""

    def __init__(self, c=4):
        super().__init__()
        self.cv1 = ConvBNReLU(3, 2 * c)
        self.m = ConvBNReLU(c, c)
        self.cv2 = ConvBNReLU(3 * c, c)

    def forward(self, x):
        y = list(self.cv1(x).chunk(2, 1))
        y.append(self.m(y[-1]))
        return self.cv2(torch.cat(y, 1))


class Dense(nn.Module):
    """cat(x, conv(x)) → a plain conv, then BN → ReLU (what mode="memory" leaves of a CSP stage's end):
    the input is kept anyway as a graph input."""

    def __init__(self, c=3):
        super().__init__()
        self.a = nn.Conv2d(c, c, 3, padding=1)
        self.conv, self.bn = nn.Conv2d(2 * c, 4, 1, bias=False), nn.BatchNorm2d(4)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(torch.cat([x, self.a(x)], 1)) * 2))


class OtherDim(nn.Module):
    """A cat along the width, then BN → ReLU → conv: not the channels."""

    def __init__(self, c=4):
        super().__init__()
        self.stem = ConvBNReLU(3, c)
        self.bn, self.conv = nn.BatchNorm2d(c), nn.Conv2d(c, c, 1)

    def forward(self, x):
        y = self.stem(x)
        return self.conv(torch.relu(self.bn(torch.cat((y, x[:, :1].expand_as(y)), dim=3))))


class WrittenLater(nn.Module):
    """The first piece is also changed in place after the cat was used: backward must not read it."""

    def __init__(self, c=4):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 1)
        self.bn, self.conv = nn.BatchNorm2d(2 * c), nn.Conv2d(2 * c, c, 1)

    def forward(self, x):
        y = self.stem(x)
        out = self.conv(torch.relu(self.bn(torch.concat([y, y * 2], 1))))
        return out + y.mul_(3).mean()


def _cat_sites(model):
    return [s for s in model.fxfuse_report.fused if s.pattern == CAT_PATTERN]


def _cat_skips(model):
    return [s for s in model.fxfuse_report.skipped if s.pattern == CAT_PATTERN]


def _without_pass(monkeypatch):
    monkeypatch.setattr(passes, "PASSES", tuple(p for p in passes.PASSES if p.run is not cat_input.run))


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["contiguous", "channels_last"])
def test_densenet_keeps_its_features_once_and_trains_exactly(fmt):
    torch.manual_seed(0)
    model = small_densenet().to(memory_format=fmt)
    x = torch.randn(2, 3, 32, 32).to(memory_format=fmt)
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    sites = _cat_sites(optimized)
    # Every dense layer's input (5), both block outputs (into the transition and into norm5).
    assert len(sites) == 7, optimized.fxfuse_report
    assert {s.op for s in sites} == {"fxfuse::cat_bn_act_conv", "fxfuse::cat_batch_norm_act"}
    # A block's first cat, of the block input alone, frees nothing itself: it is charged for keeping the
    # block input, which every later cat of the block then shares.
    assert all(s.saved_bytes >= 0 and s.recompute_bytes > 0 and s.recompute_flops == 0 for s in sites)
    assert sum(s.saved_bytes > 0 for s in sites) == 5
    assert_equivalent(model, optimized, x, steps=2, dtype=F64)


def test_densenet_saves_what_the_report_says(monkeypatch):
    torch.manual_seed(0)
    model = small_densenet()
    x = torch.randn(2, 3, 32, 32)
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    with monkeypatch.context() as m:
        _without_pass(m)
        before = fxfuse.optimize(copy.deepcopy(model), x)
    assert not _cat_sites(before)
    saved_before, saved_after = saved_activation_bytes(before, (x,)), saved_activation_bytes(optimized, (x,))
    assert saved_before - saved_after == sum(s.saved_bytes for s in _cat_sites(optimized)) > 0


def test_torchvision_densenet121_keeps_every_concatenation_out():
    model = torchvision.models.densenet121()
    report = fxfuse.explain(model, torch.randn(1, 3, 32, 32))
    sites = [s for s in report.fused if s.pattern == CAT_PATTERN]
    assert len(sites) == 58 + 4  # 58 dense layers, 3 transitions and norm5
    assert not [s for s in report.skipped if s.pattern == CAT_PATTERN]


def test_without_example_inputs_the_graph_decides():
    optimized = fxfuse.optimize(small_densenet())
    sites = _cat_sites(optimized)
    assert len(sites) == 7 and all(s.saved_bytes is None for s in sites)


def test_unet_decoder_keeps_the_skip_it_keeps_anyway():
    torch.manual_seed(0)
    model = UNetUp().to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 16, 16).to(memory_format=torch.channels_last)
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    (site,) = _cat_sites(optimized)
    assert site.op == "fxfuse::cat_conv_bn_act" and site.merged_into == "dec.0"
    half = 2 * 4 * 16 * 16 * 4  # the skip: 2 x 4 x 16 x 16 float32, the half kept anyway
    assert site.saved_bytes == half and site.recompute_bytes == 2 * 2 * half
    assert_equivalent(model, optimized, x, steps=2, dtype=F64)


def test_chunk_views_of_a_kept_tensor_are_kept_anyway():
    torch.manual_seed(0)
    model = CSP()
    x = torch.randn(2, 3, 8, 8)
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    (site,) = _cat_sites(optimized)
    assert site.op == "fxfuse::cat_conv_bn_act" and site.saved_bytes == 2 * 8 * 8 * 8 * 4  # the chunked half
    assert_equivalent(model, optimized, x, steps=2, dtype=F64)


def test_a_plain_conv_after_a_cat_keeps_the_pieces():
    torch.manual_seed(0)
    model = Dense().to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    (site,) = _cat_sites(optimized)
    assert site.op == "fxfuse::cat_conv2d" and site.merged_into == "conv" and site.saved_bytes == x.numel() * 4
    assert_equivalent(model, optimized, x, steps=2, dtype=F64)


def test_pieces_kept_by_nothing_else_are_not_rewritten_and_the_report_says_why():
    model = Fresh()
    x = torch.randn(2, 3, 8, 8)
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    assert not _cat_sites(optimized)
    (skip,) = _cat_skips(optimized)
    assert skip.modules == ("cat",) and "kept by nothing else" in skip.reason
    assert_equivalent(model, optimized, x, steps=2, dtype=F64)


def test_a_cat_along_another_dim_is_skipped():
    model = OtherDim()
    x = torch.randn(2, 3, 8, 8)
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    assert not _cat_sites(optimized)
    (skip,) = _cat_skips(optimized)
    assert "along dim 3" in skip.reason
    assert_equivalent(model, optimized, x, steps=2, dtype=F64)


def test_a_piece_written_in_place_later_is_skipped():
    model = WrittenLater()
    x = torch.randn(2, 3, 8, 8)
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    assert not _cat_sites(optimized)
    (skip,) = _cat_skips(optimized)
    assert "in place" in skip.reason
    assert_equivalent(model, optimized, x, steps=2, dtype=F64)


def test_mode_fast_keeps_the_concatenations():
    optimized = fxfuse.optimize(small_densenet(), torch.randn(2, 3, 32, 32), mode="fast")
    assert not _cat_sites(optimized)


def test_the_rewritten_graph_passes_the_pieces():
    model = fxfuse.optimize(UNetUp(), torch.randn(2, 3, 16, 16))
    state = model.__dict__[install_module._STATE]
    graph = state.fx_graphs[install_module._key(state, pattern=state.last_pattern)]
    (call,) = [n for n in graph.nodes if "pieces" in n.kwargs]
    (cat,) = [n for n in graph.nodes if n.op == "call_function" and n.target is torch.cat]
    assert call.args[0] is cat and call.kwargs["pieces"] == list(cat.args[0])


def test_memory_budget_counts_the_rebuilt_concatenations():
    model = small_densenet()
    x = torch.randn(2, 3, 32, 32)
    optimized = fxfuse.optimize(copy.deepcopy(model), x, memory_budget=0.6)
    report = optimized.fxfuse_report
    assert report.budget_met and len(_cat_sites(optimized)) == 7
    assert saved_activation_bytes(optimized, (x,)) <= 0.6 * saved_activation_bytes(model, (x,))
    assert_equivalent(model, optimized, x, steps=1, dtype=F64)


def test_torch_compile_traces_one_graph_and_trains_exactly():
    """Dynamo traces the pieces through (no graph break); AOTAutograd uses the cat_ ops' fake kernels and
    autograd, and the step gives eager's outputs, gradients and running statistics."""
    torch.manual_seed(0)
    model = small_densenet().to(F64)
    x = torch.randn(2, 3, 32, 32, dtype=F64)
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    explanation = torch._dynamo.explain(copy.deepcopy(optimized))(x)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0)
    compiled = torch.compile(optimized, backend="aot_eager")
    out, ref = compiled(x), model(x)
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    for (name, p), q in zip(model.named_parameters(), optimized.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-9, msg=name)
    for (name, b), c in zip(model.named_buffers(), optimized.buffers()):
        torch.testing.assert_close(c, b, rtol=1e-12, atol=1e-12, msg=name)


class _WritesItsInput(nn.Module):
    """A module fxfuse cannot see into once hooked (a leaf) that writes its input in place."""

    def forward(self, t):
        return t.mul_(2)


class WrittenThrough(nn.Module):
    """cat(x, y) → BN → ReLU → conv, x kept anyway (a graph input): rewritten unless y, or the storage it
    is a view of, is written in place after the cat, however the graph writes it."""

    def __init__(self, how, c=3):
        super().__init__()
        self.how = how
        self.a = nn.Conv2d(c, 2 * c, 3, padding=1)
        self.bn, self.conv = nn.BatchNorm2d(2 * c), nn.Conv2d(2 * c, 4, 1)
        self.relu = nn.ReLU(inplace=True)
        self.leaf = _WritesItsInput()
        self.leaf.register_forward_hook(lambda m, i, o: None)

    def forward(self, x):
        z = self.a(x)
        y = z.chunk(2, 1)[0] if self.how == "root" else z[:, :3]
        out = self.conv(torch.relu(self.bn(torch.cat([x, y], 1))))
        if self.how == "root":
            z.mul_(3)  # the storage the piece is a view of
        elif self.how == "view":
            y[:, :1].mul_(3)
        elif self.how == "data":
            y.data.mul_(3)  # no version counter: eager-wrong gradients, silently
        elif self.how == "functional":
            torch.nn.functional.relu(y, inplace=True)
        elif self.how == "module":
            self.relu(y)
        elif self.how == "hooked leaf":
            self.leaf(y)
        return out + (z if self.how == "root" else y).mean()


@pytest.mark.parametrize("how", ["root", "view", "data", "functional", "module", "hooked leaf"])
def test_a_piece_written_in_place_in_any_way_is_skipped(how):
    torch.manual_seed(0)
    model = WrittenThrough(how)
    x = torch.randn(2, 3, 6, 6)
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    assert not _cat_sites(optimized), optimized.fxfuse_report
    (skip,) = _cat_skips(optimized)
    assert "in place" in skip.reason
    assert_equivalent(model, optimized, x, steps=2, dtype=F64)


def test_a_piece_read_but_not_written_is_still_rewritten():
    """The same model with the piece only read after the cat: the in-place checks do not over-reach."""
    torch.manual_seed(0)
    model = WrittenThrough("none")
    x = torch.randn(2, 3, 6, 6)
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    assert len(_cat_sites(optimized)) == 1, optimized.fxfuse_report
    assert_equivalent(model, optimized, x, steps=2, dtype=F64)
