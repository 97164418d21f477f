"""fusion/regions/graph.py and regions/recompute.py: regions found in a fused graph, recomputed exactly,
state updated once."""

import copy
import importlib

import pytest
import torch
import torchvision
from support.root_statistics import RootStatistics
from torch import nn

import fxfuse
from fxfuse import measure
from fxfuse.fusion import tracing
from fxfuse.fusion.plan import Options, Plan
from fxfuse.fusion.regions import graph as regions
from fxfuse.fusion.regions import ranking, recompute
from fxfuse.testing import assert_equivalent

optimize_module = importlib.import_module("fxfuse.fusion.optimize")
install_module = importlib.import_module("fxfuse.fusion.install")

RESNET18_REGIONS = ["conv1…maxpool"] + [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)] + ["avgpool…fc"]


def _resnet18():
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10).double()


def _recomputing(model: nn.Module, groups, flat_links=frozenset()) -> nn.Module:
    """`model` fused with pointwise sites only, recomputing the region `groups` (`flat_links` run flat)."""
    options = Options("fast", Plan(regions=tuple(groups), flat_links=frozenset(flat_links)))
    optimize_module._run(model, None, options, install=True)
    return model


class DropoutBlock(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.drop = nn.Dropout(0.3)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c, momentum=None)

    def forward(self, x):
        out = self.drop(torch.relu(self.bn1(self.conv1(x))))
        return torch.relu(self.bn2(self.conv2(out)) + x)


def _dropout_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), DropoutBlock(), DropoutBlock(), nn.Flatten(), nn.LazyLinear(4))


def test_finds_blocks_and_the_runs_between_them():
    model = _resnet18()
    found = regions.find(tracing.trace(model).graph, model)
    assert [r.name for r in found if not r.parent] == RESNET18_REGIONS
    assert [(r.name, r.parent) for r in found if r.parent and r.kind == "block"] == [
        (f"layer{i}.0.downsample", f"layer{i}.0") for i in (2, 3, 4)
    ]
    chains = [r for r in found if r.kind == "chain"]
    assert all(2 <= len(r.nodes) <= regions.CHAIN_NODES and r.output is r.nodes[-1] for r in chains)
    assert "layer1.0.bn2…layer1.0.relu" in {r.name for r in chains}  # BN, the residual add and its ReLU
    assert all(r.problem is None for r in found)
    block = next(r for r in found if r.name == "layer2.0")
    assert block.kind == "block" and [n.name for n in block.inputs] == ["layer1_1_relu_1"]
    assert "layer2.0.downsample.1" in block.modules
    stem = found[0]
    assert stem.kind == "run" and [n.name for n in stem.inputs] == ["x"] and stem.output.name == "maxpool"


def test_a_region_with_two_outputs_is_refused():
    class TwoOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)

        def forward(self, x):
            y = self.conv(x)
            return y, y.relu()

    class Sum(nn.Module):
        def forward(self, pair):
            return pair[0] + pair[1]

    model = nn.Sequential(TwoOut(), Sum())
    found = regions.find(tracing.trace(model).graph, model)
    assert found[0].name == "0" and "2 of its values are used after it" in found[0].problem


def test_recomputed_regions_keep_only_their_inputs():
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    fast = _recomputing(_resnet18(), [])
    every = _recomputing(_resnet18(), [(n,) for n in RESNET18_REGIONS[:-1]])
    chained = _recomputing(_resnet18(), [tuple(RESNET18_REGIONS[:3])] + [(n,) for n in RESNET18_REGIONS[3:-1]])
    fast_bytes, every_bytes, chained_bytes = (measure.saved_activation_bytes(m, (x,)) for m in (fast, every, chained))
    assert every_bytes < fast_bytes / 3
    assert chained_bytes < every_bytes
    calls = [n.target.name for n in _graph(chained).nodes if isinstance(n.target, recompute.RegionCall)]
    assert calls == ["conv1…maxpool+layer1.0+layer1.1"] + RESNET18_REGIONS[3:-1]


