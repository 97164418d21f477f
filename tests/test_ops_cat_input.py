"""fxfuse.ops.cat_input: batch_norm_act, conv_bn_act, bn_act_conv and conv2d on `torch.cat(pieces, 1)`,
keeping the pieces for backward instead of their concatenation (fxfuse::cat_*)."""

import contextlib
import itertools

import pytest
import torch
import torch.nn.functional as F

from fxfuse.ops import cat_batch_norm_act, cat_bn_act_conv, cat_conv2d, cat_conv_bn_act
from fxfuse.ops.checks import apply_activation

F64 = torch.float64
FORMATS = [torch.contiguous_format, torch.channels_last]
CHANNELS = (2, 3, 1)  # pieces of different channel counts; 6 in all
OPS = ("batch_norm_act", "conv_bn_act", "bn_act_conv", "bn_act_conv_epilogue", "conv2d")


def _case(op, dtype=F64, fmt=torch.contiguous_format, channels=CHANNELS, seed=0):
    """(pieces, params): the pieces and every other tensor the op takes."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype)

    c, k = sum(channels), 5
    pieces = [rand(3, n, 6, 5).to(memory_format=fmt) for n in channels]
    params = dict(
        in_weight=rand(c),
        in_bias=rand(c),
        weight=rand(k, c, 3, 3).to(memory_format=fmt),
        bias=rand(k),
        bn_weight=rand(k),  # the BN after the conv
        bn_bias=rand(k),
    )
    stats = [rand(c) * 0.1, rand(c).abs() + 0.5, rand(k) * 0.1, rand(k).abs() + 0.5]
    return pieces, params, stats


def _call(op, fused, pieces, p, stats, training):
    """The op on the pieces (fused: fxfuse.ops.cat_*; else eager's torch.cat and F.* ops)."""
    in_rm, in_rv, rm, rv = stats
    if op == "batch_norm_act":
        if fused:
            return cat_batch_norm_act(pieces, in_rm, in_rv, p["in_weight"], p["in_bias"], training, 0.1, 1e-5, "relu")
        x = torch.cat(pieces, 1)
        return F.relu(F.batch_norm(x, in_rm, in_rv, p["in_weight"], p["in_bias"], training, 0.1, 1e-5))
    if op == "conv2d":
        if fused:
            return cat_conv2d(pieces, p["weight"], p["bias"], (1, 2), 1, 1, 1)
        return F.conv2d(torch.cat(pieces, 1), p["weight"], p["bias"], (1, 2), 1, 1, 1)
    if op == "conv_bn_act":
        if fused:
            return cat_conv_bn_act(
                pieces, p["weight"], p["bias"], 1, 1, 1, 1, rm, rv, p["bn_weight"], p["bn_bias"], training, 0.3, 1e-3,
                "silu",
            )  # fmt: skip
        y = F.conv2d(torch.cat(pieces, 1), p["weight"], p["bias"], 1, 1)
        return F.silu(F.batch_norm(y, rm, rv, p["bn_weight"], p["bn_bias"], training, 0.3, 1e-3))
    epilogue = op == "bn_act_conv_epilogue"
    if fused:
        return cat_bn_act_conv(
            pieces, in_rm, in_rv, p["in_weight"], p["in_bias"], training, 0.1, 1e-5, "relu", 0.0, p["weight"],
            p["bias"], (2, 1), (1, 0), 1, 1, epilogue=epilogue, running_mean=rm, running_var=rv,
            bn_weight=p["bn_weight"], bn_bias=p["bn_bias"], training=training, momentum=0.3, eps=1e-3, act="silu",
        )  # fmt: skip
    x = F.relu(F.batch_norm(torch.cat(pieces, 1), in_rm, in_rv, p["in_weight"], p["in_bias"], training, 0.1, 1e-5))
    y = F.conv2d(x, p["weight"], p["bias"], (2, 1), (1, 0))
    if epilogue:
        y = F.silu(F.batch_norm(y, rm, rv, p["bn_weight"], p["bn_bias"], training, 0.3, 1e-3))
    return y


def _run(op, fused, case, training, needs=None, saved=None):
    """Output, the gradient of every tensor that requires one (None where it has none) and the running stats."""
    pieces, params, stats = case
    needs = needs if needs is not None else [True] * (len(pieces) + len(params))
    pieces = [t.detach().clone().requires_grad_(n) for t, n in zip(pieces, needs)]
    params = {k: t.detach().clone().requires_grad_(n) for (k, t), n in zip(params.items(), needs[len(pieces) :])}
    stats = [t.clone() for t in stats]
    if saved is None:
        out = _call(op, fused, pieces, params, stats, training)
    else:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = _call(op, fused, pieces, params, stats, training)
    leaves = [t for t in (*pieces, *params.values()) if t.requires_grad]
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    grads = dict(zip(map(id, leaves), torch.autograd.grad(out, leaves, grad, allow_unused=True)))
    return out, [grads.get(id(t)) for t in (*pieces, *params.values())], stats


def _assert_same(op, case, training, needs=None, tol=1e-9):
    out, grads, stats = _run(op, True, case, training, needs)
    ref, ref_grads, ref_stats = _run(op, False, case, training, needs)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    assert out.stride() == ref.stride()
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert (g is None) == (r is None), i
        if r is not None:
            torch.testing.assert_close(g, r, rtol=tol, atol=tol, msg=f"gradient {i}")
            assert g.stride() == r.stride(), i
    for a, b in zip(stats, ref_stats):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("fmt", FORMATS, ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_matches_eager_float64(op, fmt, training):
    _assert_same(op, _case(op, fmt=fmt), training)


@pytest.mark.parametrize("op", OPS)
def test_every_output_mask(op):
    """Each piece and each parameter with or without requires_grad: the gradients eager gives, None elsewhere."""
    pieces, params, _ = case = _case(op, channels=(2, 1))
    n = len(pieces) + len(params)
    masks = {tuple(m) for m in itertools.product((True, False), repeat=len(pieces))}
    for piece_mask in sorted(masks):
        for param_mask in ([True] * len(params), [False] * len(params), [i % 2 == 0 for i in range(len(params))]):
            needs = [*piece_mask, *param_mask]
            if any(needs):
                _assert_same(op, case, True, needs)
    assert n == len(needs)


@pytest.mark.parametrize("op", OPS)
def test_single_piece(op):
    _assert_same(op, _case(op, fmt=torch.channels_last, channels=(6,)), True)


@pytest.mark.parametrize("op", ["batch_norm_act", "conv_bn_act", "bn_act_conv", "conv2d"])
def test_the_pieces_are_saved_and_not_the_concatenation(op):
    """Through save_for_backward: saved-tensor hooks see each piece, and nothing of the input's size."""
    pieces, _, _ = case = _case(op, dtype=torch.float32)
    saved = []
    _run(op, True, case, True, saved=saved)
    input_numel = sum(p.numel() for p in pieces)
    assert not [t for t in saved if t.numel() >= input_numel]
    assert sorted(t.shape[1] for t in saved if t.dim() == 4 and t.shape[0] == 3) == sorted(CHANNELS)
    eager = []
    _run(op, False, case, True, saved=eager)
    assert [t for t in eager if t.numel() == input_numel]  # eager keeps the concatenation


def test_float32_is_the_base_ops_bit_for_bit():
    case = _case("bn_act_conv_epilogue", dtype=torch.float32, fmt=torch.channels_last)
    out, grads, stats = _run("bn_act_conv_epilogue", True, case, True)
    pieces, params, stats0 = case
    x = torch.cat(pieces, 1)
    ref, ref_grads, ref_stats = _run("bn_act_conv_epilogue", True, ([x], params, stats0), True)
    assert torch.equal(out, ref)
    assert torch.equal(torch.cat(grads[: len(pieces)], 1), ref_grads[0])
    for a, b in zip(grads[len(pieces) :], ref_grads[1:]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("op", OPS)
def test_second_order_gradients_match_eager(op):
    """create_graph=True: the gradients are differentiable functions of the pieces, as eager's are."""
    pieces, params, stats = _case(op, channels=(2, 4))

    def second(fused):
        ps = [t.detach().clone().requires_grad_() for t in pieces]
        w = {k: t.detach().clone().requires_grad_() for k, t in params.items()}
        out = _call(op, fused, ps, w, [t.clone() for t in stats], True)
        grads = torch.autograd.grad(out.pow(2).sum(), [*ps, w["in_weight"]], create_graph=True, allow_unused=True)
        penalty = sum(g.pow(2).sum() for g in grads if g is not None)
        return torch.autograd.grad(penalty, [*ps, *w.values()], allow_unused=True)

    for g, r in zip(second(True), second(False)):
        assert (g is None) == (r is None)
        if r is not None:
            torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("op", OPS)
def test_torch_func_gives_eagers_result(op):
    pieces, params, stats = _case(op)

    def loss(fused, ps):
        return _call(op, fused, list(ps), params, [t.clone() for t in stats], False).pow(2).sum()

    got = torch.func.grad(lambda ps: loss(True, ps))(tuple(pieces))
    want = torch.func.grad(lambda ps: loss(False, ps))(tuple(pieces))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("case", ["spatial", "rank", "empty"])
def test_bad_pieces_raise_like_eager(case):
    pieces, params, stats = _case("bn_act_conv")
    if case == "spatial":
        pieces[1] = pieces[1][:, :, :4]
    if case == "rank":
        pieces[1] = pieces[1][0]
    if case == "empty":
        pieces = []
    with pytest.raises(Exception) as expected:
        _call("bn_act_conv", False, pieces, params, stats, True)
    with pytest.raises(expected.type):
        _call("bn_act_conv", True, pieces, params, stats, True)


def test_pieces_of_another_dtype_are_promoted_as_eager_promotes_them():
    pieces, params, stats = _case("bn_act_conv")
    pieces[1] = pieces[1].float()
    _assert_same("bn_act_conv", (pieces, params, stats), True)


@pytest.mark.parametrize("op", ["conv_bn_act", "conv2d"])
def test_autocast_runs_the_base_op_on_the_concatenation(op):
    """Under autocast the conv keeps its cast input: the pieces are not used, and it computes what eager does."""
    pieces, params, stats = _case(op, dtype=torch.float32, fmt=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = _call(op, True, pieces, params, [t.clone() for t in stats], True)
        ref = _call(op, False, pieces, params, [t.clone() for t in stats], True)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("op", ["batch_norm_act", "conv_bn_act", "bn_act_conv", "conv2d"])
def test_opcheck(op):
    pieces, p, (in_rm, in_rv, rm, rv) = _case(op, fmt=torch.channels_last)
    pieces = [t.requires_grad_() for t in pieces]
    x = torch.cat(pieces, 1).detach()
    rest = {
        "batch_norm_act": (p["in_weight"], p["in_bias"], in_rm, in_rv, True, 1e-5, "relu", 0.0),
        "conv2d": (p["weight"].requires_grad_(), p["bias"], [1, 1], [1, 1], [1, 1], 1),
        "conv_bn_act": (
            p["weight"].requires_grad_(), p["bias"], [1, 1], [1, 1], [1, 1], 1, p["bn_weight"], p["bn_bias"], rm, rv,
            True, 1e-3, "silu", 0.0,
        ),
        "bn_act_conv": (
            p["in_weight"], p["in_bias"], in_rm, in_rv, True, 1e-5, "relu", 0.0, p["weight"], p["bias"], [1, 1],
            [1, 1], [1, 1], 1, True, p["bn_weight"], p["bn_bias"], rm, rv, True, 1e-3, "silu", 0.0,
        ),
    }[op]  # fmt: skip
    torch.library.opcheck(getattr(torch.ops.fxfuse, f"cat_{op}"), (pieces, x, *rest))


def test_the_op_checks_the_pieces_add_up_to_the_input():
    pieces, p, (in_rm, in_rv, _, _) = _case("batch_norm_act")
    x = torch.cat(pieces, 1)
    with pytest.raises(RuntimeError, match="add up"):
        torch.ops.fxfuse.cat_batch_norm_act(pieces[:2], x, None, None, in_rm, in_rv, True, 1e-5, "relu", 0.0)


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda pieces: [pieces[0][:, :, :-1], *pieces[1:]], "cannot be part"),
        (lambda pieces: [pieces[0][0], *pieces[1:]], "cannot be part"),
        (lambda pieces: [pieces[0].unsqueeze(-1), *pieces[1:]], "cannot be part"),
        (lambda pieces: [pieces[0].sum(), *pieces[1:]], "cannot be part"),
        (lambda pieces: [], "at least one piece"),
    ],
)
def test_the_op_checks_each_piece_against_the_input(bad, match):
    pieces, p, (in_rm, in_rv, _, _) = _case("batch_norm_act")
    x = torch.cat(pieces, 1)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.fxfuse.cat_batch_norm_act(bad(pieces), x, None, None, in_rm, in_rv, True, 1e-5, "relu", 0.0)


def test_activation_is_applied_as_eager():
    pieces, p, (in_rm, in_rv, _, _) = _case("batch_norm_act")
    out = cat_batch_norm_act(pieces, in_rm.clone(), in_rv.clone(), None, None, True, 0.1, 1e-5, "leaky_relu", 0.2)
    ref = apply_activation(
        F.batch_norm(torch.cat(pieces, 1), in_rm.clone(), in_rv.clone(), training=True), "leaky_relu", 0.2
    )
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_under_torch_compile_the_concatenation_is_not_kept(monkeypatch):
    """AOTAutograd's CSE would merge the backward's rebuilt cat with the forward's; its partitioner,
    which does not recompute a cat, would then keep the concatenation (autograd/function.h's load_input_and)."""
    monkeypatch.setenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # the cache key does not see backward code
    pieces, params, stats = _case("batch_norm_act", dtype=torch.float32)
    pieces = [p.requires_grad_() for p in pieces]

    def block(*pieces):  # a dense layer: every piece is kept anyway (here by p * p)
        weight, bias = params["in_weight"], params["in_bias"]
        y = cat_batch_norm_act(list(pieces), *stats[:2], weight, bias, True, 0.1, 1e-5, "relu")
        return y, *[p * p for p in pieces]

    from functorch.compile import min_cut_rematerialization_partition, nop
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()  # inductor's partitioner, without inductor's code generation
    backend = aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=min_cut_rematerialization_partition)
    compiled = torch.compile(block, backend=backend)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = compiled(*pieces)
    input_numel = sum(p.numel() for p in pieces)
    assert not [t for t in saved if t.numel() >= input_numel]
    ref = block(*[p.detach().requires_grad_() for p in pieces])
    torch.testing.assert_close(out[0], ref[0])


@pytest.mark.parametrize("fake", [False, True], ids=["kernel", "fake kernel"])
def test_the_op_and_its_fake_kernel_reject_an_input_below_2_dims_alike(fake):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() if fake else contextlib.nullcontext():
        piece, weight = torch.randn(3), torch.randn(3, 3, 1, 1)
        with pytest.raises(RuntimeError, match=r"expected an input of at least 2 dims \(N, C, \.\.\.\), got 1-D"):
            torch.ops.fxfuse.cat_conv2d([piece], piece, weight, None, [1, 1], [0, 0], [1, 1], 1)
