"""fxfuse.ops.bn_act_conv (fxfuse::bn_act_conv): BN → activation → conv (→ BN → activation),
keeping only the first BN's input for backward."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from fxfuse.measure import memory
from fxfuse.ops import ACTIVATIONS, bn_act_conv
from fxfuse.ops.checks import apply_activation

FORMATS = [torch.contiguous_format, torch.channels_last]
CONV = dict(stride=(2, 1), padding=(1, 0), dilation=1)


def _case(dtype, fmt, groups=1, affine=True, bias=True, c=4, k=6, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, fmt=None):
        t = torch.randn(*shape, generator=g, dtype=dtype)
        return t.to(memory_format=fmt) if fmt is not None else t

    return dict(
        input=rand(3, c, 7, 5, fmt=fmt),
        in_weight=rand(c) if affine else None,
        in_bias=rand(c) if affine else None,
        in_stats=(rand(c) * 0.1, rand(c).abs() + 0.5),
        weight=rand(k, c // groups, 3, 3, fmt=fmt),
        bias=rand(k) if bias else None,
        bn_weight=rand(k) if affine else None,
        bn_bias=rand(k) if affine else None,
        stats=(rand(k) * 0.1, rand(k).abs() + 0.5),
        groups=groups,
    )


def _leaves(case):
    names = ("input", "in_weight", "in_bias", "weight", "bias", "bn_weight", "bn_bias")
    return {n: case[n].detach().clone().requires_grad_() for n in names if case[n] is not None}


def _run(fused, case, act, epilogue, training, momentum=(0.1, 0.3)):
    """Output, gradients of every leaf and the updated running statistics."""
    leaves = _leaves(case)
    p = {n: leaves.get(n) for n in ("input", "in_weight", "in_bias", "weight", "bias", "bn_weight", "bn_bias")}
    in_rm, in_rv = (t.clone() for t in case["in_stats"])
    rm, rv = (t.clone() for t in case["stats"])
    param = 0.2 if act == "leaky_relu" else 0.0
    if fused:
        out = bn_act_conv(
            p["input"], in_rm, in_rv, p["in_weight"], p["in_bias"], training, momentum[0], 1e-5, act, param,
            p["weight"], p["bias"], CONV["stride"], CONV["padding"], CONV["dilation"], case["groups"],
            epilogue=epilogue, running_mean=rm, running_var=rv, bn_weight=p["bn_weight"], bn_bias=p["bn_bias"],
            training=training, momentum=momentum[1], eps=1e-3, act="silu",
        )  # fmt: skip
    else:
        x = F.batch_norm(p["input"], in_rm, in_rv, p["in_weight"], p["in_bias"], training, momentum[0], 1e-5)
        out = F.conv2d(apply_activation(x, act, param), p["weight"], p["bias"], groups=case["groups"], **CONV)
        if epilogue:
            out = F.silu(F.batch_norm(out, rm, rv, p["bn_weight"], p["bn_bias"], training, momentum[1], 1e-3))
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    grads = torch.autograd.grad(out, list(leaves.values()), grad, allow_unused=True)
    return out, dict(zip(leaves, grads)), (in_rm, in_rv, rm, rv)


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("epilogue", [False, True], ids=["conv", "conv_bn"])
@pytest.mark.parametrize("fmt", FORMATS, ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_matches_eager_float64(act, epilogue, fmt, training):
    case = _case(torch.float64, fmt)
    out, grads, stats = _run(True, case, act, epilogue, training)
    ref, ref_grads, ref_stats = _run(False, case, act, epilogue, training)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
    assert out.is_contiguous(memory_format=fmt) == ref.is_contiguous(memory_format=fmt)
    for name, g in ref_grads.items():
        if g is None:
            assert grads[name] is None, name
        else:
            torch.testing.assert_close(grads[name], g, rtol=1e-9, atol=1e-9, msg=name)
    for a, b in zip(stats, ref_stats):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "groups,affine,bias", [(2, True, True), (4, False, False), (1, False, True)], ids=["grouped", "depthwise", "plain"]
)
def test_groups_and_optional_parameters(groups, affine, bias):
    case = _case(torch.float64, torch.channels_last, groups=groups, affine=affine, bias=bias, k=8 if groups == 2 else 4)
    for epilogue in (False, True):
        out, grads, stats = _run(True, case, "relu", epilogue, True)
        ref, ref_grads, ref_stats = _run(False, case, "relu", epilogue, True)
        torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-9, atol=1e-9, msg=name)
        for a, b in zip(stats, ref_stats):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("epilogue", [False, True], ids=["conv", "conv_bn"])
def test_float32_forward_is_eager_bit_for_bit(epilogue):
    """The BN-apply is fxfuse::bn_act (eager's bits on CPU), the conv is ATen's: nothing differs."""
    case = _case(torch.float32, torch.channels_last, c=8, k=8)
    out, _, stats = _run(True, case, "relu", epilogue, True)
    ref, _, ref_stats = _run(False, case, "relu", epilogue, True)
    assert torch.equal(out, ref)
    for a, b in zip(stats, ref_stats):
        assert torch.equal(a, b)


@pytest.mark.parametrize("epilogue", [False, True], ids=["conv", "conv_bn"])
def test_only_the_bn_input_is_saved(epilogue):
    """Through save_for_backward: saved-tensor hooks see the BN input and no activation-sized other."""
    case = _case(torch.float32, torch.contiguous_format, c=8, k=8)
    leaves = _leaves(case)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        bn_act_conv(
            leaves["input"], None, None, leaves["in_weight"], leaves["in_bias"], True, 0.1, 1e-5, "relu", 0.0,
            leaves["weight"], leaves["bias"], 1, 1, 1, 1, epilogue=epilogue, bn_weight=leaves.get("bn_weight"),
            bn_bias=leaves.get("bn_bias"), training=True, act="relu",
        )  # fmt: skip
    big = [t for t in saved if t.numel() >= case["input"].numel()]
    assert len(big) == 1 and big[0].data_ptr() == leaves["input"].data_ptr()


def test_cpu_backward_writes_the_prologue_grad_over_the_conv_grad():
    """Backward allocates the rebuilt activation and the conv's grad_input, and writes the first
    BN's grad_input over the latter (fxfuse::bn_act_backward_into_grad_): two activation-sized
    buffers, where a fresh grad_input made it three (channels_last, where oneDNN adds no copies)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, 32, 32, generator=g).to(memory_format=torch.channels_last)
    w = (torch.randn(16, 16, 3, 3, generator=g) * 0.1).to(memory_format=torch.channels_last)
    gamma, beta = torch.rand(16, generator=g) + 0.5, torch.randn(16, generator=g)
    rm, rv = torch.zeros(16), torch.ones(16)
    out, mean, var, *_ = torch.ops.fxfuse.bn_act_conv(
        x, gamma, beta, rm, rv, True, 1e-5, "relu", 0.0, w, None, [1, 1], [1, 1], [1, 1], 1,
        False, None, None, None, None, True, 1e-5, "none", 0.0,
    )  # fmt: skip
    grad = torch.randn(out.shape, generator=g).to(memory_format=torch.channels_last)

    def backward():
        return torch.ops.fxfuse.bn_act_conv_backward(
            grad, x, gamma, beta, mean, var, True, 1e-5, "relu", 0.0, w, None, [1, 1], [1, 1], [1, 1], 1,
            False, None, None, mean, var, True, 1e-5, "none", 0.0, [True] * 5 + [False, False],
        )  # fmt: skip

    backward()
    allocated = sum(d for d in memory._allocator_deltas(backward, torch.device("cpu")) if d > 0)
    activation = x.numel() * x.element_size()
    assert 2 * activation <= allocated < 2.5 * activation  # 2.26 here; 3.26 with a fresh grad_input


