"""fusion/report.py: the FusionReport rendered from the sites the passes found and the policy's Plan."""

import torch
from torch import nn

import fxfuse
from fxfuse.fusion.plan import Choice, Findings, Plan, SiteData, Skip
from fxfuse.fusion.regions import ranking
from fxfuse.fusion.regions.costs import LinkCost, RegionCost
from fxfuse.fusion.report import RegionChoice, render


def _found():
    upgrade = SiteData(
        ("c1", "b1", "r1"),
        ("conv2d", "batch_norm2d", "relu"),
        "fxfuse::conv_bn_act",
        "relu",
        True,
        400,
        9000,
        "keeps the conv input",
        "memory",
    )
    unknown = SiteData(
        ("c2", "b2"), ("conv2d", "batch_norm2d"), "fxfuse::conv_bn_act", "none", True, None, None, "", "memory"
    )
    inside = SiteData(
        ("blk.b", "blk.r"), ("batch_norm2d", "relu"), "fxfuse::batch_norm_act", "relu", False, 0, 0, "r", "memory"
    )
    fallback = SiteData(
        ("b3", "r3"), ("batch_norm2d", "relu"), "fxfuse::batch_norm_act", "relu", False, 0, 0, "", "memory"
    )
    skip = Skip(("c4", "b4"), ("conv2d", "batch_norm2d"), "the conv output has other users")
    return Findings([upgrade, unknown, inside, fallback], [skip], ["a note of the trace"])


def test_without_a_policy_the_sites_are_rendered_as_found():
    report = render("fast", _found(), layout="as given (preserve)")
    assert [s.pattern for s in report.fused][:2] == ["conv2d→batch_norm2d→relu", "conv2d→batch_norm2d"]
    assert [s.mode for s in report.fused] == ["memory"] * 4  # the passes' mode: no policy chose
    assert report.fused[0].reason == "keeps the conv input" and report.fused[0].recomputes
    assert [(s.modules, s.pattern, s.reason) for s in report.skipped] == [
        (("c4", "b4"), "conv2d→batch_norm2d", "the conv output has other users")
    ]
    assert report.notes == ["a note of the trace"] and report.layout == "as given (preserve)"
    assert report.budget is None and report.regions == [] and report.saved_bytes is None


def _entries():
    """Ranking entries (fusion/regions/ranking.py) on the sites of _found()."""
    upgrade, unknown, _, fallback = _found().sites
    rejected_site = SiteData(("c6", "b6"), ("conv2d", "batch_norm2d"), "fxfuse::conv_bn_act", recomputes=True)
    region_cost = RegionCost("blk", "block", ("blk.conv", "blk.b"), flops=5000, freed_bytes=300)
    return (
        ranking.Candidate(upgrade, [], 400, 22.0),
        ranking.Candidate(unknown, [], None, None),
        ranking.RegionCandidate(region_cost, "region", 5000 / 300),
        ranking.Candidate(rejected_site, [fallback], 300, 300.0),
        ranking.RegionCandidate(LinkCost("a", "b", 2_000_000, 4096), "link", 12.0),
    )


def test_the_choice_is_worded_from_data():
    c1, c2, region, c6, link = _entries()
    selection = ranking.Selection(frozenset(), {("b3", "r3")}, (("blk",),), [c1, c2], [region])
    choice = Choice(
        "budget",
        64.0,
        selection,
        chosen=[c1, c2, region],
        rejected=[c6, link],
        idle=[SiteData(("c5", "b5", "r5"), ("conv2d", "batch_norm2d", "relu"), "fxfuse::conv_bn_act")],
        budget=0.3,
        eager_bytes=1000,
        selected_bytes=250,
        notes=["a note of the policy"],
    )
    report = render("memory", _found(), Plan(frozenset(), choice=choice), notes=("a device note",))
    reasons = [s.reason for s in report.fused]
    assert reasons[0] == f"budget 0.30×: {c1.describe()}; keeps the conv input"
    assert c1.describe().startswith("22 FLOP/B")
    assert reasons[1] == "budget 0.30×: recompute cost unknown"
    assert reasons[2] == (
        "budget 0.30×: inside recomputed region blk, pointwise form (its conv is recomputed once, by the region); r"
    )
    assert reasons[3] == "budget 0.30×: pointwise recompute only"
    assert {s.mode for s in report.fused} == {"memory"}
    what = "block keeps only its inputs; backward runs its forward again (sites inside: pointwise form)"
    assert report.regions == [RegionChoice("blk", "block", 5000, 300, f"budget 0.30×: {region.describe()}; {what}")]
    skipped = [(s.name, s.pattern, s.reason) for s in report.skipped]
    assert skipped[1][:2] == ("c5 + b5 + r5", "conv2d→batch_norm2d→relu") and "free nothing" in skipped[1][2]
    assert skipped[2] == (
        "c6 + b6",
        "conv2d→batch_norm2d",
        f"recompute not chosen: {c6.describe()}, the budget is met without it",
    )
    assert skipped[3] == (
        "a→b",
        "link",
        f"link not recomputed: {link.describe()} (2.00 MFLOP for 4.0 KiB), the budget is met without it",
    )
    assert link.describe().startswith("12 FLOP/B")
    assert (report.budget, report.eager_saved_bytes, report.selected_saved_bytes, report.budget_met) == (
        0.3,
        1000,
        250,
        True,
    )
    assert report.notes[:2] == ["a note of the trace", "a note of the policy"]
    assert report.notes[2].startswith("memory budget 0.30× met: saved activations 250 B of eager's 1000 B (0.250×")
    assert report.notes[3] == "a device note"


def test_auto_says_its_limit():
    *_, c6, _ = _entries()
    choice = Choice("auto", 64.0, ranking.Selection(frozenset(), set(), ()), rejected=[c6])
    report = render("auto", Findings(), Plan(frozenset(), choice=choice))
    assert report.skipped[0].reason == (f"recompute not chosen: {c6.describe()}, above the auto limit of 64 FLOP/B")


def test_recomputing_is_what_a_site_costs_in_flops():
    """A site is an upgrade (recomputes a conv or a linear layer) exactly where it costs backward FLOPs:
    the flag comes from the pass that found it, not from its op's name."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),  # conv_bn_act
        nn.Conv2d(8, 8, 3, padding=1),
        nn.GELU(),  # conv_act
        nn.BatchNorm2d(8),
        nn.SiLU(),  # batch_norm_act
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 16),
        nn.GELU(),
        nn.Linear(16, 4),  # linear_act, or act_linear
    )
    x = torch.randn(2, 3, 8, 8)
    for mode in ("memory", "fast"):
        fused = fxfuse.explain(model, x, mode=mode).fused
        assert fused and all(s.recomputes == (s.recompute_flops > 0) for s in fused), (mode, fused)
    assert {s.op for s in fxfuse.explain(model, x).fused if s.recomputes} >= {"fxfuse::conv_bn_act", "fxfuse::conv_act"}
