"""The memory/time plane of `fxfuse bench` runs: one panel per run, a series per family of variants.

Each variant is drawn twice at its step-time ratio: its saved-for-backward ratio (filled circle) and
its step-peak ratio (hollow triangle), in its family's colour. Points another row of the same run
dominates (`bench.dominated`: no more memory on either axis and no slower) are drawn faint; a
family's other points are joined in order of time, so a sweep of budgets reads as its front.
"""

from __future__ import annotations

from typing import Sequence

from .bench import Row, dominated
from .errors import ConfigurationError

# (label, test on the variant name); the first that matches names the family
FAMILIES = (
    ("torch.compile(fxfuse)", lambda v: v.startswith("compile(")),
    ("torch.compile, activation_memory_budget", lambda v: v.startswith("compile-budget=")),
    ("fxfuse", lambda v: v in ("fast", "memory", "auto") or v.startswith(("budget=", "peak-budget="))),
    ("eager", lambda v: v.startswith("eager")),
)
COLOURS = {"fxfuse": "tab:blue", "torch.compile, activation_memory_budget": "tab:orange"}


def family(variant: str) -> str:
    """The series a variant is drawn in: one of FAMILIES' labels, else the variant's own name."""
    return next((label for label, test in FAMILIES if test(variant)), variant)


def label(variant: str) -> str:
    """The short tag written beside a point: a budget's value, or the variant's name."""
    for prefix in ("compile-budget=", "budget="):
        if variant.startswith(prefix):
            return variant[len(prefix) :]
    return variant


def plot_fronts(panels: Sequence[tuple[str, Sequence[Row]]], path: str) -> None:
    """Draws each (title, rows) run as a panel of one figure at `path` (.svg, .png, .pdf).

    Needs matplotlib (`pip install 'fxfuse[plot]'`).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigurationError("plotting needs matplotlib: pip install 'fxfuse[plot]'") from None
    if not panels:
        raise ConfigurationError("nothing to plot: give at least one bench run")
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.6), squeeze=False)
    for ax, (title, rows) in zip(axes[0], panels):
        _panel(ax, title, list(rows))
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def _panel(ax, title: str, rows: list[Row]) -> None:
    marks = dominated(rows)
    base = next((r.variant for r in rows if r.baseline), rows[0].variant)
    series: dict[str, list[Row]] = {}
    for r in rows:
        series.setdefault(family(r.variant), []).append(r)
    cycle = iter(f"C{i}" for i in range(2, 10))
    for name, members in series.items():
        colour = COLOURS.get(name) or ("black" if name == "eager" else next(cycle))
        front = sorted((r for r in members if r.variant not in marks), key=lambda r: r.time_ratio)
        if name != "eager" and len(front) > 1:
            ax.plot([r.time_ratio for r in front], [r.saved_ratio for r in front], color=colour, linewidth=0.8)
        for r in members:
            alpha = 0.3 if r.variant in marks else 1.0
            ax.scatter(r.time_ratio, r.saved_ratio, color=colour, marker="o", s=22, alpha=alpha)
            if r.peak_ratio is not None:
                ax.scatter(
                    r.time_ratio, r.peak_ratio, facecolors="none", edgecolors=colour, marker="^", s=26, alpha=alpha
                )
            ax.annotate(
                label(r.variant),
                (r.time_ratio, r.saved_ratio),
                textcoords="offset points",
                xytext=(3, 3),
                fontsize=6,
                color=colour,
                alpha=alpha,
            )
        ax.scatter([], [], color=colour, marker="o", s=22, label=name)
    ax.scatter([], [], facecolors="none", edgecolors="grey", marker="^", s=26, label="step peak (same colour)")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.axvline(1.0, color="grey", linewidth=0.5)
    ax.set_xlabel(f"train step time (ratio to {base})")
    ax.set_ylabel("saved for backward ● / step peak △ (ratio)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
