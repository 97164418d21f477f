"""The fused ops under torch.autocast (CPU bfloat16): eager's precision rules, the fused
kernels actually used, and the memory saving kept.

Eager under CPU autocast runs conv2d / linear in bfloat16 (autocast casts input, weight
and bias), batch_norm on the bfloat16 conv output with float32 parameters and running
statistics (statistics computed in float32, output bfloat16), and the activation in
bfloat16. The Autocast kernels of fxfuse::conv_bn_act / conv_act / linear_act / act_linear
(csrc/autocast/) cast the same operands and redispatch.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from support.autocast_training import assert_trains_like_eager_autocast
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fxfuse
from fxfuse import measure
from fxfuse.ops import batch_norm_act, conv_act, conv_bn_act, gelu, linear_act

BF16 = torch.bfloat16
# bfloat16 has an 8-bit significand (eps 2**-7 = 0.0078): eager and fused round the same
# float32 values at different points (batch_norm as x * alpha + beta vs (x - mean) * scale + bias),
# so single elements may differ by a couple of bf16 ulps.
OUT_TOL = dict(rtol=2e-2, atol=2e-2)


class SmallCNN(nn.Module):
    """Conv->BN->ReLU, Conv->BN->GELU, then a LeNet-style Linear->GELU head."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d(2)
        self.fc1, self.fc2 = nn.Linear(16 * 4 * 4, 32), nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.b1(self.c1(x)))
        x = self.pool(F.gelu(self.b2(self.c2(x))))
        x = F.gelu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _pair(seed=0):
    torch.manual_seed(seed)
    model = SmallCNN()
    return model, fxfuse.optimize(copy.deepcopy(model), mode="memory")


def _rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def test_train_steps_match_eager_autocast():
    eager, fused = _pair()
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
    opt_f = torch.optim.SGD(fused.parameters(), lr=0.05)
    torch.manual_seed(1)
    for step in range(3):
        x, target = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
        with torch.autocast("cpu", dtype=BF16):
            out_e, out_f = eager(x), fused(x)
            assert out_f.dtype == out_e.dtype == BF16
            loss_e, loss_f = F.cross_entropy(out_e, target), F.cross_entropy(out_f, target)
        torch.testing.assert_close(out_f, out_e, **OUT_TOL)
        loss_e.backward()
        loss_f.backward()
        for (name, p), q in zip(eager.named_parameters(), fused.parameters()):
            assert q.grad.dtype == p.grad.dtype == torch.float32, name
            # bf16 forward and backward: compare each gradient as a whole (relative norm).
            assert _rel_err(q.grad, p.grad) < 3e-2, (step, name, _rel_err(q.grad, p.grad))
        for (name, a), b in zip(eager.named_buffers(), fused.buffers()):
            assert a.dtype == b.dtype, name
            torch.testing.assert_close(b, a, rtol=1e-2, atol=1e-2, msg=name)
        opt_e.step(), opt_f.step()
        opt_e.zero_grad(), opt_f.zero_grad()
    eager.eval(), fused.eval()
    x = torch.randn(4, 3, 8, 8)
    with torch.autocast("cpu", dtype=BF16):
        out_e, out_f = eager(x), fused(x)
    assert out_f.dtype == out_e.dtype
    torch.testing.assert_close(out_f, out_e, **OUT_TOL)


def test_fused_ops_run_under_autocast():
    _, fused = _pair()
    counter = OpCounter()
    with torch.autocast("cpu", dtype=BF16), counter:
        fused(torch.randn(2, 3, 8, 8)).float().sum().backward()
    names = counter.names
    # c1→b1→relu feeds c2: the BN→ReLU merges into c2 (bn_act_conv, c2's BN→GELU its epilogue), and
    # c1 is not recomputed (that would free nothing), so it runs as ATen's conv. fc1 → GELU → fc2:
    # the GELU merges into fc2 (act_linear), whose input is fc1's bfloat16 output.
    assert names.count("fxfuse.bn_act_conv") == 1 and names.count("fxfuse.bn_act_conv_backward") == 1
    assert names.count("fxfuse.act_linear") == 1 and names.count("fxfuse.act_linear_backward") == 1
    assert "aten.native_batch_norm" not in names and names.count("aten.convolution") == 1


