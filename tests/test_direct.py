"""fxfuse.ops.direct: the ops' direct calls compute what torch.ops computes, through the same dispatch
(modes, subclasses, autograd, dynamo), and skip torch.ops' Python path."""

import sys

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fxfuse import _extension
from fxfuse.ops import direct

pytestmark = pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")


def _args():
    """Plain positional arguments for each op with a direct call, float64."""
    g = torch.Generator().manual_seed(0)

    def t(*shape, grad=True):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(grad)

    x, w8, b8 = t(2, 8, 4, 4), t(8), t(8)
    conv_w, lin_x, lin_w, lin_b = t(8, 8, 3, 3), t(2, 4, 16), t(16, 16), t(16)
    rm, rv = torch.zeros(8, dtype=torch.float64), torch.ones(8, dtype=torch.float64)
    geometry = ((1, 1), (1, 1), (1, 1), 1)
    bn = (w8, b8, rm, rv, True, 1e-5)  # weight, bias, running_mean, running_var, batch_stats, eps
    return {
        "batch_norm_act": (x, *bn, "relu", 0.0),
        "conv_bn_act": (x, conv_w, None, *geometry, *bn, "relu6", 0.0),
        "bn_act_conv": (x, *bn, "relu", 0.0, conv_w, b8, *geometry, True, *bn, "leaky_relu", 0.1),
        "conv_act": (x, conv_w, b8, *geometry, "gelu", 0.0),
        "linear_act": (lin_x, lin_w, lin_b, "gelu_tanh", 0.0),
        "act_linear": (lin_x, lin_w, lin_b, "gelu", 0.0),
        "act_linear_scale": (lin_x, lin_w, lin_b, t(16), "gelu", 0.0),
        "layer_norm_linear": (lin_x, [16], t(16), t(16), 1e-5, lin_w, lin_b),
        "conv_layer_norm_linear": (x, conv_w, b8, *geometry, [8], w8, b8, 1e-6, t(16, 8), lin_b),
    }


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


def _run(fn, args):
    """The op's outputs and the gradients of its first output against every tensor that requires grad."""
    outs = _outputs(fn(*args))
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad(outs[0].sin().sum(), leaves)
    return [o.detach() for o in outs], list(grads)


def test_every_op_named_has_its_direct_call():
    for name in direct.NAMES:
        assert direct.call(name) is getattr(_extension._C, name)


@pytest.mark.parametrize("name", sorted(_args()))
def test_direct_call_computes_what_torch_ops_computes(name):
    args = _args()[name]
    got, want = _run(direct.call(name), args), _run(getattr(torch.ops.fxfuse, name).default, args)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert torch.equal(a, b)


def test_running_statistics_update_in_place():
    mean, var = torch.rand(8, dtype=torch.float64), torch.rand(8, dtype=torch.float64)
    rm, rv = torch.zeros(8, dtype=torch.float64), torch.ones(8, dtype=torch.float64)
    rm2, rv2 = rm.clone(), rv.clone()
    assert direct.call("update_running_stats_")(rm, rv, mean, var, 0.1) is None
    torch.ops.fxfuse.update_running_stats_.default(rm2, rv2, mean, var, 0.1)
    assert torch.equal(rm, rm2) and torch.equal(rv, rv2) and not torch.equal(rm, torch.zeros(8, dtype=torch.float64))


def _op_python_calls(fn, args) -> set:
    seen = set()

    def profile(frame, event, arg):
        if event == "call":
            seen.add(frame.f_code.co_qualname)

    sys.setprofile(profile)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return seen


def test_plain_arguments_skip_torch_ops_python_path():
    args = _args()["batch_norm_act"]
    assert "OpOverload.__call__" in _op_python_calls(torch.ops.fxfuse.batch_norm_act.default, args)
    assert "OpOverload.__call__" not in _op_python_calls(direct.call("batch_norm_act"), args)


class _Logged(torch.Tensor):
    """A subclass with the default __torch_function__, which logs what it sees."""

    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_subclass_input_takes_torch_ops_and_its_torch_function():
    x, *rest = _args()["batch_norm_act"]
    _Logged.seen.clear()
    out = direct.call("batch_norm_act")(x.detach().as_subclass(_Logged), *rest)
    assert type(out[0]) is _Logged
    assert torch.ops.fxfuse.batch_norm_act.default in _Logged.seen


def test_a_torch_function_mode_sees_the_op():
    seen = []

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Mode():
        direct.call("conv_act")(*_args()["conv_act"])
    assert torch.ops.fxfuse.conv_act.default in seen


@pytest.mark.parametrize(
    "change",
    [
        lambda a: (*a[:5], 1, *a[6:]),  # an int where the schema takes a bool
        lambda a: (*a[:6], 1, *a[7:]),  # an int where it takes a float
    ],
)
def test_other_python_types_compute_as_torch_ops(change):
    args = change(_args()["batch_norm_act"])
    got, want = direct.call("batch_norm_act")(*args), torch.ops.fxfuse.batch_norm_act.default(*args)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_an_int_for_a_pair_computes_as_torch_ops():
    x, w, b, *_, act, act_param = _args()["conv_act"]
    args = (x, w, b, 1, [1, 1], (1, 1), 1, act, act_param)  # torch.ops broadcasts int[2] from one int
    got, want = direct.call("conv_act")(*args), torch.ops.fxfuse.conv_act.default(*args)
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "change",
    [
        lambda a: a[:-1],  # an argument missing
        lambda a: (*a[:7], "nope", *a[8:]),  # an activation the op does not know
        lambda a: (a[0][:, :3], *a[1:]),  # channels that do not match the parameters
        lambda a: (*a[:5], "yes", *a[6:]),  # a str where the schema takes a bool
    ],
)
def test_bad_arguments_raise_what_torch_ops_raises(change):
    args = change(_args()["batch_norm_act"])
    with pytest.raises(Exception) as want:
        torch.ops.fxfuse.batch_norm_act.default(*args)
    with pytest.raises(want.type) as got:
        direct.call("batch_norm_act")(*args)
    assert str(got.value).splitlines()[0] == str(want.value).splitlines()[0]


def test_dynamo_traces_the_op_into_its_graph():
    conv, bn = nn.Conv2d(8, 8, 3, padding=1).double(), nn.BatchNorm2d(8).double().eval()
    x = torch.randn(2, 8, 4, 4, dtype=torch.float64)

    def f(x):
        out, *_ = direct.call("conv_bn_act")(
            x, conv.weight, conv.bias, (1, 1), (1, 1), (1, 1), 1, bn.weight, bn.bias, bn.running_mean,
            bn.running_var, False, bn.eps, "relu", 0.0,
        )  # fmt: skip
        return out

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    assert torch.equal(compiled(x), f(x))
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.fxfuse.conv_bn_act.default in targets