def test_regions_and_chains_are_exact_in_float64():
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    groups = [("conv1…maxpool", "layer1.0", "layer1.1"), ("layer2.0",), ("layer3.0", "layer3.1"), ("layer4.1",)]
    assert_equivalent(_resnet18(), _recomputing(_resnet18(), groups), x, dtype=torch.float64)


def test_segments_cut_a_group_where_its_links_are_not_flat():
    group = ("a", "b", "c", "d")
    assert regions.segments(group) == [("a",), ("b",), ("c",), ("d",)]
    assert regions.segments(group, frozenset({("a", "b"), ("c", "d")})) == [("a", "b"), ("c", "d")]
    assert regions.segments(group, frozenset({("b", "c"), ("a", "c")})) == [("a",), ("b", "c"), ("d",)]


_CONVOLVING = ("aten::convolution", "fxfuse::bn_act_conv", "fxfuse::cat_bn_act_conv", "fxfuse::conv_bn_act")


def _convs_run(fn) -> int:
    """Convolution forwards run by `fn()` (aten's and those inside fxfuse's ops that hold one)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.name() in _CONVOLVING:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def _forward_convs(model, x) -> int:
    """Convolution forwards run by one train step: aten's, and those inside fxfuse's ops that hold one."""
    return _convs_run(lambda: measure.train_step(model, (x,)))


def test_a_flat_link_frees_the_same_bytes_and_runs_its_first_region_once_less():
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    group = ("conv1…maxpool", "layer1.0", "layer1.1")
    nested = _recomputing(_resnet18(), [group])
    flat = _recomputing(_resnet18(), [group], {("layer1.0", "layer1.1")})
    assert measure.saved_activation_bytes(flat, (x,)) == measure.saved_activation_bytes(nested, (x,))
    calls = [n.target for n in _graph(flat).nodes if isinstance(n.target, recompute.RegionCall)]
    assert [c.name for c in calls] == ["conv1…maxpool+layer1.0+layer1.1"]
    # layer1.0 holds two convs: run once in forward, once to rebuild layer1.1's input, once for its own
    # backward when nested; flat, its recompute is the one that rebuilds layer1.1's input.
    assert _forward_convs(nested, x) - _forward_convs(flat, x) == 2


@pytest.mark.parametrize(
    "flat_links",
    [{("layer1.0", "layer1.1")}, {("conv1…maxpool", "layer1.0"), ("layer1.0", "layer1.1"), ("layer1.1", "layer2.0")}],
)
def test_flat_links_are_exact_and_update_running_statistics_once(flat_links):
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    groups = [("conv1…maxpool", "layer1.0", "layer1.1", "layer2.0"), ("layer3.0", "layer3.1")]
    assert_equivalent(_resnet18(), _recomputing(_resnet18(), groups, flat_links), x, dtype=torch.float64, steps=2)


def test_dropout_inside_a_region_draws_the_same_mask_in_the_recompute():
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    model = _dropout_net().double()
    model(x)  # materialize the LazyLinear
    optimized = _recomputing(copy.deepcopy(model), [("1", "2")])
    assert any(isinstance(n.target, recompute.RegionCall) for n in _graph(optimized).nodes)
    assert_equivalent(model, optimized, x, dtype=torch.float64)


def test_running_statistics_and_counters_are_updated_once_per_step():
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    eager, fused = _resnet18(), _recomputing(_resnet18(), [("layer1.0", "layer1.1"), ("layer2.0",)])
    for _ in range(2):
        for m in (eager, fused):
            measure.train_step(m, (x,))
    # A second update per step would move a running mean by about momentum × itself (10%).
    for (name, a), (_, b) in zip(eager.named_buffers(), fused.named_buffers()):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-12), name
    assert int(fused.layer1[0].bn1.num_batches_tracked) == 2


def test_without_grad_a_region_runs_its_forward_once():
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    eager, fused = _resnet18(), _recomputing(_resnet18(), [("layer1.0",)])
    plain = _recomputing(_resnet18(), [])
    assert any(isinstance(n.target, recompute.RegionCall) for n in _graph(fused).nodes)
    # In train mode a second run would update layer1.0's running statistics and counters twice.
    with torch.no_grad():
        torch.testing.assert_close(fused(x), eager(x), rtol=1e-12, atol=1e-12)
        assert _convs_run(lambda: fused(x)) == _convs_run(lambda: plain(x))
        eager(x)
    assert int(fused.layer1[0].bn1.num_batches_tracked) == 2  # the output check's forward and the counted one
    for (name, a), (_, b) in zip(eager.named_buffers(), fused.named_buffers()):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12, msg=name)
    fused.eval(), eager.eval()
    with torch.no_grad():
        torch.testing.assert_close(fused(x), eager(x), rtol=1e-12, atol=1e-12)


def test_the_recompute_swaps_buffers_back():
    bn = nn.BatchNorm2d(3)
    original = bn.running_mean
    with recompute._buffers_swapped([bn]):
        assert bn.running_mean is not original and torch.equal(bn.running_mean, original)
        bn.running_mean.add_(1)
    assert bn.running_mean is original and torch.equal(original, torch.zeros(3))


def _graph(model):
    state = model.__dict__["_fxfuse_state"]
    return state.fx_graphs[install_module._key(state, pattern=state.last_pattern)]


@pytest.mark.parametrize("group", [("layer1.0", "layer2.0"), ("nonexistent",)])
def test_groups_that_are_no_chain_are_noted_and_left_alone(group):
    model = _resnet18()
    report = optimize_module._run(model, None, Options("fast", Plan(regions=(group,))), install=True)
    assert any("not" in note and group[-1] in note for note in report.notes)
    assert_equivalent(_resnet18(), model, torch.randn(2, 3, 64, 64, dtype=torch.float64), dtype=torch.float64)


def test_regions_missing_from_a_graph_are_noted_in_one_line():
    model = _resnet18()
    plan = Plan(regions=(("gone.0",), ("gone.1",), ("layer1.0",)))
    report = optimize_module._run(model, None, Options("fast", plan), install=True)
    missing = [n for n in report.notes if "not found" in n]
    assert missing == ["regions not recomputed, not found in this graph: gone.0, gone.1"], report.notes
    assert [n.target.name for n in _graph(model).nodes if isinstance(n.target, recompute.RegionCall)] == ["layer1.0"]


def test_a_region_whose_values_a_later_call_keeps_as_pieces_drops_that_hint_and_stays_exact():
    """torchvision DenseNet: the transition after a dense block keeps the block's features as the
    pieces of its concatenated input (passes/cat_input.py); recomputing the block as a region must
    not count those as outputs of the block, and the transition then keeps its concatenation."""
    import fxfuse
    from fxfuse.testing import assert_equivalent

    torch.manual_seed(0)
    model = torchvision.models.DenseNet(growth_rate=4, block_config=(2, 2), num_init_features=8, num_classes=3)
    x = torch.randn(2, 3, 32, 32)
    optimized = fxfuse.optimize(copy.deepcopy(model), x, memory_budget=0.1)
    report = optimized.fxfuse_report
    # the block itself (its layers' names also hold "denseblock"): its features are the transition's pieces
    assert "features.denseblock1" in [r.name for r in report.regions], report
    assert_equivalent(model, optimized, x, steps=2, dtype=torch.float64)


class Stages(nn.Module):
    """Stages as attributes of the root, no container of blocks (timm's DLA: `level0`…`level5`)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.stage1, self.stage2 = DropoutBlock(), DropoutBlock()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(self.stage2(self.stage1(self.stem(x))).mean((2, 3)))


def test_a_model_without_container_items_has_its_children_as_blocks():
    """Before, such a model was one run from its first module to its last: no region could free anything,
    and DLA-34's budgets below its fusion floor (0.464x) went unmet."""
    torch.manual_seed(0)
    model = Stages().double()
    found = regions.find(tracing.trace(model).graph, model)
    assert [(r.name, r.kind) for r in found if r.kind != "chain"] == [
        ("stem", "block"),
        ("stage1", "block"),
        ("stage2", "block"),
        ("fc…fc", "run"),
    ]
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    recomputing = _recomputing(copy.deepcopy(model), [("stage1",), ("stage2",)])
    plain = _recomputing(copy.deepcopy(model), [])
    saved = [
        measure.saved_activation_bytes(copy.deepcopy(m), (x.clone().requires_grad_(),)) for m in (recomputing, plain)
    ]
    assert saved[0] < saved[1]
    assert_equivalent(model, recomputing, x, dtype=torch.float64)
    # Models with container items keep their blocks: their other children stay runs.
    outer = [r.name for r in regions.find(tracing.trace(_resnet18()).graph, _resnet18()) if not r.parent]
    assert outer == RESNET18_REGIONS


def _dense_net():
    torch.manual_seed(0)
    return torchvision.models.DenseNet(growth_rate=4, block_config=(3, 2), num_init_features=8, bn_size=2).double()


def test_dense_layers_are_inner_regions_whose_recompute_stops_before_their_last_conv():
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    plain = _recomputing(_dense_net(), [])
    found = {r.name: r for r in regions.find(_graph(plain), plain)}
    layers = [f"features.denseblock1.denselayer{i}" for i in (1, 2, 3)]
    assert all(found[name].parent == "features.denseblock1" for name in layers)
    assert found["features.denseblock1"].parent == ""

    recomputing = _recomputing(_dense_net(), [(name,) for name in layers])
    calls = [n.target.name for n in _graph(recomputing).nodes if isinstance(n.target, recompute.RegionCall)]
    assert calls == layers
    saved = [measure.saved_activation_bytes(m, (x,)) for m in (recomputing, plain)]
    assert saved[0] < saved[1]
    # Each layer's 1x1 conv runs again in backward, its 3x3 conv does not: checkpoint stops once it has back
    # what the 3x3 conv saved, before that conv runs.
    assert _forward_convs(recomputing, x) - _forward_convs(plain, x) == len(layers)
    fresh = _recomputing(_dense_net(), [(name,) for name in layers])  # the steps above moved the statistics
    assert_equivalent(_dense_net(), fresh, x, dtype=torch.float64, steps=2)


def _assert_exact_to_second_order(model, optimized, x):
    """Two SGD steps and eval, then the input's second-order gradient in eval and in train mode, all in
    float64; in train mode the second backward recomputes each region once more, with its statistics
    left alone (the buffers after it must be eager's)."""
    model, optimized = copy.deepcopy(model), copy.deepcopy(optimized)
    assert_equivalent(model, optimized, x, dtype=torch.float64, steps=2)
    for train in (False, True):
        inputs = x.clone().requires_grad_()
        second = []
        for m in (model, optimized):
            m.train(train)
            (g,) = torch.autograd.grad(m(inputs).square().sum(), inputs, create_graph=True)
            second.append(torch.autograd.grad(g.square().sum(), inputs)[0])
        torch.testing.assert_close(second[1], second[0], rtol=1e-9, atol=1e-12)
        for (name, a), (_, b) in zip(model.named_buffers(), optimized.named_buffers()):
            torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12, msg=name)


