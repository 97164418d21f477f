"""torch.func and forward-mode AD over optimized models and fxfuse's ops, against eager in float64.

Under a torch.func transform or a forward-AD dual level the optimized forward runs the model's
own forward (and the op wrappers eager's ops): the fused ops drop forward-AD tangents and
functorch rejects their autograd functions. So each transform gives eager's values where eager
works, and eager's error where eager raises (BatchNorm's running statistics in train mode).
"""

import copy

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from support.reference import conv_bn_act as conv_bn_act_reference
from test_higher_order import ConvNet, ConvNeXtBlock, Mlp, _close
from torch import func, nn

import fxfuse
from fxfuse import ops

D = torch.float64
MODELS = {
    "convnet": (lambda: ConvNet(nn.SiLU), (2, 3, 5, 5)),
    "mlp": (Mlp, (2, 3, 6)),
    "convnext": (ConvNeXtBlock, (2, 4, 7, 7)),
}


def _pair(name, training=False):
    make, shape = MODELS[name]
    torch.manual_seed(0)
    eager = make().to(D).train(training)
    fused = fxfuse.optimize(copy.deepcopy(eager)).train(training)
    assert fused.fxfuse_report.fused
    return eager, fused, torch.randn(shape, dtype=D)


def _same(fn, eager, fused):
    """fn(eager) and fn(fused) agree (pytrees of tensors), or raise the same exception type."""
    results = []
    for model in (eager, fused):
        try:
            results.append(fn(model))
        except Exception as exc:  # noqa: BLE001 - compared with eager's below
            results.append(exc)
    ref, got = results
    if isinstance(ref, Exception):
        # Eager's error itself (a RuntimeError of fxfuse's own would pass a type check), and below,
        # the state it left.
        assert type(got) is type(ref), f"eager raised {ref!r}, fxfuse gave {got!r}"
        assert str(got).splitlines()[:1] == str(ref).splitlines()[:1], f"eager raised {ref!r}, fxfuse {got!r}"
    else:
        assert not isinstance(got, Exception), f"fxfuse raised {got!r} where eager did not"
        ref_leaves, ref_spec = torch.utils._pytree.tree_flatten(ref)
        got_leaves, got_spec = torch.utils._pytree.tree_flatten(got)
        assert ref_spec == got_spec
        for a, b in zip(got_leaves, ref_leaves):
            _close(a, b, "transform result")
    for (name, b), b_ref in zip(fused.named_buffers(), eager.buffers()):
        _close(b.to(D), b_ref.to(D), f"buffer {name}")


def _loss(model, x):
    return model(x).square().sum()


TRANSFORMS = {
    "grad-params": lambda m, x: func.grad(lambda p: _loss(lambda x: func.functional_call(m, p, (x,)), x))(
        dict(m.named_parameters())
    ),
    "grad-input": lambda m, x: func.grad(lambda x: _loss(m, x))(x),
    "vmap": lambda m, x: func.vmap(m)(x.unsqueeze(1)),
    "vmap-grad": lambda m, x: func.vmap(func.grad(lambda x: _loss(m, x)))(x.unsqueeze(1)),
    "jvp": lambda m, x: func.jvp(m, (x,), (torch.linspace(-1, 1, x.numel(), dtype=D).reshape(x.shape),)),
    "jacrev": lambda m, x: func.jacrev(m)(x[:1]),
    "jacfwd": lambda m, x: func.jacfwd(m)(x[:1]),
    "hessian": lambda m, x: func.hessian(lambda x: _loss(m, x))(x[:1]),
}


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_transform_in_eval(name, transform, one_thread):
    eager, fused, x = _pair(name)
    _same(lambda m: TRANSFORMS[transform](m, x), eager, fused)


@pytest.mark.parametrize("transform", ["grad-params", "vmap", "jvp"])
def test_transform_in_train_raises_eagers_error(transform, one_thread):
    """BatchNorm updating its running statistics under a transform: eager's error, state untouched."""
    eager, fused, x = _pair("convnet", training=True)
    with pytest.raises(RuntimeError):  # on a copy: _same compares the state eager's one call leaves
        TRANSFORMS[transform](copy.deepcopy(eager), x)
    _same(lambda m: TRANSFORMS[transform](m, x), eager, fused)


@pytest.mark.parametrize("transform", ["grad-params", "vmap-grad", "jvp", "hessian"])
def test_transform_in_train_without_running_stats(transform, one_thread):
    """torch.func's recipe for BatchNorm in train mode (batch statistics only); then a normal fused step."""
    eager, fused, x = _pair("convnet", training=True)
    for model in (eager, fused):
        func.replace_all_batch_norm_modules_(model)
    _same(lambda m: TRANSFORMS[transform](m, x), eager, fused)
    _same(lambda m: torch.autograd.grad(_loss(m, x), list(m.parameters())), eager, fused)


