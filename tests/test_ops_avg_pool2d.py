"""fxfuse::avg_pool2d (fxfuse/ops/avg_pool2d.py): F.avg_pool2d bit for bit, keeping none of its input
for backward; gradients of every order, layouts, eager's errors and eager's path where it must."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.op_checks import assert_same_layout, same_error, saved_tensors

from fxfuse import _extension

pytestmark = pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")

if _extension.loaded():
    from fxfuse.ops import avg_pool2d

CONFIGS = [
    dict(kernel_size=2, stride=2),
    dict(kernel_size=3, stride=None, padding=1),
    dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), ceil_mode=True),
    dict(kernel_size=3, stride=2, padding=1, count_include_pad=False),
    dict(kernel_size=[2], stride=[1], divisor_override=3),
]
LAYOUTS = ["contiguous", "channels_last", "unbatched"]


def _input(layout, dtype=torch.float64):
    if layout == "unbatched":
        x = torch.randn(5, 9, 11, dtype=dtype)
    else:
        x = torch.randn(3, 5, 9, 11, dtype=dtype)
        if layout == "channels_last":
            x = x.contiguous(memory_format=torch.channels_last)
    return x.requires_grad_()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_eager_bit_for_bit_and_keeps_nothing(config, layout, dtype):
    x = _input(layout, dtype)
    out, saved = saved_tensors(lambda: avg_pool2d(x, **config))
    assert saved == []  # eager keeps the whole input
    ref = F.avg_pool2d(x, **config)
    assert torch.equal(out, ref)
    assert_same_layout(out, ref)
    g = torch.randn_like(ref)
    (gx,) = torch.autograd.grad(out, x, g)
    (rx,) = torch.autograd.grad(ref, x, g)
    assert torch.equal(gx, rx)
    assert_same_layout(gx, rx)


def test_the_op_runs_where_a_gradient_is_needed():
    x = _input("channels_last")
    with torch.autograd.profiler.profile() as prof:
        avg_pool2d(x, 2)
    assert "fxfuse::avg_pool2d" in {e.name for e in prof.function_events}


def test_gradcheck_and_gradgradcheck():
    x = _input("contiguous")
    fn = lambda t: avg_pool2d(t, 3, 2, 1, count_include_pad=False)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


def test_second_order_gradient_matches_eager():
    w = torch.randn(5, 1, 1, dtype=torch.float64)

    def penalty(pool, x):
        y = pool(x * w, 2) ** 2
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return torch.autograd.grad((g**2).sum(), x)[0]

    x = _input("channels_last")
    assert torch.allclose(penalty(avg_pool2d, x), penalty(F.avg_pool2d, x), rtol=0, atol=1e-12)


def test_eager_path_without_a_gradient_and_under_torch_func():
    x = torch.randn(2, 3, 8, 8)
    _, saved = saved_tensors(lambda: avg_pool2d(x, 2))
    assert saved == []
    xg = x.clone().requires_grad_()
    jvp = torch.func.jvp(lambda t: avg_pool2d(t, 2), (xg,), (torch.ones_like(xg),))
    ref = torch.func.jvp(lambda t: F.avg_pool2d(t, 2), (xg,), (torch.ones_like(xg),))
    assert all(torch.equal(a, b) for a, b in zip(jvp, ref))
    assert torch.equal(torch.func.grad(lambda t: avg_pool2d(t, 2).sum())(xg), torch.full_like(xg, 0.25))


def test_strided_input_takes_eager_path():
    x = torch.randn(2, 3, 16, 16, requires_grad=True)[:, :, ::2]
    out, saved = saved_tensors(lambda: avg_pool2d(x, 2))
    assert torch.equal(out, F.avg_pool2d(x, 2))
    assert len(saved) == 1  # eager's AvgPool2DBackward


@pytest.mark.parametrize(
    "args",
    [
        dict(kernel_size=0),
        dict(kernel_size=2, padding=2),
        dict(kernel_size=(1, 2, 3)),
        dict(kernel_size=2.5),
        dict(kernel_size=2, divisor_override=0),
    ],
    ids=str,
)
def test_bad_arguments_raise_eagers_error(args):
    x = _input("contiguous")
    same_error(lambda: avg_pool2d(x, **args), lambda: F.avg_pool2d(x, **args))


def test_bad_input_raises_eagers_error():
    x = torch.randn(3, 8, requires_grad=True)  # 2-D: avg_pool2d wants 3-D or 4-D
    same_error(lambda: avg_pool2d(x, 2), lambda: F.avg_pool2d(x, 2))
    x = torch.randn(1, 2, 1, 1, requires_grad=True)  # output would be empty
    same_error(lambda: avg_pool2d(x, 2), lambda: F.avg_pool2d(x, 2))


def test_fake_and_meta():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.randn(2, 3, 9, 9).contiguous(memory_format=torch.channels_last).requires_grad_()
        out = torch.ops.fxfuse.avg_pool2d(x, [3], [2], [1], True, False, None)
        ref = torch.ops.aten.avg_pool2d(x, [3], [2], [1], True, False, None)
        assert out.shape == ref.shape and out.stride() == ref.stride()
    x = torch.randn(2, 3, 9, 9, device="meta", requires_grad=True)
    out, saved = saved_tensors(lambda: avg_pool2d(x, 3, 2, 1))
    assert out.shape == (2, 3, 5, 5) and saved == []
    out.sum().backward()
    assert x.grad.shape == x.shape


def test_opcheck():
    x = _input("channels_last", torch.float32)
    torch.library.opcheck(torch.ops.fxfuse.avg_pool2d.default, (x, [2], [2], [0], False, True, None))


def test_torch_compile_matches_eager():
    x = _input("channels_last", torch.float32)
    compiled = torch.compile(lambda t: avg_pool2d(t, 2) * 2, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    ref = F.avg_pool2d(x, 2) * 2
    assert torch.equal(out, ref)
    assert torch.equal(torch.autograd.grad(out.sum(), x)[0], torch.autograd.grad(ref.sum(), x)[0])