def test_autocast_keeps_the_memory_saving():
    eager, fused = _pair()
    x = torch.randn(16, 3, 8, 8)
    with torch.autocast("cpu", dtype=BF16):
        saved_e = measure.saved_activation_bytes(eager, (x,))
        saved_f = measure.saved_activation_bytes(fused, (x,))
    # Eager keeps, per Conv->BN->act, the bf16 conv output and BN output (or ReLU's output);
    # the fused op keeps its bf16 input only. Measured here: see the assertion message.
    assert saved_f < 0.75 * saved_e, (saved_f, saved_e)


def test_conv_bn_act_op_casts_like_eager_autocast():
    x, w, b = torch.randn(4, 3, 6, 6), torch.randn(5, 3, 3, 3), torch.randn(5)
    g, beta = torch.rand(5) + 0.5, torch.randn(5)
    rm_e, rv_e, rm_f, rv_f = torch.zeros(5), torch.ones(5), torch.zeros(5), torch.ones(5)
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autocast("cpu", dtype=BF16):
        ref = F.relu(F.batch_norm(F.conv2d(x, w, b, 1, 1), rm_e, rv_e, g, beta, True, 0.1, 1e-5))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = conv_bn_act(x, w.requires_grad_(), b, 1, 1, 1, 1, rm_f, rv_f, g, beta, True, 0.1, 1e-5, "relu")
    assert out.dtype == ref.dtype == BF16
    assert rm_f.dtype == rv_f.dtype == torch.float32
    torch.testing.assert_close(out, ref, **OUT_TOL)
    torch.testing.assert_close(rm_f, rm_e, rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(rv_f, rv_e, rtol=1e-2, atol=1e-3)
    # Saved for backward: the bf16 input, weight and conv bias, the float32 BN parameters and
    # batch statistics, no (N, C_out, H, W) activation.
    assert sorted(str(dt) for shape, dt in saved) == sorted(["torch.bfloat16"] * 3 + ["torch.float32"] * 4), saved
    assert ((4, 3, 6, 6), BF16) in saved and ((5, 3, 3, 3), BF16) in saved and ((5,), BF16) in saved


def test_layer_act_ops_match_eager_autocast_exactly():
    # Same ATen layer op on the same autocast-cast operands, then the same activation.
    x, w, b = torch.randn(4, 16), torch.randn(8, 16), torch.randn(8)
    xc, wc = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
    with torch.autocast("cpu", dtype=BF16):
        out, ref = linear_act(x, w, b, "gelu"), F.gelu(F.linear(x, w, b))
        outc, refc = (
            conv_act(xc, wc, None, padding=1, act="silu"),
            F.silu(F.conv2d(xc, wc, None, 1, 1)),
        )
        outg, refg = gelu(x), F.gelu(x)
    assert out.dtype == ref.dtype == outc.dtype == refc.dtype == BF16 and outg.dtype == refg.dtype == torch.float32
    assert torch.equal(out, ref) and torch.equal(outc, refc) and torch.equal(outg, refg)


def test_bf16_input_with_float32_bn_params_outside_autocast():
    # What eager's batch_norm accepts (and autocast produces): bf16 input, float32 parameters.
    x = torch.randn(4, 6, 5, 5).to(BF16).requires_grad_()
    g, beta = (torch.rand(6) + 0.5).requires_grad_(), torch.randn(6).requires_grad_()
    rm_e, rv_e, rm_f, rv_f = torch.zeros(6), torch.ones(6), torch.zeros(6), torch.ones(6)
    ref = F.gelu(F.batch_norm(x, rm_e, rv_e, g, beta, True, 0.1, 1e-5))
    counter = OpCounter()
    with counter:
        out = batch_norm_act(x, rm_f, rv_f, g, beta, True, 0.1, 1e-5, "gelu")
    assert "fxfuse.batch_norm_act" in counter.names
    assert out.dtype == ref.dtype == BF16
    torch.testing.assert_close(out, ref, **OUT_TOL)
    torch.testing.assert_close(rm_f, rm_e, rtol=1e-2, atol=1e-3)
    dy = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (x, g, beta), dy)
    got = torch.autograd.grad(out, (x, g, beta), dy)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype
        assert _rel_err(a, e) < 2e-2


