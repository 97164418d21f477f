import json
import runpy
from pathlib import Path

import pytest

from fxfuse import bench, plot
from fxfuse.bench import Row
from fxfuse.errors import ConfigurationError


def _rows():
    def row(variant, saved, peak, time, baseline=False):
        return Row(variant, 0, 0, 0.0, saved_ratio=saved, time_ratio=time, peak_ratio=peak, baseline=baseline)

    return [
        row("eager-channels_last", 1.0, 1.0, 1.0, baseline=True),
        row("budget=0.5", 0.49, 0.55, 0.98),
        row("budget=0.3", 0.27, 0.37, 1.13),
        row("budget=0.25", 0.30, 0.40, 1.20),  # dominated by budget=0.3
        row("compile-budget=0.5", 0.46, 0.58, 1.02),
    ]


def test_families_group_a_runs_variants_into_series():
    assert plot.family("budget=0.3") == plot.family("memory") == plot.family("peak-budget=0.5") == "fxfuse"
    assert plot.family("compile-budget=0.5") == "torch.compile, activation_memory_budget"
    assert plot.family("compile(budget=0.5)") == "torch.compile(fxfuse)"
    assert plot.family("eager") == plot.family("eager-channels_last") == "eager"
    assert plot.family("checkpoint") == "checkpoint"
    assert plot.label("budget=0.25") == plot.label("compile-budget=0.25") == "0.25"
    assert plot.label("checkpoint") == "checkpoint"


def test_plot_fronts_draws_one_panel_per_run(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "fronts.svg"
    plot.plot_fronts([("model A", _rows()), ("model B", _rows()[:3])], str(path))
    svg = path.read_text()
    assert svg.startswith("<?xml")
    assert "model A" in svg and "model B" in svg
    assert "torch.compile, activation_memory_budget" in svg and "fxfuse" in svg


def test_plot_fronts_needs_a_run():
    pytest.importorskip("matplotlib")
    with pytest.raises(ConfigurationError, match="nothing to plot"):
        plot.plot_fronts([], "unused.svg")


def test_rows_survive_a_json_round_trip():
    rows = _rows()
    written = bench.to_json(rows)
    assert written[3]["dominated_by"] == "budget=0.3"
    assert bench.from_json(written) == rows


def test_the_readme_figure_redraws_from_the_runs_kept_in_docs(tmp_path):
    pytest.importorskip("matplotlib")
    root = Path(__file__).resolve().parents[1]
    runs = sorted((root / "docs" / "fronts").glob("*.json"))
    assert len(runs) == 3
    for path in runs:
        rows = bench.from_json(json.loads(path.read_text())["rows"])
        assert any(r.baseline for r in rows) and any(r.variant.startswith("compile-budget=") for r in rows)
    out = tmp_path / "fronts.svg"
    script = runpy.run_path(str(root / "benchmarks" / "plot_fronts.py"))
    script["main"]([str(out), *map(str, runs)])
    assert "densenet121" in out.read_text()
