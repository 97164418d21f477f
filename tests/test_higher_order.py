"""Second-order gradients (create_graph=True) through every fxfuse op and optimized models, against eager.

A gradient penalty — `gx = grad((y * r).sum(), x, create_graph=True)`, then the gradients of
`gx.square().sum() + (y * r).sum()` — in float64, train and eval, on the ops called directly and on
small models through `fxfuse.optimize` (one per op family, and one recomputing regions), and
`gradgradcheck` on each op.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from support.reference import bn_act as bn_act_reference
from support.reference import conv_bn_act as conv_bn_act_reference
from support.root_statistics import RootStatistics
from torch import nn

import fxfuse
from fxfuse import ops
from fxfuse.ops.checks import apply_activation

D = torch.float64


def _close(actual, expected, what=""):
    assert (actual is None) == (expected is None), what
    if expected is None:
        return
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    err = (actual - expected).abs().max().item() if expected.numel() else 0.0
    assert err <= 1e-9 * scale, f"{what}: off by {err:.3g} (scale {scale:.3g})"


def _penalty_grads(fn, x, params):
    """(gx, gradients of the penalty for x and each of `params`, y) for `y = fn(x, *params)`.

    The penalty reads the first-order gradients of the parameters too (MAML, gradient-norm
    regularizers): an op whose parameter gradients are not differentiable (a C++ kernel's, where
    the create_graph path was skipped) differs here even where its input gradient is ATen's."""
    y = fn(x, *params)
    r = torch.linspace(-1, 2, y.numel(), dtype=y.dtype).reshape(y.shape)
    wanted = [x, *[p for p in params if p is not None and p.requires_grad]]
    first = torch.autograd.grad((y * r).sum(), wanted, create_graph=True, materialize_grads=True)
    loss = sum(g.square().sum() for g in first) + (y * r.flip(-1)).sum()
    return first[0], torch.autograd.grad(loss, wanted, materialize_grads=True), y


def _leaf(*shape, positive=False):
    t = torch.randn(*shape, dtype=D)
    return (t.abs() + 0.5 if positive else t).requires_grad_()


def _stats(c):
    return torch.randn(c, dtype=D) * 0.1, torch.rand(c, dtype=D) + 0.5


# Each case: (fused, eager, x, params, buffers): fused(x, *params, *buffers) against eager(x, *params, *buffers'),
# the buffers (running statistics) cloned for eager and compared after.
def _conv_bn_act_case(training, act):
    rm, rv = _stats(4)

    def call(f):
        return lambda x, w, b, bw, bb, rm, rv: f(x, w, b, 1, 1, 1, 1, rm, rv, bw, bb, training, 0.1, 1e-5, act)

    params = (_leaf(4, 3, 3, 3), _leaf(4), _leaf(4, positive=True), _leaf(4))
    return call(ops.conv_bn_act), call(conv_bn_act_reference), _leaf(2, 3, 5, 5), params, (rm, rv)


def _batch_norm_act_case(training, act):
    rm, rv = _stats(3)

    def call(f):
        return lambda x, w, b, rm, rv: f(x, rm, rv, w, b, training, 0.1, 1e-5, act, 0.1)

    def eager(x, rm, rv, w, b, training, momentum, eps, act, p):
        return apply_activation(F.batch_norm(x, rm, rv, w, b, training, momentum, eps), act, p)

    params = (_leaf(3, positive=True), _leaf(3))
    return call(ops.batch_norm_act), call(eager), _leaf(2, 3, 4, 4), params, (rm, rv)