def test_float64_is_not_cast_under_autocast():
    x, w = torch.randn(2, 3, 6, 6, dtype=torch.double), torch.randn(4, 3, 3, 3, dtype=torch.double)
    with torch.autocast("cpu", dtype=BF16):
        out = conv_bn_act(x, w, None, 1, 1, 1, 1, None, None, None, None, True, 0.1, 1e-5, "relu")
        ref = F.relu(F.batch_norm(F.conv2d(x, w, None, 1, 1), None, None, None, None, True, 0.1, 1e-5))
    assert out.dtype == ref.dtype == torch.double
    torch.testing.assert_close(out, ref)


def test_mixed_dtypes_eager_rejects_still_raise_under_autocast():
    x, w = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3, dtype=torch.double)
    with torch.autocast("cpu", dtype=BF16):
        with pytest.raises(RuntimeError) as eager:
            F.conv2d(x, w)
        with pytest.raises(type(eager.value)):
            conv_bn_act(x, w, None, 1, 0, 1, 1, None, None, None, None, True, 0.1, 1e-5, "relu")


def test_torch_compile_under_autocast():
    torch._dynamo.reset()
    eager, fused = _pair()
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 3, 8, 8)
    with torch.autocast("cpu", dtype=BF16):
        out, ref = compiled(x), eager(x)
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **OUT_TOL)
    out.float().sum().backward()
    ref.float().sum().backward()
    for (name, p), q in zip(eager.named_parameters(), fused.parameters()):
        assert _rel_err(q.grad, p.grad) < 3e-2, name


# --------------------------------------------------------------------------- the linear-holding ops
# layer_norm_linear, conv_layer_norm_linear, act_linear (any input dtype) and act_linear_scale serve
# autocast with eager's casts (csrc/autocast/layer_autocast.cpp): eager's output and every gradient
# bit for bit, bfloat16 and float16, with only the input (or the conv's cast input) kept.

C = 16


def _ln_linear(x, lw, lb, w, b):
    return F.linear(F.layer_norm(x, [C], lw, lb, 1e-6), w, b)


def _conv_ln_linear(x, cw, cb, lw, lb, w, b):
    return _ln_linear(F.conv2d(x, cw, cb, 1, 3, 1, C).permute(0, 2, 3, 1), lw, lb, w, b)


def _act_linear(h, w, b):
    return F.linear(F.gelu(h), w, b)


def _act_linear_scale(h, w, b, s):
    return F.linear(F.gelu(h), w, b) * s


def _low(x):
    """x as a low-precision layer's output is under autocast: in the autocast dtype (outside, as it is)."""
    return x.to(torch.get_autocast_dtype("cpu")) if torch.is_autocast_enabled("cpu") else x


