"""The model's own torch.utils.checkpoint calls (fusion/user_checkpoint.py): kept as checkpoint regions,
fused inside, with eager's outputs, gradients and state (running statistics advance twice per step)."""

import copy
import importlib
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import fxfuse
from fxfuse import measure
from fxfuse.fusion import user_checkpoint
from fxfuse.testing import assert_equivalent

install_module = importlib.import_module("fxfuse.fusion.install")


class Block(nn.Module):
    def __init__(self, c=8, p=0.0):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.drop = nn.Dropout(p)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(self.bn2(self.conv2(self.drop(torch.relu(self.bn1(self.conv1(x)))))) + x)


class Net(nn.Module):
    """stem, then each block under `checkpoint(block, x, **options)` (None: no checkpoint), then a head."""

    def __init__(self, p=0.0, **options):
        super().__init__()
        self.options = options
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.Sequential(Block(p=p), Block(p=p))
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = checkpoint(block, x, **self.options)
        return self.fc(x.mean((2, 3)))


@pytest.fixture(autouse=True, params=["impl", "parts"])
def route(request, monkeypatch):
    """Every test through both ways of intercepting checkpoint calls: torch < 2.14 has only "parts"."""
    if request.param == "impl" and not hasattr(torch.utils.checkpoint, "_checkpoint_impl"):
        pytest.skip("this torch's checkpoint has no _checkpoint_impl (torch < 2.14): only the parts route applies")
    monkeypatch.setattr(user_checkpoint, "ROUTE", request.param)
    return request.param


def _x(n=2, c=3, size=8):
    return torch.randn(n, c, size, size, dtype=torch.float64)


def _checkpoint_calls(model: nn.Module) -> list:
    state = model.__dict__[install_module._STATE]
    graph = state.fx_graphs[install_module._key(state, pattern=state.last_pattern)]
    return [n.target for n in graph.nodes if isinstance(n.target, user_checkpoint.CheckpointCall)]


def _saved_bytes(model, x):
    return measure.saved_activation_bytes(model, (x.clone().requires_grad_(),))


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_regions_are_kept_fused_and_exact(reentrant):
    model = Net(use_reentrant=reentrant).double()
    optimized = fxfuse.optimize(copy.deepcopy(model))
    calls = _checkpoint_calls(optimized)
    assert [c.name for c in calls] == ["checkpoint(blocks.0)", "checkpoint(blocks.1)"]
    assert all(c.reentrant == reentrant for c in calls)
    notes = "\n".join(optimized.fxfuse_report.notes)
    assert "checkpoint(blocks.0): the model's own torch.utils.checkpoint" in notes and "fused call(s) inside" in notes
    assert "win over fxfuse's recompute regions" in notes
    assert any(s.modules[0].startswith("blocks.0") for s in optimized.fxfuse_report.fused)  # fused inside
    x = _x()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # reentrant: "None of the inputs have requires_grad=True"
        assert_equivalent(model, optimized, x, dtype=torch.float64)
        assert _saved_bytes(optimized, x) <= _saved_bytes(model, x)


class RawInput(nn.Module):
    """The first block checkpointed on the model's input itself, which (as in training) does not require grad."""

    def __init__(self, p=0.0, **options):
        super().__init__()
        self.options = options
        self.block = Block(c=3, p=p)
        self.fc = nn.Linear(3, 4)

    def forward(self, x):
        return self.fc(checkpoint(self.block, x, **self.options).mean((2, 3)))


