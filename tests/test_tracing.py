"""Tracing never changes the model and never drops a state change.

Modules that update their own state in forward (buffer counters, EMAs, hand-written
running statistics) are traced through; the updates must be graph nodes that run on
every call, in train and in eval, exactly as eager runs them. A write torch.fx cannot
record makes the module a leaf (said in the report), or an error for the root.
"""

import copy

import pytest
import torch
from torch import nn

import fxfuse
from fxfuse.errors import TracingError
from fxfuse.fusion import tracing
from fxfuse.testing import assert_equivalent

F64 = torch.float64


class Tracker(nn.Module):
    """Counts every call and training step and keeps an EMA of its input's channel means."""

    def __init__(self, c):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(c))

    def forward(self, y):
        self.calls.add_(1)
        if self.training:
            self.steps += 1
            self.ema.mul_(0.9).add_(y.detach().mean((0, 2, 3)), alpha=0.1)
        return y


class HandNorm(nn.Module):
    """A hand-written per-channel norm with running statistics updated by `running_mean.mul_(...)`."""

    def __init__(self, c, momentum=0.2):
        super().__init__()
        self.momentum = momentum
        self.register_buffer("running_mean", torch.zeros(1, c, 1, 1))

    def forward(self, y):
        if self.training:
            mean = y.mean((0, 2, 3), keepdim=True)
            self.running_mean.mul_(1 - self.momentum).add_(mean.detach(), alpha=self.momentum)
        else:
            mean = self.running_mean
        return y - mean


class PlainCounter(nn.Module):
    """Keeps its counter as a plain tensor attribute: torch.fx cannot see writes to it."""

    def __init__(self):
        super().__init__()
        self.count = torch.zeros((), dtype=torch.long)

    def forward(self, y):
        self.count.add_(1)
        return y


class StatefulNet(nn.Module):
    def __init__(self, counter=False):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.track = Tracker(8)
        self.norm = HandNorm(8)
        self.counter = PlainCounter() if counter else nn.Identity()
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=None)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        y = self.track(torch.relu(self.bn1(self.conv1(x))))
        y = self.counter(self.norm(y))
        y = torch.relu(self.bn2(self.conv2(y)))
        return self.head(y.mean((2, 3)))


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_state_identical(model, snapshot):
    state = model.state_dict()
    assert state.keys() == snapshot.keys()
    changed = [k for k, v in state.items() if not torch.equal(v, snapshot[k])]
    assert not changed, f"optimize changed {changed}"


@pytest.mark.parametrize("counter", [False, True], ids=["buffers", "plain-attribute"])
def test_optimize_leaves_every_tensor_bit_identical(counter):
    model = StatefulNet(counter).to(F64)
    before = _snapshot(model)
    count = model.counter.count.clone() if counter else None
    fxfuse.optimize(model, torch.randn(2, 3, 8, 8, dtype=F64))
    _assert_state_identical(model, before)
    if counter:
        assert torch.equal(model.counter.count, count)


