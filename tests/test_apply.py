"""fusion/apply.py: a plan rewrites a copy of the captured graph, never the capture, and only the sites it names."""

import torch
from torch import nn

from fxfuse.fusion.apply import apply
from fxfuse.fusion.capture import capture
from fxfuse.fusion.plan import Options, Plan


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
