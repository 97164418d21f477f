"""fxfuse.ops.checks' pieces of the runtime's thin path: the remembered conv plan, the one pass over a
call's tensors (autocast included), and the modes that send a call to the full checks."""

import pytest
import torch

from fxfuse import _extension
from fxfuse.ops import checks


def test_a_conv_plan_is_conv_geometrys_answer_remembered():
    x, w = torch.randn(2, 4, 9, 7), torch.randn(6, 2, 3, 3)
    plan = checks.conv_plan(x.shape, w.shape, (2, 1), (1, 0), (1, 2), 2)
    assert plan == tuple(checks.conv_geometry(x, w, (2, 1), (1, 0), (1, 2))[1:])
    assert checks.conv_plan(x.shape, w.shape, (2, 1), (1, 0), (1, 2), 2) is plan


@pytest.mark.parametrize(
    "args",
    [
        ((2, 4, 9, 9), (6, 4, 3, 3), 1, "same", 1, 1),  # padding as a string: the input may be padded
        ((2, 4, 9, 9), (6, 4, 3, 3), 1, 0, 1, 2),  # groups that do not match the channels
        ((2, 4, 9), (6, 4, 3), 1, 0, 1, 1),  # not 2-D
        ((2, 4, 2, 2), (6, 4, 3, 3), 1, 0, 1, 1),  # no output
        ((2, 4, 9, 9), (6, 4, 3, 3), 1, 0, 1, 1.0),  # groups not an int
        ((2, 4, 9, 9), (6, 4, 3, 3), [1, 1], 0, 1, 1),  # a list: not remembered
    ],
)
def test_a_conv_plan_declines_what_the_full_checks_must_decide(args):
    input_shape, weight_shape, *rest = args
    assert checks.conv_plan(torch.Size(input_shape), torch.Size(weight_shape), *rest) is None


def test_conv_plans_start_over_when_full(monkeypatch):
    monkeypatch.setattr(checks, "_CONV_PLANS", {})
    monkeypatch.setattr(checks, "_CONV_PLANS_MAX", 3)
    for size in range(5, 10):
        checks.conv_plan(torch.Size((1, 1, size, size)), torch.Size((1, 1, 3, 3)), 1, 0, 1, 1)
    assert len(checks._CONV_PLANS) <= 3


def test_alike_checks_dtype_device_and_shape_of_what_is_given():
    a, b = torch.zeros(3), torch.zeros(3, dtype=torch.float64)
    assert checks.alike(torch.float32, a.device, (3,), (a, None, a))
    assert not checks.alike(torch.float32, a.device, (3,), (a, b))
    assert not checks.alike(torch.float32, a.device, (4,), (a,))
    assert checks.alike(torch.float32, a.device, None, (torch.zeros(2, 2),))
    assert not checks.alike(torch.float32, torch.device("meta"), None, (a,))


@pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")
def test_quiet_modes_is_false_under_each_mode_the_thin_path_leaves_to_the_full_checks():
    assert checks.quiet_modes()
    with torch.autocast("cpu"):  # autocast is the tensors' part: thin_dtypes
        assert checks.quiet_modes()
    with torch.autograd.forward_ad.dual_level():
        assert not checks.quiet_modes()
    seen = []
    torch.func.vmap(lambda t: seen.append(checks.quiet_modes()) or t)(torch.zeros(2))
    assert seen == [False]
    seen.clear()
    torch.compile(lambda t: seen.append(checks.quiet_modes()) or t + 1, backend="eager")(torch.zeros(2))
    assert seen == [False]


def test_thin_dtypes_outside_autocast_wants_the_inputs_dtype_and_device_everywhere():
    x, w, b, stats = torch.randn(2, 4, 3, 3), torch.randn(6, 4, 1, 1), torch.randn(6), [torch.zeros(6)] * 4
    assert checks.thin_dtypes(x, (w, b), (6,), ((stats, (6,)),))
    assert checks.thin_dtypes(x, (w, None), (6,), (((None,) * 4, (6,)),))
    assert not checks.thin_dtypes(x, (w.double(), b), (6,), ((stats, (6,)),))
    assert not checks.thin_dtypes(x, (w, b), (6,), (([stats[0].double()], (6,)),))
    assert not checks.thin_dtypes(x, (w, torch.zeros(5)), (6,), ((stats, (6,)),))


def test_thin_dtypes_under_autocast_follows_what_autocast_casts():
    x, w, b = torch.randn(2, 4, 3, 3), torch.randn(6, 4, 1, 1), torch.randn(6)
    f32, low = [torch.zeros(6)] * 4, [torch.zeros(6, dtype=torch.bfloat16)] * 4
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert checks.thin_dtypes(x, (w, b), (6,), ((f32, (6,)),))  # conv_bn_act: its Autocast kernel casts
        assert checks.thin_dtypes(x, (w, b), (6,), ((low, (6,)),))
        assert not checks.thin_dtypes(x, (w, b), (6,), ((f32[:2] + low[:2], (6,)),))  # one BN, two dtypes
        assert not checks.thin_dtypes(x.double(), (w, b), (6,), ((f32, (6,)),))  # float64 is not cast
        # bn_act_conv: the BN input must be a low-precision conv output already
        assert checks.thin_dtypes(x.bfloat16(), (w, b), (6,), ((f32, (6,)),), True)
        assert not checks.thin_dtypes(x, (w, b), (6,), ((f32, (6,)),), True)


def test_thin_plain_wants_torch_tensors_and_no_function_mode():
    x, w = torch.randn(2, 3), torch.nn.Parameter(torch.randn(3, 3))
    assert checks.thin_plain(x, w, None)
    assert not checks.thin_plain(torch.nn.Parameter(x), w)  # a Parameter input: the full checks
    assert not checks.thin_plain(x.int(), w)
    assert not checks.thin_plain(x.to_sparse(), w)

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        assert not checks.thin_plain(x, w)


def test_thin_linear_and_thin_conv_admit_only_what_the_full_checks_admit():
    x, w, b = torch.randn(2, 5, 8), torch.randn(6, 8), torch.randn(6)
    assert checks.thin_linear(x, w, b) and checks.linear_fusable(x, w, b)
    for args in ((x, w, torch.randn(5)), (x, torch.randn(6, 7), b), (x, w.double(), b), (torch.randn(()), w, b)):
        assert not checks.thin_linear(*args)
    assert checks.thin_linear(x, w, b, torch.ones(8), None)  # a layer norm's tensors, checked in the same pass

    class Sub(torch.Tensor):
        pass

    assert not checks.thin_linear(x, w, b, torch.ones(8).as_subclass(Sub))
    x, w = torch.randn(2, 4, 6, 6), torch.randn(6, 2, 3, 3)
    geometry = checks.thin_conv(x, w, None, 1, 1, 1, 2)
    expected = checks.fusable_conv_geometry(x, w, None, 1, 1, 1, 2)
    assert geometry[0] is x and list(geometry[1:]) == list(expected[1:])
    assert checks.thin_conv(x, torch.randn(5, 2, 3, 3), None, 1, 1, 1, 2) is None  # 5 outputs, 2 groups
    assert checks.thin_conv(x, w, None, 1, "same", 1, 2) is None
