"""A budgeted train step with dropout inside the recomputed blocks, against eager's, on any device
(test_checkpointed.py on the CPU, test_cuda.py on a GPU)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import fxfuse
from fxfuse.fusion.regions import checkpointed


def _model() -> nn.Module:
    def block(c_in: int) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(c_in, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.3)
        )

    return nn.Sequential(*(block(c) for c in (3, 8, 8, 8)), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def check_budget_step_with_dropout_matches_eager(device: str, monkeypatch) -> int:
    """Two train steps in float64 at memory_budget=0.3: outputs, every gradient and the running statistics
    are eager's to 1e-9, with dropout drawn from the same seed (a recompute restores the forward's RNG, the
    device's included). Returns how many frames of fxfuse's own checkpoint ran (torch's is not counted)."""
    frames = []
    init = checkpointed._Frame.__init__

    def counted(self, *args):
        frames.append(1)
        init(self, *args)

    monkeypatch.setattr(checkpointed._Frame, "__init__", counted)
    torch.manual_seed(0)
    model = _model().to(device, torch.float64)
    x = torch.randn(4, 3, 12, 12, device=device, dtype=torch.float64)
    optimized = fxfuse.optimize(copy.deepcopy(model), x, memory_budget=0.3)
    frames.clear()  # optimize measures under saved-tensor hooks: torch's checkpoint runs there
    for step in range(2):
        results = []
        for m in (model, optimized):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            out = m(x)
            out.square().sum().backward()
            results.append((out, [p.grad for p in m.parameters()], [b.clone() for b in m.buffers()]))
        (want_out, want_grads, want_bufs), (out, grads, bufs) = results
        torch.testing.assert_close(out, want_out, rtol=1e-9, atol=1e-9)
        for i, (a, b) in enumerate(zip(grads, want_grads)):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=f"step {step}, gradient {i}")
        for i, (a, b) in enumerate(zip(bufs, want_bufs)):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=f"step {step}, buffer {i}")
    return len(frames)
