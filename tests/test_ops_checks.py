"""fxfuse.ops.checks' pieces of the runtime's thin path: the remembered conv plan, the one pass over a
call's tensors, and the modes that send a call to the full checks."""

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
def test_quiet_modes_is_false_under_each_mode_the_full_checks_handle():
    assert checks.quiet_modes()
    with torch.autocast("cpu"):
        assert not checks.quiet_modes()
    with torch.autograd.forward_ad.dual_level():
        assert not checks.quiet_modes()
    seen = []
    torch.func.vmap(lambda t: seen.append(checks.quiet_modes()) or t)(torch.zeros(2))
    assert seen == [False]
    seen.clear()
    torch.compile(lambda t: seen.append(checks.quiet_modes()) or t + 1, backend="eager")(torch.zeros(2))
    assert seen == [False]
