"""fusion/passes/rebuild.py, with ops/rebuild.py in the optimized forward: BN→activation outputs that several
ops keep are rebuilt in backward, exactly, and a budget takes it as its cheapest entry."""

import copy
import importlib

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fxfuse
from fxfuse import measure
from fxfuse.fusion import install, runtime
from fxfuse.fusion.plan import Options, Plan
from fxfuse.ops import rebuild
from fxfuse.testing import assert_equivalent

optimize_module = importlib.import_module("fxfuse.fusion.optimize")


class Osa(nn.Module):
    """VoVNet's shape in small: a BN→ReLU output feeds a conv and a concatenation, another a pooled gate
    and a multiply; in eager each of those ops keeps it."""

    def __init__(self, c=8):
        super().__init__()
        self.stem, self.bn0 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.mid, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.concat, self.bn2 = nn.Conv2d(2 * c, c, 1, bias=False), nn.BatchNorm2d(c)
        self.fc = nn.Conv2d(c, c, 1)
        self.head = nn.Linear(c, 5)

    def forward(self, x):
        a = torch.relu(self.bn0(self.stem(x)))
        b = torch.relu(self.bn1(self.mid(a)))
        c = torch.relu(self.bn2(self.concat(torch.cat([a, b], 1))))
        gated = c * torch.sigmoid(self.fc(c.mean((2, 3), keepdim=True)))
        return self.head(gated.mean((2, 3)))


def _model(dtype=torch.float64):
    torch.manual_seed(0)
    return Osa().to(dtype)


def _x(dtype=torch.float64, size=12):
    torch.manual_seed(1)
    return torch.randn(4, 8, size, size, dtype=dtype)


def _optimized(model, rebuild_=True, mode="fast"):
    optimize_module._run(model, None, Options(mode, Plan(rebuild=rebuild_)), install=True)
    return model


def _marked(model) -> list:
    graph = install.fx_graph(model)
    return [n for n in graph.nodes if n.kwargs.get("rebuild") or n.kwargs.get("rebuildable")]


def test_marks_every_bn_act_output_no_node_changes_and_keeps_less():
    model, x = _model(), _x()
    plain, rebuilt = _optimized(copy.deepcopy(model), False), _optimized(copy.deepcopy(model))
    assert len(_marked(plain)) == 0 and len(_marked(rebuilt)) == 3
    assert measure.saved_activation_bytes(rebuilt, (x,)) < measure.saved_activation_bytes(plain, (x,))
    with rebuild.Tally() as tally:
        rebuilt(x).sum().backward()
    assert tally.count == 2  # a for the 3x3 conv, c for the multiply (mode="fast" keeps the concatenation)


def test_rebuilt_model_trains_and_evaluates_as_eager():
    model, x = _model(), _x()
    assert_equivalent(model, _optimized(copy.deepcopy(model)), x, steps=2)


def test_float32_error_no_worse_than_eager():
    model, x = _model(torch.float32), _x(torch.float32)
    assert_equivalent(model, _optimized(copy.deepcopy(model)), x, steps=2, dtype=torch.float32)


class Changes(nn.Module):
    """BN→ReLU outputs that the graph returns or views."""

    def __init__(self, c=4):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(c, c, 3, padding=1, bias=False) for _ in range(4))
        self.bns = nn.ModuleList(nn.BatchNorm2d(c) for _ in range(4))

    def forward(self, x):
        a = torch.relu(self.bns[0](self.convs[0](x)))
        b = torch.relu(self.bns[1](self.convs[1](a)))
        v = b.flatten(1)
        c = torch.relu(self.bns[2](self.convs[2](b)))
        d = torch.relu(self.bns[3](self.convs[3](c)))
        return self.convs[0](d) + self.convs[3](d), c, v.sum()


def test_outputs_returned_changed_in_place_or_viewed_are_not_marked():
    torch.manual_seed(0)
    model = Changes().double()
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    optimized = _optimized(copy.deepcopy(model))
    marked = _marked(optimized)
    assert len(marked) == 1  # d: a merged into the conv after it (bn_act_conv), b is viewed, c returned
    assert_equivalent(model, optimized, x, steps=1, eval=False)


class InPlace(nn.Module):
    def __init__(self, c=4):
        super().__init__()
        self.conv, self.bn, self.out = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.Conv2d(c, c, 1)

    def forward(self, x):
        a = torch.relu(self.bn(self.conv(x)))
        y = self.out(a) + self.conv(a)
        a.mul_(2)  # after ReLU kept its output: eager's backward raises
        return y


