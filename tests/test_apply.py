"""fusion/apply.py: a plan rewrites a copy of the captured graph, never the capture, and only the sites it names."""

import torch
import torchvision
from torch import nn

from fxfuse.fusion.apply import apply, copy_of
from fxfuse.fusion.capture import capture
from fxfuse.fusion.plan import Options, Plan


def _resnet():
    """ResNet-50's structure (bottlenecks, downsampling), one block per stage, narrow."""
    return torchvision.models.resnet.ResNet(torchvision.models.resnet.Bottleneck, [1, 1, 1, 1], width_per_group=16)


def _net():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1, bias=False),
        nn.BatchNorm2d(4),
        nn.ReLU(),
    )


def _fused_calls(graph) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_function" and "fxfuse" in getattr(n.target, "__module__", ""))


def test_every_plan_starts_from_the_same_capture():
    model = _net()
    captured = capture(model, (torch.randn(2, 3, 8, 8),))
    code = captured.traced.graph.python_code("self").src
    every, found = apply(model, captured, Options("memory"))
    assert len(found.sites) == 2 and _fused_calls(every) == 2
    first = found.sites[0].names
    one, found = apply(model, captured, Options("memory", Plan(frozenset({first}))))
    assert [s.names for s in found.sites] == [first] and _fused_calls(one) == 1
    none, found = apply(model, captured, Options("memory", Plan(frozenset())))
    assert found.sites == [] and _fused_calls(none) == 0
    assert captured.traced.graph.python_code("self").src == code


def test_the_findings_carry_the_capture_notes_without_sharing_them():
    model = _net()
    captured = capture(model, None)
    captured.notes.append("a note of the capture")
    _, found = apply(model, captured, Options("fast"))
    assert found.notes[0] == "a note of the capture" and {s.mode for s in found.sites} == {"fast"}
    found.notes.append("added later")
    assert captured.notes == ["a note of the capture"]


def test_a_copy_is_rewritten_without_changing_the_capture():
    model, x = _resnet(), torch.randn(2, 3, 32, 32)
    captured = capture(model, (x,))
    code = captured.traced.graph.python_code("self").src
    own = copy_of(captured)
    assert own.traced.graph is not captured.traced.graph
    assert own.traced.graph.python_code("self").src == code
    assert len(own.shapes) == len(captured.shapes) > 0
    assert all(n.graph is own.traced.graph for n in own.shapes)
    for node in list(own.traced.graph.nodes):
        if node.op == "call_module" and not node.users:
            own.traced.graph.erase_node(node)
    node = next(n for n in own.traced.graph.nodes if n.op == "call_module")
    node.target = "fc"
    assert captured.traced.graph.python_code("self").src == code
