"""torch.compile(fxfuse.optimize(model)): one graph, exact, and backward keeps no more than fxfuse eager.

Both ways fxfuse runs under torch.compile are tested: the default (the fused ops as opaque
calls) and, with fxfuse.ops.compiled.enabled ("composed"), the ATen compositions of
fxfuse/ops/compiled.py inside selective-checkpoint regions. Most tests use the "aot_eager_decomp_partition" backend:
AOTAutograd with inductor's decompositions and its min-cut partitioner (which is what
decides what backward keeps, honouring the regions' policy), without inductor's C++
code generation, which takes minutes on a small shared CPU. One test runs inductor
itself on a small model.
"""

import copy
import warnings

import pytest
import torch
import torch._dynamo.utils
import torchvision
from support.blocks import Block
from support.config_flag_net import ConfigFlagNet
from torch import nn

import fxfuse
from fxfuse.measure import memory
from fxfuse.ops import compiled
from fxfuse.testing import assert_equivalent

PARTITIONED = "aot_eager_decomp_partition"  # AOTAutograd + min-cut partitioner, no code generation


def small_net() -> nn.Module:
    """Every fused family: conv_bn_act, add_into, batch_norm_act, conv_act, layer_norm_linear, act_linear,
    linear_act, gelu."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        Block(8),
        nn.BatchNorm2d(8),
        nn.SiLU(),
        nn.Conv2d(8, 8, 1),
        nn.GELU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.LayerNorm(8),  # merged into the next Linear (layer_norm_linear)
        nn.Linear(8, 16),
        nn.GELU(),  # merged into the next Linear (act_linear)
        nn.Linear(16, 4),
        nn.Linear(4, 4),
        nn.Hardswish(),  # linear_act
    )


def channels_last(model: nn.Module, x: torch.Tensor, dtype=torch.float64):
    return model.to(dtype, memory_format=torch.channels_last), x.to(dtype).contiguous(memory_format=torch.channels_last)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(params=["opaque", "composed"])
def composed(request, monkeypatch):
    monkeypatch.setattr(compiled, "enabled", request.param == "composed")
    return request.param == "composed"


def captured_graphs(model: nn.Module, *inputs) -> list[torch.fx.GraphModule]:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(model, backend=backend)(*inputs)
    return graphs


def test_one_graph_with_every_fused_site(composed):
    model = fxfuse.optimize(small_net())
    sites = [s.op for s in model.fxfuse_report.fused]
    assert {
        "fxfuse::conv_bn_act",
        "fxfuse::batch_norm_act",
        "fxfuse::conv_act",
        "fxfuse::act_linear",
        "fxfuse::linear_act",
        "fxfuse::layer_norm_linear",
    } <= set(sites)
    (graph,) = captured_graphs(model, torch.randn(2, 3, 8, 8))
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    checkpointed = sum(1 for t in targets if "tag_activation_checkpoint" in t)
    if composed:  # a recompute region per site; GELU is F.gelu
        assert not [t for t in targets if "fxfuse" in t]
        assert checkpointed == len([s for s in sites if s != "fxfuse::gelu"])
    else:  # every site is its fused op (a BN→act merged into a Conv→BN→act is one bn_act_conv for both)
        # An op called by its packet or by its overload (the BatchNorm family's `.default`).
        ops = {t.removesuffix(".default").replace(".", "::", 1) for t in targets if t.startswith("fxfuse.")}
        assert ops == set(sites)
        assert checkpointed == 0


def test_resnet18_is_one_graph():
    explanation = torch._dynamo.explain(fxfuse.optimize(torchvision.models.resnet18()))(torch.randn(2, 3, 32, 32))
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0)


class Holder(nn.Module):
    """`model` under the name torch.compile's OptimizedModule gives it, so state_dict keys match."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._orig_mod = model

    def forward(self, *args):
        return self._orig_mod(*args)


def test_resnet18_trains_and_evaluates_exactly_in_float64():
    model = torchvision.models.resnet18()
    candidate = torch.compile(fxfuse.optimize(copy.deepcopy(model)), backend=PARTITIONED)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # 64x64: layer4's BN then normalizes 8 values per channel. At 32x32 (2 values) float64
    # rounding grows past the tolerance by step 2 for fxfuse eager and plain compile alike.
    assert_equivalent(Holder(model), candidate, torch.randn(2, 3, 64, 64), dtype=torch.float64)
    # the deep copies assert_equivalent runs were compiled: train and eval graphs
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= frames + 2


def test_recompute_regions_under_compile_train_exactly_in_float64():
    """memory_budget=0.3 recomputes whole regions (layer1, layer2 of resnet18) through
    checkpoint with their buffers swapped; dynamo accepts no such context_fn, so each region
    runs between compiled graphs as it does eagerly (a graph break per region). Running
    statistics are updated once, gradients and eval outputs are eager's."""
    model = torchvision.models.resnet18()
    x = torch.randn(2, 3, 64, 64)
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,), memory_budget=0.3)
    assert any(r.kind != "link" for r in optimized.fxfuse_report.regions), "no region to compile around"
    candidate = torch.compile(optimized, backend=PARTITIONED)
    assert_equivalent(Holder(model), candidate, x, dtype=torch.float64)


def test_small_net_trains_and_evaluates_exactly_in_float64(composed):
    model = small_net()
    candidate = torch.compile(fxfuse.optimize(copy.deepcopy(model)), backend=PARTITIONED)
    assert_equivalent(Holder(model), candidate, torch.randn(4, 3, 8, 8), dtype=torch.float64)