def _train_like_eager(eager, fused, x, steps=2):
    """`steps` forward/backward/SGD steps of both models from the same RNG state at each step (backward
    included: a recompute without preserve_rng_state draws from it), compared; returns eager's gradients."""
    grads = {"eager": [], "fused": []}
    for name, model in (("eager", eager), ("fused", fused)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(steps):
            torch.manual_seed(100 + step)
            opt.zero_grad(set_to_none=True)
            model(x).sum().backward()
            grads[name].append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
            opt.step()
    for e, f in zip(grads["eager"], grads["fused"]):
        assert e.keys() == f.keys()
        for n in e:
            assert (e[n] is None) == (f[n] is None), n
            if e[n] is not None:
                torch.testing.assert_close(f[n], e[n], rtol=1e-9, atol=1e-12, msg=n)
    for (n, a), (_, b) in zip(eager.state_dict().items(), fused.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12, msg=n)
    return grads["eager"]


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_kind_is_kept_for_an_input_without_grad(reentrant):
    """Reentrant checkpointing of an input that does not require grad gives the region's parameters no
    gradient (eager warns "None of the inputs have requires_grad=True"); non-reentrant gives them one.
    assert_equivalent's inputs require grad, where both kinds compute the same: this is what tells them apart."""
    model = RawInput(use_reentrant=reentrant).double()
    optimized = fxfuse.optimize(copy.deepcopy(model))
    assert any(s.modules[0].startswith("block") for s in optimized.fxfuse_report.fused)  # fused inside
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        grads = _train_like_eager(model, optimized, _x())
    assert (grads[0]["block.conv1.weight"] is None) == reentrant  # the two kinds do differ here


@pytest.mark.parametrize("reentrant", [False, True])
def test_preserve_rng_state_false_is_kept(reentrant):
    """Dropout under preserve_rng_state=False: eager's recompute draws a new mask from the RNG state at
    backward; a recompute that restored the state (the default) would give other gradients."""
    model = RawInput(p=0.3, use_reentrant=reentrant, preserve_rng_state=False).double()
    optimized = fxfuse.optimize(copy.deepcopy(model))
    x = _x().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _train_like_eager(model, optimized, x)
        # the option matters here: with preserve_rng_state=True eager's gradients are other ones
        preserved = copy.deepcopy(model)
        preserved.options = dict(use_reentrant=reentrant)
        with pytest.raises(AssertionError):
            _train_like_eager(copy.deepcopy(model), preserved, x, steps=1)


def test_batch_norm_state_advances_twice_per_step_as_in_eager():
    model = Net(use_reentrant=False).double()
    optimized = fxfuse.optimize(copy.deepcopy(model))
    x = _x()
    for m in (model, optimized):
        m(x.clone().requires_grad_()).sum().backward()
    assert int(model.blocks[0].bn1.num_batches_tracked) == 2  # eager's recompute runs the BN again
    assert int(optimized.blocks[0].bn1.num_batches_tracked) == 2
    assert int(optimized.stem[1].num_batches_tracked) == 1
    torch.testing.assert_close(optimized.blocks[1].bn2.running_var, model.blocks[1].bn2.running_var, rtol=1e-12, atol=0)


class TailBlock(nn.Module):
    """conv → BN → SiLU, then an add: the fused conv→BN→SiLU op holds the region's last saved tensor."""

    def __init__(self, c=8):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.SiLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x))) + x


class TailNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 1)
        self.blocks = nn.Sequential(TailBlock(), TailBlock())

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x.mean((2, 3))


def test_running_statistics_advance_twice_when_a_fused_op_saves_last():
    """Non-reentrant checkpointing stops its recompute early, right after the last saved tensor: where a
    fused BatchNorm op saves it, that stop would skip the op's running-statistics update (fxfuse's BN ops
    update after saving), which eager's recompute makes. fxfuse runs such a recompute to its end."""
    model = TailNet().double()
    optimized = fxfuse.optimize(copy.deepcopy(model))
    assert any(s.modules[0].startswith("blocks.1") for s in optimized.fxfuse_report.fused)
    x = _x()
    for m in (model, optimized):
        m(x.clone().requires_grad_()).sum().backward()
    for name, buffer in model.named_buffers():
        torch.testing.assert_close(optimized.get_buffer(name), buffer, rtol=1e-12, atol=0, msg=name)


