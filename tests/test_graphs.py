"""fusion/graphs.py: graphs compiled against the live module, subgraphs, and the metadata a replacement keeps."""

import torch
import torch.fx as fx
from torch import nn

from fxfuse.fusion import graphs


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return torch.relu(self.lin(x)) + 1


def test_a_compiled_graph_reads_the_live_module():
    model = _Net()
    fn = graphs.compile_graph(fx.symbolic_trace(model).graph)
    x = torch.randn(2, 3)
    torch.testing.assert_close(fn(model, x), model(x))
    with torch.no_grad():
        model.lin.weight.zero_()  # no copy: the change shows
    torch.testing.assert_close(fn(model, x), model(x))


def test_a_graph_bound_to_its_owner_calls_its_submodules_without_looking_them_up():
    model = nn.Sequential(_Net(), nn.Sequential(nn.Linear(3, 3)))
    fn = graphs.compile_graph(fx.symbolic_trace(model).graph, owner=model)
    x = torch.randn(2, 3)
    looked_up = []
    original = nn.Module.__getattr__

    def spy(self, name):
        looked_up.append(name)
        return original(self, name)

    nn.Module.__getattr__ = spy
    try:
        out = fn(model, x)
    finally:
        nn.Module.__getattr__ = original
    torch.testing.assert_close(out, model(x))
    assert set(looked_up) <= {"weight", "bias"}  # the layers' own reads of their parameters
    model[1][0].weight = nn.Parameter(torch.zeros(3, 3))  # parameters stay live
    torch.testing.assert_close(fn(model, x), model(x))


def test_a_subgraph_computes_its_nodes_from_its_inputs():
    graph = fx.symbolic_trace(_Net()).graph
    lin, relu, add = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    sub, components = graphs.subgraph([relu, add], [lin], [add])
    assert components == ()
    h = torch.randn(2, 3)
    torch.testing.assert_close(graphs.compile_graph(sub)(None, h), torch.relu(h) + 1)


def test_provenance_keeps_the_module_stack_the_source_line_and_the_keys_asked_for():
    node = fx.Graph().placeholder("x")
    node.meta.update(nn_module_stack={"a": ("a", nn.Linear)}, stack_trace="line", val=1, other=2)
    assert graphs.provenance(node) == {"nn_module_stack": {"a": ("a", nn.Linear)}, "stack_trace": "line"}
    assert graphs.provenance(node, "other") == {
        "nn_module_stack": {"a": ("a", nn.Linear)},
        "stack_trace": "line",
        "other": 2,
    }


def _aliasing_graph() -> dict:
    def f(x):
        y = x.relu()
        a, _ = y.chunk(2, 1)
        v = a.data.t()
        z = y * 2
        return v + z.contiguous()

    graph = fx.symbolic_trace(f).graph
    return {n.name: n for n in graph.nodes}


def test_aliasing_ops_lead_back_to_the_storage_they_share():
    nodes = _aliasing_graph()
    assert graphs.aliased(nodes["getitem"]) is nodes["chunk"]
    assert graphs.aliased(nodes["getattr_1"]) is nodes["getitem"]  # .data
    assert graphs.aliased(nodes["relu"]) is None and graphs.aliased(nodes["mul"]) is None
    assert graphs.storage_root(nodes["t"]) is nodes["relu"]
    assert graphs.storage_root(nodes["mul"]) is nodes["mul"]


def test_a_storage_family_is_every_alias_reached_from_a_node():
    nodes = _aliasing_graph()
    family = {n.name for n in graphs.storage_family(nodes["relu"])}
    assert family == {"relu", "chunk", "getitem", "getitem_1", "getattr_1", "t"}  # mul writes a new tensor
    assert {n.name for n in graphs.storage_family(nodes["mul"])} == {"mul", "contiguous"}
