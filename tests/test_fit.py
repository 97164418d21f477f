"""measure.fit: the largest batch within a memory cap, counted on meta and measured with the allocator."""

import copy

import pytest
import torch
from torch import nn

import fxfuse
from fxfuse import measure
from fxfuse.errors import ConfigurationError
from fxfuse.measure import fit


def conv_net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    ).to(memory_format=torch.channels_last)


def example():
    return (torch.randn(2, 3, 32, 32).contiguous(memory_format=torch.channels_last),)


@pytest.mark.parametrize(
    "text, size",
    [("3GiB", 3 * 2**30), ("1.5 GB", 1_500_000_000), ("800MiB", 800 * 2**20), ("4096", 4096), ("2kib", 2048)],
)
def test_parse_size(text, size):
    assert fit.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "3 parsecs", "-1GiB", "0MiB", "1e3"])
def test_parse_size_rejects_what_is_not_a_size(text):
    with pytest.raises(ConfigurationError, match="memory"):
        fit.parse_size(text)


@pytest.mark.parametrize("answer", [0, 1, 2, 3, 7, 8, 9, 31, 100, 1000])
@pytest.mark.parametrize("start", [1, 5, 64])
def test_search_finds_the_threshold_of_a_monotone_predicate(answer, start):
    asked = []

    def fits(n):
        asked.append(n)
        return n <= answer

    assert fit.search(fits, start=start) == answer
    assert len(asked) == len(set(asked))  # each n asked once
    assert len(asked) <= 2 * (abs(answer - start) + 1).bit_length() + 2


def test_search_from_the_answer_costs_two_questions():
    asked = []
    assert fit.search(lambda n: asked.append(n) or n <= 47, start=47) == 47
    assert asked == [47, 48]


def test_search_stops_at_the_limit():
    assert fit.search(lambda n: True, start=3, limit=50) == 50
    with pytest.raises(ConfigurationError):
        fit.search(lambda n: True, limit=0)


def test_batched_keeps_layout_dtype_and_rows():
    x = (
        torch.arange(2 * 3 * 4 * 4, dtype=torch.float64)
        .reshape(2, 3, 4, 4)
        .contiguous(memory_format=torch.channels_last)
    )
    ids = torch.tensor([[1, 2], [3, 4]])
    y, z, flag = fit.batched((x.requires_grad_(), ids, True), 5)
    assert y.shape == (5, 3, 4, 4) and y.dtype == torch.float64 and y.requires_grad
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(y.detach()[3], x.detach()[1]) and torch.equal(z[4], ids[0]) and flag is True
    (meta,) = fit.batched((x,), 7, device="meta")
    assert meta.device.type == "meta" and meta.shape[0] == 7 and meta.is_contiguous(memory_format=torch.channels_last)


def test_state_bytes_counts_parameters_and_buffers_once():
    model = nn.BatchNorm2d(10)
    assert fit.state_bytes(model) == (10 + 10 + 10 + 10) * 4 + 8  # weight, bias, mean, var; the counter
    tied = nn.Sequential(nn.Linear(4, 4, bias=False))
    tied.append(tied[0])
    assert fit.state_bytes(tied) == 16 * 4


def _counted_total(model, n):
    (x,) = fit.batched(example(), n, device="meta")
    return fit.state_bytes(model) + x.untyped_storage().nbytes() + measure.step_peak_bytes_meta(model, (x,))


def test_counted_answer_is_the_last_batch_within_the_cap():
    model = conv_net()
    cap = _counted_total(model, 40) + 1000
    n = fit.largest_batch(model, example(), cap)
    assert _counted_total(model, n) <= cap < _counted_total(model, n + 1)
    assert n in (40, 41)


def test_measured_answer_is_the_last_batch_within_the_cap_on_the_allocator():
    model = conv_net()
    cap = _counted_total(model, 24)

    def measured_total(n):
        (x,) = fit.batched(example(), n)
        measure.train_step(model, (x,))
        step = measure.step_allocated_peak_bytes(lambda: measure.train_step(model, (x,)))
        return fit.state_bytes(model) + x.untyped_storage().nbytes() + step

    n = fit.largest_batch(model, example(), cap, how="measured")
    assert measured_total(n) <= cap < measured_total(n + 1)
    assert 20 <= n <= 24  # the allocator sees a little more than the meta count


def test_measured_search_leaves_buffers_and_gradients_as_they_were():
    model = conv_net()
    model(example()[0]).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    state = copy.deepcopy(model.state_dict())
    fit.largest_batch(model, example(), _counted_total(model, 6), how="measured")
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def test_fxfuse_fits_a_larger_batch_than_eager():
    model = conv_net()
    optimized = fxfuse.optimize(copy.deepcopy(model), example(), mode="memory")
    cap = _counted_total(model, 32)
    eager = fit.largest_batch(model, example(), cap)
    fused = fit.largest_batch(optimized, example(), cap)
    assert eager in (32, 33) and fused >= 1.4 * eager


def test_nothing_fits_below_the_model_itself():
    model = conv_net()
    assert fit.largest_batch(model, example(), fit.state_bytes(model)) == 0
    assert fit.largest_batch(model, example(), fit.state_bytes(model), how="measured") == 0


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ConfigurationError, match="counted"):
        fit.largest_batch(conv_net(), example(), 2**30, how="guessed")
    with pytest.raises(ConfigurationError, match="batch dimension"):
        fit.largest_batch(conv_net(), (3.0,), 2**30)


def test_cuda_probe_empties_the_allocator_cache_before_capping(monkeypatch):
    """Blocks cached before a capped probe would be reused outside the cap (faked CUDA calls: no GPU needed)."""
    calls = []
    props = type("Props", (), {"total_memory": 2**34})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.5, raising=False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, device=None: calls.append(("fraction", f))
    )
    monkeypatch.setattr(fit, "train_step", lambda model, inputs: calls.append("step"))
    fits = fit._fits_cuda(conv_net(), example(), 2**33, torch.device("cuda", 0))
    assert fits(4)
    assert calls == ["empty_cache", ("fraction", 0.5), "step", "step", "empty_cache", ("fraction", 0.5)]