class Untraceable(TailBlock):
    """A TailBlock whose forward branches on a tensor's value: torch.fx cannot trace it, so fxfuse
    keeps it a module call and optimizes its children on their own."""

    def __init__(self, c=8):
        super().__init__(c)
        self.body = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.SiLU())

    def forward(self, x):
        if x.mean() > 1e6:
            return x
        return self.body(x) + x


@pytest.mark.parametrize("why", ["hooked", "untraceable"])
def test_running_statistics_advance_twice_in_a_module_optimized_on_its_own(why):
    """The checkpointed block is a module call in the caller's graph (it has a hook, or cannot be traced), and
    its own fused conv→BN→SiLU saves the region's last tensor: the recompute must still run to the end."""
    model = TailNet().double()
    if why == "hooked":
        model.blocks[1].register_forward_hook(lambda module, args, out: None)
    else:
        model.blocks[1] = Untraceable().double()
    optimized = fxfuse.optimize(copy.deepcopy(model))
    assert any(s.modules[0].startswith("blocks.1.") for s in optimized.fxfuse_report.fused)
    x = _x()
    for m in (model, optimized):
        m(x.clone().requires_grad_()).sum().backward()
    for name, buffer in model.named_buffers():
        torch.testing.assert_close(optimized.get_buffer(name), buffer, rtol=1e-12, atol=0, msg=name)


def test_checkpoint_options_are_passed_on(monkeypatch):
    """Dropout under preserve_rng_state, context_fn (called as often as in eager) and determinism_check."""
    entered = []

    def context_fn():
        entered.append(1)
        return torch.utils.checkpoint.noop_context_fn()

    options = dict(use_reentrant=False, preserve_rng_state=True, context_fn=context_fn, determinism_check="none")
    model = Net(p=0.3, **options).double()
    assert_equivalent(model, fxfuse.optimize(copy.deepcopy(model)), _x(), dtype=torch.float64)
    eager_calls = len(entered)
    entered.clear()
    optimized = fxfuse.optimize(copy.deepcopy(model))
    optimized(_x().requires_grad_()).sum().backward()
    one_step = len(entered)
    entered.clear()
    copy.deepcopy(model)(_x().requires_grad_()).sum().backward()
    assert one_step == len(entered) == 2 and eager_calls > 0  # once per checkpoint call
    assert [c.options["context_fn"] for c in _checkpoint_calls(optimized)] == [context_fn, context_fn]
    # what reaches torch.utils.checkpoint at run time: every option the model gave (determinism_check="none"
    # only shows where a recompute's tensors differ from the forward's, which eager then reports)
    passed, real = [], torch.utils.checkpoint.checkpoint

    def spy(function, *args, **kwargs):
        passed.append({k: kwargs.get(k) for k in options})
        return real(function, *args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", spy)
    optimized(_x().requires_grad_()).sum().backward()
    assert passed == [options, options]


class Sequential(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.layers = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, bias=False),
            nn.BatchNorm2d(8),
            nn.SiLU(),
            Block(),
            Block(),
        )

    def forward(self, x):
        return checkpoint_sequential(self.layers, 2, x, use_reentrant=self.reentrant).mean((2, 3))


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_sequential(reentrant):
    model = Sequential(reentrant).double()
    optimized = fxfuse.optimize(copy.deepcopy(model))
    assert len(_checkpoint_calls(optimized)) == 1  # the last segment runs without checkpoint, as in eager
    assert len(optimized.fxfuse_report.fused) >= 4
    x = _x()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert_equivalent(model, optimized, x, dtype=torch.float64)
        assert _saved_bytes(optimized, x) <= _saved_bytes(model, x)


