"""The habits of real training code around an optimized model, each against the same model in eager,
float64, over two train steps plus eval (issue 33's suite; hooks, higher-order gradients and the
model's own checkpointing have their own files: test_hooks.py, test_higher_order.py, test_user_checkpoint.py)."""

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import fxfuse
from fxfuse.fusion.optimize import is_optimized
from fxfuse.testing import assert_equivalent

TOL = dict(rtol=1e-9, atol=1e-9)


def _net(act=nn.ReLU):
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        act(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        act(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    ).double()


def _x(n=4, size=8):
    return torch.randn(n, 3, size, size, dtype=torch.double)


def _pair(model=None, act=nn.ReLU):
    eager = model if model is not None else _net(act)
    optimized = fxfuse.optimize(copy.deepcopy(eager))
    assert optimized.fxfuse_report.fused, "the habit must run through fused ops"
    return eager, optimized


def _step(model, x, lr=0.1):
    """One SGD step; returns the output and the input's gradient."""
    x = x.clone().requires_grad_()
    out = model(x)
    out.square().sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    grad = x.grad
    model.zero_grad(set_to_none=True)
    return out.detach(), grad


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], **TOL, msg=k)


def _assert_trains_alike(eager, optimized, x, steps=2, step=_step):
    for _ in range(steps):
        for a, b in zip(step(eager, x), step(optimized, x)):
            torch.testing.assert_close(b, a, **TOL)
        _assert_same_state(eager, optimized)
    eager.eval(), optimized.eval()
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), eager(x), **TOL)


@pytest.mark.parametrize("act", [nn.ReLU, nn.SiLU], ids=["relu", "silu"])
def test_functional_call_with_other_parameters(act):
    eager, optimized = _pair(act=act)
    x = _x()
    params = {k: (v * 1.1).detach().requires_grad_() for k, v in eager.named_parameters()}
    buffers = {k: v.clone() for k, v in eager.named_buffers()}
    results = []
    for model in (eager, optimized):
        p = {k: v.clone().detach().requires_grad_() for k, v in params.items()}
        b = {k: v.clone() for k, v in buffers.items()}
        out = torch.func.functional_call(model, {**p, **b}, (x,))
        grads = torch.autograd.grad(out.square().sum(), list(p.values()))
        results.append((out, grads, b))
    (out_e, grads_e, buf_e), (out_o, grads_o, buf_o) = results
    torch.testing.assert_close(out_o, out_e, **TOL)
    for a, b in zip(grads_e, grads_o):
        torch.testing.assert_close(b, a, **TOL)
    for k in buf_e:
        torch.testing.assert_close(buf_o[k], buf_e[k], **TOL, msg=k)
    _assert_same_state(eager, optimized)  # the module's own tensors untouched by either


@pytest.mark.parametrize("how", ["torch.save", "pickle", "deepcopy"])
def test_a_saved_or_copied_optimized_model_is_still_optimized_and_exact(how):
    eager, optimized = _pair()
    x = _x()
    _step(eager, x), _step(optimized, x)
    if how == "torch.save":
        buf = io.BytesIO()
        torch.save(optimized, buf)
        buf.seek(0)
        restored = torch.load(buf, weights_only=False)
    elif how == "pickle":
        restored = pickle.loads(pickle.dumps(optimized))
    else:
        restored = copy.deepcopy(optimized)
    assert is_optimized(restored) and restored.fxfuse_report.fused
    _assert_same_state(eager, restored)
    _assert_trains_alike(eager, restored, x)


def test_load_state_dict_of_an_eager_checkpoint():
    eager, optimized = _pair()
    x = _x()
    for _ in range(2):
        _step(eager, x)
    optimized.load_state_dict(eager.state_dict())
    _assert_same_state(eager, optimized)
    _assert_trains_alike(eager, optimized, x)


def test_timm_model_ema_tracks_the_same_weights():
    timm_utils = pytest.importorskip("timm.utils")
    eager, optimized = _pair()
    x = _x()
    emas = [timm_utils.ModelEmaV3(m, decay=0.5) for m in (eager, optimized)]
    for _ in range(2):
        for model, ema in zip((eager, optimized), emas):
            _step(model, x)
            ema.update(model)
        _assert_same_state(emas[0].module, emas[1].module)
    with torch.no_grad():
        torch.testing.assert_close(emas[1].module(x), emas[0].module(x), **TOL)