@pytest.mark.parametrize("training", [True, False])
def test_functional_call(training, one_thread):
    """functional_call runs the fused graph (no transform) on the given parameters and buffers."""
    eager, fused, x = _pair("convnet", training)
    torch.manual_seed(1)
    params = {k: (v.detach() + 0.1 * torch.randn_like(v)).requires_grad_() for k, v in eager.named_parameters()}

    def step(model):
        state = {**{k: v.clone() for k, v in params.items()}, **{k: b.clone() for k, b in model.named_buffers()}}
        state.update({k: v.detach().requires_grad_() for k, v in state.items() if k in params})
        out = func.functional_call(model, state, (x,))
        assert (model is eager) != _ran_fxfuse(out), "functional_call of the optimized model ran no fused op"
        grads = torch.autograd.grad(out.square().sum(), [state[k] for k in params])
        return out, grads, {k: v for k, v in state.items() if k not in params}

    _same(step, eager, fused)


def _ran_fxfuse(out):
    """Whether `out`'s autograd graph has a node of an fxfuse op."""
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "fxfuse" in node.name():  # Python kernels' GeneratedBackwardFor_fxfuse_*, C++ ones' fxfuse::*
            return True
        todo.extend(n for n, _ in node.next_functions)
    return False


def test_forward_ad_dual_level(one_thread):
    eager, fused, x = _pair("convnet")
    tangent = torch.randn_like(x)

    def jvp(model):
        with fwAD.dual_level():
            out = model(fwAD.make_dual(x, tangent))
            return fwAD.unpack_dual(out)

    _same(lambda m: tuple(jvp(m)), eager, fused)


@pytest.mark.parametrize("training", [True, False])
def test_autograd_functional_hessian_and_jvp(training, one_thread):
    """torch.autograd.functional's double-backward tricks go through the ops' create_graph path."""
    eager, fused, x = _pair("convnet", training)
    x = x[:, :, :3, :3]
    _same(lambda m: torch.autograd.functional.hessian(lambda x: _loss(m, x), x), eager, fused)
    v = torch.randn_like(x)
    _same(lambda m: torch.autograd.functional.jvp(m, x, v, create_graph=False), eager, fused)


def test_op_under_jvp_and_vmap(one_thread):
    """Called directly under a transform, an op runs eager's composition (the fused op would drop the tangent)."""
    x, w, b = torch.randn(2, 3, 5, 5, dtype=D), torch.randn(4, 3, 3, 3, dtype=D), torch.randn(4, dtype=D)
    bn_w, bn_b = torch.rand(4, dtype=D) + 0.5, torch.randn(4, dtype=D)
    args = (1, 1, 1, 1, None, None, bn_w, bn_b, True, 0.1, 1e-5, "silu")
    v = torch.randn_like(x)
    got = func.jvp(lambda x: ops.conv_bn_act(x, w, b, *args), (x,), (v,))
    ref = func.jvp(lambda x: conv_bn_act_reference(x, w, b, *args), (x,), (v,))
    for a, r in zip(got, ref):
        _close(a, r, "conv_bn_act under jvp")
    rows, lw = x.reshape(2, 5, 15), torch.randn(4, 15, dtype=D)
    got = func.vmap(lambda x: ops.linear_act(x, lw, b, "gelu"))(rows)
    _close(got, F.gelu(F.linear(rows, lw, b)), "linear_act under vmap")
    # The linear and GELU ops check for a transform in their own place (checks.fusable): jvp and grad too.
    tangent = torch.randn_like(rows)
    for name, fused, eager in (
        ("linear_act", lambda x: ops.linear_act(x, lw, b, "gelu"), lambda x: F.gelu(F.linear(x, lw, b))),
        ("gelu", lambda x: ops.gelu(x, "tanh"), lambda x: F.gelu(x, approximate="tanh")),
    ):
        for a, r in zip(func.jvp(fused, (rows,), (tangent,)), func.jvp(eager, (rows,), (tangent,))):
            _close(a, r, f"{name} under jvp")
        grad = [func.grad(lambda x, f=f: f(x).square().sum())(rows) for f in (fused, eager)]
        _close(*grad, f"{name} under grad")


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
def test_transform_with_recompute_regions(transform, one_thread):
    """A model with recompute regions (memory_budget) runs its own forward under a transform too:
    the op wrappers' checks do not cover the regions, whose checkpoint's saved-tensor hooks
    torch.func rejects."""
    torch.manual_seed(0)
    eager = ConvNet(nn.SiLU).to(D).eval()
    x = torch.randn(2, 3, 5, 5, dtype=D)
    fused = fxfuse.optimize(copy.deepcopy(eager), x, memory_budget=0.05).eval()
    from fxfuse.fusion.install import _STATE

    graphs = fused.__dict__[_STATE].fx_graphs.values()
    assert any("RegionCall" in str(node.target) for g in graphs for node in g.nodes), fused.fxfuse_report
    _same(lambda m: TRANSFORMS[transform](m, x), eager, fused)