class Closure(nn.Module):
    """A nested checkpoint, a function closing over a traced tensor, and a keyword argument."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 1)
        self.outer, self.inner = Block(), Block()

    def forward(self, x):
        x = self.stem(x)
        scale = x.mean((0, 2, 3), keepdim=True).sigmoid()

        def run(t, *, shift):
            t = checkpoint(self.inner, self.outer(t) * scale + shift, use_reentrant=False)
            return t, t.relu()

        a, b = checkpoint(run, x, shift=1.0, use_reentrant=False)
        return (a + b).mean((2, 3))


def test_nested_checkpoint_closure_and_two_outputs():
    model = Closure().double()
    optimized = fxfuse.optimize(copy.deepcopy(model))
    (outer,) = _checkpoint_calls(optimized)
    assert outer.name == "checkpoint(outer…inner)"
    assert_equivalent(model, optimized, _x(), dtype=torch.float64)


class CrossBoundary(nn.Module):
    """A BN outside the checkpoint, its ReLU inside: fused, the BN would run (and update) in the recompute."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.other = nn.Conv2d(3, 8, 1)

    def forward(self, x):
        y = self.bn(self.conv(x))
        return checkpoint(lambda t: torch.relu(y) * t, self.other(x), use_reentrant=False).mean((2, 3))


def test_no_site_crosses_a_checkpoint_boundary():
    model = CrossBoundary().double()
    optimized = fxfuse.optimize(copy.deepcopy(model))
    assert any(user_checkpoint.CROSSES in s.reason for s in optimized.fxfuse_report.skipped)
    assert not optimized.fxfuse_report.fused
    assert _checkpoint_calls(optimized)[0].name.startswith("checkpoint(CrossBoundary.forward.<locals>.<lambda>")
    assert_equivalent(model, optimized, _x(), dtype=torch.float64)


class NestedCrossBoundary(nn.Module):
    """Inside an outer checkpoint, a BN whose ReLU is in an inner one: the inner boundary splits conv→BN→ReLU."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.other = nn.Conv2d(3, 8, 1)

    def forward(self, x):
        def outer(t):
            y = self.bn(self.conv(t))
            return checkpoint(lambda u: torch.relu(y) * u, self.other(t), use_reentrant=False)

        return checkpoint(outer, x, use_reentrant=False).mean((2, 3))


def test_no_site_crosses_a_nested_checkpoint_boundary():
    """A node traced in an inner region belongs to it, not to the outer one around it: fused across the
    inner boundary, the BN would run (and update its statistics) in the inner region's recomputes too."""
    model = NestedCrossBoundary().double()
    optimized = fxfuse.optimize(copy.deepcopy(model))
    assert any(user_checkpoint.CROSSES in s.reason for s in optimized.fxfuse_report.skipped)
    assert_equivalent(model, optimized, _x(), dtype=torch.float64)