def _cases():
    torch.manual_seed(0)
    x, h, xi = torch.randn(2, 5, 5, C), torch.randn(2, 5, 5, 4 * C), torch.randn(2, C, 6, 6)
    lw, lb = torch.rand(C) + 0.5, torch.randn(C)
    w, b, w2, b2, s = (
        torch.randn(4 * C, C) / 4,
        torch.randn(4 * C),
        torch.randn(C, 4 * C) / 8,
        torch.randn(C),
        torch.rand(C),
    )
    cw, cb = torch.randn(C, 1, 7, 7) / 7, torch.randn(C)
    ops_ = fxfuse.ops
    return {
        "layer_norm_linear": (
            "layer_norm_linear", lambda x, lw, lb, w, b: ops_.layer_norm_linear(x, [C], lw, lb, 1e-6, w, b),
            _ln_linear, (x, lw, lb, w, b), False,
        ),
        "layer_norm_linear_low_input": (
            "layer_norm_linear", lambda x, lw, lb, w, b: ops_.layer_norm_linear(_low(x), [C], lw, lb, 1e-6, w, b),
            lambda x, *a: _ln_linear(_low(x), *a), (x, lw, lb, w, b), True,
        ),
        "conv_layer_norm_linear": (
            "conv_layer_norm_linear",
            lambda x, cw, cb, lw, lb, w, b: ops_.conv_layer_norm_linear(
                x, cw, cb, 1, 3, 1, C, [C], lw, lb, 1e-6, w, b
            ),
            _conv_ln_linear, (xi, cw, cb, lw, lb, w, b), True,
        ),
        "act_linear": ("act_linear", lambda h, w, b: ops_.act_linear(h, w, b, "gelu"), _act_linear, (h, w2, b2), False),
        "act_linear_scale": (
            "act_linear_scale", lambda h, w, b, s: ops_.act_linear_scale(h, w, b, s, "gelu"),
            _act_linear_scale, (h, w2, b2, s), False,
        ),
        "act_linear_scale_low_input": (
            "act_linear_scale", lambda h, w, b, s: ops_.act_linear_scale(_low(h), w, b, s, "gelu"),
            lambda h, *a: _act_linear_scale(_low(h), *a), (h, w2, b2, s), True,
        ),
    }  # fmt: skip


def _step(fn, tensors, grad_seed, dtype):
    """fn's output and gradients (in every tensor) under CPU autocast (`dtype`; None: float64, no autocast)."""
    leaves = [t.detach().clone().double() if dtype is None else t.detach().clone() for t in tensors]
    leaves = [t.requires_grad_() for t in leaves]
    with torch.autocast("cpu", dtype=dtype or BF16, enabled=dtype is not None):
        out = fn(*leaves)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out.dtype)
    return out, torch.autograd.grad(out, leaves, grad)


@pytest.mark.parametrize("dtype", [BF16, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(_cases()))
def test_linear_ops_are_eager_autocast(case, dtype):
    op, fused, eager, tensors, kept_low = _cases()[case]
    counter = OpCounter()
    saved = []
    with counter, torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, grads = _step(fused, tensors, 1, dtype)
    assert f"fxfuse.{op}" in counter.names and f"fxfuse.{op}_backward" in counter.names, counter.names
    ref, ref_grads = _step(eager, tensors, 1, dtype)
    assert out.dtype == ref.dtype and torch.equal(out, ref)
    for got, want in zip(grads, ref_grads):
        assert got.dtype == want.dtype and torch.equal(got, want)
    # Kept: the input (as autocast leaves it or casts it) and parameters, no activation of its own.
    first = tensors[0]
    wide = [t for t in saved if t.dim() == first.dim() and t.numel() >= first.numel()]
    assert [(tuple(t.shape), t.dtype) for t in wide] == [(tuple(first.shape), dtype if kept_low else first.dtype)]
    # Accuracy against float64: eager's (the same bits).
    exact, exact_grads = _step(eager, tensors, 1, None)
    assert _rel_err(out, exact) <= _rel_err(ref, exact)
    for got, want, e in zip(grads, ref_grads, exact_grads):
        assert _rel_err(got, e) <= _rel_err(want, e)


@pytest.mark.parametrize("op", ["act_linear", "layer_norm_linear", "act_linear_scale"])
def test_float64_input_with_float32_weight_raises_eagers_error(op):
    # Autocast leaves float64 alone and casts the weight: eager's F.linear rejects the pair, and so
    # do the wrappers and the ops' Autocast kernels (through eager's composition).
    x, w, s = torch.randn(3, C, dtype=torch.double), torch.randn(4, C), torch.rand(4)
    calls = {
        "act_linear": (
            lambda: fxfuse.ops.act_linear(x, w, None, "gelu"),
            lambda: torch.ops.fxfuse.act_linear(x, w, None, "gelu", 0.0),
        ),
        "layer_norm_linear": (
            lambda: fxfuse.ops.layer_norm_linear(x, [C], None, None, 1e-5, w),
            lambda: torch.ops.fxfuse.layer_norm_linear(x, [C], None, None, 1e-5, w, None),
        ),
        "act_linear_scale": (
            lambda: fxfuse.ops.act_linear_scale(x, w, None, s, "gelu"),
            lambda: torch.ops.fxfuse.act_linear_scale(x, w, None, s, "gelu", 0.0),
        ),
    }[op]  # fmt: skip
    with torch.autocast("cpu", dtype=BF16):
        with pytest.raises(RuntimeError) as eager:
            F.linear(x, w)
        for call in calls:
            with pytest.raises(type(eager.value), match="dtype"):
                call()


@pytest.mark.parametrize("pool", ["max_pool2d", "avg_pool2d"])
def test_pooling_serves_autocast(pool):
    # Pooling is on no autocast list: the op runs on the low-precision input as eager does.
    x = torch.randn(2, 4, 6, 6).to(BF16).requires_grad_()
    counter = OpCounter()
    with torch.autocast("cpu", dtype=BF16), counter:
        out = getattr(fxfuse.ops, pool)(x, 2)
    assert f"fxfuse.{pool}" in counter.names
    with torch.autocast("cpu", dtype=BF16):
        ref = getattr(F, pool)(x, 2)
    assert out.dtype == ref.dtype == BF16 and torch.equal(out, ref)
    grad = torch.randn_like(ref)
    assert torch.equal(torch.autograd.grad(out, x, grad)[0], torch.autograd.grad(ref, x, grad)[0])


def _convnext_like():
    from torchvision.models.convnext import CNBlock

    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, C, 4, 4), CNBlock(C, 1e-6, 0.0), CNBlock(C, 1e-6, 0.0))


