"""region_costs.profile: per-region recompute FLOPs and bytes freed, counted on the meta device."""

import importlib

import pytest
import torch
import torchvision
from torch import nn

from fxfuse import measure
from fxfuse.fusion.regions import costs as region_costs

optimize_module = importlib.import_module("fxfuse.fusion.optimize")
install_module = importlib.import_module("fxfuse.fusion.install")


def _profile(model: nn.Module, x: torch.Tensor) -> region_costs.Profile:
    trial = measure.meta_copy(model)
    optimize_module._run(trial, None, optimize_module.Options("fast"), install=True)
    state = trial.__dict__["_fxfuse_state"]
    graph = state.fx_graphs[install_module._key(state, pattern=state.last_pattern)]
    return region_costs.profile(trial, graph, measure.to_meta((x,)))


def test_a_blocks_flops_are_its_convolutions():
    x = torch.randn(2, 3, 64, 64)
    profile = _profile(torchvision.models.resnet18(num_classes=10), x)
    block = next(r for r in profile.regions if r.name == "layer1.1")
    # two 3x3 convs, 64 -> 64 channels, on 2 x 16 x 16 outputs: 2 FLOPs per multiply-add
    assert block.flops == 2 * (2 * 2 * 16 * 16 * 64 * 64 * 9)
    assert block.kind == "block"


def test_a_blocks_flops_include_the_layers_inside_fused_ops():
    # A ConvNeXt block, fused in fast mode: its Linears run inside fxfuse::layer_norm_linear and
    # fxfuse::act_linear (ops/flops.py gives the counter their FLOPs), the depthwise conv eagerly.
    x = torch.randn(2, 3, 32, 32)
    profile = _profile(torchvision.models.convnext_tiny(num_classes=10), x)
    block = next(r for r in profile.regions if r.name == "features.1.0")
    rows, width = 2 * 8 * 8, 96
    linears = 2 * (2 * rows * width * 4 * width)
    depthwise = 2 * rows * width * 7 * 7
    assert block.flops == linears + depthwise


def test_a_region_frees_what_only_its_nodes_keep_less_its_input():
    x = torch.randn(2, 3, 64, 64)
    profile = _profile(torchvision.models.resnet18(num_classes=10), x)
    block = next(r for r in profile.regions if r.name == "layer1.1")
    act = 2 * 64 * 16 * 16 * 4  # one float32 activation of layer1
    stats = 2 * 2 * 64 * 4  # mean and inverse std of two batch norms
    # Pointwise form keeps conv1's output (the BN→ReLU input) and conv2's output (bn2's input);
    # the BN→ReLU output (conv2's input) is rebuilt by fxfuse::bn_act_conv, not kept. The block's
    # output is the next block's input, which that block keeps; its own input is this one's
    # previous block's output: kept anyway.
    assert block.freed_bytes == 2 * act + stats
    stem = profile.regions[0]
    assert stem.name == "conv1…maxpool" and stem.kind == "run" and stem.freed_bytes > 0


def test_links_join_consecutive_regions_and_free_the_second_ones_input():
    x = torch.randn(2, 3, 64, 64)
    profile = _profile(torchvision.models.resnet18(num_classes=10), x)
    link = next(k for k in profile.links if k.first == "layer1.0")
    assert link.second == "layer1.1"
    assert link.freed_bytes == 2 * 64 * 16 * 16 * 4
    assert link.flops == next(r.flops for r in profile.regions if r.name == "layer1.0")


def test_the_whole_graph_is_no_region():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3))
    profile = _profile(model, torch.randn(2, 3, 16, 16))
    assert profile.regions == [] and profile.links == []
    assert any("whole graph" in why for why in profile.problems.values())


def _dense_net() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.DenseNet(growth_rate=4, block_config=(3, 2), num_init_features=8, bn_size=2)


