"""fxfuse.optimize: exactness over conv/BN configurations and forms, safety, drop-in behaviour."""

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxfuse
from fxfuse.testing import assert_equivalent


class ConvBNAct(nn.Module):
    def __init__(self, cin=4, cout=6, act=None, conv_kw=None, bn_kw=None, kernel=3):
        super().__init__()
        conv_kw = {"padding": 1, "bias": False, **(conv_kw or {})}
        self.conv = nn.Conv2d(cin, cout, kernel, **conv_kw)
        self.bn = nn.BatchNorm2d(cout, **(bn_kw or {}))
        self.act = act if act is not None else nn.Identity()
        self.head = nn.Conv2d(cout, 3, 1)

    def forward(self, x):
        return self.head(self.act(self.bn(self.conv(x))))


def _fused_ops(model):
    return [s.op for s in model.fxfuse_report.fused]


def _check(model, x, dtype=torch.float64, expect_fused=1, mode="memory"):
    optimized = fxfuse.optimize(copy.deepcopy(model), mode=mode)
    assert len(optimized.fxfuse_report.fused) == expect_fused, optimized.fxfuse_report
    assert_equivalent(model, optimized, x, dtype=dtype)
    return optimized


CONV_CONFIGS = {
    "bias": {"bias": True},
    "stride2": {"stride": 2},
    "padding_tuple": {"padding": (0, 2)},
    "padding_same_even_kernel": {"padding": "same", "dilation": 1},
    "padding_same_dilated": {"padding": "same", "dilation": 2},
    "padding_valid": {"padding": "valid"},
    "dilation": {"dilation": (2, 1), "padding": 2},
    "groups": {"groups": 2},
    "reflect": {"padding_mode": "reflect", "bias": True},
    "replicate": {"padding_mode": "replicate"},
    "circular": {"padding_mode": "circular", "stride": (2, 1)},
}


@pytest.mark.parametrize("name", CONV_CONFIGS)
def test_conv_configurations(name):
    kw = CONV_CONFIGS[name]
    kernel = 4 if name == "padding_same_even_kernel" else 3
    _check(ConvBNAct(conv_kw=kw, act=nn.ReLU(), kernel=kernel), torch.randn(2, 4, 9, 8))


def test_depthwise_conv():
    model = ConvBNAct(cin=6, cout=6, conv_kw={"groups": 6}, act=nn.ReLU6())
    _check(model, torch.randn(2, 6, 7, 7))


BN_CONFIGS = {
    "no_affine": {"affine": False},
    "no_running_stats": {"track_running_stats": False},
    "cumulative_average": {"momentum": None},
    "eps_momentum": {"eps": 1e-2, "momentum": 0.5},
    "bare": {"affine": False, "track_running_stats": False},
}


@pytest.mark.parametrize("name", BN_CONFIGS)
def test_bn_configurations(name):
    _check(ConvBNAct(bn_kw=BN_CONFIGS[name], act=nn.SiLU()), torch.randn(3, 4, 6, 5))


ACT_MODULES = {
    "relu": nn.ReLU(),
    "relu_inplace": nn.ReLU(inplace=True),
    "relu6": nn.ReLU6(),
    "leaky": nn.LeakyReLU(0.2),
    "gelu": nn.GELU(),
    "gelu_tanh": nn.GELU(approximate="tanh"),
    "silu": nn.SiLU(inplace=True),
    "hardswish": nn.Hardswish(),
    "none": None,
}


@pytest.mark.parametrize("name", ACT_MODULES)
def test_activation_modules(name):
    optimized = _check(ConvBNAct(act=ACT_MODULES[name]), torch.randn(2, 4, 6, 6))
    expected = {"relu_inplace": "relu", "leaky": "leaky_relu(0.2)"}.get(name, name)
    assert optimized.fxfuse_report.fused[0].activation == expected


