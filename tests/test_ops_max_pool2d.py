"""fxfuse::max_pool2d (fxfuse/ops/max_pool2d.py): F.max_pool2d bit for bit, keeping one byte per output
element for backward; gradients of every order, ties and NaNs, layouts, eager's errors and eager's path
where it must; max_pool2d_indices gives back ATen's indices."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.op_checks import assert_same_layout, same_error, saved_tensors

from fxfuse import _extension

pytestmark = pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")

if _extension.loaded():
    from fxfuse.ops import generic_path, max_pool2d

CONFIGS = [
    dict(kernel_size=2, stride=2),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 0), ceil_mode=True),
    dict(kernel_size=3, stride=1, padding=1, dilation=2),
    dict(kernel_size=(2, 3), dilation=(2, 1)),
    dict(kernel_size=[2], stride=[]),
    dict(kernel_size=(1, 5), stride=1, padding=(0, 2)),
]
LAYOUTS = ["contiguous", "channels_last", "unbatched"]


def _input(layout, dtype=torch.float64, shape=(3, 5, 9, 11)):
    x = torch.randn(*shape, dtype=dtype)
    x[..., 1, :] = 0.0  # ties inside windows: the gradient goes where ATen's index points
    if layout == "unbatched":
        x = x[0]
    elif layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    return x.requires_grad_()


def _indices(x, config):
    args = dict(config)
    return F.max_pool2d(x.detach(), **args, return_indices=True)[1]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_eager_bit_for_bit_and_keeps_one_byte_per_output(config, layout, dtype):
    x = _input(layout, dtype)
    out, saved = saved_tensors(lambda: max_pool2d(x, **config))
    ref = F.max_pool2d(x, **config)
    assert [(t.dtype, t.shape) for t in saved] == [(torch.uint8, ref.shape)]  # eager: the input and int64 indices
    assert torch.equal(out, ref)
    assert_same_layout(out, ref)
    g = torch.randn_like(ref)
    (gx,) = torch.autograd.grad(out, x, g)
    (rx,) = torch.autograd.grad(ref, x, g)
    assert torch.equal(gx, rx)
    assert_same_layout(gx, rx)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_indices_round_trip(config, layout):
    x = _input(layout)
    k = config["kernel_size"]
    kernel = [k, k] if isinstance(k, int) else list(k)
    stride = config.get("stride", kernel)
    args = [kernel, stride, config.get("padding", 0), config.get("dilation", 1)]
    _, offsets = torch.ops.fxfuse.max_pool2d(x.detach(), *args, config.get("ceil_mode", False))
    ref = _indices(x, config)
    assert offsets.dtype == torch.uint8 and offsets.stride() == ref.stride()
    assert torch.equal(torch.ops.fxfuse.max_pool2d_indices(offsets, x.shape[-1], *args), ref)
    with generic_path():  # ATen's integer ops, what other devices run
        _, generic = torch.ops.fxfuse.max_pool2d(x.detach(), *args, config.get("ceil_mode", False))
        assert torch.equal(generic, offsets) and generic.stride() == offsets.stride()
        assert torch.equal(torch.ops.fxfuse.max_pool2d_indices(offsets, x.shape[-1], *args), ref)
        strided = offsets.transpose(-1, -2).contiguous().transpose(-1, -2)
        assert torch.equal(torch.ops.fxfuse.max_pool2d_indices(strided, x.shape[-1], *args), ref)


def test_nan_and_inf_windows_route_the_gradient_as_eager():
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    x[0, 0, :2, :2] = float("nan")
    x[0, 1, 2:4, 2:4] = float("-inf")
    x[1, 2] = float("-inf")
    x.requires_grad_()
    out, ref = max_pool2d(x, 2), F.max_pool2d(x, 2)
    assert torch.equal(out.nan_to_num(), ref.nan_to_num()) and torch.equal(out.isnan(), ref.isnan())
    g = torch.randn_like(ref)
    assert torch.equal(torch.autograd.grad(out, x, g)[0], torch.autograd.grad(ref, x, g)[0])


def test_the_op_runs_where_a_gradient_is_needed():
    x = _input("channels_last")
    with torch.autograd.profiler.profile() as prof:
        max_pool2d(x, 2)
    assert "fxfuse::max_pool2d" in {e.name for e in prof.function_events}


def test_gradcheck_and_gradgradcheck():
    x = torch.randn(2, 3, 7, 7, dtype=torch.float64, requires_grad=True)  # no ties: finite differences
    fn = lambda t: max_pool2d(t, 3, 2, 1)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


def test_second_order_gradient_matches_eager():
    w = torch.randn(5, 1, 1, dtype=torch.float64)

    def penalty(pool, x):
        y = pool(x * w, 3, 2, 1) ** 2
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return torch.autograd.grad((g**2).sum(), x)[0]

    x = _input("channels_last")
    assert torch.allclose(penalty(max_pool2d, x), penalty(F.max_pool2d, x), rtol=0, atol=1e-12)


def test_eager_path_without_a_gradient_under_torch_func_and_with_indices():
    x = torch.randn(2, 3, 8, 8)
    _, saved = saved_tensors(lambda: max_pool2d(x, 2))
    assert saved == []
    xg = x.clone().requires_grad_()
    jvp = torch.func.jvp(lambda t: max_pool2d(t, 2), (xg,), (torch.ones_like(xg),))
    ref = torch.func.jvp(lambda t: F.max_pool2d(t, 2), (xg,), (torch.ones_like(xg),))
    assert all(torch.equal(a, b) for a, b in zip(jvp, ref))
    out, idx = max_pool2d(xg, 2, return_indices=True)
    assert torch.equal(idx, F.max_pool2d(xg, 2, return_indices=True)[1])


def test_strided_input_and_large_windows_take_eager_path():
    x = torch.randn(2, 3, 40, 40, requires_grad=True)
    out, saved = saved_tensors(lambda: max_pool2d(x[:, :, ::2], 2))
    assert torch.equal(out, F.max_pool2d(x[:, :, ::2], 2))
    assert torch.uint8 not in {t.dtype for t in saved}
    out, saved = saved_tensors(lambda: max_pool2d(x, 17))  # 289 positions: more than a byte holds
    assert torch.equal(out, F.max_pool2d(x, 17)) and torch.int64 in {t.dtype for t in saved}


@pytest.mark.parametrize(
    "args",
    [
        dict(kernel_size=0),
        dict(kernel_size=2, padding=2),
        dict(kernel_size=(1, 2, 3)),
        dict(kernel_size=2.5),
        dict(kernel_size=2, dilation=0),
        dict(kernel_size=2, stride=0),
    ],
    ids=str,
)
def test_bad_arguments_raise_eagers_error(args):
    x = _input("contiguous")
    same_error(lambda: max_pool2d(x, **args), lambda: F.max_pool2d(x, **args))


def test_bad_input_raises_eagers_error():
    x = torch.randn(3, 8, requires_grad=True)  # 2-D: max_pool2d wants 3-D or 4-D
    same_error(lambda: max_pool2d(x, 2), lambda: F.max_pool2d(x, 2))
    x = torch.randn(1, 2, 1, 1, requires_grad=True)  # output would be empty
    same_error(lambda: max_pool2d(x, 2), lambda: F.max_pool2d(x, 2))


def test_fake_and_meta():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.randn(2, 3, 9, 9).contiguous(memory_format=torch.channels_last).requires_grad_()
        out, offsets = torch.ops.fxfuse.max_pool2d(x, [3], [2], [1], [1], True)
        ref, idx = torch.ops.aten.max_pool2d_with_indices(x, [3], [2], [1], [1], True)
        assert out.shape == ref.shape and out.stride() == ref.stride()
        assert offsets.dtype == torch.uint8 and offsets.stride() == idx.stride()
    x = torch.randn(2, 3, 9, 9, device="meta", requires_grad=True)
    out, saved = saved_tensors(lambda: max_pool2d(x, 3, 2, 1))
    assert out.shape == (2, 3, 5, 5) and [t.dtype for t in saved] == [torch.uint8]
    out.sum().backward()
    assert x.grad.shape == x.shape


def test_opcheck():
    x = _input("channels_last", torch.float32)
    torch.library.opcheck(torch.ops.fxfuse.max_pool2d.default, (x, [3, 3], [2, 2], [1, 1], [1, 1], False))
    _, offsets = torch.ops.fxfuse.max_pool2d(x.detach(), [3, 3], [2, 2], [1, 1], [1, 1], False)
    torch.library.opcheck(torch.ops.fxfuse.max_pool2d_indices.default, (offsets, 11, [3, 3], [2, 2], [1, 1], [1, 1]))


def test_torch_compile_matches_eager():
    x = _input("channels_last", torch.float32)
    compiled = torch.compile(lambda t: max_pool2d(t, 2) * 2, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    ref = F.max_pool2d(x, 2) * 2
    assert torch.equal(out, ref)
    assert torch.equal(torch.autograd.grad(out.sum(), x)[0], torch.autograd.grad(ref.sum(), x)[0])
