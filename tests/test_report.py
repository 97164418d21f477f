"""fusion/report.py: the FusionReport rendered from the sites the passes found and the policy's Plan."""

import pytest
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


def test_sites_that_may_not_save_under_autocast_are_named_there():
    bn_conv = SiteData(("b5", "r5"), ("batch_norm2d", "relu"), "fxfuse::bn_act_conv", "relu", False, 8, 0, "", "memory")
    cat = SiteData(("cat",), ("cat",), "fxfuse::cat_bn_act_conv", "", False, 16, 0, "", "memory")
    found = _found()
    found.sites.extend([bn_conv, cat])
    report = render("memory", found)
    assert [s.under_autocast != "" for s in report.fused] == [False] * 4 + [True, True]
    assert "batch_norm_act, then the conv" in report.fused[4].under_autocast
    assert "not the concatenation's pieces" in report.fused[5].under_autocast
    assert report.to_dict()["fused"][4]["under_autocast"] == report.fused[4].under_autocast
    assert not any("autocast" in n for n in report.notes)  # made outside autocast: no note
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = render("memory", found)
    (note,) = [n for n in report.notes if "autocast" in n]
    assert note.startswith("under torch.autocast, 2 fused site(s) may not save") and "b5 + r5, cat" in note
    found.sites[4:] = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not any("autocast" in n for n in render("memory", found).notes)


# ---------------------------------------------------------------- 100 columns


def _long_found():
    """Sites with names and reasons far wider than a terminal."""
    long = tuple(f"encoder.stages.{i}.blocks.{i}.very_long_module_name_{'x' * 30}" for i in range(3))
    reason = "keeps the conv input; " + "a reason that goes on and on " * 12
    site = SiteData(long, ("conv2d", "batch_norm2d", "relu"), "fxfuse::conv_bn_act", "relu", True, 4096, 9000, reason)
    skip = Skip((long[1], "decoder." + "y" * 80), ("conv2d", "batch_norm2d"), "a skip reason that is long " * 10)
    return Findings([site], [skip], ["a note " * 40]), long, reason


def test_every_line_fits_100_columns_and_explain_gives_the_whole_reason():
    found, long, reason = _long_found()
    report = render("memory", found, layout="channels_last (memory_format='channels_last') " * 3)
    lines = str(report).splitlines()
    assert lines[0].startswith("fxfuse report (mode=memory): 1 sites fused") and "1 skipped" in lines[0]
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)
    assert "keeps the conv input" in str(report) and reason not in str(report)  # the short form only
    full = report.explain(" + ".join(long))
    assert " ".join(reason.split()) in " ".join(full.split()) and all(len(line) <= 100 for line in full.splitlines())
    by_module = report.explain(long[1])  # a module names every entry that holds it: the site and the skip
    assert by_module.startswith(full) and "skipped " in by_module
    assert ("a skip reason that is long " * 10).strip() in " ".join(by_module.split())
    with pytest.raises(KeyError, match="no site"):
        report.explain("not.a.module")


def _check_width(report):
    text = str(report)
    too_wide = [line for line in text.splitlines() if len(line) > 100]
    assert not too_wide, "\n".join(too_wide)
    assert all(len(line) <= 100 for line in report.details().splitlines())
    for site in [*report.fused, *report.skipped, *report.covered]:
        # the full reason is on demand, whatever the table shows
        assert " ".join(site.reason.split()) in " ".join(report.explain(site.name).split())
    return text


def _resnet18():
    import torchvision

    return torchvision.models.resnet18()


def _resnet50():
    import torchvision

    return torchvision.models.resnet50()


def _convnext():
    import timm

    return timm.create_model("convnext_atto", pretrained=False, num_classes=10)


@pytest.mark.parametrize(
    "build, options",
    [
        (_resnet18, {"mode": "memory"}),
        (_resnet18, {"mode": "fast"}),
        (_resnet18, {"mode": "auto"}),
        (_resnet50, {"mode": "memory", "memory_format": "channels_last"}),
        (_resnet18, {"memory_budget": 0.5, "peak_budget": 0.9}),
        (_convnext, {"mode": "memory"}),
        (_convnext, {"mode": "fast"}),
        (_convnext, {"mode": "auto", "memory_budget": 0.6}),
    ],
    ids=[
        "resnet18-memory",
        "resnet18-fast",
        "resnet18-auto",
        "resnet50-memory-cl",
        "resnet18-budget",
        "convnext-memory",
        "convnext-fast",
        "convnext-budget",
    ],
)
def test_real_reports_fit_100_columns(build, options):
    torch.manual_seed(0)
    report = fxfuse.explain(build(), torch.randn(2, 3, 64, 64), **options)
    text = _check_width(report)
    assert text.splitlines()[0].startswith(f"fxfuse report (mode={report.mode}): {len(report.fused)} sites fused")
    assert "fused per op: " in text and "recompute in backward: " in text
    if report.budget is not None:
        assert f"memory budget {report.budget:.2f}× {'met' if report.budget_met else 'NOT met'}" in text


def test_sites_another_op_covers_are_not_skipped():
    """ResNet-18 in memory mode: each conv1→bn1→relu of a block runs as ATen's conv with its BN→ReLU
    merged into conv2 (bn_act_conv); the report counts these 8 as covered, not skipped."""
    report = fxfuse.explain(_resnet18(), torch.randn(2, 3, 64, 64))
    assert not report.skipped and len(report.covered) == 8
    fused = {s.name: s for s in report.fused}
    for c in report.covered:
        assert c.modules[0].endswith("conv1") and c.op == "fxfuse::bn_act_conv"
        assert fused[c.by].op == c.op and set(c.modules[1:]) <= set(fused[c.by].modules)
        assert "free nothing" in report.explain(c.name)
    text = _check_width(report)
    assert text.splitlines()[0] == "fxfuse report (mode=memory): 21 sites fused, 8 covered, 0 skipped"
    assert "\nskipped " not in text and "layer1.0.conv1" not in text  # no row: counted in the summary
    assert "covered, not skipped: 8 sites run in another fused site (8 in bn_act_conv)" in text
