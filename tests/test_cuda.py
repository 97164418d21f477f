"""fxfuse on a CUDA GPU: the CUDA bn_act kernels (csrc/cuda/) against the generic path
and eager, a training step, and float16 autocast.

Every test here needs a GPU and an extension built with FXFUSE_CUDA=1; without them they
skip with the reason. Where no GPU exists, `make test` still compiles the CUDA kernels
(`make cuda-check`) and tests/test_bn_act_elementwise.py checks their per-element math
on the host.
"""

import copy
import itertools

import pytest
import torch
from support.reference import ACTS
from torch import nn

import fxfuse
from fxfuse import _extension

HAS_GPU = torch.cuda.is_available()
HAS_CUDA_KERNELS = _extension.loaded() and torch._C._dispatch_has_kernel_for_dispatch_key("fxfuse::bn_act", "CUDA")

needs_gpu = pytest.mark.skipif(
    not HAS_GPU,
    reason="needs a CUDA GPU (torch.cuda.is_available() is False); the CUDA kernels are only "
    "compiled on this machine (make cuda-check)",
)
needs_cuda_kernels = pytest.mark.skipif(
    HAS_GPU and not HAS_CUDA_KERNELS, reason="fxfuse._C was built without FXFUSE_CUDA=1: no CUDA kernels registered"
)

TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _data(dtype, channels_last, device="cuda"):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, 5, 7, generator=g, dtype=torch.float64) * 2 + 0.3
    dy = torch.randn(x.shape, generator=g, dtype=torch.float64)
    sd = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    w, b = torch.rand(6, generator=g) + 0.5, torch.randn(6, generator=g)
    x, dy = x.to(device, dtype), dy.to(device, dtype)
    if channels_last:
        x, dy = x.contiguous(memory_format=torch.channels_last), dy.contiguous(memory_format=torch.channels_last)
    return x, dy, w.to(device, sd), b.to(device, sd)


@needs_gpu
@needs_cuda_kernels
@pytest.mark.parametrize("act,p", ACTS)
@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_cuda_kernels_match_generic(act, p, dtype, channels_last):
    C = _extension.generic_kernels()
    x, dy, w, b = _data(dtype, channels_last)
    mean, var, _ = torch.ops.fxfuse.bn_stats(x)
    out = torch.ops.fxfuse.bn_act(x, mean, var, w, b, 1e-5, act, p)
    ref = C.bn_act(x, mean, var, w, b, 1e-5, act, p)
    assert out.dtype == ref.dtype and out.stride() == ref.stride()
    torch.testing.assert_close(out, ref, rtol=TOL[dtype], atol=TOL[dtype])
    for batch_stats in (True, False):
        got = torch.ops.fxfuse.bn_act_backward(dy, x, mean, var, w, b, 1e-5, act, p, batch_stats, [True] * 3)
        want = C.bn_act_backward(dy, x, mean, var, w, b, 1e-5, act, p, batch_stats, [True] * 3)
        for a, e in zip(got, want):
            assert a.dtype == e.dtype
            torch.testing.assert_close(a, e, rtol=TOL[dtype], atol=10 * TOL[dtype])


def _cnn():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.GELU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 16),
        nn.GELU(),
        nn.Linear(16, 4),
    )


@needs_gpu
def test_cuda_training_step_matches_eager():
    torch.manual_seed(0)
    model = _cnn().cuda().double()
    optimized = fxfuse.optimize(copy.deepcopy(model))
    x = torch.randn(4, 3, 8, 8, device="cuda", dtype=torch.double)
    out, ref = optimized(x), model(x)
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), optimized.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    for a, b in zip(model.buffers(), optimized.buffers()):
        torch.testing.assert_close(a, b)