class FunctionalAct(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.conv = nn.Conv2d(3, 5, 3, padding=1)
        self.bn = nn.BatchNorm2d(5)

    def forward(self, x):
        return self.fn(self.bn(self.conv(x)))


FUNCTIONAL_ACTS = {
    "F.relu": F.relu,
    "F.relu_": F.relu_,
    "torch.relu": torch.relu,
    "Tensor.relu": lambda t: t.relu(),
    "Tensor.relu_": lambda t: t.relu_(),
    "F.relu(inplace)": lambda t: F.relu(t, inplace=True),
    "F.relu6": F.relu6,
    "F.leaky_relu": lambda t: F.leaky_relu(t, 0.3),
    "F.leaky_relu_": F.leaky_relu_,
    "F.gelu": F.gelu,
    "F.gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "F.silu": F.silu,
    "F.hardswish": F.hardswish,
    "F.silu(inplace)": lambda t: F.silu(t, inplace=True),
}


@pytest.mark.parametrize("name", FUNCTIONAL_ACTS)
def test_functional_activations(name):
    optimized = _check(FunctionalAct(FUNCTIONAL_ACTS[name]), torch.randn(2, 3, 5, 5))
    assert optimized.fxfuse_report.fused[0].activation != "none"


class FunctionalConvBN(nn.Module):
    """Everything in functional form, reading self.training in forward."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 3, 3, 3) * 0.2)
        self.bias = nn.Parameter(torch.randn(6))
        self.bn_weight = nn.Parameter(torch.rand(6) + 0.5)
        self.bn_bias = nn.Parameter(torch.randn(6))
        self.register_buffer("running_mean", torch.zeros(6))
        self.register_buffer("running_var", torch.ones(6))

    def forward(self, x):
        y = F.conv2d(x, self.weight, self.bias, stride=2, padding=1)
        y = F.batch_norm(y, self.running_mean, self.running_var, self.bn_weight, self.bn_bias, self.training, 0.2, 1e-4)
        return F.gelu(y)


def test_functional_form_and_training_flag_after_eval():
    model = FunctionalConvBN()
    optimized = _check(model, torch.randn(2, 3, 8, 8))
    x = torch.randn(2, 3, 8, 8)
    opt = fxfuse.optimize(copy.deepcopy(model))
    ref = copy.deepcopy(model)
    for m in (opt, ref):
        m(x)  # one training step updates running stats
        m.eval()
    torch.testing.assert_close(opt(x), ref(x))
    opt.train(), ref.train()
    torch.testing.assert_close(opt(x), ref(x))
    assert "fxfuse::conv_bn_act" in _fused_ops(optimized)


def test_frozen_bn_uses_running_stats_while_rest_trains():
    model = ConvBNAct(act=nn.ReLU()).double()
    model.bn.running_mean.normal_()
    model.bn.running_var.uniform_(0.5, 2)
    ref, opt = copy.deepcopy(model), fxfuse.optimize(copy.deepcopy(model))
    for m in (ref, opt):
        m.train()
        m.bn.eval()
    x = torch.randn(2, 4, 6, 6, dtype=torch.double)
    outs = [m(x) for m in (ref, opt)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-9, atol=1e-10)
    grad = torch.randn_like(outs[0])
    for o in outs:
        o.backward(grad)
    for (name, p), q in zip(ref.named_parameters(), opt.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-10, msg=name)
    for b1, b2 in zip(ref.buffers(), opt.buffers()):
        assert torch.equal(b1, b2)


class SharedBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4, momentum=None)

    def forward(self, x):
        return F.relu(self.bn(self.conv2(F.relu(self.bn(self.conv1(x))))))


def test_bn_module_used_twice():
    _check(SharedBN(), torch.randn(2, 3, 6, 6), expect_fused=2)


class MyBN(nn.BatchNorm2d):
    def forward(self, x):
        return super().forward(x) * 2


class CustomBNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = MyBN(4)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


def test_bn_subclass_with_different_forward_is_not_a_plain_bn():
    optimized = _check(CustomBNModel(), torch.randn(2, 3, 6, 6), expect_fused=0)
    # MyBN is traced through: its inner F.batch_norm has no conv directly before it.
    assert optimized(torch.randn(2, 3, 6, 6)).shape == (2, 4, 4, 4)


class ConvOutputReused(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x):
        y = self.conv(x)
        return F.relu(self.bn(y)) + y


def test_conv_output_with_other_users_is_skipped_with_reason():
    optimized = _check(ConvOutputReused(), torch.randn(2, 3, 5, 5), expect_fused=1)
    assert optimized.fxfuse_report.fused[0].op == "fxfuse::batch_norm_act"
    # Its BN→ReLU runs in that batch_norm_act: the conv→BN site is listed as covered, with the reason.
    report = optimized.fxfuse_report
    assert not report.skipped
    assert len(report.covered) == 1 and "other users" in report.covered[0].reason


class TutorialNet(nn.Module):
    """The conv-BN tutorial's unfused network: F.relu_ applied in place on the BN output."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8, affine=False, track_running_stats=False)
        self.conv2 = nn.Conv2d(8, 16, 3, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(16, affine=False, track_running_stats=False)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = self.bn1(self.conv1(x))
        F.relu_(x)
        x = self.bn2(self.conv2(x))
        F.relu_(x)
        x = F.max_pool2d(x, 2)
        return self.fc(x.flatten(1))


def test_inplace_activation_whose_input_is_used_later_is_fused():
    optimized = _check(TutorialNet(), torch.randn(4, 1, 12, 12), expect_fused=3)  # and its max pool
    assert [s.activation for s in optimized.fxfuse_report.fused if s.activation] == ["relu", "relu"]


def test_hooks_prevent_fusion():
    model = ConvBNAct(act=nn.ReLU())
    model.bn.register_forward_hook(lambda *a: None)
    report = fxfuse.explain(model)
    assert not report.fused and "hooks" in report.skipped[0].reason


def test_fast_mode_keeps_the_conv_output():
    # The BN→GELU output feeds only the head conv, so it is merged into it (fxfuse::bn_act_conv):
    # still no conv recompute.
    optimized = _check(ConvBNAct(act=nn.GELU()), torch.randn(2, 4, 6, 6), mode="fast")
    assert _fused_ops(optimized) == ["fxfuse::bn_act_conv"]
    assert "no conv recompute" in optimized.fxfuse_report.fused[0].reason


def test_float32_tolerances():
    import torchvision

    model = torchvision.models.resnet18(num_classes=10)
    optimized = fxfuse.optimize(copy.deepcopy(model))
    # 64x64 and batch 4 keep layer4's BN well-conditioned (4 values per channel at 32x32,
    # batch 2 would make float32 eager itself differ from float64 by 1e-4).
    assert_equivalent(model, optimized, torch.randn(4, 3, 64, 64))


# ---------------------------------------------------------------- drop-in replacement


class UserNet(nn.Module):
    """A user's model class with its own methods, attributes and a train() override."""

    def __init__(self):
        super().__init__()
        self.stem = ConvBNAct(act=nn.ReLU())
        self.freeze_bn = False
        self.note = "mine"

    def forward(self, x):
        return self.stem(x)

    def train(self, mode=True):
        super().train(mode)
        if self.freeze_bn:
            self.stem.bn.eval()
        return self

    def describe(self):
        return f"UserNet({self.note})"


def test_drop_in_replacement():
    model = UserNet()
    keys = list(model.state_dict())
    names = [n for n, _ in model.named_parameters()]
    params_before = list(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimized = fxfuse.optimize(model)
    assert optimized is model and isinstance(model, UserNet)
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_parameters()] == names
    assert all(a is b for a, b in zip(model.parameters(), params_before))
    assert model.describe() == "UserNet(mine)" and model.note == "mine"
    model.freeze_bn = True
    model.train()
    assert model.training and not model.stem.bn.training  # the override is honoured
    model(torch.randn(2, 4, 5, 5)).sum().backward()
    optimizer.step()  # the optimizer built before optimize still drives the parameters


def test_state_dict_round_trips_both_ways():
    plain, optimized = UserNet(), fxfuse.optimize(UserNet())
    optimized.load_state_dict(plain.state_dict())
    plain.load_state_dict(optimized.state_dict())
    x = torch.randn(2, 4, 5, 5)
    plain.eval(), optimized.eval()
    torch.testing.assert_close(optimized(x), plain(x))


def test_deepcopy_pickle_and_torch_save():
    model = fxfuse.optimize(UserNet().double())
    x = torch.randn(2, 4, 5, 5, dtype=torch.double)
    model.eval()
    want = model(x)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert clone.fxfuse_report.fused and type(clone) is type(model)
        torch.testing.assert_close(clone(x), want)
        assert clone.stem.conv.weight is not model.stem.conv.weight
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded(x), want)


def test_dtype_device_and_memory_format_conversions():
    model = ConvBNAct(act=nn.ReLU())
    ref = copy.deepcopy(model).double().to(memory_format=torch.channels_last)
    optimized = fxfuse.optimize(model).double().to("cpu").to(memory_format=torch.channels_last)
    x = torch.randn(2, 4, 6, 6, dtype=torch.double).to(memory_format=torch.channels_last)
    out = optimized(x)
    torch.testing.assert_close(out, ref(x), rtol=1e-9, atol=1e-10)
    assert out.is_contiguous(memory_format=torch.channels_last)


def test_optimizing_twice_does_no_harm():
    model = ConvBNAct(act=nn.ReLU())
    once = fxfuse.optimize(copy.deepcopy(model))
    twice = fxfuse.optimize(fxfuse.optimize(copy.deepcopy(model)), mode="fast")
    assert len(twice.fxfuse_report.fused) == 1 and twice.fxfuse_report.mode == "fast"
    assert type(twice).__mro__.count(type(twice)) == 1 and type(type(twice)._fxfuse_original_class) is type
    assert_equivalent(once, twice, torch.randn(2, 4, 5, 5), dtype=torch.float64)


def test_explain_does_not_change_the_model():
    model = UserNet()
    report = fxfuse.explain(model, torch.randn(2, 4, 8, 8))
    assert type(model) is UserNet and not hasattr(model, "fxfuse_report")
    assert report.fused[0].saved_bytes == 2 * 6 * 8 * 8 * 4  # the conv output, float32
    assert "conv2d→batch_norm2d→relu" in report.details()  # the 100-column table leaves the pattern out


def test_no_grad_and_inference_mode_save_nothing():
    model = fxfuse.optimize(ConvBNAct(act=nn.GELU()))
    x = torch.randn(2, 4, 6, 6)
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            out = model(x)
        assert not out.requires_grad


# ---------------------------------------------------------------- untraceable code


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = ConvBNAct(act=nn.ReLU())

    def forward(self, x):
        if x.sum() > 0:  # control flow on a tensor value: not traceable
            return self.block(x)
        return self.block(-x)


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = DataDependent()
        self.tail = ConvBNAct(cin=3, cout=4, act=nn.ReLU())

    def forward(self, x):
        return self.tail(self.inner(x))


def test_untraceable_submodule_becomes_a_leaf_and_its_children_are_optimized():
    model = Wrapper()
    optimized = _check(model, torch.randn(2, 4, 5, 5), expect_fused=2)
    report = optimized.fxfuse_report
    assert any("inner" in note and "not traceable" in note for note in report.notes)
    # conv→bn→relu→head: the BN→ReLU merges into `head` (no conv recompute: it would free nothing)
    assert {s.modules[0] for s in report.fused} == {"tail.bn", "inner.block.bn"}


def test_untraceable_top_level_optimizes_submodules():
    optimized = _check(DataDependent(), torch.randn(2, 4, 5, 5), expect_fused=1)
    assert "optimizing its submodules instead" in " ".join(optimized.fxfuse_report.notes)


class Hopeless(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x
        return -x


def test_nothing_traceable_raises_naming_the_module():
    with pytest.raises(fxfuse.TracingError, match="Hopeless"):
        fxfuse.optimize(Hopeless())


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("case", ["rank3", "rank5", "channels", "dtype", "batch1_1x1"])
def test_bad_input_raises_what_eager_raises(case):
    model = ConvBNAct(act=nn.ReLU(), conv_kw={"padding": 0}, kernel=1)
    optimized = fxfuse.optimize(copy.deepcopy(model))
    x = {
        "rank3": torch.randn(4, 5, 5),
        "rank5": torch.randn(1, 4, 5, 5, 1),
        "channels": torch.randn(2, 3, 5, 5),
        "dtype": torch.randn(2, 4, 5, 5, dtype=torch.double),
        "batch1_1x1": torch.randn(1, 4, 1, 1),
    }[case]
    with pytest.raises(Exception) as eager_exc:
        model(x)
    with pytest.raises(type(eager_exc.value)):
        optimized(x)


def test_nan_propagates_like_eager():
    model = ConvBNAct(act=nn.ReLU())
    optimized = fxfuse.optimize(copy.deepcopy(model))
    x = torch.randn(2, 4, 5, 5)
    x[0, 0, 0, 0] = float("nan")
    torch.testing.assert_close(optimized(x), model(x), equal_nan=True)
    torch.testing.assert_close(optimized.bn.running_mean, model.bn.running_mean, equal_nan=True)


def test_bad_arguments_are_fxfuse_errors():
    with pytest.raises(fxfuse.FxFuseError, match="mode"):
        fxfuse.optimize(ConvBNAct(), mode="turbo")
    with pytest.raises(fxfuse.FxFuseError, match="nn.Module"):
        fxfuse.optimize(lambda x: x)