@pytest.mark.parametrize("counter", [False, True], ids=["buffers", "plain-attribute"])
def test_state_updates_run_every_call_in_train_and_eval(counter):
    torch.manual_seed(0)
    model = StatefulNet(counter).to(F64)
    x = torch.randn(2, 3, 8, 8, dtype=F64)
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    assert len(optimized.fxfuse_report.fused) == 2
    assert_equivalent(model, optimized, x, steps=3)
    # The same three steps and two eval calls by hand: the counters themselves.
    for m in (model, optimized):
        for _ in range(3):
            m.train()(x).sum().backward()
        m.eval()(x), m(x)
    for m in (model, optimized):
        assert m.track.calls.item() == 5 and m.track.steps.item() == 3
        assert m.bn2.num_batches_tracked.item() == 3
        if counter:
            assert m.counter.count.item() == 5
    torch.testing.assert_close(optimized.norm.running_mean, model.norm.running_mean, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(optimized.track.ema, model.track.ema, rtol=1e-12, atol=1e-14)


def test_unrecordable_write_makes_the_module_a_leaf_with_a_reason():
    model = StatefulNet(counter=True)
    report = fxfuse.explain(model)
    notes = [n for n in report.notes if n.startswith("counter:")]
    assert notes and "changes counter.count" in notes[0] and "kept as a leaf" in notes[0]
    assert model.counter.count.item() == 0


class RootCounter(StatefulNet):
    def __init__(self):
        super().__init__()
        self.calls = torch.zeros((), dtype=torch.long)

    def forward(self, x):
        self.calls.add_(1)
        return super().forward(x)


def test_unrecordable_write_in_the_root_optimizes_its_submodules_and_changes_nothing():
    torch.manual_seed(0)
    model = RootCounter().to(F64)
    before = _snapshot(model)
    x = torch.randn(2, 3, 8, 8, dtype=F64)
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    _assert_state_identical(model, before)
    assert optimized.calls.item() == 0
    notes = optimized.fxfuse_report.notes
    assert any("RootCounter: forward is not traceable" in n and "changes calls" in n for n in notes), notes
    assert_equivalent(model, optimized, x, steps=3)
    optimized(x)
    assert optimized.calls.item() == 1


def test_unrecordable_write_everywhere_is_an_error_that_changes_nothing():
    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
            self.calls = torch.zeros((), dtype=torch.long)

        def forward(self, x):
            self.calls.add_(1)
            return self.bn(self.conv(x))

    model = Counting()
    with pytest.raises(TracingError, match="changes calls"):
        fxfuse.optimize(model)
    assert model.calls.item() == 0 and not fxfuse.fusion.is_optimized(model)


def test_batchnorm_counter_traced_through_counts_every_step():
    """The pattern timm's BatchNormAct2d had: a BN subclass with a hand-copied forward, traced through."""

    class CopiedBN(nn.BatchNorm2d):
        def forward(self, x):
            torch._assert(x.ndim == 4, "expected 4D input")
            self.num_batches_tracked.add_(1)
            return torch.nn.functional.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias, self.training, 0.1, self.eps
            )

    model = nn.Sequential(nn.Conv2d(3, 4, 3), CopiedBN(4), nn.ReLU()).to(F64)
    x = torch.randn(2, 3, 8, 8, dtype=F64)
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    assert [s.pattern for s in optimized.fxfuse_report.fused] == ["conv2d→batch_norm2d→relu"]
    assert model[1].num_batches_tracked.item() == 0
    assert_equivalent(model, optimized, x, steps=3)
    with pytest.raises(AssertionError, match="expected 4D input"):
        optimized(torch.randn(3, 8, 8, dtype=F64))


class Tied(nn.Module):
    """A parameter under two names (weight tying), a buffer, a plain tensor attribute, shape-dependent padding."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3), nn.Conv2d(3, 4, 3)
        self.b.weight = self.a.weight
        self.bn = nn.BatchNorm2d(4)
        self.register_buffer("shift", torch.ones(4, 1, 1))
        self.scale = torch.full((4, 1, 1), 2.0)  # not registered: a constant of the graph

    def forward(self, x):
        x = torch.nn.functional.pad(x, [0, x.shape[-1] % 2, 0, 0])
        y = torch.nn.functional.conv2d(x, self.a.weight, self.a.bias) + self.b(x)
        return self.bn(y + torch.nn.functional.conv2d(x, self.b.weight, self.b.bias)) * self.scale + self.shift


@pytest.mark.parametrize("concrete", [False, True], ids=["symbolic", "concrete"])
def test_parameter_lookup_by_identity_gives_torch_fx_graph(monkeypatch, concrete):
    """FxFuseTracer.getattr finds parameters and buffers in a map instead of torch.fx's scan: the same graph."""
    from fxfuse.fusion import tracing

    model, x = Tied(), torch.randn(2, 3, 7, 7)
    inputs = (x,) if concrete else None
    ours = tracing.trace(model, example_inputs=inputs).graph
    monkeypatch.setattr(tracing.FxFuseTracer, "getattr", torch.fx.Tracer.getattr)
    theirs = tracing.trace(model, example_inputs=inputs).graph
    assert str(ours) == str(theirs)
    attrs = {n.target for n in ours.nodes if n.op == "get_attr"}
    assert {"a.weight", "a.bias", "b.bias", "shift", "scale"} <= attrs and "b.weight" not in attrs  # tied: first name