def test_a_budget_recomputes_dense_layers_exactly_with_second_order_gradients():
    import fxfuse

    model = _dense_net()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    # At 0.25 the stem's conv upgrade suffices: on tensors this small, a region's per-op cost
    # (regions/time_model.py) outweighs its few FLOPs. 0.15 needs two dense layers.
    optimized = fxfuse.optimize(copy.deepcopy(model), x, memory_budget=0.15)
    chosen = [r.name for r in optimized.fxfuse_report.regions]
    assert sum(".denselayer" in name for name in chosen) >= 2, optimized.fxfuse_report
    _assert_exact_to_second_order(model, optimized, x)


class SeparableConv(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False)
        self.pw, self.bn = nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(self.bn(self.pw(self.dw(x))))


class Aggregation(nn.Module):
    """VoVNet's one-shot aggregation: layers whose outputs are all concatenated, then a 1x1 conv."""

    def __init__(self, c=4, layers=2):
        super().__init__()
        self.mid = nn.ModuleList(SeparableConv(c) for _ in range(layers))
        self.concat, self.bn = nn.Conv2d(c * (layers + 1), c, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        outs = [x]
        for layer in self.mid:
            x = layer(x)
            outs.append(x)
        return torch.relu(self.bn(self.concat(torch.cat(outs, 1))))


def _aggregating_net(c=4):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, c, 3, padding=1), Aggregation(c), Aggregation(c), nn.Flatten(), nn.LazyLinear(3))


