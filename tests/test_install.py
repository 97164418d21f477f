"""fusion/install.py: the walk over a model's traceable roots, the class swap and its undoing."""

import copy
import pickle

import torch
from torch import nn

from fxfuse.fusion import install
from fxfuse.fusion.capture import Captures
from fxfuse.fusion.plan import Findings, Options
from fxfuse.testing import assert_equivalent


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class Untraceable(nn.Module):
    """Its own forward branches on a value; its blocks trace."""

    def __init__(self):
        super().__init__()
        self.a, self.b = Block(), Block()

    def forward(self, x):
        y = self.a(x)
        return self.b(y) if y.sum() > 0 else self.b(-y)


def test_a_walk_that_does_not_install_leaves_the_model_alone():
    model = Untraceable()
    found = Findings()
    assert install.walk(model, None, Options("memory"), install.Walk(found, install=False)) == 2
    assert [s.names[0] for s in found.sites] == ["a.conv", "b.conv"]
    assert not any(install.is_optimized(m) for m in model.modules())
    assert install.fx_graph(model.a) is None


def test_installed_roots_run_their_graphs_and_uninstall_restores_the_classes():
    model, x = Untraceable(), torch.randn(2, 4, 6, 6)
    eager = copy.deepcopy(model)
    walk = install.Walk(Findings(), install=True, captures=Captures())
    assert install.walk(model, None, Options("memory"), walk) == 2
    assert install.is_optimized(model.a) and install.is_optimized(model.b) and not install.is_optimized(model)
    assert install.fx_graph(model.a) is not None
    assert_equivalent(eager, model, x, dtype=torch.float64)
    loaded = pickle.loads(pickle.dumps(model))
    assert type(loaded.a) is not Block and install.is_optimized(loaded.a)
    install.uninstall(model)
    assert type(model.a) is Block and not any(install.is_optimized(m) for m in model.modules())


def test_a_trial_walk_builds_one_mode_only():
    model = Block()
    walk = install.Walk(Findings(), install=True, captures=Captures(), both_modes=False)
    install.walk(model, None, Options("memory"), walk)
    state = model.__dict__[install._STATE]
    assert len(state.graphs) == 1
