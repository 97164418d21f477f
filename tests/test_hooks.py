"""Module hooks after fxfuse.optimize fire as in eager, with the same tensors (issue 33 §1).

Every kind of module hook, registered before optimize or after it (and after a first
forward), on a fused module and on a module fxfuse traced through; hooks removed again;
global module hooks; torch.nn.utils.prune and parametrizations.weight_norm. Each is
compared with the same model in eager, in float64, over two train steps and an eval.
"""

import copy
import importlib

import pytest
import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.nn.utils import parametrizations, prune
from torch.utils._python_dispatch import TorchDispatchMode

import fxfuse
from fxfuse.fusion.plan import Options, Plan
from fxfuse.testing import assert_equivalent

optimize_module = importlib.import_module("fxfuse.fusion.optimize")
install_module = importlib.import_module("fxfuse.fusion.install")

TOL = 1e-9


class Block(nn.Module):
    """A residual block fxfuse traces through."""

    def __init__(self, c=4):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x))) + x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU())
        self.block = Block()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.norm = nn.LayerNorm(4)
        self.fc1 = nn.Linear(4, 8)
        self.gelu = nn.GELU()
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x):
        x = self.pool(self.block(self.stem(x))).flatten(1)
        return self.fc2(self.gelu(self.fc1(self.norm(x))))


def _net():
    torch.manual_seed(0)
    return Net().double()


def _input():
    return torch.randn(2, 3, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


class CountFxfuseOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fxfuse":
            self.count += 1
        return func(*args, **(kwargs or {}))


def _fxfuse_ops(model, x) -> int:
    """How many fxfuse ops an eval forward runs (it changes no state)."""
    training = model.training
    model.eval()
    with torch.no_grad(), CountFxfuseOps() as counter:
        model(x)
    model.train(training)
    return counter.count


# Each kind: register(module, records) -> handle. Hooks record what they receive; the
# "modify" ones also change the value passed on, which the model's output must show.
def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value.detach().clone()]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return [value]


HOOKS = {
    "forward_pre": lambda m, rec: m.register_forward_pre_hook(lambda mod, args: rec.append(_tensors(args))),
    "forward_pre_kwargs_modify": lambda m, rec: m.register_forward_pre_hook(
        lambda mod, args, kwargs: rec.append(_tensors(args)) or ((args[0] * 1.5, *args[1:]), kwargs),
        with_kwargs=True,
    ),
    "forward": lambda m, rec: m.register_forward_hook(lambda mod, args, out: rec.append(_tensors((args, out)))),
    "forward_modify": lambda m, rec: m.register_forward_hook(lambda mod, args, out: out * 0.5 + 0.25),
    "forward_kwargs_always_call": lambda m, rec: m.register_forward_hook(
        lambda mod, args, kwargs, out: rec.append(_tensors((args, kwargs, out))), with_kwargs=True, always_call=True
    ),
    "full_backward": lambda m, rec: m.register_full_backward_hook(
        lambda mod, gin, gout: rec.append(_tensors((gin, gout)))
    ),
    "full_backward_modify": lambda m, rec: m.register_full_backward_hook(
        lambda mod, gin, gout: tuple(None if g is None else g * 3.0 for g in gin)
    ),
    "backward_pre": lambda m, rec: m.register_full_backward_pre_hook(lambda mod, gout: rec.append(_tensors(gout))),
    "legacy_backward": lambda m, rec: m.register_backward_hook(
        lambda mod, gin, gout: rec.append(_tensors((gin, gout)))
    ),
}

# Modules fxfuse fuses (stem.1: a BN in a conv→BN→ReLU merged into block.conv; norm+fc1: layer_norm_linear;
# gelu+fc2: act_linear), one it traces through (block) and a container it traces through (stem).
TARGETS = ["stem.1", "stem.0", "stem.2", "block", "block.conv", "stem", "norm", "fc1", "gelu", "fc2", ""]