class OptionalArgs(nn.Module):
    """Branches on optional arguments as model code does: `if scale is None:`, a bool flag, a keyword-only int."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x, scale=None, double=False, *, shift=0):
        y = self.bn(self.conv(x))
        if scale is None:
            y = y * 3
        else:
            y = y * scale
        if double:
            y = y * 2
        return y + shift


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((), {}),
        ((None,), {}),
        ((None, True), {}),
        ((), {"double": True}),
        ((), {"scale": None, "shift": 2}),
        ((torch.full((1, 4, 1, 1), 0.5, dtype=F64),), {}),
        ((), {"scale": torch.full((1, 4, 1, 1), 0.5, dtype=F64), "double": True}),
    ],
    ids=["x", "x-None", "x-None-True", "double", "scale-None-shift", "scale-tensor", "scale-tensor-double"],
)
@pytest.mark.parametrize("with_inputs", [False, True], ids=["no-example", "example"])
def test_optional_arguments_take_the_branch_eager_takes(args, kwargs, with_inputs):
    """torch.fx makes optional arguments placeholders, on which `is None` is always False: the graph took the
    `scale` branch and multiplied by None (or silently skipped `y * 3`). They are bound per call pattern."""
    torch.manual_seed(0)
    model = OptionalArgs().double()
    x = torch.randn(2, 3, 8, 8, dtype=F64)
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,) if with_inputs else None)
    assert optimized.fxfuse_report.fused
    for _ in range(2):  # the second call runs the graph the first built
        expected, got = model(x, *args, **kwargs), optimized(x, *args, **kwargs)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(optimized.bn.running_mean, model.bn.running_mean, rtol=1e-12, atol=1e-12)


def test_a_call_pattern_gets_its_own_graph_and_the_example_s_graph_is_fused():
    from fxfuse.fusion import install

    model = OptionalArgs().double()
    x = torch.randn(2, 3, 8, 8, dtype=F64)
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,))
    graph = install.graph_for(optimized, x)
    assert graph is not None and not any(n.target is torch._assert for n in graph.nodes)
    assert install.graph_for(optimized, x, None, True) is None  # not built until called
    optimized(x, None, True)
    assert install.graph_for(optimized, x, None, True) is not None
    assert install.graph_for(optimized, x, None, 1) is None  # 1 is not True: its own pattern


class Layer(nn.Module):
    """An HF-style layer: called with positional None and bool arguments it branches on."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, h, mask=None, output_attentions=False):
        y = torch.relu(self.bn(self.conv(h)))
        if mask is not None:
            y = y * mask
        return (y, y.mean()) if output_attentions else (y,)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.log = []

    def forward(self, h):
        for layer in self.layers:
            h = layer(h, None, False)[0]
        self.log.append(1)  # a write torch.fx cannot record: the root runs as written, its layers are optimized
        return h


def test_submodules_called_with_none_and_flags_are_optimized_for_those_calls():
    torch.manual_seed(0)
    model = Encoder().double()
    x = torch.randn(2, 4, 8, 8, dtype=F64)
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,))
    assert_equivalent(model, optimized, x, dtype=F64)
    from fxfuse.fusion import install

    optimized(x)  # builds the layers' graphs for (h, None, False)
    graph = install.graph_for(optimized.layers[0], x, None, False)
    assert graph is not None and any("conv_bn_act" in str(n.target) for n in graph.nodes)


def test_hf_model_called_as_it_is_keeps_its_output_type_and_options():
    """A bare HF MobileNetV1Model: its forward branches on `output_hidden_states` (an optional argument) and
    its TF padding on the input's shape. Before, optimize raised; now it fuses every conv and returns the
    model's own output type, and a call with options runs as eager does."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MobileNetV1Config(depth_multiplier=0.25, num_channels=3)
    model = transformers.MobileNetV1Model(config).double().train()
    x = torch.randn(2, 3, 32, 32, dtype=F64)
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,))
    assert len(optimized.fxfuse_report.fused) == 27
    expected, got = model(x), optimized(x)
    assert type(got) is type(expected)
    torch.testing.assert_close(got.last_hidden_state, expected.last_hidden_state, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got.pooler_output, expected.pooler_output, rtol=1e-9, atol=1e-9)
    (got.last_hidden_state.sum() + got.pooler_output.sum()).backward()
    (expected.last_hidden_state.sum() + expected.pooler_output.sum()).backward()
    for (name, p), q in zip(model.named_parameters(), optimized.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-9, msg=name)
    expected = model(x, output_hidden_states=True, return_dict=False)
    got = optimized(x, output_hidden_states=True, return_dict=False)
    assert type(got) is tuple and len(got) == len(expected) == 3 and len(got[2]) == len(expected[2])
    torch.testing.assert_close(got[0], expected[0], rtol=1e-9, atol=1e-9)


def test_dict_outputs_keep_their_type():
    import collections

    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

        def forward(self, x):
            out = collections.OrderedDict()
            out["out"] = self.bn(self.conv(x))
            out["aux"] = x.mean()
            return out

    model = Heads().double()
    x = torch.randn(2, 3, 8, 8, dtype=F64)
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,))
    got = optimized(x)
    assert type(got) is collections.OrderedDict and list(got) == ["out", "aux"]
    torch.testing.assert_close(got["out"], model(x)["out"], rtol=1e-12, atol=1e-12)


class _OddPad(nn.Module):
    """TF-style 'same' padding: Python on the input's shape, traced with concrete shapes."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x):
        if x.shape[-1] % 2:
            x = torch.nn.functional.pad(x, (1, 1, 1, 1))
        return self.bn(self.conv(x))


