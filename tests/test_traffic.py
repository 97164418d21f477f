"""measure/traffic.py: each op's FLOPs and the bytes it reads and writes, on meta or real tensors."""

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from fxfuse.measure.traffic import OpCosts


def test_a_pointwise_op_moves_its_operands_and_result_and_runs_no_flop():
    a, b = torch.empty(4, 8, device="meta"), torch.empty(4, 8, device="meta")
    with OpCosts() as costs:
        a + b
    assert [(op.name, op.flops, op.moved) for op in costs.ops] == [("aten.add.Tensor", 0, 3 * 4 * 8 * 4)]


def test_an_in_place_op_reads_and_writes_its_operand():
    a = torch.empty(16, dtype=torch.float64, device="meta")
    with OpCosts() as costs:
        a.relu_()
    assert costs.moved == 2 * 16 * 8


def test_views_and_allocations_move_nothing():
    a = torch.empty(2, 3, 4, 5, device="meta")
    with OpCosts() as costs:
        a.permute(0, 2, 3, 1)
        a.reshape(2, -1)
        torch.empty_like(a)
        a.detach()
    assert costs.ops and costs.moved == 0 and costs.flops == 0


def test_a_conv_has_flop_counters_flops_and_moves_input_weight_and_output():
    x, w = torch.empty(2, 3, 8, 8, device="meta"), torch.empty(5, 3, 3, 3, device="meta")
    with FlopCounterMode(display=False) as counter:
        F.conv2d(x, w, padding=1)
    with OpCosts() as costs:
        F.conv2d(x, w, padding=1)
    assert costs.flops == counter.get_total_flops() == 2 * (2 * 5 * 8 * 8) * (3 * 3 * 3)
    assert costs.moved == 4 * (2 * 3 * 8 * 8 + 5 * 3 * 3 * 3 + 2 * 5 * 8 * 8)


def test_timed_ops_on_real_tensors():
    a = torch.randn(64, 64)
    with OpCosts(timed=True) as costs:
        a @ a
    [op] = costs.ops
    assert op.seconds is not None and op.seconds >= 0 and op.flops == 2 * 64**3
    with OpCosts() as untimed:
        a @ a
    assert untimed.ops[0].seconds is None


def test_a_grouped_conv_backward_costs_its_forward_per_gradient():
    """torch's formula counts a depthwise conv's weight gradient as a dense conv's (32 groups: 33x the forward
    for both gradients); here each gradient costs the forward's FLOPs."""
    x = torch.empty(2, 32, 16, 16, device="meta", requires_grad=True)
    w = torch.empty(32, 1, 3, 3, device="meta", requires_grad=True)
    y = F.conv2d(x, w, padding=1, groups=32)
    forward = 2 * (2 * 32 * 16 * 16) * 9
    with OpCosts() as costs:
        y.sum().backward()
    [conv] = [op for op in costs.ops if op.name == "aten.convolution_backward.default"]
    assert conv.flops == 2 * forward
    x.grad = w.grad = None
    y = F.conv2d(x, w.detach(), padding=1, groups=32)
    with OpCosts() as costs:
        y.sum().backward()
    [conv] = [op for op in costs.ops if op.name == "aten.convolution_backward.default"]
    assert conv.flops == forward