@pytest.mark.parametrize("epilogue", [False, True], ids=["conv", "conv_bn"])
def test_autocast_matches_eager_and_keeps_only_the_bn_input(epilogue):
    """CPU bfloat16 autocast, a bfloat16 BN input (a conv output under autocast): the conv runs on
    bfloat16 operands as eager's does, float32 parameters get float32 gradients."""
    case = _case(torch.float32, torch.channels_last, c=8, k=8)
    case["input"] = case["input"].to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, grads, stats = _run(True, case, "relu", epilogue, True)
        ref, ref_grads, ref_stats = _run(False, case, "relu", epilogue, True)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    for name, g in ref_grads.items():
        if g is None:
            assert grads[name] is None, name
            continue
        assert grads[name].dtype == g.dtype, name
        # atol: the conv bias before a training BN has a zero gradient in exact arithmetic (bf16 noise here)
        torch.testing.assert_close(grads[name], g, rtol=5e-2, atol=5e-2, msg=name)
    for a, b in zip(stats, ref_stats):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    leaves = _leaves(case)
    saved = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            bn_act_conv(
                leaves["input"], None, None, leaves["in_weight"], leaves["in_bias"], True, 0.1, 1e-5, "relu", 0.0,
                leaves["weight"], leaves["bias"], 1, 1, 1, 1, epilogue=epilogue, bn_weight=leaves.get("bn_weight"),
                bn_bias=leaves.get("bn_bias"), training=True,
            )  # fmt: skip
    big = [t for t in saved if t.numel() >= case["input"].numel()]
    assert len(big) == 1 and big[0].data_ptr() == leaves["input"].data_ptr()


