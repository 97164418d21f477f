"""fusion/wording.py: the report's words for the policy's choice, from the Choice's data (the entries of
the ranking) and from what the policy counted."""

from fxfuse.fusion import wording
from fxfuse.fusion.plan import Choice, SiteData
from fxfuse.fusion.regions import ranking
from fxfuse.fusion.regions.costs import LinkCost, RegionCost
from fxfuse.measure import PeakParts


def _site(*names):
    return SiteData(names, ("conv2d", "batch_norm2d"), "fxfuse::conv_bn_act", recomputes=True)


def test_units():
    assert [wording.format_bytes(n) for n in (None, 1000, 4096, 3 * 2**20, 5 * 2**30, 2**42)] == [
        "-",
        "1000 B",
        "4.0 KiB",
        "3.0 MiB",
        "5.0 GiB",
        "4096.0 GiB",
    ]
    assert [wording.format_flops(n) for n in (None, 12, 2_000, 2_000_000, 3e9)] == [
        "-",
        "12 FLOP",
        "2.00 kFLOP",
        "2.00 MFLOP",
        "3.00 GFLOP",
    ]


def test_the_limit_names_what_decided():
    assert wording.limit(Choice("auto", 64.0)) == "auto: ≤ 64 FLOP/B"
    assert wording.limit(Choice("memory", 64.0)) == "memory: frees bytes beyond its pointwise form"
    assert wording.limit(Choice("budget", budget=0.3)) == "budget 0.30×"
    assert wording.limit(Choice("budget", budget=0.3, peak_budget=0.5)) == "budget 0.30×, peak budget 0.50×"
    assert wording.limit(Choice("budget", peak_budget=0.5)) == "peak budget 0.50×"


def _choice_of(chosen, *, flat_links=frozenset(), rejected=()):
    regions = [e for e in chosen if e.kind == "region"]
    links = [e for e in chosen if e.kind == "link"]
    rebuild = next((e for e in chosen if e.kind == "rebuild"), None)
    selection = ranking.Selection(frozenset(), set(), (), [], regions, links, flat_links, rebuild)
    return Choice("budget", 64.0, selection, list(chosen), list(rejected), budget=0.3)


def test_a_row_per_region_link_and_rebuild_that_runs():
    a = ranking.RegionCandidate(RegionCost("a", "block", ("a.c",), flops=6000, freed_bytes=300), "region", 20.0)
    b = ranking.RegionCandidate(RegionCost("b", "run", ("b.c",), flops=3000, freed_bytes=200), "region", 15.0)
    link = ranking.RegionCandidate(LinkCost("a", "b", 6000, 100), "link", 60.0)
    rebuild = ranking.rebuild_candidate(500, 1000, 4)
    rows = wording.region_rows(_choice_of([rebuild, a, b, link]))
    assert [(r.name, r.kind, r.recompute_flops, r.saved_bytes) for r in rows] == [
        ("BN→activation outputs", "rebuild", 0, 500),
        ("a", "block", 6000, 300),
        ("b", "run", 3000, 200),
        ("a→b", "link", 6000, 100),
    ]
    assert rows[0].reason.startswith(f"budget 0.30×: {rebuild.describe()}; the ops that keep a BatchNorm")
    assert rows[1].reason == (
        f"budget 0.30×: {a.describe()}; block keeps only its inputs; backward runs its forward again "
        "(sites inside: pointwise form)"
    )
    assert (
        rows[3].reason == f"budget 0.30×: {link.describe()}; chains a and b: backward runs a again to rebuild b's input"
    )
    flat = wording.region_rows(_choice_of([a, b, link], flat_links=frozenset({("a", "b")})))[2]
    assert (flat.recompute_flops, flat.saved_bytes) == (0, 100)
    assert flat.reason.startswith("budget 0.30×: chains a and b, flat: one recompute runs both")


