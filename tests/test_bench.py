"""fxfuse.bench and `fxfuse bench`: variants, peers, the table and its JSON."""

import copy
import json
import mmap

import pytest
import torch
from torch import nn

from fxfuse import bench, measure
from fxfuse.cli import main
from fxfuse.errors import ConfigurationError


def small_net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Sequential(
            nn.Conv2d(8, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 1),
            nn.BatchNorm2d(8),
            nn.GELU(),
        ),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def test_variant_names_and_errors():
    assert bench.parse_variants(["memory", "auto"], [0.7], ["checkpoint"]) == [
        "eager",
        "memory",
        "auto",
        "budget=0.7",
        "checkpoint",
    ]
    assert bench.parse_variants(["memory"], [0.5, 0.3], ["compile-budget"], channels_last_baseline=True) == [
        "eager",
        "eager-channels_last",
        "memory",
        "budget=0.5",
        "budget=0.3",
        "compile-budget=0.5",
        "compile-budget=0.3",
    ]
    assert bench.parse_variants(["memory"], [0.3], peak_budgets=[0.5]) == [
        "eager",
        "memory",
        "budget=0.3",
        "peak-budget=0.5",
    ]
    with pytest.raises(ConfigurationError, match="give --budget too"):
        bench.parse_variants(["memory"], [], ["compile-budget"])
    assert bench.parse_variants(["memory"], [0.3, 0.25], budget_peak=0.5) == [
        "eager",
        "memory",
        "budget=0.3",
        "budget=0.25",
        "budget=0.3,peak=0.5",
        "budget=0.25,peak=0.5",
    ]
    with pytest.raises(ConfigurationError, match="needs --budget too"):
        bench.parse_variants(["memory"], [], budget_peak=0.5)
    assert bench.parse_variants(["memory", "auto"], [], ["compile", "compile-fxfuse", "compile-fxfuse-composed"]) == [
        "eager",
        "memory",
        "auto",
        "compile",
        "compile(memory)",
        "compile(auto)",
        "compile(memory,composed)",
        "compile(auto,composed)",
    ]
    # fxfuse's fastest form at a budget may be under torch.compile: compile each budget too
    assert bench.parse_variants(["eager"], [0.5], ["compile-budget", "compile-fxfuse"]) == [
        "eager",
        "budget=0.5",
        "compile-budget=0.5",
        "compile(budget=0.5)",
    ]
    with pytest.raises(ConfigurationError, match="give --modes memory"):
        bench.parse_variants(["eager"], [], ["compile-fxfuse"])
    # fxfuse's ops under compile's own knapsack: each mode at each budget
    assert bench.parse_variants(["fast", "memory"], [0.5, 0.3], ["compile-budget", "compile-budget-fxfuse"]) == [
        "eager",
        "fast",
        "memory",
        "budget=0.5",
        "budget=0.3",
        "compile-budget=0.5",
        "compile-budget=0.3",
        "compile-budget=0.5(fast)",
        "compile-budget=0.5(memory)",
        "compile-budget=0.3(fast)",
        "compile-budget=0.3(memory)",
    ]
    for modes, budgets in ((["eager"], [0.5]), (["fast"], [])):
        with pytest.raises(ConfigurationError, match="give --modes fast"):
            bench.parse_variants(modes, budgets, ["compile-budget-fxfuse"])
    with pytest.raises(ConfigurationError, match="unknown mode"):
        bench.parse_variants(["turbo"])
    with pytest.raises(ConfigurationError, match="unknown peer"):
        bench.parse_variants([], peers=["deepspeed"])