def _bn_act_conv_case(training, act, epilogue):
    in_rm, in_rv = _stats(3)
    rm, rv = _stats(4)

    def fused(x, in_w, in_b, w, b, bw, bb, in_rm, in_rv, rm, rv):
        second = dict(running_mean=rm, running_var=rv, bn_weight=bw, bn_bias=bb, training=training, act="silu")
        return ops.bn_act_conv(
            x, in_rm, in_rv, in_w, in_b, training, 0.1, 1e-5, act, 0.0, w, b, 1, 1, 1, 1,
            **(dict(epilogue=True, **second) if epilogue else {}),
        )  # fmt: skip

    def eager(x, in_w, in_b, w, b, bw, bb, in_rm, in_rv, rm, rv):
        y = apply_activation(F.batch_norm(x, in_rm, in_rv, in_w, in_b, training, 0.1, 1e-5), act)
        y = F.conv2d(y, w, b, 1, 1)
        return F.silu(F.batch_norm(y, rm, rv, bw, bb, training, 0.1, 1e-5)) if epilogue else y

    params = (_leaf(3, positive=True), _leaf(3), _leaf(4, 3, 3, 3), _leaf(4), _leaf(4, positive=True), _leaf(4))
    return fused, eager, _leaf(2, 3, 5, 5), params, (in_rm, in_rv, rm, rv)


def _conv_layer_norm_linear_case():
    def call(conv_ln_linear):
        return lambda x, cw, cb, lw, lb, w, b: conv_ln_linear(x, cw, cb, 1, 2, 1, 4, [4], lw, lb, 1e-5, w, b)

    def eager(x, cw, cb, s, p, d, g, shape, lw, lb, eps, w, b):
        z = F.conv2d(x, cw, cb, s, p, d, g).permute(0, 2, 3, 1)
        return F.linear(F.layer_norm(z, shape, lw, lb, eps), w, b)

    params = (_leaf(4, 1, 5, 5), _leaf(4), _leaf(4, positive=True), _leaf(4), _leaf(6, 4), _leaf(6))
    return call(ops.conv_layer_norm_linear), call(eager), _leaf(2, 4, 5, 5), params, ()


def _cases():
    cases = {}
    for training in (True, False):
        mode = "train" if training else "eval"
        for act in ("relu", "silu", "gelu_tanh"):
            cases[f"conv_bn_act-{mode}-{act}"] = lambda t=training, a=act: _conv_bn_act_case(t, a)
        for act in ("leaky_relu", "hardswish", "gelu"):
            cases[f"batch_norm_act-{mode}-{act}"] = lambda t=training, a=act: _batch_norm_act_case(t, a)
        for epilogue in (False, True):
            name = f"bn_act_conv-{mode}-{'epilogue' if epilogue else 'conv'}"
            cases[name] = lambda t=training, e=epilogue: _bn_act_conv_case(t, "relu6" if e else "silu", e)
    cases["conv2d"] = lambda: (ops.conv2d, F.conv2d, _leaf(2, 3, 5, 5), (_leaf(4, 3, 3, 3), _leaf(4)), ())
    depthwise = (_leaf(3, 1, 5, 5), _leaf(3))

    def depthwise_conv(f):
        return lambda x, w, b: f(x, w, b, 1, 2, 1, 3)

    cases["conv2d-depthwise5x5"] = lambda: (
        depthwise_conv(ops.conv2d), depthwise_conv(F.conv2d), _leaf(2, 3, 6, 6), depthwise, ()
    )  # fmt: skip

    conv = (_leaf(4, 3, 3, 3), _leaf(4))
    cases["conv_act"] = lambda: (
        lambda x, w, b: ops.conv_act(x, w, b, 1, 1, 1, 1, "silu"),
        lambda x, w, b: F.silu(F.conv2d(x, w, b, 1, 1)),
        _leaf(2, 3, 5, 5),
        conv,
        (),
    )
    linear = (_leaf(6, 5), _leaf(6))
    cases["linear_act"] = lambda: (
        lambda x, w, b: ops.linear_act(x, w, b, "gelu"),
        lambda x, w, b: F.gelu(F.linear(x, w, b)),
        _leaf(3, 5),
        linear,
        (),
    )
    cases["act_linear"] = lambda: (
        lambda x, w, b: ops.act_linear(x, w, b, "silu"),
        lambda x, w, b: F.linear(F.silu(x), w, b),
        _leaf(2, 3, 5),
        linear,
        (),
    )
    for act in ("none", "gelu"):
        cases[f"act_linear_scale-{act}"] = lambda a=act: (
            lambda x, w, b, s: ops.act_linear_scale(x, w, b, s, a),
            lambda x, w, b, s: F.linear(apply_activation(x, a), w, b) * s,
            _leaf(2, 3, 5),
            (*linear, _leaf(6)),
            (),
        )
    norm = (_leaf(5, positive=True), _leaf(5), _leaf(6, 5), _leaf(6))
    cases["layer_norm_linear"] = lambda: (
        lambda x, lw, lb, w, b: ops.layer_norm_linear(x, [5], lw, lb, 1e-5, w, b),
        lambda x, lw, lb, w, b: F.linear(F.layer_norm(x, [5], lw, lb, 1e-5), w, b),
        _leaf(2, 3, 5),
        norm,
        (),
    )
    cases["conv_layer_norm_linear"] = _conv_layer_norm_linear_case
    for approximate in ("none", "tanh"):
        cases[f"gelu-{approximate}"] = lambda a=approximate: (
            lambda x: ops.gelu(x, a),
            lambda x: F.gelu(x, approximate=a),
            _leaf(3, 7),
            (),
            (),
        )
    mean, var = _stats(3)
    cases["bn_act"] = lambda: (
        lambda x, w, b: torch.ops.fxfuse.bn_act(x, mean, var, w, b, 1e-5, "silu", 0.0),
        lambda x, w, b: bn_act_reference(x, mean, var, w, b, 1e-5, "silu"),
        _leaf(2, 3, 4, 4),
        (_leaf(3, positive=True), _leaf(3)),
        (),
    )
    return cases


