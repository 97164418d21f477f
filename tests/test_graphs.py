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