class _KeywordNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _OddPad()

    def forward(self, x, mask=None, scale: float = 1.0, **kwargs):
        y = self.block(x) * scale
        return y if mask is None else y * mask


def test_a_keyword_call_traces_shape_dependent_code_with_its_own_inputs():
    """HF models are called `model(pixel_values=x)`: the graph such a call builds traced shape-dependent
    submodules with no example inputs (they were positional only), so they stayed unfused leaves."""
    from fxfuse.fusion import install

    torch.manual_seed(0)
    model = _KeywordNet().double()
    x, mask = torch.randn(2, 3, 9, 9, dtype=F64), torch.rand(2, 4, 9, 9, dtype=F64)
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,))
    for kwargs in ({"x": x}, {"mask": mask, "x": x}, {"scale": 2.0, "x": x, "mask": mask}):
        torch.testing.assert_close(optimized(**kwargs), model(**kwargs), rtol=1e-12, atol=1e-12)
        graph = install.graph_for(optimized, **kwargs)
        assert graph is not None and any("conv_bn_act" in str(n.target) for n in graph.nodes), kwargs
        before = tracing.trace_count
        optimized(**kwargs)
        assert tracing.trace_count == before, "a second call of the same pattern traced again"
    assert not any("not traceable" in note for note in optimized.fxfuse_report.notes), optimized.fxfuse_report.notes


def test_a_call_in_signature_order():
    forward = _KeywordNet.forward
    assert tracing.in_signature_order(forward, (1,), {"scale": 2.0}) == (1, None, 2.0)
    assert tracing.in_signature_order(forward, (), {"mask": 3, "x": 1}) == (1, 3, 1.0)
    assert tracing.in_signature_order(forward, (), {"mask": 3}) is None  # x missing
    assert tracing.in_signature_order(forward, (1,), {"other": 3}) is None  # goes to **kwargs


def _stem():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU())


class AugmentedView(nn.Module):
    """`v += 1` on a view: eager writes into `y`, a graph would add into a new tensor and leave `y`."""

    def __init__(self):
        super().__init__()
        self.stem, self.conv = _stem(), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = self.conv(self.stem(x))
        v = y[:, :2]
        v += 1
        return torch.relu(y)


class AugmentedAlias(nn.Module):
    """`y += 1` while another name still holds `y`: eager's `z` is `y` changed."""

    def __init__(self):
        super().__init__()
        self.stem, self.conv = _stem(), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = self.conv(self.stem(x))
        z = y
        y += 1
        return z * 2 + y


class AugmentedInput(nn.Module):
    """`x += 1` on the forward's input: eager changes the caller's tensor."""

    def __init__(self):
        super().__init__()
        self.stem = _stem()

    def forward(self, x):
        x += 1
        return self.stem(x)


class AugmentedFresh(nn.Module):
    """ResNet's `out += identity` on a tensor nothing else holds: the graph's new tensor is eager's."""

    def __init__(self):
        super().__init__()
        self.stem, self.conv, self.bn = _stem(), nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)

    def forward(self, x):
        identity = self.stem(x)
        out = self.bn(self.conv(identity))
        out += identity
        return torch.relu(out)


@pytest.mark.parametrize("model_class", [AugmentedView, AugmentedAlias])
def test_an_augmented_assignment_another_name_reads_stays_untraced_and_exact(model_class):
    torch.manual_seed(0)
    model = model_class().double()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    with pytest.raises(TracingError, match="records as a new tensor"):
        tracing.trace(model)
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    assert any("records as a new tensor" in note for note in optimized.fxfuse_report.notes)
    assert optimized.fxfuse_report.fused  # the stem, optimized on its own
    assert_equivalent(model, optimized, x, dtype=torch.float64, steps=2)


def test_an_augmented_assignment_to_the_input_changes_the_callers_tensor_as_eager():
    torch.manual_seed(0)
    model = AugmentedInput().double()
    optimized = fxfuse.optimize(copy.deepcopy(model), torch.randn(2, 3, 6, 6, dtype=torch.float64))
    assert any("the caller's input" in note for note in optimized.fxfuse_report.notes)
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    xs = [x.clone(), x.clone()]
    torch.testing.assert_close(optimized(xs[1]), model(xs[0]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(xs[1], xs[0], rtol=0, atol=0)
    torch.testing.assert_close(xs[0], x + 1, rtol=0, atol=0)


def test_an_augmented_assignment_nothing_else_reads_is_traced():
    torch.manual_seed(0)
    model = AugmentedFresh().double()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    tracing.trace(model)
    optimized = fxfuse.optimize(copy.deepcopy(model), x)
    assert len(optimized.fxfuse_report.fused) == 2, optimized.fxfuse_report
    assert_equivalent(model, optimized, x, dtype=torch.float64, steps=2)
