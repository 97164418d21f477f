"""StateGuard: what tracing changed, named and put back."""

import torch
from torch import nn

from fxfuse.fusion.state_guard import StateGuard, owned_tensors


def _model():
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    m[1].plain = torch.zeros(2)
    return m


def test_owned_tensors_lists_parameters_buffers_and_plain_tensors_once():
    m = _model()
    m.shared = m[1].plain
    names = [name for name, _ in owned_tensors(m)]
    assert names == [
        "shared",
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    ]


def test_in_place_writes_are_restored_and_named():
    m = _model()
    guard = StateGuard(m)
    guard.begin(m)
    m[1].running_mean.add_(1)
    m[1].plain.fill_(3)
    assert guard.end() == ["1.running_mean", "1.plain"]
    assert torch.equal(m[1].running_mean, torch.zeros(4)) and torch.equal(m[1].plain, torch.zeros(2))


def test_assignments_are_undone_and_named():
    m = _model()
    guard = StateGuard(m)
    guard.begin(m)
    buffer = m[1].num_batches_tracked
    m[1].num_batches_tracked = buffer + 1
    m[0].extra = 5
    m[1].momentum = 0.5
    assert sorted(guard.end()) == ["0.extra", "1.momentum", "1.num_batches_tracked"]
    assert m[1].num_batches_tracked is buffer and not hasattr(m[0], "extra") and m[1].momentum == 0.1


def test_writes_into_dict_and_list_attributes_are_undone_and_named():
    m = _model()
    m[0].cache, m[1].seen = {"cpu": 1}, [1]
    cache, seen = m[0].cache, m[1].seen
    guard = StateGuard(m)
    guard.begin(m)
    m[0].cache["cuda"] = object()  # timm LeViT's attention_bias_cache in eval
    m[1].seen.append(2)
    assert sorted(guard.end()) == ["0.cache", "1.seen"]
    assert m[0].cache is cache and cache == {"cpu": 1} and m[1].seen is seen and seen == [1]


class _Cached(nn.Module):
    """Caches a tensor derived from a parameter in eval, as timm's LeViT attention does."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        self.bias = nn.Parameter(torch.randn(4, 1, 1))
        self.cache = {}

    def forward(self, x):
        if self.training:
            bias = self.bias * 2
        else:
            if "b" not in self.cache:
                self.cache["b"] = self.bias * 2
            bias = self.cache["b"]
        return torch.relu(self.bn(self.conv(x))) + bias


def test_a_module_filling_a_cache_in_forward_stays_eager_and_untouched():
    import copy

    import fxfuse
    from fxfuse.testing import assert_equivalent

    model = nn.Sequential(_Cached()).eval()
    x = torch.randn(2, 3, 8, 8)
    optimized = fxfuse.optimize(copy.deepcopy(model), (x,))  # traced in eval: the cache is filled
    assert optimized[0].cache == {}
    assert any("0: not traceable" in n and "0.cache" in n for n in optimized.fxfuse_report.notes)
    torch.testing.assert_close(optimized(x), model(x))
    assert list(optimized[0].cache) == ["b"] and isinstance(optimized[0].cache["b"], torch.Tensor)
    fresh = nn.Sequential(_Cached())
    assert_equivalent(fresh, fxfuse.optimize(copy.deepcopy(fresh), (x,)), x)  # train, then eval


def test_a_write_is_blamed_on_the_innermost_frame_only():
    m = _model()
    guard = StateGuard(m)
    guard.begin(m)
    with torch.no_grad():
        m[0].weight.mul_(2)  # the outer frame's own write
    guard.begin(m[1])
    m[1].running_var.mul_(2)
    assert guard.end() == ["1.running_var"]
    assert guard.end() == ["0.weight"]


def test_an_eval_forward_changes_nothing():
    m = _model().eval()
    guard = StateGuard(m)
    guard.begin(m)
    m(torch.randn(2, 3, 5, 5))
    assert guard.end() == []
