"""The torchvision models the memory-format tutorial lists as fully supporting channels_last.

Measured on this torch (CPU), batch 2 at 64x64, train mode, forward and backward. Real runs
cover one model per family; every listed model is audited in fake mode, built on the meta
device so that not even its weights are allocated. Fake and real must agree, except where
fake mode itself says its strides may differ (caveats and noted findings).
"""

import functools

import pytest
import torch
import torchvision

from fxfuse.audit import ChannelsLastReport, audit_channels_last
from fxfuse.audit.fake_notes import KNOWN_FAKE_STRIDE_DIFFERENCES

TUTORIAL_MODELS = [
    "alexnet", "mnasnet0_5", "mnasnet0_75", "mnasnet1_0", "mnasnet1_3", "mobilenet_v2",
    "resnet101", "resnet152", "resnet18", "resnet34", "resnet50", "resnext50_32x4d",
    "shufflenet_v2_x0_5", "shufflenet_v2_x1_0", "shufflenet_v2_x1_5", "shufflenet_v2_x2_0",
    "squeezenet1_0", "squeezenet1_1", "vgg11", "vgg11_bn", "vgg13", "vgg13_bn", "vgg16", "vgg16_bn",
    "vgg19", "vgg19_bn", "wide_resnet101_2", "wide_resnet50_2",
]  # fmt: skip
REAL_SUBSET = ["resnet18", "mobilenet_v2", "shufflenet_v2_x0_5", "squeezenet1_1", "alexnet"]  # one per family
OTHER_ARCHITECTURES = ["convnext_tiny", "efficientnet_b0"]  # permute + LayerNorm; SiLU + squeeze-excitation

FLATTEN_COPY = {("forward", "aten.clone.default")}  # torch.flatten before the classifier copies to NCHW
# Channel shuffle goes NCHW through a 5-D view + contiguous; the next block's cat then mixes formats.
SHUFFLE_CAT = {("forward", "aten.cat.default"), ("backward", "aten.cat.default")}
# The global-average-pool gradient comes back NCHW; the last activation's backward follows it.
EXPECTED_LOSSES = {
    "alexnet": FLATTEN_COPY,
    **{name: FLATTEN_COPY for name in TUTORIAL_MODELS if name.startswith("vgg")},
    **{name: SHUFFLE_CAT for name in TUTORIAL_MODELS if name.startswith("shufflenet")},
    "mobilenet_v2": {("backward", "aten.hardtanh_backward.default")},
    "convnext_tiny": {("backward", "aten.mul.Tensor"), ("backward", "aten.add.Tensor")},
    "efficientnet_b0": {("backward", "aten.silu_backward.default")},
}


@functools.cache
def real_report(name: str) -> ChannelsLastReport:
    torch.manual_seed(0)
    return audit_channels_last(torchvision.models.get_model(name), torch.randn(2, 3, 64, 64))


@functools.cache
def fake_report(name: str) -> ChannelsLastReport:
    with torch.device("meta"):
        model = torchvision.models.get_model(name)
    return audit_channels_last(model, torch.empty(2, 3, 64, 64, device="meta"), fake=True)


def loss_ops(report: ChannelsLastReport) -> set[tuple[str, str]]:
    return {(f.phase, f.op) for f in report.findings}


@pytest.mark.parametrize("name", REAL_SUBSET + OTHER_ARCHITECTURES)
def test_real_audit(name):
    report = real_report(name)
    assert report.backward and not report.fake
    assert report.ops_checked["forward"] > 10 and report.ops_checked["backward"] > 10
    assert loss_ops(report) == EXPECTED_LOSSES.get(name, set()), str(report)


@pytest.mark.parametrize("name", TUTORIAL_MODELS)
def test_fake_audit_of_every_tutorial_model(name):
    report = fake_report(name)
    expected = EXPECTED_LOSSES.get(name, set())
    reliable = {(phase, op) for phase, op in expected if op not in KNOWN_FAKE_STRIDE_DIFFERENCES}
    assert report.backward and report.fake
    assert loss_ops(report) == reliable, str(report)
    # A real loss that fake strides cannot show still surfaces, as a caveat.
    assert {(c.phase, c.op) for c in report.caveats} == expected - reliable


def sites(report: ChannelsLastReport) -> set[tuple]:
    entries = report.findings + report.info + report.ambiguous
    return {(f.severity, f.phase, f.op, f.module, f.location, f.count) for f in entries}


@pytest.mark.parametrize("name", REAL_SUBSET + OTHER_ARCHITECTURES)
def test_fake_agrees_with_real(name):
    real, fake = real_report(name), fake_report(name)
    flagged = {(f.phase, f.op, f.module, f.location) for f in fake.findings + fake.caveats if f.note}
    unexplained = [site for site in sites(real) ^ sites(fake) if site[1:5] not in flagged]
    assert unexplained == []