class BadArguments(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return checkpoint(lambda t, k: self.block(t) * k, x, k=2.0, use_reentrant=True)


def test_arguments_eager_rejects_raise_eagers_error():
    model = BadArguments().double()
    optimized = fxfuse.optimize(copy.deepcopy(model))
    assert "Unexpected keyword arguments: k" in "\n".join(optimized.fxfuse_report.notes)
    for m in (model, optimized):
        with pytest.raises(ValueError, match="Unexpected keyword arguments: k"):
            m(_x(c=8))


def test_memory_budget_never_recomputes_around_a_users_checkpoint():
    model = Net(use_reentrant=False).double()
    x = _x()
    optimized = fxfuse.optimize(copy.deepcopy(model), x, memory_budget=0.3)
    assert len(_checkpoint_calls(optimized)) == 2
    chosen = optimized.__dict__[install_module._STATE].options.plan.regions
    assert not [g for g in chosen if any(name.startswith("blocks") for name in g)], chosen
    assert_equivalent(model, optimized, x, dtype=torch.float64)


def _timm_resnet50():
    timm = pytest.importorskip("timm")
    model = timm.create_model("resnet50", num_classes=10).double()
    model.set_grad_checkpointing(True)
    return model


def test_timm_resnet50_grad_checkpointing(single_thread):
    model = _timm_resnet50()
    optimized = fxfuse.optimize(copy.deepcopy(model))
    names = [c.name for c in _checkpoint_calls(optimized)]
    assert names == [f"checkpoint(layer{i}.{j})" for i, n in zip(range(1, 5), (3, 4, 6, 3)) for j in range(n)]
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    assert_equivalent(model, optimized, x, dtype=torch.float64)
    assert _saved_bytes(optimized, x) <= _saved_bytes(model, x)


def test_switching_checkpointing_off_after_optimize_rebuilds(single_thread):
    timm = pytest.importorskip("timm")
    model = timm.create_model("resnet18", num_classes=10).double()
    model.set_grad_checkpointing(True)
    optimized = fxfuse.optimize(copy.deepcopy(model))
    for m in (model, optimized):
        m.set_grad_checkpointing(False)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    for m in (model, optimized):
        m(x).sum().backward()
    assert _checkpoint_calls(optimized) == []
    assert int(optimized.layer1[0].bn1.num_batches_tracked) == int(model.layer1[0].bn1.num_batches_tracked) == 1


class HFWrapper(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(inputs_embeds=x).last_hidden_state


def _bert(reentrant):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertModel(config, add_pooling_layer=False).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    return HFWrapper(model)


@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_transformers_gradient_checkpointing(reentrant):
    model = _bert(reentrant)
    optimized = fxfuse.optimize(copy.deepcopy(model))
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    # BERT's forward reads its input's shape: without example inputs it is captured at its first call.
    assert not optimized.fxfuse_report.fused
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        optimized(x)
        assert optimized.fxfuse_report.fused  # the MLP's GELU → Linear inside each layer
        assert_equivalent(model, optimized, x, dtype=torch.float64)
        # The layers' own checkpointing stays: what is saved is what eager saves with it, far below
        # what eager saves without it.
        unchecked = copy.deepcopy(model)
        unchecked.model.gradient_checkpointing_disable()
        assert _saved_bytes(optimized, x) <= _saved_bytes(model, x) < _saved_bytes(unchecked, x) / 2


def _torch_checkpoint_state():
    """What fxfuse patches while tracing: torch.utils.checkpoint's functions and CheckpointFunction's own apply."""
    import torch.utils.checkpoint as tc

    names = ("_checkpoint_impl", *user_checkpoint._GENERATORS)
    return {n: getattr(tc, n) for n in names if hasattr(tc, n)}, tc.CheckpointFunction.__dict__.get("apply")


def test_tracing_puts_torch_checkpoint_back_as_it_was():
    before = _torch_checkpoint_state()
    for reentrant in (True, False):
        model = fxfuse.optimize(Net(use_reentrant=reentrant).double())
        assert _checkpoint_calls(model)
    after = _torch_checkpoint_state()
    assert after[0] == before[0] and after[1] is before[1]


def test_a_torch_without_the_patched_functions_stops_tracing_with_the_reason(monkeypatch):
    """Where torch.utils.checkpoint has none of what fxfuse patches (a future torch), optimize says so
    instead of tracing through the checkpoint, which would drop it silently (BatchNorm statistics would
    then advance once a step, where eager's recompute advances them twice)."""
    import types

    import torch.utils.checkpoint as tc

    bare = types.SimpleNamespace(noop_context_fn=tc.noop_context_fn, checkpoint=tc.checkpoint)
    monkeypatch.setattr(user_checkpoint, "torch_checkpoint", bare)
    monkeypatch.setattr(user_checkpoint, "ROUTE", None)
    with pytest.raises(fxfuse.TracingError, match="cannot keep torch.utils.checkpoint regions on torch"):
        fxfuse.optimize(Net(use_reentrant=False).double())


def test_optimize_in_several_threads_keeps_every_checkpoint_and_restores_torch():
    """The patches are process-wide: traces in several threads take turns, and torch.utils.checkpoint
    is as it was afterwards."""
    import threading

    before = _torch_checkpoint_state()
    results, errors = [], []

    def run(reentrant):
        try:
            results.append(fxfuse.optimize(Net(use_reentrant=reentrant).double()))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i % 2 == 0,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 4
    assert all(len(_checkpoint_calls(m)) == 2 for m in results)
    after = _torch_checkpoint_state()
    assert after[0] == before[0] and after[1] is before[1]