def test_running_statistics_are_updated_once_per_step_and_saved_bytes_stay(composed):
    model, x = channels_last(small_net(), torch.randn(4, 3, 8, 8))
    compiled_model = torch.compile(fxfuse.optimize(copy.deepcopy(model)), backend=PARTITIONED)
    for _ in range(3):
        memory.train_step(model, (x,))
        memory.train_step(compiled_model, (x,))
    for (name, ref), got in zip(model.named_buffers(), compiled_model._orig_mod.buffers()):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12, msg=name)
    assert int(model[1].num_batches_tracked) == int(compiled_model._orig_mod[1].num_batches_tracked) == 3
    eager = fxfuse.optimize(copy.deepcopy(model))
    assert 0 < memory.saved_activation_bytes(compiled_model, (x,)) <= memory.saved_activation_bytes(eager, (x,))


def test_resnet18_saves_no_more_than_fxfuse_eager():
    model, x = channels_last(torchvision.models.resnet18(), torch.randn(2, 3, 32, 32), torch.float32)
    eager = fxfuse.optimize(copy.deepcopy(model))
    compiled_model = torch.compile(fxfuse.optimize(copy.deepcopy(model)), backend=PARTITIONED)
    memory.train_step(compiled_model, (x,))
    fused_eager = memory.saved_activation_bytes(eager, (x,))
    assert 0 < memory.saved_activation_bytes(compiled_model, (x,)) <= fused_eager
    # Plain torch.compile keeps more: the conv outputs (what fxfuse recomputes).
    plain = torch.compile(copy.deepcopy(model), backend=PARTITIONED)
    memory.train_step(plain, (x,))
    assert memory.saved_activation_bytes(plain, (x,)) > fused_eager


def test_inductor_small_net_exact_and_saves_no_more_than_fxfuse_eager():
    """The default (opaque ops) through inductor itself. The composed path was checked the same way
    (float64 resnet18, relative differences <= 3e-10) but its C++ code generation takes minutes here."""
    model, x = channels_last(small_net(), torch.randn(4, 3, 8, 8))
    eager = fxfuse.optimize(copy.deepcopy(model))
    compiled_model = torch.compile(fxfuse.optimize(copy.deepcopy(model)))
    for _ in range(2):
        xs = [x.clone().requires_grad_() for _ in range(2)]
        out, ref = compiled_model(xs[0]), model(xs[1])
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
        out.square().sum().backward()
        ref.square().sum().backward()
        torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-10, atol=1e-10)
        for (name, p), q in zip(model.named_parameters(), compiled_model._orig_mod.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-10, msg=name)
            p.grad = q.grad = None
    for (name, b), c in zip(model.named_buffers(), compiled_model._orig_mod.buffers()):
        torch.testing.assert_close(c, b, rtol=1e-12, atol=1e-12, msg=name)
    assert memory.saved_activation_bytes(compiled_model, (x,)) <= memory.saved_activation_bytes(eager, (x,))


def test_a_change_that_needs_a_new_graph_breaks_the_compiled_graph_with_fxfuses_reason():
    """A config read in forward changed after the first compiled call: fxfuse builds its new graph outside
    dynamo (torch.fx cannot run under it), so fullgraph=True stops with fxfuse's reason, and the graph the
    eager call builds then compiles as one graph (before, the compiled model kept the old graph silently)."""

    torch._dynamo.reset()
    model, x = fxfuse.optimize(ConfigFlagNet()), torch.randn(2, 3, 8, 8)
    compiled_model = torch.compile(model, backend=PARTITIONED, fullgraph=True)
    assert len(compiled_model(x)) == 1
    model.config.extra = True
    with pytest.raises(torch._dynamo.exc.Unsupported, match="fxfuse: the optimized ConfigFlagNet needs a new graph"):
        compiled_model(x)
    assert len(model(x)) == 2
    assert len(compiled_model(x)) == 2
    torch._dynamo.reset()


def test_compiling_an_optimized_model_warns_of_no_cached_function(monkeypatch):
    # Dynamo warns at every functools.cache-wrapped function it traces (once per process: its record of
    # what it warned of is emptied here); the runtime's per-call helpers use plain dicts instead.
    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())
    torch._dynamo.reset()
    model = fxfuse.optimize(small_net())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.compile(model, backend="eager")(torch.randn(2, 3, 8, 8)).sum().backward()
    assert not [w for w in seen if "lru_cache" in str(w.message)]


@pytest.mark.parametrize("setting", ["fast", "memory", "budget"])
def test_compiled_autograd_runs_the_fused_backwards_exactly_in_float64(setting):
    """torch._dynamo.compiled_autograd traces backward through fxfuse's C++ Functions. It asserts
    a C++ Function's context holds no non-differentiable marks (the statistics and pooling offsets
    the fused ops return), which fxfuse drops once autograd has wrapped the outputs."""
    from torch._dynamo import compiled_autograd

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
        Block(8),
        Block(8),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 4, 1),
    ).double()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    options = {"fast": {}, "memory": {"mode": "memory"}, "budget": {"memory_budget": 0.2, "example_inputs": (x,)}}
    optimized = fxfuse.optimize(copy.deepcopy(model), **options[setting])
    ops = {s.op for s in optimized.fxfuse_report.fused}
    marked = "fxfuse::batch_norm_act" if setting == "budget" else "fxfuse::conv_bn_act"
    assert {marked, "fxfuse::bn_act_conv", "fxfuse::max_pool2d"} <= ops
    assert (setting == "budget") == any(r.kind != "link" for r in optimized.fxfuse_report.regions)
    model(x).square().sum().backward()
    loss = optimized(x).square().sum()
    with compiled_autograd._enable(torch.compile(backend="eager")):
        loss.backward()
    for (name, p), q in zip(model.named_parameters(), optimized.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-9, msg=name)
    for (name, b), c in zip(model.named_buffers(), optimized.buffers(), strict=True):
        torch.testing.assert_close(c, b, rtol=1e-12, atol=0, msg=name)
