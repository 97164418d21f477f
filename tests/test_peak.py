"""measure.peak: the step peak counted on a meta-device copy."""

import torch
import torchvision
from torch import nn

from fxfuse import measure
from fxfuse.measure.peak import LiveBytes


def test_live_bytes_follow_storage_lifetimes():
    base = torch.empty(1000, device="meta")
    with LiveBytes() as mode:
        a = base.clone()  # 4000 bytes
        view = a[10:]  # no new storage
        del a
        b = base * 2  # 4000 more; `a` lives on through its view
        del view, b
    assert mode.peak == 8000 and mode.current == 0


def test_saved_tensors_stay_counted_until_backward_frees_them():
    x = torch.empty(1000, device="meta", requires_grad=True)
    with LiveBytes() as mode:
        y = x.exp()  # saved by exp's backward
        loss = y.sum()
        del y
        held = mode.current
        loss.backward()
    assert held >= 4000
    del loss
    assert mode.current == 4000  # x.grad


def test_peak_of_a_linear_step():
    model = nn.Sequential(nn.Linear(100, 200), nn.ReLU(), nn.Linear(200, 10))
    x = torch.randn(32, 100)
    peak = measure.step_peak_bytes_meta(model, (x,))
    activations = 32 * 200 * 4 * 2  # linear output and ReLU output
    grads = sum(p.numel() * 4 for p in model.parameters())
    assert activations < peak < activations + grads + 3 * 32 * 200 * 4


def test_meta_peak_of_resnet_is_eager_scale():
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    peak = measure.step_peak_bytes_meta(model, (x,))
    saved = measure.saved_activation_bytes_meta(model, (x,))
    assert saved < peak < saved + sum(p.numel() * 4 for p in model.parameters()) + 4 * saved
    for p in model.parameters():
        assert p.grad is None and p.device.type == "cpu"  # the user's model is untouched


def test_peak_parts_add_up_to_the_peak():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    parts = measure.step_peak_parts_meta(model, (x,))
    assert parts.peak == measure.step_peak_bytes_meta(model, (x,))
    assert parts.parameter_grads + parts.forward_kept + parts.backward_transient == parts.peak
    assert 0 < parts.parameter_grads <= sum(p.numel() * 4 for p in model.parameters())
    assert parts.inputs == x.numel() * 4