def test_output_changed_in_place_is_not_marked_and_backward_raises_as_eager():
    torch.manual_seed(0)
    model, x = InPlace(), torch.randn(2, 4, 6, 6)
    optimized = _optimized(copy.deepcopy(model))
    assert _marked(optimized) == []
    for m in (model, optimized):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            m(x).sum().backward()


def test_second_order_gradients_match_eager():
    model, x = _model(), _x()
    optimized = _optimized(copy.deepcopy(model))

    def penalty(m):
        xi = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(m(xi).square().sum(), xi, create_graph=True)
        return torch.autograd.grad(gx.square().sum(), list(m.parameters()))

    for e, g in zip(penalty(model), penalty(optimized)):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)


def test_user_hooks_and_checkpoint_around_the_model_see_what_is_kept():
    model, x = _model(), _x()
    optimized = _optimized(copy.deepcopy(model))
    reference = copy.deepcopy(model)
    reference(x).sum().backward()
    expected = [p.grad for p in reference.parameters()]
    packed = []

    def offload(t):
        packed.append(t)
        return t.clone()

    with torch.autograd.graph.saved_tensors_hooks(offload, lambda t: t):
        loss = optimized(x).sum()
    loss.backward()
    assert packed
    for e, p in zip(expected, optimized.parameters()):
        torch.testing.assert_close(p.grad, e, rtol=1e-12, atol=1e-12)
        p.grad = None
    checkpoint(optimized, x, use_reentrant=False).sum().backward()
    for e, p in zip(expected, optimized.parameters()):
        torch.testing.assert_close(p.grad, e, rtol=1e-12, atol=1e-12)


def test_torch_func_transforms_run_as_eager():
    model, x = _model(), _x()
    optimized = _optimized(copy.deepcopy(model)).eval()
    model.eval()
    v = torch.randn_like(x)
    expected = torch.func.jvp(model, (x,), (v,))
    got = torch.func.jvp(optimized, (x,), (v,))
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    # grad and vjp disable saved-tensor hooks: pushing the Scope's would raise
    (out, vjp), (out_e, vjp_e) = torch.func.vjp(optimized, x), torch.func.vjp(model, x)
    torch.testing.assert_close(out, out_e, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(vjp(torch.ones_like(out)), vjp_e(torch.ones_like(out_e)), rtol=1e-12, atol=1e-12)


def test_a_budget_takes_the_rebuild_first_and_reports_it():
    # Large enough that bytes moved, not the per-op cost, price the rebuild (regions/time_model.py).
    model, x = _model(torch.float32), _x(torch.float32, size=48)
    base = fxfuse.optimize(copy.deepcopy(model), (x,), memory_budget=1.0)  # the ranking's empty prefix
    base_bytes = measure.saved_activation_bytes(base, (x,))
    eager_bytes = measure.saved_activation_bytes(model, (x,))
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,), memory_budget=0.99 * base_bytes / eager_bytes)
    plan = optimized.__dict__["_fxfuse_state"].options.plan
    assert plan.rebuild and not plan.regions
    (row,) = [r for r in optimized.fxfuse_report.regions if r.kind == "rebuild"]
    assert row.name == "BN→activation outputs" and row.saved_bytes > 0 and row.recompute_flops == 0
    assert "BN→activation outputs" in str(optimized.fxfuse_report)
    assert measure.saved_activation_bytes(optimized, (x,)) < base_bytes


def test_runtime_takes_the_flag():
    assert "rebuild" in runtime.batch_norm_act_module.__code__.co_varnames


@pytest.mark.parametrize("grad", [True, False])
def test_no_scope_left_behind(grad):
    model, x = _model(), _x()
    optimized = _optimized(copy.deepcopy(model))
    with torch.set_grad_enabled(grad):
        optimized(x)
    assert not rebuild.active()


class Shortcut(nn.Module):
    """A BN→ReLU output that a later conv keeps and a residual add reads (added into the other operand)."""

    def __init__(self, c=4):
        super().__init__()
        self.conv0, self.bn0 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        a = torch.relu(self.bn0(self.conv0(x)))
        return torch.relu(self.bn1(self.conv1(a)) + a)


def test_an_add_into_another_tensor_does_not_stop_the_rebuild():
    torch.manual_seed(0)
    model, x = Shortcut().double(), torch.randn(2, 4, 6, 6, dtype=torch.float64)
    optimized = _optimized(copy.deepcopy(model))
    graph = install.fx_graph(optimized)
    assert any(n.target is runtime.add_into for n in graph.nodes)  # bn1's output + a, written into bn1's
    assert len(_marked(optimized)) == 1
    assert_equivalent(model, optimized, x, steps=2)