def test_modules_inside_a_block_are_inner_regions_at_any_depth():
    """Before, only inner regions ending in a conv were offered (DenseNet's layers): VoVNet's separable
    layers were not, and a budget below mode="memory" went straight to whole blocks."""
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    model = _aggregating_net().double()
    model(x)
    plain = _recomputing(copy.deepcopy(model), [])
    found = {r.name: r for r in regions.find(_graph(plain), plain)}
    layers = [f"{b}.mid.{i}" for b in (1, 2) for i in (0, 1)]
    assert {name: found[name].parent for name in layers} == {name: name.split(".")[0] for name in layers}
    inner = [r.name for r in found.values() if r.parent and r.kind == "block"]
    assert inner == layers  # one-node modules are not regions
    recomputing = _recomputing(copy.deepcopy(model), [(name,) for name in layers])
    calls = [n.target.name for n in _graph(recomputing).nodes if isinstance(n.target, recompute.RegionCall)]
    assert calls == layers
    saved = [measure.saved_activation_bytes(m, (x,)) for m in (recomputing, plain)]
    assert saved[0] < saved[1]
    fresh = _recomputing(copy.deepcopy(model), [(name,) for name in layers])
    assert_equivalent(model, fresh, x, dtype=torch.float64, steps=2)


def test_a_budget_recomputes_inner_regions_without_a_tail_conv_exactly_with_second_order_gradients(monkeypatch):
    import fxfuse

    # Priced without a checkpoint call's fixed cost, which at this tiny input moves the budget from the inner
    # regions to conv upgrades: the test is of the inner regions' exactness.
    monkeypatch.setattr(ranking, "REGION_CALL_OPS", 0)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    model = _aggregating_net(c=8).double()
    model(x)
    for budget in (0.5, 0.35, 0.25):
        report = fxfuse.explain(copy.deepcopy(model), x, memory_budget=budget)
        chosen = [r.name for r in report.regions]
        # A block chosen after its layers replaces them, and the report lists what is recomputed.
        assert not [(a, b) for a in chosen for b in chosen if b.startswith(a + ".")], report
    optimized = fxfuse.optimize(copy.deepcopy(model), x, memory_budget=0.4)
    # the layers themselves, not only chains inside them (whose names also hold ".mid.")
    chosen = [r.name for r in optimized.fxfuse_report.regions]
    assert {"1.mid.0", "1.mid.1"} <= set(chosen), optimized.fxfuse_report
    _assert_exact_to_second_order(model, optimized, x)