CASES = _cases()


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradient_penalty_through_the_op(name, one_thread):
    fused, eager, x, params, buffers = CASES[name]()
    eager_buffers = tuple(b.clone() for b in buffers)
    gx, grads, y = _penalty_grads(lambda x, *p: fused(x, *p, *buffers), x, params)
    assert "fxfuse" in y.grad_fn.name(), f"{name}: the fused op did not run ({y.grad_fn.name()})"
    gx_ref, grads_ref, _ = _penalty_grads(lambda x, *p: eager(x, *p, *eager_buffers), x, params)
    _close(gx, gx_ref, f"{name}: first-order input gradient")
    for i, (g, ref) in enumerate(zip(grads, grads_ref)):
        _close(g, ref, f"{name}: second-order gradient {i}")
    for b, ref in zip(buffers, eager_buffers):
        _close(b, ref, f"{name}: running statistics (updated once, by the forward)")


@pytest.mark.parametrize(
    "name",
    ["conv_bn_act-train-silu", "conv_bn_act-eval-gelu_tanh", "batch_norm_act-train-gelu", "bn_act_conv-train-epilogue",
     "bn_act_conv-eval-conv", "conv2d", "conv2d-depthwise5x5", "conv_act", "linear_act", "act_linear",
     "act_linear_scale-gelu", "layer_norm_linear", "conv_layer_norm_linear", "gelu-none", "gelu-tanh", "bn_act"],
)  # fmt: skip
def test_gradgradcheck(name, one_thread):
    fused, _, x, params, buffers = CASES[name]()
    inputs = (x.detach()[:1].clone().requires_grad_(), *params)
    # gradgradcheck runs the op many times: running statistics are left out of training cases (batch statistics).
    buffers = tuple(None for _ in buffers) if "-train-" in name else buffers
    assert torch.autograd.gradgradcheck(lambda x, *p: fused(x, *p, *buffers), inputs)


# Each op family's case and the module whose backward chooses between the C++ op and the recompute.
FAST_PATH_CASES = {  # case: the C++ backward op its normal backward runs
    "conv_bn_act-train-relu": "conv_bn_act_backward",
    "batch_norm_act-train-gelu": "bn_act_backward",
    "bn_act": "bn_act_backward",
    "bn_act_conv-train-epilogue": "bn_act_conv_backward",
    "conv2d-depthwise5x5": "conv2d_backward",
    "conv_act": "conv_act_backward",
    "linear_act": "linear_act_backward",
    "act_linear": "act_linear_backward",
    "act_linear_scale-gelu": "act_linear_scale_backward",
    "layer_norm_linear": "layer_norm_linear_backward",
    "conv_layer_norm_linear": "conv_layer_norm_linear_backward",
    "gelu-tanh": "gelu_backward",
}