def test_checkpoint_peer_is_exact_and_saves_memory():
    model = small_net()
    x = torch.randn(2, 3, 16, 16)
    peer = bench.checkpoint_blocks(copy.deepcopy(model))
    # conv, bn, linear at the top; the inner Sequential is a list of blocks: its conv, bn, conv, bn
    assert sum(isinstance(m, bench.Checkpointed) for m in peer.modules()) == 7
    outs = []
    for m in (model, peer):
        m.double()
        out = m(x.double())
        out.square().sum().backward()
        outs.append((out, [p.grad for p in m.parameters()]))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-12, atol=0)
    for a, b in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    model.float(), peer.float()
    assert measure.saved_activation_bytes(peer, (x,)) < measure.saved_activation_bytes(model, (x,))


def test_peak_budget_variant_is_optimized_under_that_budget():
    x = torch.randn(2, 3, 16, 16)
    variant = bench.make_variant("peak-budget=0.9", small_net(), (x,))
    assert variant.fxfuse_report.peak_budget == 0.9
    assert variant.fxfuse_report.selected_peak_bytes is not None


def test_budget_with_peak_variant_is_optimized_under_both():
    x = torch.randn(2, 3, 16, 16)
    report = bench.make_variant("budget=0.8,peak=0.95", small_net(), (x,)).fxfuse_report
    assert (report.budget, report.peak_budget) == (0.8, 0.95)


def test_compare_rows_are_ratios_to_eager():
    x = torch.randn(2, 3, 16, 16)
    variants = {name: bench.make_variant(name, small_net(), (x,)) for name in ("eager", "memory", "budget=0.8")}
    rows = bench.compare(variants, (x,), repeats=1)
    assert [r.variant for r in rows] == ["eager", "memory", "budget=0.8"]
    assert rows[0].saved_ratio == 1.0 and rows[0].time_ratio == 1.0
    assert rows[1].saved_ratio < 1.0 and rows[1].saved_bytes < rows[0].saved_bytes
    assert rows[2].saved_ratio <= 0.8
    for r in rows:
        assert r.peak_bytes is None or r.peak_bytes >= 0  # tiny tensors can fit in already-resident heap
    text = bench.render(rows)
    assert "peak in step" in text and "budget=0.8" in text
    if measure.minor_faults() is not None:  # CPU inputs: each row has its step's page faults
        assert all(r.step_faults is not None and r.step_faults >= 0 for r in rows)
        assert "page faults/step" in text


def test_page_faults_are_a_column_only_where_counted():
    rows = [bench.Row("eager", 100, 100, 1.0, baseline=True), bench.Row("memory", 50, 60, 1.1, 0.5, 0.6, 1.1)]
    assert "page faults/step" not in bench.render(rows)
    rows[0].step_faults, rows[1].step_faults = 1200.0, 300.0
    lines = bench.render(rows).splitlines()
    assert lines[0].rstrip().endswith("page faults/step")
    assert lines[2].rstrip().endswith("1200") and lines[3].rstrip().endswith("300")
    assert bench.from_json(bench.to_json(rows))[1].step_faults == 300.0


def test_step_times_show_their_rounds_spread_where_measured():
    rows = [bench.Row("eager", 100, 100, 0.5, baseline=True, step_spread=0.04), bench.Row("memory", 50, 60, 0.6)]
    eager, memory_row = bench.render(rows).splitlines()[2:]
    assert "500 ms (IQR 4%)" in eager and "600 ms" in memory_row and "IQR" not in memory_row


def test_the_narrow_table_fits_100_columns():
    rows = [
        bench.Row("eager-channels_last", 2**30, 2**30, 12.5, peak_bytes=3 * 2**30, peak_ratio=1.0, baseline=True),
        bench.Row("budget=0.5,peak=0.95", 2**29, 2**29, 12.9, 0.5, 0.5, 1.032, 2**30, 1 / 3, step_spread=0.12),
        bench.Row("eager", 2**30, 2**30, 13.0, time_ratio=1.04),
    ]
    lines = bench.render_narrow(rows).splitlines()
    assert all(len(line) <= 100 for line in lines)
    assert lines[2].split() == ["eager-channels_last*", "1024.0", "MiB", "(1.000×)", "3072.0", "MiB", "(1.000×)"] + [
        "12500",
        "ms",
        "(1.000×)",
    ]
    assert "512.0 MiB (0.500×)" in lines[3] and "1024.0 MiB (0.333×)" in lines[3] and "IQR 12%" in lines[3]
    assert lines[4].split()[4] == "-" and "(1.040×)" in lines[4]  # no peak measured: no ratio