def test_a_dense_layer_is_an_inner_region_costed_without_its_last_conv():
    """A layer's recompute stops before its 3x3 conv (regions/graph.py tail_conv): it costs its 1x1 conv."""
    x = torch.randn(2, 3, 32, 32)
    profile = _profile(_dense_net(), x)
    by_name = {r.name: r for r in profile.regions}
    layer = by_name["features.denseblock1.denselayer2"]
    assert layer.parent == "features.denseblock1" and by_name["features.denseblock1"].parent == ""
    pixels = 2 * 8 * 8
    assert layer.flops == 2 * pixels * (8 + 4) * 8  # 1x1 conv: 12 -> bn_size * growth_rate channels
    # It frees that conv's output (the BN→ReLU→3x3 conv's input) and the two batch norms' statistics.
    assert layer.freed_bytes == pixels * 8 * 4 + 2 * (12 + 8) * 4  # mean and inverse std
    assert not any(link.first.endswith("denselayer1") or link.second.endswith("denselayer2") for link in profile.links)


class Gated(nn.Module):
    """Conv→BN→ReLU, then a squeeze-excite gate: the multiply keeps the ReLU's output."""

    def __init__(self, c=16):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.fc = nn.Conv2d(c, c, 1)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return y * torch.sigmoid(self.fc(y.mean((2, 3), keepdim=True)))


def test_a_chain_recomputes_what_costs_almost_nothing():
    """BN→ReLU→gate as a chain: it keeps the BN input (kept anyway) and frees the ReLU output the multiply
    kept, for the gate's 1x1 conv on pooled values; chains that cost more per byte are not offered."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), Gated(), Gated(), nn.Flatten())
    profile = _profile(model, torch.randn(2, 3, 16, 16))
    chains = {r.name: r for r in profile.regions if r.kind == "chain"}
    gate = chains["1.bn…1.fc"]
    assert gate.parent == "1" and gate.flops == 2 * 2 * 16 * 16  # the 1x1 conv on 2 pooled vectors
    relu = 2 * 16 * 16 * 16 * 4
    assert relu <= gate.freed_bytes < relu + 2 * 16 * 4 * 4  # and the gate and BN statistics
    assert all(r.flops <= region_costs.CHAIN_FLOPS_PER_BYTE * r.freed_bytes for r in chains.values())
    assert not any(r.name.startswith("1.conv") for r in chains.values())  # a 3x3 conv: 72 FLOP/B


def test_a_chain_reaches_across_a_bottleneck_tail():
    """CSPResNet's bottleneck ends BN→LeakyReLU→1x1 conv→BN→add→LeakyReLU (8 nodes): one chain frees what the
    two 0-FLOP chains inside it do and the 1x1 conv's output, for that conv (12.8 FLOP/B), where the inner
    region `conv3` (conv→BN) overlapped those chains and was dropped."""
    timm = pytest.importorskip("timm")
    profile = _profile(timm.models.cspnet.cspresnet50(), torch.randn(2, 3, 64, 64))
    chains = {r.name: r for r in profile.regions if r.kind == "chain"}
    tail = chains["stages.0.blocks.0.conv2.bn…stages.0.blocks.0.act3"]
    inside = [chains["stages.0.blocks.0.conv2.bn…stages.0.blocks.0.conv3.conv"]]
    inside.append(chains["stages.0.blocks.0.conv3.bn…stages.0.blocks.0.act3"])
    assert all(c.nodes < tail.nodes and c.flops == 0 for c in inside)
    assert tail.freed_bytes > sum(c.freed_bytes for c in inside) and 0 < tail.flops


def test_a_region_moves_what_its_ops_read_and_write_and_a_link_reruns_all_of_its_first():
    """Bytes moved (regions/time_model.py prices them): layer1.1 of a ResNet-18 runs two 3x3 convs on
    64-channel activations, each reading one and writing one, besides its BN→ReLU, add and ReLU; a link
    runs its first region again whole."""
    x = torch.randn(2, 3, 64, 64)
    profile = _profile(torchvision.models.resnet18(num_classes=10), x)
    regions = {r.name: r for r in profile.regions}
    block = regions["layer1.1"]
    act = 2 * 64 * 16 * 16 * 4
    assert block.moved > 4 * act and block.ops >= 4
    link = next(link for link in profile.links if link.first == "layer1.0")
    assert (link.flops, link.moved, link.ops) == (
        regions["layer1.0"].flops,
        regions["layer1.0"].moved,
        regions["layer1.0"].ops,
    )