def _errors_against(grads, truth):
    """Each parameter's gradient error against a float64 run, relative to that gradient's norm, for the
    parameters whose true gradient is not about zero (a conv bias that BatchNorm follows has a zero
    true gradient: both sides' values there are rounding noise)."""
    largest = max(t.norm() for t in truth)
    return [((g.double() - t).norm() / t.norm()).item() for g, t in zip(grads, truth) if t.norm() > 1e-6 * largest]


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_autocast_matches_eager_autocast(dtype):
    """Under CUDA autocast, fxfuse's outputs have eager's dtype, and its gradients are about as
    close to a float64 run as eager autocast's are."""
    torch.manual_seed(0)
    model = _cnn().cuda()
    optimized = fxfuse.optimize(copy.deepcopy(model))
    reference = copy.deepcopy(model).double()
    x = torch.randn(8, 3, 8, 8, device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        out, ref = optimized(x), model(x)
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    ref.float().sum().backward()
    reference(x.double()).sum().backward()
    truth = [p.grad for p in reference.parameters()]
    eager = _errors_against([p.grad for p in model.parameters()], truth)
    fused = _errors_against([p.grad for p in optimized.parameters()], truth)
    eps = torch.finfo(dtype).eps
    for i, (f, e) in enumerate(zip(fused, eager)):  # per parameter: the fused BatchNorms' own too
        assert f <= 2 * e + 4 * eps, (i, f, e)
    for a, b in zip(model.buffers(), optimized.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


@needs_gpu
def test_cuda_largest_batch_under_a_memory_fraction():
    from fxfuse.measure import fit

    torch.manual_seed(0)
    model = _cnn().cuda()
    optimized = fxfuse.optimize(copy.deepcopy(model), mode="memory")
    x = torch.randn(8, 3, 64, 64, device="cuda")
    cap = torch.cuda.memory_allocated() + 256 * 2**20
    eager = fit.largest_batch(model, (x,), cap, how="measured", start=fit.largest_batch(model, (x,), cap))
    fused = fit.largest_batch(optimized, (x,), cap, how="measured", start=fit.largest_batch(optimized, (x,), cap))
    assert 0 < eager < fused
    # Afterwards the process has its whole GPU again, and a fraction set before is kept.
    big = torch.empty(cap, dtype=torch.uint8, device="cuda")
    del big
    torch.cuda.set_per_process_memory_fraction(0.9)
    try:
        fit.largest_batch(model, (x,), cap, how="measured", start=eager)
        assert torch.cuda.get_per_process_memory_fraction() == pytest.approx(0.9)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


CUDA_SHAPES = [(4, 6, 5, 7), (2, 67, 9, 11), (8, 160, 4, 4), (1, 3, 1, 1), (3, 33, 64, 65)]
MASKS = [list(m) for m in itertools.product([False, True], repeat=3) if any(m)]


def _cuda_case(shape, dtype, channels_last, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = shape[1]
    sd = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 0.3).to("cuda", dtype)
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to("cuda", dtype)
    if channels_last:
        x, dy = x.contiguous(memory_format=torch.channels_last), dy.contiguous(memory_format=torch.channels_last)
    w = (torch.rand(C, generator=g, dtype=torch.float64) + 0.5).to("cuda", sd)
    b = torch.randn(C, generator=g, dtype=torch.float64).to("cuda", sd)
    return x, dy, w, b


def _sum_atol(expected, dtype):
    """Tolerance for a per-channel sum over the batch (grad_weight, grad_bias): in half and
    bfloat16 the two sides round g differently, so a channel whose terms cancel differs by
    about the dtype's precision times the largest channel's sum."""
    if dtype in (torch.float16, torch.bfloat16):  # (3, 33, 64, 65): sums up to 250, seen differences 0.1 / 0.9
        return TOL[dtype] * max(1.0, expected.abs().max().item())
    return 10 * TOL[dtype]


@needs_gpu
@needs_cuda_kernels
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_cuda_bn_stats_and_inplace_forms(shape, dtype, channels_last):
    """bn_stats (split reduction), bn_act_, bn_act_backward_ and bn_act_backward_into_grad_ on
    CUDA against the generic path, and truly in place (same storage, same strides)."""
    C = _extension.generic_kernels()
    x, dy, w, b = _cuda_case(shape, dtype, channels_last)
    stats = torch.ops.fxfuse.bn_stats(x)
    for a, e in zip(stats, C.bn_stats(x)):  # one value per channel: both unbiased variances are nan
        torch.testing.assert_close(a, e, rtol=TOL[dtype], atol=TOL[dtype], equal_nan=True)
    mean, var, _ = stats
    for act, p in ACTS:
        y = x.clone()
        ptr = y.data_ptr()
        torch.ops.fxfuse.bn_act_(y, mean, var, w, b, 1e-5, act, p)
        assert y.data_ptr() == ptr
        torch.testing.assert_close(y, C.bn_act(x, mean, var, w, b, 1e-5, act, p), rtol=TOL[dtype], atol=TOL[dtype])
        for batch_stats in (True, False):
            for mask in MASKS:
                want = C.bn_act_backward(dy, x, mean, var, w, b, 1e-5, act, p, batch_stats, mask)
                got = torch.ops.fxfuse.bn_act_backward(dy, x, mean, var, w, b, 1e-5, act, p, batch_stats, mask)
                for i, (a, e) in enumerate(zip(got, want)):
                    assert (a is None) == (e is None)
                    if e is not None:
                        atol = 10 * TOL[dtype] if i == 0 else _sum_atol(e, dtype)
                        torch.testing.assert_close(a, e, rtol=TOL[dtype], atol=atol)
                y, g = x.clone(), dy.clone()
                py, pg = y.data_ptr(), g.data_ptr()
                got_ = torch.ops.fxfuse.bn_act_backward_(dy, y, mean, var, w, b, 1e-5, act, p, batch_stats, mask[1:])
                got_g = torch.ops.fxfuse.bn_act_backward_into_grad_(
                    g, x, mean, var, w, b, 1e-5, act, p, batch_stats, mask[1:]
                )
                assert y.data_ptr() == py and g.data_ptr() == pg and y.stride() == x.stride()
                ref = C.bn_act_backward(dy, x, mean, var, w, b, 1e-5, act, p, batch_stats, [True, *mask[1:]])
                torch.testing.assert_close(y, ref[0], rtol=TOL[dtype], atol=10 * TOL[dtype])
                torch.testing.assert_close(g, ref[0], rtol=TOL[dtype], atol=10 * TOL[dtype])
                for a, c, e in zip(got_, got_g, ref[1:]):
                    if e is not None:
                        atol = _sum_atol(e, dtype)
                        torch.testing.assert_close(a, e, rtol=TOL[dtype], atol=atol)
                        torch.testing.assert_close(c, e, rtol=TOL[dtype], atol=atol)


@needs_gpu
@needs_cuda_kernels
@pytest.mark.parametrize("shape", CUDA_SHAPES[:3], ids=str)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_cuda_batch_norm_act_matches_eager_cuda(shape, dtype, channels_last):
    """fxfuse.ops.batch_norm_act on CUDA against eager F.batch_norm + activation on CUDA."""
    from fxfuse.ops import batch_norm_act
    from fxfuse.ops.checks import apply_activation

    x, dy, w, b = _cuda_case(shape, dtype, channels_last, seed=1)
    w, b = w.float() if dtype != torch.float64 else w, b.float() if dtype != torch.float64 else b
    for act, p in ACTS:
        xs = [x.clone().requires_grad_() for _ in range(2)]
        ps = [(w.clone().requires_grad_(), b.clone().requires_grad_()) for _ in range(2)]
        stats = [(torch.zeros_like(w), torch.ones_like(w)) for _ in range(2)]
        out = batch_norm_act(xs[0], *stats[0], *ps[0], True, 0.1, 1e-5, act, p)
        ref = apply_activation(torch.nn.functional.batch_norm(xs[1], *stats[1], *ps[1], True, 0.1, 1e-5), act, p)
        tol = TOL[dtype] * (10 if dtype in (torch.float16, torch.bfloat16) else 1)
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
        out.backward(dy)
        ref.backward(dy)
        for a, e in zip((xs[0].grad, *(t.grad for t in ps[0])), (xs[1].grad, *(t.grad for t in ps[1]))):
            torch.testing.assert_close(a, e, rtol=10 * tol, atol=10 * tol)
        for a, e in zip(stats[0], stats[1]):
            torch.testing.assert_close(a, e, rtol=tol, atol=tol)


@needs_gpu
@needs_cuda_kernels
def test_cuda_bn_act_over_2_31_elements_takes_the_64_bit_path():
    free = torch.cuda.mem_get_info()[0]
    shape = (2, 64, 4100, 4100)  # 2.15e9 elements
    if free < 3 * 2 * 64 * 4100 * 4100 * 2:
        pytest.skip("not enough GPU memory for three > 2^31-element half tensors")
    x = torch.randn(shape, device="cuda", dtype=torch.float16)
    mean, var, _ = torch.ops.fxfuse.bn_stats(x)
    # the last channel's statistics from its own slice (well below 2^31 elements)
    last = x[:, -1:].contiguous()
    torch.testing.assert_close(mean[-1:], last.float().mean((0, 2, 3)), rtol=1e-4, atol=1e-4)
    out = torch.ops.fxfuse.bn_act(x, mean, var, None, None, 1e-5, "relu", 0.0)
    want = torch.ops.fxfuse.bn_act(last, mean[-1:], var[-1:], None, None, 1e-5, "relu", 0.0)
    torch.testing.assert_close(out[:, -1:], want, rtol=0, atol=0)
    torch.ops.fxfuse.bn_act_(x, mean, var, None, None, 1e-5, "relu", 0.0)
    torch.testing.assert_close(x[-1, -1], out[-1, -1], rtol=0, atol=0)


@pytest.fixture
def no_tf32(monkeypatch):
    """float32 convolutions and matmuls in float32 on both sides (TF32 rounds each differently)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


@needs_gpu
@needs_cuda_kernels
@pytest.mark.parametrize("size", [8, 33], ids=lambda s: f"{s}x{s}")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_every_op_family_matches_eager_cuda(size, dtype, channels_last, no_tf32):
    """Each op family (tests/support/generic_peaks.py: batch_norm_act, conv_bn_act, bn_act_conv with and
    without its epilogue, conv_act, depthwise conv2d, gelu, linear_act, act_linear,
    act_linear_scale, layer_norm_linear, conv_layer_norm_linear) on CUDA against eager's ops on
    CUDA: the output and the gradient of every input and parameter."""
    from support import generic_peaks as gp

    tol = 1e-9 if dtype == torch.float64 else 1e-4
    for case in gp.step_cases(dtype, channels_last, size, device=torch.device("cuda")):
        results = []
        for fn in (case.fused, case.eager):
            out = fn()
            results.append((out.detach(), *torch.autograd.grad(out, case.leaves, case.dy)))
        for i, (a, e) in enumerate(zip(*results)):
            scale = e.abs().max().item()
            torch.testing.assert_close(a, e, rtol=tol, atol=tol * scale, msg=f"{case.name}: result {i}")


@needs_gpu
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_every_family_model_matches_eager_cuda_float64(channels_last):
    """An optimized model with every op family, NCHW and channels_last, on CUDA in float64: outputs,
    every gradient, running statistics and counters over train steps and eval (assert_equivalent)."""
    from support.generic_peaks import EveryFamily

    from fxfuse.testing import assert_equivalent

    fmt = torch.channels_last if channels_last else torch.contiguous_format
    torch.manual_seed(0)
    model = EveryFamily().cuda().to(memory_format=fmt)
    optimized = fxfuse.optimize(copy.deepcopy(model), mode="memory")
    assert len(optimized.fxfuse_report.fused) >= 6
    x = torch.randn(3, 3, 10, 10, device="cuda").contiguous(memory_format=fmt)
    assert_equivalent(model, optimized, x, dtype=torch.float64)


@needs_gpu
def test_timed_waits_for_the_device():
    """fxfuse.measure.timed (what bench, fit and memory_format="auto" time with) counts the GPU's
    work, not only the launch: a kernel that spins for a known time takes at least that long."""
    from fxfuse import measure

    torch.cuda._sleep(50_000_000)  # the clock ramps up on the first spin (33 ms, then 25 ms on an H200)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    device_seconds = start.elapsed_time(end) / 1e3
    # launching alone takes microseconds: half the device's time tells the two apart
    assert measure.timed(lambda: torch.cuda._sleep(50_000_000)) >= 0.5 * device_seconds


def _launches(fn):
    """cudaLaunchKernel calls fn makes (the host's launches, as the GPU profile counts them)."""
    fn()  # warm: lazy initialisation launches nothing of fn's own
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.name.startswith("cudaLaunchKernel"))


@needs_gpu
@needs_cuda_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_cuda_fused_bn_launches_no_more_than_eager(dtype, channels_last):
    """Per fused BN + activation: statistics, running update and apply in at most 4 launches,
    the backward in at most 3 (bn_act_kernels.h), as eager's BN + activation."""
    x, dy, w, b = _cuda_case((8, 64, 14, 14), dtype, channels_last)
    rm, rv = torch.zeros(64, device="cuda"), torch.ones(64, device="cuda")

    def forward():
        mean, var, unbiased = torch.ops.fxfuse.bn_stats(x)
        torch.ops.fxfuse.update_running_stats_(rm, rv, mean, unbiased, 0.1)
        return torch.ops.fxfuse.bn_act(x, mean, var, w, b, 1e-5, "relu", 0.0)

    mean, var, _ = torch.ops.fxfuse.bn_stats(x)
    assert _launches(forward) <= 4
    mask = [True, True, True]
    assert (
        _launches(lambda: torch.ops.fxfuse.bn_act_backward(dy, x, mean, var, w, b, 1e-5, "relu", 0.0, True, mask)) <= 3
    )


@needs_gpu
@needs_cuda_kernels
@pytest.mark.parametrize("momentum", [0.1, 0.3])
@pytest.mark.parametrize("running_dtype", [torch.float32, torch.float16], ids=str)
def test_cuda_running_stats_round_as_eager_native_cuda(momentum, running_dtype):
    """The running update follows eager's native CUDA batch_norm (cuDNN off) bit for bit, FMA
    contraction included: batch statistics both sides compute exactly (two values a +- d per
    channel), so only the update's rounding can differ."""
    g = torch.Generator().manual_seed(5)
    C = 40
    a = torch.randint(-8, 8, (C,), generator=g) / 4
    d = torch.randint(1, 8, (C,), generator=g) / 8
    x = torch.stack([a - d, a + d]).view(2, C, 1, 1).to("cuda", running_dtype)
    rm = torch.randn(C, generator=g).to("cuda", running_dtype)
    rv = (torch.rand(C, generator=g) + 0.5).to("cuda", running_dtype)
    want_m, want_v = rm.clone(), rv.clone()
    with torch.backends.cudnn.flags(enabled=False):
        torch.nn.functional.batch_norm(x, want_m, want_v, None, None, True, momentum, 1e-5)
    got_m, got_v = rm.clone(), rv.clone()
    mean, _, unbiased = torch.ops.fxfuse.bn_stats(x)
    torch.ops.fxfuse.update_running_stats_(got_m, got_v, mean, unbiased, momentum)
    assert torch.equal(got_m, want_m) and torch.equal(got_v, want_v)


@needs_gpu
@needs_cuda_kernels
@pytest.mark.parametrize("shape,channels_last", [((2, 16, 4, 8), False), ((2, 16, 3, 5), True), ((2, 6, 3, 5), True)])
@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("misaligned", [False, True])
def test_cuda_vector_and_scalar_walks_match_generic(shape, channels_last, dtype, misaligned):
    """The 16-byte vector walks (NCHW with H * W, channels_last with C a multiple of the vector
    width) and the scalar walk (other sizes, a pointer off 16 bytes) against the generic path."""
    C = _extension.generic_kernels()
    x, dy, w, b = _cuda_case(shape, dtype, channels_last, seed=3)
    if misaligned:
        flat = torch.empty(x.numel() + 1, dtype=dtype, device="cuda")[1:]
        n, c, h, wd = x.shape
        view = flat.view(n, h, wd, c).permute(0, 3, 1, 2) if channels_last else flat.view(x.shape)
        x = view.copy_(x)
        assert x.data_ptr() % 16 != 0
    mean, var, _ = torch.ops.fxfuse.bn_stats(x)
    for act, p in (("silu", 0.0), ("leaky_relu", 0.1)):
        torch.testing.assert_close(
            torch.ops.fxfuse.bn_act(x, mean, var, w, b, 1e-5, act, p),
            C.bn_act(x, mean, var, w, b, 1e-5, act, p),
            rtol=TOL[dtype],
            atol=TOL[dtype],
        )
        got = torch.ops.fxfuse.bn_act_backward(dy, x, mean, var, w, b, 1e-5, act, p, True, [True, True, True])
        want = C.bn_act_backward(dy, x, mean, var, w, b, 1e-5, act, p, True, [True, True, True])
        for i, (a, e) in enumerate(zip(got, want)):
            torch.testing.assert_close(a, e, rtol=TOL[dtype], atol=10 * TOL[dtype] if i == 0 else _sum_atol(e, dtype))


def _captured_steps(model, x, replays):
    """Three warm-up steps on a side stream, one train step captured in a CUDA graph, then
    `replays` replays: the output, gradients and buffers after the last (PyTorch's whole-network
    capture recipe: gradients set to None before capture, so the graph owns them)."""
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            model(static_x).square().sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    model.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = model(static_x)
        static_out.square().sum().backward()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return static_out, [p.grad for p in model.parameters()], list(model.buffers())


def _eager_steps(model, x, steps):
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        out = model(x)
        out.square().sum().backward()
    return out, [p.grad for p in model.parameters()], list(model.buffers())


@needs_gpu
@needs_cuda_kernels
@pytest.mark.parametrize("mode", ["fast", "memory"])
def test_cuda_graph_captures_an_optimized_step_and_replays_it_exactly(mode):
    """A train step of an optimized model has no host synchronization (tests/test_host_cost.py
    checks the CPU side), so it can be captured in a CUDA graph: replayed, it gives what eager's
    steps give, output, every gradient and the running statistics with their counters, in
    float64."""
    from support.generic_peaks import EveryFamily

    torch.manual_seed(0)
    model = EveryFamily().cuda().double()
    optimized = fxfuse.optimize(copy.deepcopy(model), mode=mode)
    x = torch.randn(3, 3, 10, 10, device="cuda", dtype=torch.double)
    replays = 2
    got = _captured_steps(optimized, x, replays)
    want = _eager_steps(model, x, 3 + replays)
    torch.testing.assert_close(got[0], want[0], rtol=1e-9, atol=1e-9)
    for name, a, b in zip(("gradient", "buffer"), got[1:], want[1:]):
        assert len(a) == len(b)
        for i, (t, u) in enumerate(zip(a, b)):
            torch.testing.assert_close(t, u, rtol=1e-9, atol=1e-9, msg=f"{name} {i}")


@needs_gpu
@needs_cuda_kernels
def test_cuda_budget_regions_with_dropout_match_eager_float64(monkeypatch):
    """Recompute regions on the GPU run under fxfuse's own checkpoint (fusion/regions/checkpointed.py),
    which keeps the CUDA RNG state of the forward for the recompute: dropout in a recomputed block draws
    the forward's mask, and the step is eager's (test_checkpointed.py runs the same check on the CPU)."""
    from support.dropout_regions import check_budget_step_with_dropout_matches_eager

    assert check_budget_step_with_dropout_matches_eager("cuda", monkeypatch) > 0