def _run(model, x, register=None, records=None, steps=2):
    """Two SGD steps and an eval forward; `register(model)` right after the first train forward
    when given. Returns outputs, input and parameter gradients and the final state. The input requires
    grad, so that a full backward hook on the first layer gets (and may change) a gradient."""
    torch.manual_seed(5)
    projection = torch.randn(2, 2, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outs, grads = [], []
    for step in range(steps):
        model.train()
        leaf = x.detach().clone().requires_grad_()
        y = model(leaf)
        if step == 0 and register is not None:
            register(model)
        opt.zero_grad()
        (y * projection).sum().backward()
        grads.append({"<input>": leaf.grad.clone()})
        grads[-1].update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        outs.append(y.detach())
    model.eval()
    with torch.no_grad():
        outs.append(model(x))
    return outs, grads, {k: v.clone() for k, v in model.state_dict().items()}


def _assert_close(a, b, what):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape, what
        assert (a - b).abs().max().item() <= TOL * max(1.0, a.abs().max().item()), what
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            _assert_close(a[k], b[k], f"{what}[{k}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{what}: {len(a)} against {len(b)}"
        for i, (u, v) in enumerate(zip(a, b)):
            _assert_close(u, v, f"{what}[{i}]")
    else:
        assert a == b, what


def _compare(eager_run, fused_run, eager_records, fused_records):
    _assert_close(eager_records, fused_records, "hook records")
    _assert_close(eager_run, fused_run, "outputs, gradients, state")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", HOOKS)
@pytest.mark.parametrize("when", ["before", "after"])
def test_hook_fires_as_in_eager(kind, target, when):
    x = _input()
    eager, fused = _net(), _net()
    records = {"eager": [], "fused": []}

    def register(name):
        return lambda model: HOOKS[kind](model.get_submodule(target), records[name])

    if when == "before":
        register("eager")(eager)
        register("fused")(fused)
        fxfuse.optimize(fused)
        eager_run, fused_run = _run(eager, x), _run(fxfuse.optimize(fused), x)
    else:  # registered after optimize and after a first forward
        fxfuse.optimize(fused)
        eager_run = _run(eager, x, register("eager"))
        fused_run = _run(fused, x, register("fused"))
    if kind not in ("forward_modify", "full_backward_modify"):
        # 2 backwards, 3 forwards (two train, one eval), one less when registered after the first forward
        assert len(records["eager"]) == (2 if "backward" in kind else 3) - (when == "after")
    if "modify" in kind:  # the hook does change eager's run, so a fused run without it would differ
        with pytest.raises(AssertionError):
            _assert_close(_run(_net(), x), eager_run, "unhooked against hooked")
    _compare(eager_run, fused_run, records["eager"], records["fused"])


def test_hooked_bn_is_not_fused_and_the_report_says_why():
    model = _net()
    model.stem[1].register_forward_hook(lambda *a: None)
    report = fxfuse.optimize(model).fxfuse_report
    assert not any("stem.1" in s.modules for s in report.fused)
    assert any("stem.1" in s.modules and "forward hook" in s.reason for s in report.skipped), report
    assert any(n.startswith("stem.1: has a forward hook; kept as a module call") for n in report.notes), report


def test_hooked_block_stays_a_module_and_is_optimized_on_its_own():
    model = _net()
    model.block.register_forward_hook(lambda *a: None)
    report = fxfuse.optimize(model).fxfuse_report
    assert any(n.startswith("block: has a forward hook") and "optimized on its own" in n for n in report.notes)
    assert any("block.conv" in s.modules for s in report.fused), report
    assert optimize_module.is_optimized(model.block)


def test_hooks_added_and_removed_after_optimize_switch_graphs():
    x = _input()
    model = fxfuse.optimize(_net())
    fused_ops = _fxfuse_ops(model, x)
    assert fused_ops > 0
    seen = []
    handle = model.stem[1].register_forward_hook(lambda mod, args, out: seen.append(out))
    hooked_ops = _fxfuse_ops(model, x)
    assert len(seen) == 1 and hooked_ops < fused_ops  # stem's conv→BN→ReLU merge is undone
    handle.remove()
    assert _fxfuse_ops(model, x) == fused_ops and len(seen) == 1
    handle = model.block.register_forward_pre_hook(lambda mod, args: seen.append(args))
    # block's own forward is fused on its own: the same fxfuse ops run (stem's alone would also be > 0)
    assert _fxfuse_ops(model, x) == fused_ops and len(seen) == 2
    assert optimize_module.is_optimized(model.block)
    handle.remove()
    assert _fxfuse_ops(model, x) == fused_ops and len(seen) == 2
    assert_equivalent(_net(), model, x, dtype=torch.float64)


class TrainBranchBlock(Block):
    """A Block whose forward branches on `self.training` in Python: tracing bakes the branch into the graph."""

    def forward(self, x):
        y = super().forward(x)
        return y * 0.5 if self.training else y + 1.0


def _train_branch_net():
    net = _net()
    torch.manual_seed(0)
    net.block = TrainBranchBlock().double()
    return net


def test_hook_and_train_eval_switches_combine():
    """With a hook registered after optimize, each train/eval switch still runs that mode's graph (the key
    holds both which modules have hooks and the training flags): block's traced `self.training` branch."""
    x = _input()
    eager, fused = _train_branch_net(), fxfuse.optimize(_train_branch_net())
    seen = {"eager": [], "fused": []}
    outputs = {"eager": [], "fused": []}
    for name, model in (("eager", eager), ("fused", fused)):
        model.block.bn.register_forward_hook(lambda mod, args, out, rec=seen[name]: rec.append(out.clone()))
        for training in (True, False, True, False):
            model.train(training)
            with torch.no_grad():
                outputs[name].append(model(x))
    _assert_close(seen["eager"], seen["fused"], "BN outputs")
    _assert_close(outputs["eager"], outputs["fused"], "model outputs")
    _assert_close(eager.state_dict(), fused.state_dict(), "state")


GLOBAL_HOOKS = {
    "forward_pre": lambda rec: nn_module.register_module_forward_pre_hook(
        lambda mod, args: rec.append((type(mod).__name__, _tensors(args)))
    ),
    "forward": lambda rec: nn_module.register_module_forward_hook(
        lambda mod, args, out: rec.append((type(mod).__name__, _tensors(out)))
    ),
    "full_backward": lambda rec: nn_module.register_module_full_backward_hook(
        lambda mod, gin, gout: rec.append((type(mod).__name__, _tensors((gin, gout))))
    ),
    "backward_pre": lambda rec: nn_module.register_module_full_backward_pre_hook(
        lambda mod, gout: rec.append((type(mod).__name__, _tensors(gout)))
    ),
}


@pytest.mark.parametrize("kind", GLOBAL_HOOKS)
def test_global_hooks_fire_for_every_module_call_then_fusion_resumes(kind):
    x = _input()
    eager, fused = _net(), fxfuse.optimize(_net())
    fused_ops = _fxfuse_ops(fused, x)
    records = {"eager": [], "fused": []}
    runs = {}
    for name, model in (("eager", eager), ("fused", fused)):
        handle = GLOBAL_HOOKS[kind](records[name])
        try:
            with pytest.warns(UserWarning, match="global module hooks") if name == "fused" else _no_context():
                runs[name] = _run(model, x)
            ops = _fxfuse_ops(model, x)  # records, but changes no state
            assert name == "eager" or ops == 0
        finally:
            handle.remove()
    assert records["eager"]
    _compare(runs["eager"], runs["fused"], records["eager"], records["fused"])
    assert _fxfuse_ops(fused, x) == fused_ops


class _no_context:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.fixture(autouse=True)
def _warn_every_time(monkeypatch):
    monkeypatch.setattr(install_module, "_warned_global_hooks", False)


def _pruned(net):
    prune.l1_unstructured(net.stem[0], "weight", amount=0.4)
    prune.random_unstructured(net.fc1, "weight", amount=0.3)
    return net


# A pruned module's `weight` is a computed tensor attribute, which deepcopy refuses (in eager too),
# so these compare with _run rather than assert_equivalent (which copies both models).
def test_prune_before_optimize_trains_exactly():
    x = _input()
    torch.manual_seed(3)
    model = fxfuse.optimize(_pruned(_net()))
    assert any("forward pre hook" in n for n in model.fxfuse_report.notes)
    torch.manual_seed(3)
    _assert_close(_run(_pruned(_net()), x), _run(model, x), "outputs, gradients, state")


def test_prune_after_optimize_and_prune_remove_train_exactly():
    x = _input()
    eager, fused = _net(), fxfuse.optimize(_net())
    fused_ops = _fxfuse_ops(fused, x)
    for model in (eager, fused):
        model.eval()
        model(x)
        torch.manual_seed(3)
        _pruned(model)
    assert _fxfuse_ops(fused, x) < fused_ops
    _assert_close(_run(eager, x), _run(fused, x), "outputs, gradients, state (pruned)")
    for model in (eager, fused):
        prune.remove(model.stem[0], "weight")
        prune.remove(model.fc1, "weight")
    assert _fxfuse_ops(fused, x) == fused_ops
    _assert_close(_run(eager, x), _run(fused, x), "outputs, gradients, state (pruning made permanent)")


def _weight_normed(net):
    parametrizations.weight_norm(net.stem[0])
    parametrizations.weight_norm(net.block.conv)
    parametrizations.weight_norm(net.fc1)
    return net


def test_weight_norm_trains_exactly():
    x = _input()
    model = fxfuse.optimize(_weight_normed(_net()))
    assert_equivalent(_weight_normed(_net()), model, x, dtype=torch.float64)


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.head(self.blocks(x))


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_hooked_module_is_not_recomputed_in_a_region(when):
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    torch.manual_seed(0)
    eager = Chain().double()
    fused = copy.deepcopy(eager)
    counts = {"eager": 0, "fused": 0}

    def hook(name):
        return lambda *args: counts.__setitem__(name, counts[name] + 1)

    eager.blocks[0].conv.register_forward_hook(hook("eager"))
    if when == "before":
        fused.blocks[0].conv.register_forward_hook(hook("fused"))
    options = Options("fast", Plan(regions=(("blocks.0",), ("blocks.1",))))
    report = optimize_module._run(fused, None, options, install=True)
    if when == "before":
        assert any("region blocks.0 not recomputed" in n and "hook" in n for n in report.notes), report.notes
    else:
        fused(x)  # the hook comes after a first forward
        fused.blocks[0].conv.register_forward_hook(hook("fused"))
    for model in (eager, fused):
        model(x).sum().backward()
    assert counts["fused"] == counts["eager"] == 1


def test_feature_hooks_on_resnet_stages_keep_the_fusions_inside():
    """timm's FeatureHooks / torchinfo style: forward hooks on every stage of a torchvision ResNet."""
    torchvision = pytest.importorskip("torchvision")

    def resnet():
        torch.manual_seed(0)
        return torchvision.models.resnet18(num_classes=2).double()

    # 64²: layer4's BNs see 2x2x2 values per channel. At 32² (one value per image) float64 rounding
    # differences between thread counts grow to ~2e-9 of the outputs over the SGD steps.
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    stages = [f"layer{i}" for i in range(1, 5)]
    plain = fxfuse.optimize(resnet()).fxfuse_report
    records = {"eager": [], "fused": []}

    def hooked(name):
        model = resnet()
        for stage in stages:
            model.get_submodule(stage).register_forward_hook(lambda m, a, out, rec=records[name]: rec.append(out))
        return model

    eager, fused = hooked("eager"), fxfuse.optimize(hooked("fused"))
    assert len(fused.fxfuse_report.fused) == len(plain.fused)  # every stage is optimized on its own
    assert all(optimize_module.is_optimized(fused.get_submodule(s)) for s in stages)
    eager_run, fused_run = _run(eager, x), _run(fused, x)
    assert len(records["eager"]) == 12
    _compare(eager_run, fused_run, [r.detach() for r in records["eager"]], [r.detach() for r in records["fused"]])


def test_a_hook_registered_after_optimize_is_in_the_report():
    x = _input()
    model = fxfuse.optimize(_net())
    model(x)
    model.stem[1].register_forward_hook(lambda *a: None)
    model(x)
    notes = model.fxfuse_report.notes
    assert any(n.startswith("graph built at a later call: stem.1: has a forward hook") for n in notes), notes
    assert any(
        "stem.0 + stem.1 (conv2d→batch_norm2d) not fused: the BatchNorm module has a forward hook" in n for n in notes
    )


def test_explain_reports_hooked_modules_and_changes_nothing():
    model = _net()
    model.block.register_forward_hook(lambda *a: None)
    report = fxfuse.explain(model)
    assert any("block.conv" in s.modules for s in report.fused)
    assert any(n.startswith("block: has a forward hook") for n in report.notes)
    assert not any(optimize_module.is_optimized(m) for m in model.modules())


def test_optimize_with_example_inputs_and_a_budget_does_not_fire_hooks():
    x = _input()
    model, calls = _net(), []
    model.stem[1].register_forward_hook(lambda mod, args, out: calls.append(out.device))
    model.block.register_forward_pre_hook(lambda mod, args: calls.append(args[0].device))
    fxfuse.optimize(model, x, memory_budget=0.6)
    assert calls == []  # fxfuse's meta-device forwards ran no user hook
    model(x)
    assert calls == [torch.device("cpu")] * 2


def test_prune_with_example_inputs():
    x = _input()
    torch.manual_seed(3)
    model = fxfuse.optimize(_pruned(_net()), x)
    torch.manual_seed(3)
    _assert_close(_run(_pruned(_net()), x), _run(model, x), "outputs, gradients, state")