def test_allocator_peak_counts_tensors_whatever_the_c_allocator_keeps():
    """The bench's memory numbers count the allocator's bytes: freed and reused memory, or
    pages the C allocator keeps resident, do not change them."""

    def step():
        a = torch.ones(8 * 2**20 // 4)  # 8 MiB
        b = torch.ones(16 * 2**20 // 4)  # 16 MiB: 24 MiB held
        del a, b
        c = torch.ones(4 * 2**20 // 4)  # 4 MiB
        del c

    for _ in range(3):  # the same figure once glibc has the blocks in its free lists
        assert measure.step_allocated_peak_bytes(step) == 24 * 2**20
    net, x = small_net(), torch.randn(2, 3, 16, 16)
    held = measure.forward_allocated_bytes(net, (x,))
    assert held >= measure.saved_activation_bytes(net, (x,)) > 0
    assert measure.forward_allocated_bytes(net, (x,)) == held


def test_ratios_are_to_the_faster_eager_baseline_and_variants_run_in_their_layout():
    x = torch.randn(2, 3, 16, 16)
    fmt = torch.channels_last
    names = ["eager", "eager-channels_last", "memory"]
    variants = {name: bench.make_variant(name, small_net(), (x,), memory_format=fmt) for name in names}
    assert variants["eager"][0].weight.is_contiguous()
    assert variants["eager-channels_last"][0].weight.is_contiguous(memory_format=fmt)
    assert variants["memory"][0].weight.is_contiguous(memory_format=fmt)
    rows = bench.compare(variants, (x,), repeats=1, memory_format=fmt)
    baselines = [r for r in rows if r.baseline]
    assert len(baselines) == 1 and baselines[0].variant in ("eager", "eager-channels_last")
    assert baselines[0].time_ratio == 1.0 and baselines[0].saved_ratio == 1.0
    other = next(r for r in rows if r.variant in ("eager", "eager-channels_last") and not r.baseline)
    assert other.step_seconds >= baselines[0].step_seconds
    assert "(baseline)" in bench.render(rows)


def test_compile_budgets_are_compiled_separately_and_stay_exact():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.GELU(),
    )
    x = torch.randn(2, 3, 8, 8)
    loose, tight = (bench.make_variant(f"compile-budget={b}", model, (x,)) for b in (1.0, 0.05))
    saved = {b: measure.saved_activation_bytes(m, (x,)) for b, m in ((1.0, loose), (0.05, tight))}
    assert saved[0.05] < saved[1.0], saved
    eager = copy.deepcopy(model)
    for m in (eager, tight):
        m.train()
    torch.testing.assert_close(tight(x), eager(x), rtol=1e-4, atol=1e-5)


def _touch_fresh_pages(size: int) -> None:
    # An anonymous mapping: new pages whatever the heap already holds (malloc could reuse resident memory).
    block = mmap.mmap(-1, size)
    block.write(b"x" * size)
    block.close()


def test_step_peak_counts_memory_freed_before_the_step_ends():
    peak = measure.step_peak_bytes(lambda: _touch_fresh_pages(64 * 2**20))
    if peak is None:
        pytest.skip("this OS cannot reset the resident high-water mark")
    assert peak >= 60 * 2**20, peak


def test_cli_bench_json_with_peers(capsys):
    argv = [
        "bench",
        "tests.test_bench:small_net",
        "--input-shape",
        "2,3,16,16",
        "--modes",
        "fast,memory",
        "--budget",
        "0.8",
        "--with",
        "checkpoint",
        "--repeats",
        "1",
        "--json",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert [r["variant"] for r in result["rows"]] == [
        "eager",
        "eager-channels_last",
        "fast",
        "memory",
        "budget=0.8",
        "checkpoint",
    ]
    assert result["memory_format"] == "channels_last" and sum(r["baseline"] for r in result["rows"]) == 1
    assert result["amp"] is None  # no --amp
    assert result["reports"]["budget=0.8"]["budget_met"] is True
    assert "[fxfuse bench] timing train steps" in captured.err  # progress goes to stderr


def test_cli_bench_table_with_compile(capsys):
    argv = [
        "bench",
        "tests.test_bench:small_net",
        "--input-shape",
        "2,3,8,8",
        "--modes",
        "auto",
        "--with",
        "compile",
        "--repeats",
        "1",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "compile" in out and "auto: " in out and "train step" in out


def test_cli_bench_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "frontier.svg"
    argv = [
        "bench",
        "tests.test_bench:small_net",
        "--input-shape",
        "2,3,8,8",
        "--modes",
        "memory",
        "--memory-format",
        "contiguous",
        "--repeats",
        "1",
        "--plot",
        str(path),
    ]
    assert main(argv) == 0
    svg = path.read_text()
    assert svg.startswith("<?xml") and "eager-channels_last" in svg and "memory" in svg
    assert "variants in contiguous" in capsys.readouterr().out


def test_cli_bench_bad_mode_is_a_clear_error(capsys):
    assert main(["bench", "tests.test_bench:small_net", "--input-shape", "2,3,8,8", "--modes", "turbo"]) == 2
    assert "unknown mode 'turbo'" in capsys.readouterr().err


def test_cli_optimize_with_budget(capsys):
    assert main(["optimize", "tests.test_bench:small_net", "--input-shape", "2,3,16,16", "--budget", "0.8"]) == 0
    out = capsys.readouterr().out
    assert "memory budget 0.80× met" in out


def test_add_fit_fills_counted_and_measured_batches_with_ratios_to_the_baseline():
    model = small_net().to(memory_format=torch.channels_last)
    x = (torch.randn(2, 3, 16, 16),)
    names = ["eager", "eager-channels_last", "memory", "checkpoint"]
    variants = {n: bench.make_variant(n, model, x, memory_format=torch.channels_last) for n in names}
    rows = bench.compare(variants, x, repeats=1, memory_format=torch.channels_last)
    cap = measure.step_peak_bytes_meta(model, (torch.randn(32, 3, 16, 16),))
    bench.add_fit(rows, variants, x, cap, memory_format=torch.channels_last)
    by = {r.variant: r for r in rows}
    base = next(r for r in rows if r.baseline)
    for r in rows:
        # The allocator also sees what kernels use inside themselves, which the meta count cannot.
        assert 8 < r.fit_measured <= r.fit_counted, r
        assert r.fit_ratio == pytest.approx(r.fit_measured / base.fit_measured)
    assert by["memory"].fit_counted > 1.3 * by["eager-channels_last"].fit_counted
    assert by["memory"].fit_measured > by["eager-channels_last"].fit_measured
    table = bench.render(rows)
    assert "batch in cap (counted)" in table and "batch in cap (measured)" in table
    with pytest.raises(ConfigurationError, match="counted"):
        bench.add_fit(rows, variants, x, cap, ways=("guessed",))


def test_fit_hint_of_compiled_variants_is_what_they_compile():
    counted = {"eager-channels_last": 10, "budget=0.5": 20, "memory": 30}
    assert bench._fit_hint("compile-budget=0.5", counted, "eager-channels_last") == 20
    assert bench._fit_hint("compile(memory)", counted, "eager-channels_last") == 30
    assert bench._fit_hint("compile-budget=0.3(memory)", counted, "eager-channels_last") == 30
    assert bench._fit_hint("compile", counted, "eager-channels_last") == 10
    assert bench._fit_hint("memory", counted, "eager-channels_last") == 30


def test_cli_bench_fit_cap(capsys):
    argv = ["bench", "tests.test_bench:small_net", "--input-shape", "2,3,16,16", "--repeats", "1"]
    assert main([*argv, "--fit-cap", "8MiB", "--fit-by", "counted", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["fit_cap_bytes"] == 8 * 2**20
    assert all(r["fit_counted"] > 0 and r["fit_measured"] is None for r in result["rows"])
    assert main([*argv, "--fit-cap", "8MiB", "--with", "compile"]) == 0
    out = capsys.readouterr().out
    assert "batch in cap (measured)" in out and "8.00 MiB" not in out and "0.01 GiB" in out
    with pytest.raises(SystemExit):
        main([*argv, "--fit-cap", "lots"])
    assert "memory size" in capsys.readouterr().err


def test_compile_comparison_lines():
    rows = [
        bench.Row("compile", 400, 0, 2.0, peak_bytes=500),
        bench.Row("memory", 200, 0, 3.0, peak_bytes=300),
        bench.Row("compile(memory)", 180, 0, 2.1, peak_bytes=270),
    ]
    assert bench.compile_comparison(rows) == [
        "compile(memory): vs compile: time 1.050, saved 0.450, peak 0.540; "
        "vs fxfuse memory eager: time 0.700, saved 0.900, peak 0.900"
    ]


def test_compile_comparison_of_fxfuse_under_compiles_budget():
    rows = [
        bench.Row("compile-budget=0.5", 400, 0, 2.0, peak_bytes=500),
        bench.Row("compile-budget=0.5(fast)", 200, 0, 1.9, peak_bytes=450),
        bench.Row("compile-budget=0.3(fast)", 100, 0, 2.2, peak_bytes=400),  # no compile-budget=0.3 row
    ]
    assert bench.compile_comparison(rows) == [
        "compile-budget=0.5(fast): vs compile-budget=0.5: time 0.950, saved 0.500, peak 0.900"
    ]
    assert bench.budget_compiled_mode("compile-budget=0.25(memory)") == (0.25, "memory")
    assert bench.budget_compiled_mode("compile-budget=0.25") is None
    assert bench.budget_compiled_mode("compile(memory)") is None


def test_fxfuse_under_compiles_budget_is_exact_in_float64():
    """compile's knapsack recomputes the ops between fxfuse's; gradients and running statistics stay eager's."""
    torch._dynamo.reset()
    model = small_net().double()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    eager = copy.deepcopy(model)
    variant = bench.make_variant("compile-budget=0.1(fast)", model, (x,))
    assert isinstance(variant, bench.BudgetCompiled)
    assert variant.model.fxfuse_report.fused, "nothing fused: the test would compare compile with itself"
    for _ in range(2):
        for m in (eager, variant):
            m.zero_grad(set_to_none=True)
            m(x).square().sum().backward()
        for (name, p), q in zip(eager.named_parameters(), variant.model.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-12, msg=name)
        for (name, b), c in zip(eager.named_buffers(), variant.model.buffers()):
            torch.testing.assert_close(c, b, rtol=1e-9, atol=1e-12, msg=name)
    torch._dynamo.reset()


def test_compiled_fxfuse_variants_run_and_keep_their_flag():
    from fxfuse.ops import compiled

    torch._dynamo.reset()
    model, x = small_net(), torch.randn(2, 3, 8, 8)
    opaque = bench.make_variant("compile(memory)", model, (x,))
    composed = bench.make_variant("compile(memory,composed)", model, (x,))
    assert isinstance(composed, bench.ComposedCompiled) and not compiled.enabled
    for variant in (opaque, composed):
        torch.testing.assert_close(variant(x), model(x))
    assert not compiled.enabled
    torch._dynamo.reset()


def test_every_compiled_variant_compiles_with_the_backend_given():
    """tools/gpu_check.py's dry run compiles with aot_eager_decomp_partition on the CPU: each compiled
    variant passes `compile_backend` on to torch.compile (a recording backend sees each graph)."""
    model, x = small_net(), torch.randn(2, 3, 8, 8)
    seen = []

    def backend(gm, example_inputs):
        seen.append(name)
        return gm.forward

    names = ["compile", "compile-budget=0.5", "compile(fast)", "compile(fast,composed)", "compile-budget=0.5(fast)"]
    for name in names:
        torch._dynamo.reset()
        variant = bench.make_variant(name, model, (x,), compile_backend=backend)
        torch.testing.assert_close(variant(x), model(x))
    torch._dynamo.reset()
    assert set(seen) == set(names)


def _row(name, saved, peak, time):
    return bench.Row(name, 0, 0, 0.0, saved_ratio=saved, peak_ratio=peak, time_ratio=time)


def test_dominated_rows_name_a_row_no_worse_in_saved_peak_and_time():
    rows = [
        _row("eager", 1.0, 1.0, 1.0),
        _row("budget=0.5", 0.5, 0.6, 1.05),
        _row("budget=0.3", 0.3, 0.6, 1.30),
        _row("compile-budget=0.5", 0.25, 0.5, 1.10),  # beats budget=0.3 everywhere
        _row("budget=0.4", 0.5, 0.6, 1.05),  # equal to budget=0.5: not dominated
    ]
    assert bench.dominated(rows) == {"budget=0.3": "compile-budget=0.5"}
    # a row without a peak counts as the worst peak
    assert bench.dominated([_row("a", 0.5, None, 1.0), _row("b", 0.5, 0.9, 1.0)]) == {"a": "b"}


def test_cli_bench_frontier_sweeps_budgets_and_marks_the_front(capsys):
    argv = ["bench", "tests.test_bench:small_net", "--input-shape", "2,3,8,8", "--frontier", "0.6,0.3"]
    assert main(argv + ["--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "budget=0.6" in out and "budget=0.3" in out and "Pareto front" in out
    assert "front" in out.split("Pareto front", 1)[1]
    assert main(argv + ["--repeats", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["variant"] for r in rows} >= {"eager", "budget=0.6", "budget=0.3"}
    marks = bench.dominated([bench.Row(**{k: v for k, v in r.items() if k != "dominated_by"}) for r in rows])
    assert {r["variant"]: r["dominated_by"] for r in rows if r["dominated_by"]} == marks


def test_cli_bench_amp_runs_every_variant_and_plan_under_autocast(capsys):
    argv = ["bench", "tests.test_bench:small_net", "--input-shape", "2,3,16,16", "--repeats", "1", "--json"]
    argv += ["--budget", "0.5", "--with", "checkpoint", "--fit-cap", "8MiB", "--fit-by", "counted"]
    assert main([*argv, "--amp", "bf16"]) == 0
    amp = json.loads(capsys.readouterr().out)
    assert amp["amp"] == "bf16"  # without --amp it is None (test_cli_bench_json_with_peers)
    report = amp["reports"]["budget=0.5"]
    assert "bfloat16 autocast on cpu" in report["precision"] and report["budget_met"] is True
    rows = {r["variant"]: r for r in amp["rows"]}
    # Measured under autocast: eager keeps bf16 activations (and bf16 weight copies), and the budget holds there.
    x = torch.randn(2, 3, 16, 16).to(memory_format=torch.channels_last)
    model = small_net().to(memory_format=torch.channels_last)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert rows["eager-channels_last"]["saved_bytes"] == measure.saved_activation_bytes(model, (x,))
    # What the same bench measures without --amp: eager's float32 saved bytes (the eager row is contiguous).
    plain_eager = measure.saved_activation_bytes(small_net(), (torch.randn(2, 3, 16, 16),))
    assert rows["eager"]["saved_bytes"] < plain_eager
    assert rows["budget=0.5"]["saved_ratio"] <= 0.5 * 1.02
    assert all(r["fit_counted"] > 0 for r in rows.values())
    with pytest.raises(SystemExit):
        main([*argv, "--amp", "fp8"])