def test_autocast_float32_bn_input_runs_the_composition():
    """A float32 BN input under autocast: eager casts the activation output at the conv, which
    the op does not do, so the unfused composition runs (eager's values exactly)."""
    case = _case(torch.float32, torch.channels_last, c=8, k=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _, _ = _run(True, case, "relu", True, True)
        ref, _, _ = _run(False, case, "relu", True, True)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert torch.equal(out, ref)


@pytest.mark.parametrize("case", ["channels", "bn_channels", "dtype", "batch1", "too_small"])
def test_bad_input_raises_like_eager(case):
    x = torch.randn(1 if case == "batch1" else 2, 3, 1 if case == "batch1" else 6, 6)
    w = torch.randn(4, 3, 3, 3)
    in_rm, in_rv = torch.zeros(3), torch.ones(3)
    if case == "channels":
        w = torch.randn(4, 5, 3, 3)
    if case == "bn_channels":
        in_rm, in_rv = torch.zeros(5), torch.ones(5)
    if case == "dtype":
        w = w.double()
    if case == "too_small":
        x = torch.randn(2, 3, 2, 2)

    def fused():
        bn_act_conv(x, in_rm.clone(), in_rv.clone(), None, None, True, 0.1, 1e-5, "relu", 0.0, w, None, 1, 0, 1, 1)

    def eager():
        F.conv2d(F.relu(F.batch_norm(x, in_rm.clone(), in_rv.clone(), training=True)), w, None, 1, 0)

    with pytest.raises(Exception) as expected:
        eager()
    with pytest.raises(expected.type):
        fused()


def test_unknown_activation():
    x, w = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
    for in_act, act in (("swish", "none"), ("relu", "swish")):
        with pytest.raises(ValueError, match="unknown activation"):
            bn_act_conv(
                x, None, None, None, None, True, 0.1, 1e-5, in_act, 0.0, w, epilogue=True, training=True, act=act
            )


def test_padding_same_runs_the_composition():
    case = _case(torch.float64, torch.contiguous_format)
    x, w = case["input"], torch.randn(4, 4, 4, 4, dtype=torch.float64)
    out = bn_act_conv(x, None, None, None, None, True, 0.1, 1e-5, "relu", 0.0, w, None, 1, "same", 1, 1)
    torch.testing.assert_close(out, F.conv2d(F.relu(F.batch_norm(x, None, None, training=True)), w, padding="same"))


def test_opcheck():
    case = _case(torch.float64, torch.channels_last)
    for epilogue, batch_stats in itertools.product((False, True), (False, True)):
        in_rm, in_rv = case["in_stats"]
        rm, rv = case["stats"]
        args = (
            case["input"].requires_grad_(), case["in_weight"], case["in_bias"], in_rm, in_rv, batch_stats, 1e-5, "relu",
            0.0, case["weight"].requires_grad_(), case["bias"], [1, 1], [1, 1], [1, 1], 1, epilogue, case["bn_weight"],
            case["bn_bias"], rm, rv, batch_stats, 1e-3, "silu", 0.0,
        )  # fmt: skip
        torch.library.opcheck(torch.ops.fxfuse.bn_act_conv, args)