@pytest.mark.parametrize("name", sorted(FAST_PATH_CASES))
def test_normal_backward_takes_the_fast_path(name):
    """Without create_graph the op's C++ backward op runs, and with it the eager recompute does. (On CPU
    some C++ backwards are ATen composites that autograd records, so the values alone cannot tell the
    recompute was skipped; a device kernel's gradients would not be differentiable.)"""
    backward_op = f"fxfuse::{FAST_PATH_CASES[name]}"
    fused, _, x, params, buffers = CASES[name]()

    def backward_ops(create_graph: bool) -> set:
        out = fused(x, *params, *buffers).sum()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            torch.autograd.grad(out, x, create_graph=create_graph)
        return {e.name for e in prof.events()}

    assert backward_op in backward_ops(False)
    assert backward_op not in backward_ops(True)


# --------------------------------------------------------------------------- models through fxfuse.optimize


class ConvNet(nn.Module):
    def __init__(self, act=nn.ReLU):
        super().__init__()
        self.conv1, self.bn1, self.act1 = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), act()
        self.conv2, self.bn2, self.act2 = nn.Conv2d(6, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), act()
        self.conv3, self.bn3 = nn.Conv2d(6, 6, 1, bias=False), nn.BatchNorm2d(6, momentum=None)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        y = self.act1(self.bn1(self.conv1(x)))
        y = self.act2(self.bn2(self.conv2(y)))
        y = F.silu(self.bn3(self.conv3(y)) + y)
        return self.fc(y.mean((2, 3)))


class Mlp(nn.Module):
    def __init__(self, dim=6):
        super().__init__()
        self.norm, self.fc1, self.act, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 12), nn.GELU(), nn.Linear(12, dim)
        self.gamma = nn.Parameter(torch.rand(dim) + 0.5)
        self.head, self.head_act = nn.Linear(dim, 4), nn.SiLU()

    def forward(self, x):
        x = x + self.gamma * self.fc2(self.act(self.fc1(self.norm(x))))
        return self.head_act(self.head(x))


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim=4):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm, self.fc1, self.act, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 8), nn.GELU(), nn.Linear(8, dim)
        self.gamma = nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x):
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.gamma * self.fc2(self.act(self.fc1(self.norm(y))))
        return x + y.permute(0, 3, 1, 2)


def _model_penalty(model, x):
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = model(x)
    r = torch.linspace(-1, 2, y.numel(), dtype=y.dtype).reshape(y.shape)
    # Parameters' first-order gradients in the penalty too (see _penalty_grads).
    params = [p for p in model.parameters() if p.requires_grad]
    gx, *gp = torch.autograd.grad((y * r).sum(), [x, *params], create_graph=True)
    (gx.square().sum() + sum(g.square().sum() for g in gp) + (y * r.flip(-1)).sum()).backward()
    return y.detach(), gx.detach(), x.grad