def test_frozen_partly_fine_tuned_backbone():
    eager = _net()
    for p in eager[0].parameters():
        p.requires_grad_(False)
    eager, optimized = _pair(eager)
    x = _x()

    def step(model, x):
        model.train()
        model[1].eval()  # the frozen stage's BN keeps its statistics
        return _step(model, x)

    _assert_trains_alike(eager, optimized, x, step=step)
    assert eager[1].num_batches_tracked.item() == 0 and optimized[1].num_batches_tracked.item() == 0


class _Tied(nn.Module):
    """One Conv→BN→ReLU block applied three times: its BN sees three batches per step."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = self.stem(x)
        for _ in range(3):
            x = self.block(x)
        return self.head(x.mean((2, 3)))


def test_a_weight_tied_block_applied_several_times():
    eager, optimized = _pair(_Tied().double())
    x = _x()
    _assert_trains_alike(eager, optimized, x)
    assert optimized.block[1].num_batches_tracked.item() == 6


def test_saved_tensors_offloaded_to_cpu_with_save_on_cpu():
    eager, optimized = _pair()
    x = _x()

    def step(model, x):
        with torch.autograd.graph.save_on_cpu():
            return _step(model, x)

    _assert_trains_alike(eager, optimized, x, step=step)


def test_assert_equivalent_on_a_silu_net():
    eager, optimized = _pair(act=nn.SiLU)
    assert_equivalent(eager, optimized, _x(), dtype=torch.float64)


def _outcome(model, x):
    try:
        out = model(x)
        out.sum().backward()
        return ("ok", out.detach())
    except Exception as exc:  # noqa: BLE001 - the outcome is what is compared
        return (type(exc), str(exc))


@pytest.mark.parametrize(
    "x",
    [
        pytest.param(torch.randn(1, 3, 1, 1, dtype=torch.double), id="batch 1 at 1x1 in train mode"),
        pytest.param(torch.randn(0, 3, 8, 8, dtype=torch.double), id="empty batch"),
        pytest.param(torch.randn(2, 3, 8, 8), id="wrong dtype"),
        pytest.param(
            torch.randn(2, 3, 8, 8, dtype=torch.double).index_fill(0, torch.tensor([1]), float("nan")), id="NaN"
        ),
    ],
)
def test_unusual_input_gets_what_eager_gives(x):
    eager, optimized = _pair()
    got, want = _outcome(optimized, x), _outcome(eager, x)
    assert got[0] == want[0], (got, want)
    if want[0] == "ok":
        torch.testing.assert_close(got[1], want[1], **TOL, equal_nan=True)
    sa, sb = eager.state_dict(), optimized.state_dict()
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], **TOL, equal_nan=True, msg=k)


class _RoundSTE(torch.autograd.Function):
    """Quantization-aware training's straight-through estimator: round forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class _SplitScale(torch.autograd.Function):
    """Two outputs and a backward that is not the forward's derivative (scaled)."""

    @staticmethod
    def forward(ctx, x):
        return x.relu(), x * 2

    @staticmethod
    def backward(ctx, ga, gb):
        return 0.5 * ga + 3 * gb


class _QuantNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        y = _RoundSTE.apply(torch.relu(self.bn1(self.conv1(x))))
        a, b = _SplitScale.apply(self.bn2(self.conv2(y)))
        return self.head((a + b).mean((2, 3)))


@pytest.mark.parametrize("with_inputs", [False, True], ids=["symbolic", "concrete"])
def test_custom_autograd_functions_keep_their_backward(with_inputs):
    """A custom autograd.Function stays one call: tracing must not inline its forward and lose its backward."""
    eager, x = _QuantNet().double(), _x()
    optimized = fxfuse.optimize(copy.deepcopy(eager), (x,) if with_inputs else None)
    assert optimized.fxfuse_report.fused
    _assert_trains_alike(eager, optimized, x)