def test_under_torch_compile_the_graph_runs_without_the_scope():
    model, x = _model(), _x()
    optimized = _optimized(copy.deepcopy(model))
    torch._dynamo.reset()
    compiled = torch.compile(optimized, backend="aot_eager", fullgraph=True)  # a Scope pushed would break the graph
    reference = copy.deepcopy(model)
    torch.testing.assert_close(compiled(x), reference(x), rtol=1e-12, atol=1e-12)
    compiled(x).sum().backward()
    reference(x).sum().backward()
    for e, p in zip(reference.parameters(), optimized.parameters()):
        torch.testing.assert_close(p.grad, e.grad, rtol=1e-9, atol=1e-12)
    assert not rebuild.active()


class Reaches(nn.Module):
    """BN→ReLU outputs that code could change outside the graph's view: `.data`, `.mT`, a module of its own."""

    def __init__(self, c=4):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(c, c, 3, padding=1, bias=False) for _ in range(4))
        self.bns = nn.ModuleList(nn.BatchNorm2d(c) for _ in range(4))
        self.own = nn.Identity()

    def forward(self, x):
        a = torch.relu(self.bns[0](self.convs[0](x)))
        b = torch.relu(self.bns[1](self.convs[1](a)))
        c = torch.relu(self.bns[2](self.convs[2](b)))
        d = torch.relu(self.bns[3](self.convs[3](c)))
        return self.convs[0](a) + a.data, self.convs[1](b) + b.mT, self.convs[2](c) + self.own(c), self.convs[3](d) + d


def test_only_users_that_read_leave_a_site_rebuilt():
    torch.manual_seed(0)
    optimized = _optimized(Reaches().double())
    marked = _marked(optimized)
    assert len(marked) == 1  # d: a's .data, b's .mT and c's module call could reach it outside the graph


@pytest.mark.parametrize("budget", [0.05, 0.3, 0.6])
def test_the_plan_rebuilds_only_where_it_frees(budget):
    model, x = _model(torch.float32), _x(torch.float32, size=48)
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,), memory_budget=budget)
    plan = optimized.__dict__["_fxfuse_state"].options.plan
    with rebuild.Tally() as tally:
        optimized(x).sum().backward()
    assert plan.rebuild == (tally.count > 0)
    rows = [r for r in optimized.fxfuse_report.regions if r.kind == "rebuild"]
    assert len(rows) == int(plan.rebuild) and all(r.saved_bytes > 0 for r in rows)


def test_a_peak_budget_alone_keeps_no_rebuild_its_peak_does_not_need():
    # The ranking reaches the rebuild, but the step peak is the same without it: no rebuild pass for nothing.
    torch.manual_seed(0)
    model, x = Osa(16), torch.randn(8, 16, 48, 48)
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,), peak_budget=0.8)
    report = optimized.fxfuse_report
    assert report.peak_budget_met and not optimized.__dict__["_fxfuse_state"].options.plan.rebuild
    assert "BN→activation outputs: not rebuilt, the step peak is within the peak budget without it" in report.notes
    assert not [r for r in report.regions if r.kind == "rebuild"]


class Hooked(nn.Module):
    """A BN→ReLU output read by a conv that has a forward pre-hook: the hook sees (and could change) it."""

    def __init__(self, c=4):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.left, self.right = nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 1)

    def forward(self, x):
        a = torch.relu(self.bn(self.conv(x)))
        return self.left(a) + self.right(a)


def test_a_module_with_hooks_stops_the_rebuild():
    torch.manual_seed(0)
    plain = _optimized(Hooked().double())
    assert len(_marked(plain)) == 1  # without the hook it is rebuilt
    hooked = Hooked().double()
    hooked.left.register_forward_pre_hook(lambda m, args: None)
    assert _marked(_optimized(hooked)) == []


class InputInPlace(nn.Module):
    """The BN input changed in place after the BN: its output must not be rebuilt from the changed input."""

    def __init__(self, c=4):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.left, self.right = nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 1)

    def forward(self, x):
        y = self.conv(x)
        a = torch.relu(self.bn(y))
        y.mul_(3)
        return self.left(a) + self.right(a) + y


def test_bn_input_changed_in_place_gives_eagers_gradients():
    torch.manual_seed(0)
    model = InputInPlace().double()
    optimized = _optimized(copy.deepcopy(model))
    x = torch.randn(2, 4, 6, 6, dtype=torch.float64)
    weights = lambda m: [m.left.weight, m.right.weight]  # noqa: E731 - their backward never reaches the BN's
    expected = torch.autograd.grad(model(x).sum(), weights(model))
    for got, want in zip(torch.autograd.grad(optimized(x).sum(), weights(optimized)), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
