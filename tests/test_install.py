"""fusion/install.py: the class swap of a model's roots, its undoing, and what runs at call time."""

import copy
import pickle

import pytest
import torch
from support.branching import Block, Holder, Untraceable
from support.config_flag_net import ConfigFlagNet
from torch import nn

import fxfuse
from fxfuse.fusion import install, roots
from fxfuse.fusion.apply import apply_roots
from fxfuse.fusion.capture import Captures
from fxfuse.fusion.plan import Options
from fxfuse.testing import assert_equivalent


def _installed(model, both_modes=True):
    """`model`'s roots (roots.py) rewritten with every site and installed."""
    tree = [roots.find(model, None, Captures())]
    options = Options("memory")
    applied = apply_roots(tree, options, installed=True)
    install.install(tree, applied, options, both_modes=both_modes)
    return tree


def test_installed_roots_run_their_graphs_and_uninstall_restores_the_classes():
    model, x = Untraceable(), torch.randn(2, 4, 6, 6)
    eager = copy.deepcopy(model)
    _installed(model)
    assert install.is_optimized(model.a) and install.is_optimized(model.b) and not install.is_optimized(model)
    assert install.fx_graph(model.a) is not None
    assert_equivalent(eager, model, x, dtype=torch.float64)
    loaded = pickle.loads(pickle.dumps(model))
    assert type(loaded.a) is not Block and install.is_optimized(loaded.a)
    install.uninstall(model)
    assert type(model.a) is Block and not any(install.is_optimized(m) for m in model.modules())


def test_a_trial_install_builds_one_mode_only():
    model = Block()
    _installed(model, both_modes=False)
    state = model.__dict__[install._STATE]
    assert len(state.graphs) == 1


def test_a_module_at_two_paths_is_installed_once():
    model, block = Untraceable(), Block()
    model.a, model.b = Holder(block), Holder(block)  # two modules whose forward does not trace
    _installed(model)
    assert install.is_optimized(block) and len(block.__dict__[install._STATE].graphs) == 2  # both modes, once


def _conv_bn_relu_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3)).double()


class LoRA(nn.Module):
    """A PEFT-style wrapper: the base layer plus a low-rank term, with the base's weight and bias visible."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(2, base.in_features, dtype=base.weight.dtype) * 0.1)
        self.b = nn.Parameter(torch.randn(base.out_features, 2, dtype=base.weight.dtype) * 0.1)

    weight = property(lambda self: self.base.weight)
    bias = property(lambda self: self.base.bias)

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


def _same_after(edit, model: nn.Module, x: torch.Tensor) -> None:
    eager = copy.deepcopy(model)
    optimized = fxfuse.optimize(model)
    assert optimized.fxfuse_report.fused
    for m in (eager, optimized):
        m(x)  # builds the graphs the edit must not leave in use (and moves both models' BN statistics)
        torch.manual_seed(1)
        edit(m)
    for train in (True, False):
        eager.train(train), optimized.train(train)
        xe, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_e, out_o = eager(xe), optimized(xo)
        torch.testing.assert_close(out_o, out_e, rtol=1e-12, atol=1e-12)
        out_e.square().sum().backward()
        out_o.square().sum().backward()
        torch.testing.assert_close(xo.grad, xe.grad, rtol=1e-12, atol=1e-12)
        for (name, p), q in zip(eager.named_parameters(), optimized.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_a_fused_sites_activation_replaced_after_optimize_is_the_one_that_runs():
    def edit(m):
        m[2] = nn.Tanh()

    _same_after(edit, _conv_bn_relu_net(), torch.randn(2, 3, 8, 8, dtype=torch.float64))


def test_a_fused_layer_wrapped_after_optimize_runs_its_wrapper():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).double()

    def edit(m):
        m[1], m[3] = LoRA(m[1]), LoRA(m[3])

    _same_after(edit, mlp, torch.randn(4, 16, dtype=torch.float64))


def test_a_fused_norm_replaced_by_another_kind_after_optimize():
    def edit(m):
        m[1] = nn.GroupNorm(2, 8).double()  # eager runs it; fused BN code would look for running_mean

    _same_after(edit, _conv_bn_relu_net(), torch.randn(2, 3, 8, 8, dtype=torch.float64))


def test_a_submodule_deleted_after_optimize():
    class Folded(nn.Module):  # what ultralytics' fuse() does: BN folded away, `bn` deleted, forward switched
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)

        def forward(self, x):
            return torch.relu(self.bn(self.conv(x)) if hasattr(self, "bn") else self.conv(x))

    def edit(m):
        del m.bn

    _same_after(edit, Folded().double(), torch.randn(2, 3, 8, 8, dtype=torch.float64))


def test_a_layer_swapped_for_its_twin_after_optimize_is_the_one_that_runs():
    # Same type, same place in the tree: only the module object differs (the graphs call the modules they were
    # built with, so the tree check must see it).
    def edit(m):
        twin = nn.BatchNorm2d(8).double()
        with torch.no_grad():
            twin.weight.uniform_(0.5, 1.5)
        m[1] = twin

    _same_after(edit, _conv_bn_relu_net(), torch.randn(2, 3, 8, 8, dtype=torch.float64))


def test_children_renamed_in_place_after_optimize_are_read_again():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(3, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)

        def forward(self, x):
            return torch.relu(self.bn(self.a(x))) + self.b(x)

    def edit(m):  # the same objects, in the same order, under each other's names
        m._modules = type(m._modules)(b=m._modules["a"], a=m._modules["b"], bn=m._modules["bn"])

    _same_after(edit, Two().double(), torch.randn(2, 3, 8, 8, dtype=torch.float64))


def test_a_config_flag_changed_after_optimize_is_read_again():
    model = ConfigFlagNet().double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    optimized = fxfuse.optimize(copy.deepcopy(model))
    assert len(optimized(x)) == 1
    optimized.config.extra = True
    assert len(optimized(x)) == 2
    optimized.config.extra = False
    assert len(optimized(x)) == 1


def test_an_unchanged_tree_keeps_its_graphs():
    optimized = fxfuse.optimize(_conv_bn_relu_net())
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    optimized(x)
    state = optimized.__dict__[install._STATE]
    graphs = dict(state.graphs)
    optimized(x)
    optimized[1].momentum = 0.2  # read at run time, not baked in
    optimized(x)
    assert state.graphs == graphs


def test_torch_jit_script_compiles_the_original_forward_sharing_the_models_tensors():
    """TorchScript cannot compile the generated forward: it scripts the original class, with a warning, and
    the optimized model is left as it was (its submodule table included: torch.jit rewrites the one it
    scripts)."""
    torch.manual_seed(0)
    eager = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), Holder(Block()), Untraceable(), nn.Conv2d(4, 2, 1)
    )
    optimized = fxfuse.optimize(copy.deepcopy(eager))
    children = dict(optimized._modules)
    assert install.is_optimized(optimized[4].a)  # a root of its own: scripted as its original class too
    with pytest.warns(UserWarning, match="torch.jit.script compiles Sequential's own forward, unfused"):
        scripted = torch.jit.script(optimized)
    assert install.is_optimized(optimized) and optimized._modules == children
    assert all(a is b for a, b in zip(scripted.parameters(), optimized.parameters(), strict=True))
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(scripted(x), eager(x), rtol=0, atol=0)  # train: both update running stats
    for a, b in zip(eager.buffers(), optimized.buffers(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    scripted.eval(), eager.eval()
    torch.testing.assert_close(scripted(x), eager(x), rtol=0, atol=0)