class InPlaceTail(nn.Module):
    def __init__(self, c=4):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.bn(self.conv(x))
        z = y * 2
        return self.act(y) + z  # the ReLU writes over y, which the multiply read


def test_a_region_that_would_recompute_from_an_input_changed_in_place_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), InPlaceTail(), nn.Flatten()).double()
    graph = tracing.trace(model).graph
    modules = dict(model.named_modules())
    nodes = {n.name: n for n in graph.nodes}
    bn, mul, act, add = nodes["_1_bn"], nodes["mul"], nodes["_1_act"], nodes["add"]
    # the multiply alone reads y, which the ReLU after it overwrites; the ReLU and add overwrite their input
    for members, why in (([mul], "_1_act, after it, writes into its input"), ([mul, act, add], "_1_act writes into")):
        problem = regions._region("r", "chain", members, modules).problem
        assert problem is not None and why in problem, problem
    assert regions._region("r", "chain", [bn, mul, act, add], modules).problem is None
    assert all(r.problem is None for r in regions.find(graph, model))  # the unsafe runs are not offered
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    for budget in (0.8, 0.5, 0.2):
        optimized = fxfuse.optimize(copy.deepcopy(model), x, memory_budget=budget)
        assert_equivalent(model, optimized, x, dtype=torch.float64)