def _compare_models(eager, fused, x, steps=2):
    """Gradient-penalty train steps (SGD) then an eval penalty: outputs, gradients and state against eager."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (eager, fused)]
    for phase in ["train"] * steps + ["eval"]:
        for m in (eager, fused):
            m.train(phase == "train")
        ref, got = _model_penalty(eager, x), _model_penalty(fused, x)
        for what, a, b in zip(("output", "input gradient", "penalty's input gradient"), got, ref):
            _close(a, b, f"{phase}: {what}")
        for (name, p), p_ref in zip(fused.named_parameters(), eager.parameters()):
            _close(p.grad, p_ref.grad, f"{phase}: {name}.grad")
        if phase == "train":
            for opt in opts:
                opt.step()
    for (name, b), b_ref in zip(fused.named_buffers(), eager.buffers()):
        _close(b.to(D), b_ref.to(D), f"buffer {name}")


MODELS = {
    "conv_bn_act": (lambda: ConvNet(nn.SiLU), dict(mode="memory"), (2, 3, 6, 6)),
    "conv_bn_act-relu": (lambda: ConvNet(nn.ReLU), dict(mode="memory"), (2, 3, 6, 6)),
    "batch_norm_act+bn_act_conv": (lambda: ConvNet(nn.Hardswish), dict(mode="fast"), (2, 3, 6, 6)),
    "mlp": (Mlp, dict(mode="memory"), (2, 3, 6)),
    "mlp-fast": (Mlp, dict(mode="fast"), (2, 3, 6)),
    "convnext": (ConvNeXtBlock, dict(mode="memory"), (2, 4, 7, 7)),
    "convnext-fast": (ConvNeXtBlock, dict(mode="fast"), (2, 4, 7, 7)),
}
EXPECTED_OPS = {
    "conv_bn_act": {"conv_bn_act"},
    "conv_bn_act-relu": {"conv_bn_act"},
    "batch_norm_act+bn_act_conv": {"bn_act_conv"},
    "mlp": {"layer_norm_linear", "act_linear", "linear_act"},
    "mlp-fast": {"layer_norm_linear", "act_linear"},
    "convnext": {"conv_layer_norm_linear", "act_linear"},
    "convnext-fast": {"conv2d", "layer_norm_linear", "act_linear"},
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradient_penalty_through_optimized_model(name, one_thread):
    make, kwargs, shape = MODELS[name]
    torch.manual_seed(0)
    eager = make().to(D)
    fused = fxfuse.optimize(copy.deepcopy(eager), **kwargs)
    fused_ops = {site.op.removeprefix("fxfuse::") for site in fused.fxfuse_report.fused}
    assert EXPECTED_OPS[name] <= fused_ops, fused.fxfuse_report
    _compare_models(eager, fused, torch.randn(shape, dtype=D))


class Block(nn.Module):
    def __init__(self, c=4):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return F.silu(self.bn2(self.conv2(F.silu(self.bn1(self.conv1(x))))) + x)


def test_gradient_penalty_through_recompute_regions(one_thread):
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Block(), Block(), Block(), nn.Flatten(), nn.Linear(4 * 36, 3))
    eager = eager.to(D)
    x = torch.randn(2, 3, 6, 6, dtype=D)
    fused = fxfuse.optimize(copy.deepcopy(eager), x, memory_budget=0.05)
    assert any("RegionCall" in str(node.target) for g in _graphs(fused) for node in g.nodes), fused.fxfuse_report
    _compare_models(eager, fused, x)


def _graphs(model):
    from fxfuse.fusion.install import _STATE

    return list(model.__dict__[_STATE].fx_graphs.values())


@pytest.mark.parametrize(
    "make, shape, budget",
    [(Mlp, (2, 3, 6), 0.3), (ConvNeXtBlock, (2, 4, 7, 7), 0.05), (RootStatistics, (2, 3, 6, 6), 0.2)],
)
def test_gradient_penalty_through_regions_reading_the_roots_own_tensors(make, shape, budget, one_thread):
    """A region that reads a parameter or buffer of the root module itself (`gamma`; a ViT's pos_embed;
    running statistics): the root's path is "" among the region's modules, which the recompute's
    buffer swap looked up as an attribute (every forward with grad raised AttributeError); its
    buffers must be swapped too, or each recompute updates the running statistics once more."""
    torch.manual_seed(0)
    eager = make().to(D)
    x = torch.randn(shape, dtype=D)
    fused = fxfuse.optimize(copy.deepcopy(eager), x, memory_budget=budget)
    calls = [n.target for g in _graphs(fused) for n in g.nodes if "RegionCall" in str(n.target)]
    assert any("" in call.module_paths for call in calls), fused.fxfuse_report
    _compare_models(eager, fused, x)