def _activation_bytes(model, shape):
    """Saved bytes at twice the batch minus at the batch: what does not grow with the batch (the
    weights' autocast copies) cancels."""
    x, x2 = torch.randn(*shape), torch.randn(2 * shape[0], *shape[1:])
    return measure.saved_activation_bytes(model, (x2,)) - measure.saved_activation_bytes(model, (x,))


@pytest.mark.parametrize("mode", ["fast", "memory"])
def test_convnext_blocks_free_under_autocast_what_they_free_in_float32(mode):
    model = _convnext_like()
    shape = (2, 3, 16, 16)
    fused = fxfuse.optimize(copy.deepcopy(model), torch.randn(*shape), mode=mode)
    freed, ops_run = {}, {}
    for amp in (False, True):
        counter = OpCounter()
        with torch.autocast("cpu", dtype=BF16, enabled=amp):
            freed[amp] = _activation_bytes(model, shape) - _activation_bytes(fused, shape)
            with counter:
                fused(torch.randn(*shape))
        ops_run[amp] = sorted(n for n in counter.names if n.startswith("fxfuse."))
    assert ops_run[True] == ops_run[False] and "fxfuse.act_linear_scale" in ops_run[True], ops_run
    # Every tensor float32's plan frees is freed under autocast, where it is a bfloat16 tensor, but for
    # the layer norms' statistics (mean and rstd, one per position), which stay float32: 2 blocks.
    stats = 2 * 2 * (shape[0] * 4 * 4) * 4
    assert freed[False] > 0 and freed[True] * 2 == freed[False] + stats, freed


def test_convnext_blocks_train_like_eager_autocast():
    assert_trains_like_eager_autocast(_convnext_like(), torch.randn(2, 3, 16, 16))


def test_convnext_blocks_under_torch_compile_and_autocast():
    # The fake kernels give the autocast form's dtypes (the linear in the weight's, a float32 scale
    # promoting), so AOTAutograd traces the Autocast kernels' calls.
    torch._dynamo.reset()
    model = _convnext_like()
    fused = fxfuse.optimize(copy.deepcopy(model), torch.randn(2, 3, 16, 16), mode="memory")
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 3, 16, 16)
    with torch.autocast("cpu", dtype=BF16):
        out, ref = compiled(x), model(x)
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **OUT_TOL)
    out.float().sum().backward()
    ref.float().sum().backward()
    for (name, p), q in zip(model.named_parameters(), fused.parameters()):
        assert _rel_err(q.grad, p.grad) < 3e-2, name