def test_an_inner_region_replaced_by_one_around_it_has_no_row():
    outer = ranking.RegionCandidate(
        RegionCost("a", "block", ("a.c",), 9000, 900, nodes=frozenset("xy")), "region", 10.0
    )
    inner = ranking.RegionCandidate(RegionCost("a.c", "block", ("a.c",), 100, 90, nodes=frozenset("x")), "region", 1.0)
    choice = _choice_of([inner, outer])
    choice.selection.regions.remove(inner)  # ranking.select keeps the outermost
    assert [r.name for r in wording.region_rows(choice)] == ["a"]


def test_a_row_per_entry_not_taken():
    upgrade = ranking.Candidate(_site("c", "b"), [], 400, 300.0)
    link = ranking.RegionCandidate(LinkCost("a", "b", 2_000_000, 4096), "link", 12.0)
    rows = wording.rejected_rows(_choice_of([], rejected=[upgrade, link]))
    assert rows == [
        wording.Rejected(("c", "b"), ("conv2d", "batch_norm2d"), 300.0, cost=upgrade.describe()),
        wording.Rejected(("a→b",), ("link",), 12.0, True, 2_000_000, 4096, link.describe()),
    ]


def test_the_peak_floor_says_what_it_consists_of_where_counted():
    choice = Choice("budget", peak_budget=0.4, eager_peak_bytes=1000, selected_peak_bytes=600)
    bare = wording.peak_floor(choice, 3, 10, None)
    assert bare == (
        "peak budget 0.40× is not reachable: the lowest step peak the ranking reaches is 0.600× of eager's "
        "(600 B), first reached with 3 of its 10 entries; more recompute does not lower it, so fxfuse stopped there"
    )
    parts = PeakParts(600, 100, 300, 200, 50)
    assert wording.peak_floor(choice, 3, 10, parts) == (
        f"{bare}. At that peak: parameters' gradients 100 B, backward transient (activation gradients and "
        "recomputed tensors) 200 B, activations the forward still holds 300 B; the inputs (50 B) are held "
        "besides. Recompute lowers only the activations held; the rest is the floor"
    )


def test_the_estimated_cost_and_the_nearest_cheaper_point():
    choice = Choice("budget", budget=0.3, eager_bytes=1000, selected_bytes=250)
    alone = wording.estimated_cost(choice, 1.2, 1.5, None, 0.0)
    assert alone.startswith("estimated cost: 0.250× costs 1.20× (saved activations and step time × eager's")
    assert "a region's weighted 1.5×)" in alone
    priced = wording.estimated_cost(choice, 1.2, 1.5, None, 0.0, 80)
    assert "a region's weighted 1.5×, plus 80 ops for its checkpoint call)" in priced
    cheaper = wording.estimated_cost(choice, 1.2, 1.5, 301, 1.1)
    assert cheaper.startswith("nearest cheaper point: 0.250× costs 1.20×; 0.301× costs 1.10× (memory_budget=0.31;")


def test_the_policys_other_notes():
    assert wording.not_rebuilt("X", True) == "X: not rebuilt, the step peak is within the peak budget without it"
    assert wording.not_rebuilt("X", False).endswith(
        "the regions and layers recomputed in this plan cover what it would rebuild"
    )
    assert wording.no_regions(None) == "no recompute regions: the model is not traced as one graph"
    assert wording.no_regions(ValueError("v")).endswith("on the meta device raised ValueError: v")
    assert (
        wording.no_rebuild(KeyError("k"))
        == "no rebuilt activations: counting them on the meta device raised KeyError: 'k'"
    )
    assert wording.uncounted(RuntimeError("r")).startswith("could not count the selection's saved activations")
    assert wording.took_more(2, 5, 0.61, 0.55).startswith("took 2 more of the ranking's entries than the budget needs")
    assert "0.610× of eager's, above the 0.550×" in wording.peak_raised(0.61, 0.55)
    choice = Choice("budget", budget=0.1, eager_bytes=1000, selected_bytes=400)
    assert wording.unreachable(choice, 7, 9).startswith("memory budget 0.10× is not reachable: the least the ranking")
    assert (
        wording.saved_beside(choice) == "saved activations 400 B of eager's 1000 B (0.400×, counted on the meta device)"
    )