class _MemoryFormatChecked(nn.Module):
    """Branches on its input's memory format: torch.fx cannot trace it, so it is a leaf holding a BatchNorm."""

    def __init__(self, c=8):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        y = self.bn(self.conv(x))
        if y.is_contiguous(memory_format=torch.channels_last):
            y = y.contiguous()
        return torch.relu(y)


class _Counting(nn.Module):
    """Counts its calls in a Python int and a plain tensor: a leaf, as its forward changes state."""

    def __init__(self, c=8):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.calls, self.seen = 0, torch.zeros(())

    def forward(self, x):
        self.calls += 1
        self.seen.add_(1)
        return torch.relu(self.bn(self.conv(x)))


class _LeafBlock(nn.Module):
    def __init__(self, inner, c=8):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.inner = inner

    def forward(self, x):
        return torch.relu(self.inner(torch.relu(self.bn(self.conv(x)))) + x)


def _leaf_net(inner):
    torch.manual_seed(0)
    blocks = [_LeafBlock(inner()) for _ in range(3)]
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def test_a_leaf_module_in_a_region_updates_the_statistics_of_its_batch_norms_once():
    """Before, the recompute swapped the buffers of the modules the region calls but not of their
    submodules: a BatchNorm inside a module kept as a leaf counted every step twice."""
    model = _leaf_net(_MemoryFormatChecked).double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    recomputing = _recomputing(copy.deepcopy(model), [("1",), ("2", "3")])
    graph = _graph(recomputing)
    calls = [n.target for n in graph.nodes if isinstance(n.target, recompute.RegionCall)]
    assert [c.name for c in calls] == ["1", "2+3"]
    assert "1.inner" in calls[0].module_paths  # called as a leaf: its BatchNorm is not a path of its own
    assert_equivalent(model, recomputing, x, dtype=torch.float64, steps=2)
    budgeted = fxfuse.optimize(copy.deepcopy(model), x, memory_budget=0.3)
    assert any(r.name.startswith(("1", "2", "3")) for r in budgeted.fxfuse_report.regions), budgeted.fxfuse_report
    assert_equivalent(model, budgeted, x, dtype=torch.float64, steps=2)


def test_a_region_holding_a_leaf_that_changes_state_in_forward_is_refused():
    """A module kept as a leaf because its forward changes state (a counter) would count again in the
    recompute: eager's count after one step is 1, a recomputed region made it 2 (3 nested in a chain)."""
    model = _leaf_net(_Counting).double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    found = {r.name: r for r in regions.find(_graph(_recomputing(copy.deepcopy(model), [])), model)}
    assert "1.inner" in found["1"].problem and "changes" in found["1"].problem, found["1"].problem
    for budget in (0.3, 0.15):
        optimized = fxfuse.optimize(copy.deepcopy(model), x, memory_budget=budget)
        measure.train_step(optimized, (x,))
        assert [optimized[i].inner.calls for i in (1, 2, 3)] == [1, 1, 1], optimized.fxfuse_report
        assert [float(optimized[i].inner.seen) for i in (1, 2, 3)] == [1.0, 1.0, 1.0]


def test_a_region_reading_the_roots_own_tensors_trains_as_eager():
    """Before, the recompute looked the root up as an attribute named "" (every step raised AttributeError);
    its running statistics must be swapped too, or each recompute updates them again."""
    torch.manual_seed(0)
    model = RootStatistics().double()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    optimized = fxfuse.optimize(copy.deepcopy(model), x, memory_budget=0.2)
    calls = [n.target for n in _graph(optimized).nodes if isinstance(n.target, recompute.RegionCall)]
    assert any("" in call.module_paths for call in calls), optimized.fxfuse_report
    assert_equivalent(model, optimized, x, dtype=torch.float64, steps=2)
