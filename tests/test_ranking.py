"""fusion/regions/ranking.py: one ranking of upgrades, regions and links; what a prefix selects."""

import pytest

from fxfuse.fusion.plan import SiteData
from fxfuse.fusion.regions import ranking, time_model
from fxfuse.fusion.regions.costs import LinkCost, Profile, RegionCost


def _upgrade(conv, bn, ratio, marginal=100):
    site = SiteData((conv, bn), ("conv2d", "batch_norm2d"), "fxfuse::conv_bn_act", recomputes=True)
    pointwise = SiteData((bn, "relu"), ("batch_norm2d", "relu"), "fxfuse::batch_norm_act", "relu")
    return ranking.Candidate(site, [pointwise], marginal, ratio), pointwise


def _nodes(prefix, n, start=0):
    return frozenset(f"{prefix}_{i}" for i in range(start, start + n))


def _profile():
    regions = [
        RegionCost("a", "block", ("a.conv1", "a.bn1"), flops=1000, freed_bytes=100, nodes=_nodes("a", 4)),  # 10 FLOP/B
        RegionCost("b", "block", ("b.conv1", "b.bn1"), flops=4000, freed_bytes=100, nodes=_nodes("b", 4)),  # 40 FLOP/B
    ]
    return Profile(regions, [LinkCost("a", "b", flops=1000, freed_bytes=200)], {})  # 5 FLOP/B


@pytest.fixture
def unweighted(monkeypatch):
    """Regions costed by their ops' time alone, as the per-site upgrades are (the ordering logic)."""
    monkeypatch.setattr(ranking, "REGION_TIME_COST", 1.0)
    monkeypatch.setattr(ranking, "REGION_CALL_OPS", 0)


def test_one_list_cheapest_first_and_a_link_after_its_regions(unweighted):
    inside_b, _ = _upgrade("b.conv1", "b.bn1", 20.0)
    inside_a, _ = _upgrade("a.conv1", "a.bn1", 30.0)  # after region a: dropped
    outside, _ = _upgrade("c.conv1", "c.bn1", 50.0)
    ranked = ranking.rank([inside_b, inside_a, outside], _profile())
    assert [e.name for e in ranked] == ["a", "b.conv1 + b.bn1", "b", "a→b", "c.conv1 + c.bn1"]


def test_a_prefix_selects_pointwise_sites_inside_chosen_regions_and_chains_links(unweighted):
    inside_b, pointwise_b = _upgrade("b.conv1", "b.bn1", 20.0)
    outside, pointwise_c = _upgrade("c.conv1", "c.bn1", 50.0)
    ranked = ranking.rank([inside_b, outside], _profile())
    order = ["a", "b"]
    pointwise = [pointwise_b, pointwise_c]

    two = ranking.select(ranked[:2], pointwise, order)  # region a, upgrade in b
    assert two.groups == (("a",),)
    assert ("b.conv1", "b.bn1") in two.allowed and ("c.bn1", "relu") in two.allowed

    three = ranking.select(ranked[:3], pointwise, order)  # + region b: its upgrade no longer applies
    assert three.groups == (("a",), ("b",))
    assert ("b.conv1", "b.bn1") not in three.allowed and ("b.bn1", "relu") in three.allowed

    four = ranking.select(ranked[:4], pointwise, order)  # + link a→b
    assert four.groups == (("a", "b"),)
    gains = [ranking.estimated_gain(ranking.select(ranked[:k], pointwise, order)) for k in range(len(ranked) + 1)]
    assert gains == sorted(gains)


def test_a_functional_site_belongs_to_its_blocks_scope():
    region = RegionCost("layer1.0", "block", ("layer1.0.conv1",), 1, 1)
    assert ranking.site_in_region(("layer1.0.conv1", "layer1.0:batch_norm"), region)
    assert ranking.site_in_region(("layer1.0.sub:conv2d",), region)
    assert not ranking.site_in_region(("layer1.01.conv1",), region)


def test_region_time_weighs_more_than_a_sites(monkeypatch):
    """A region's recompute second costs REGION_TIME_COST times a site's (measured): at 2.5, region "a"
    at 10 FLOP/B ranks after an upgrade at 20 FLOP/B; at 1.5 before it. The displayed ratio stays its own."""
    upgrade, _ = _upgrade("c.conv1", "c.bn1", 20.0)
    monkeypatch.setattr(ranking, "REGION_CALL_OPS", 0)
    monkeypatch.setattr(ranking, "REGION_TIME_COST", 2.5)
    ranked = ranking.rank([upgrade], _profile())
    assert [e.name for e in ranked][:2] == ["c.conv1 + c.bn1", "a"]
    assert ranked[1].describe() == f"10 FLOP/B, est. {2.5 * time_model.seconds(1000) * 1e3:.2f} ms"
    monkeypatch.setattr(ranking, "REGION_TIME_COST", 1.5)
    assert [e.name for e in ranking.rank([upgrade], _profile())][:2] == ["a", "c.conv1 + c.bn1"]


def test_a_region_pays_for_its_checkpointed_call(monkeypatch):
    """Each region runs as one checkpoint call, whose host cost does not shrink with the region: a 0-FLOP
    chain that frees a few KiB ranks after an upgrade that recomputes a small conv for as many bytes, and
    a link (its chain's wrapping call) pays it too. A rebuild runs inside the fused ops: no call."""
    monkeypatch.setattr(ranking, "REGION_TIME_COST", 1.0)
    freed = 16 * 1024
    chain = RegionCost("c.bn…c.relu", "chain", ("c.bn", "c.relu"), 0, freed, nodes=_nodes("c", 2), moved=5 * freed)
    upgrade, _ = _upgrade("d.conv", "d.bn", 64.0, marginal=freed)  # a 1x1 conv, 1 MFLOP
    call = time_model.seconds(0, 0, ranking.REGION_CALL_OPS)
    assert call == pytest.approx(ranking.REGION_CALL_OPS * time_model.OP_SECONDS) and call > 1e-4
    ranked = ranking.rank([upgrade], Profile([chain], [], {}))
    assert [e.name for e in ranked] == ["d.conv + d.bn", "c.bn…c.relu"]
    assert ranked[1].seconds == pytest.approx(time_model.seconds(0, 5 * freed) + call)
    link = ranking.RegionCandidate(LinkCost("a", "b", flops=1000, freed_bytes=200), "link", 5.0)
    assert link.seconds == pytest.approx(time_model.seconds(1000) + call)
    rebuild = ranking.rebuild_candidate(freed, moved=2 * freed, ops=3)
    assert rebuild.seconds == pytest.approx(time_model.seconds(0, 2 * freed, 3))
    monkeypatch.setattr(ranking, "REGION_CALL_OPS", 0)  # without it, the chain came first
    assert [e.name for e in ranking.rank([upgrade], Profile([chain], [], {}))] == ["c.bn…c.relu", "d.conv + d.bn"]


def test_bytes_moved_cost_time_like_flops(unweighted):
    """The time model prices what FLOPs miss: a chain of pointwise ops (0 FLOPs) that moves bytes is not
    free, and a region whose recompute moves many bytes per byte it frees (BN statistics, BN-apply and
    ReLU over a few channels at high resolution) ranks after one of the same FLOPs that moves few."""
    moved_per_flop = time_model.SECONDS_PER_FLOP / time_model.SECONDS_PER_BYTE
    flops = 100_000
    busy = RegionCost(
        "busy", "block", ("b.conv",), flops, 100, nodes=_nodes("b", 3), moved=int(2 * flops * moved_per_flop)
    )
    lean = RegionCost("lean", "block", ("l.conv",), flops, 100, nodes=_nodes("l", 3), moved=0)
    chain = RegionCost("c.bn…c.relu", "chain", ("c.bn", "c.relu"), 0, 100, nodes=_nodes("c", 2), moved=400)
    ranked = ranking.rank([], Profile([busy, lean, chain], [], {}))
    assert [e.name for e in ranked] == ["c.bn…c.relu", "lean", "busy"]
    assert ranked[0].seconds == pytest.approx(400 * time_model.SECONDS_PER_BYTE)
    assert ranked[2].seconds == pytest.approx(3 * ranked[1].seconds, rel=1e-3)
    assert ranked[0].describe().startswith("0 FLOP/B, 4.0 B moved/B, est. ")


def test_an_upgrade_pays_for_the_bytes_its_recompute_moves(unweighted):
    """Two upgrades at the same FLOPs per byte: the one whose conv reads and writes more per byte it
    frees (few channels, high resolution) ranks second."""
    few, _ = _upgrade("a.conv", "a.bn", 72.0)
    many, _ = _upgrade("b.conv", "b.bn", 72.0)
    few.site.recompute_bytes = 300
    many.site.recompute_bytes = 0
    assert [e.name for e in ranking.rank([few, many], None)] == ["b.conv + b.bn", "a.conv + a.bn"]
    assert few.seconds == pytest.approx(time_model.seconds(7200, 300))
    assert few.describe() == f"72 FLOP/B, 3.0 B moved/B, est. {few.seconds * 1e3:.2f} ms"


def test_an_inner_region_gives_way_to_its_block(unweighted):
    """DenseNet's layers are regions inside their dense block's: a block chosen later replaces them, and one
    ranked before them makes them idle (dropped)."""
    inner = [
        RegionCost("a.l1", "block", ("a.l1.conv",), 100, 100, "a", _nodes("a", 2)),  # 1 FLOP/B
        RegionCost("a.l2", "block", ("a.l2.conv",), 2000, 100, "a", _nodes("a", 2, 2)),  # 20 FLOP/B
    ]
    profile = _profile()
    profile.regions += inner
    ranked = ranking.rank([], profile)
    assert [e.name for e in ranked] == ["a.l1", "a", "b", "a→b"]  # a.l2 after its block: dropped
    order = [r.name for r in profile.regions]
    assert ranking.select(ranked[:1], [], order).groups == (("a.l1",),)
    assert ranking.select(ranked[:2], [], order).groups == (("a",),)


def test_nested_inner_regions_give_way_to_any_region_around_them(unweighted):
    """Inner regions nest (VoVNet's `conv_mid.0` in `conv_mid` in the block): the outermost chosen one is
    recomputed, and one ranked after any region around it is dropped."""
    nested = [
        RegionCost("a.mid.0", "block", ("a.mid.0.conv",), 100, 100, "a.mid", _nodes("a", 1)),  # 1 FLOP/B
        RegionCost("a.mid", "block", ("a.mid.0.conv", "a.mid.1.conv"), 400, 200, "a", _nodes("a", 2)),
        RegionCost("a.mid.1", "block", ("a.mid.1.conv",), 3000, 100, "a.mid", _nodes("a", 1, 1)),  # 30 FLOP/B
    ]
    profile = _profile()
    profile.regions += nested
    ranked = ranking.rank([], profile)
    assert [e.name for e in ranked] == ["a.mid.0", "a.mid", "a", "b", "a→b"]  # a.mid.1 after a.mid: dropped
    order = [r.name for r in profile.regions]
    assert ranking.select(ranked[:2], [], order).groups == (("a.mid",),)
    assert ranking.select(ranked[:3], [], order).groups == (("a",),)
    assert not ranking.encloses(nested[0], nested[1]) and ranking.encloses(profile.regions[0], nested[0])


def test_a_region_across_the_edge_of_one_ranked_before_it_is_dropped(unweighted):
    """A chain straddling two inner regions cannot be recomputed with either: the cheaper one per byte stays."""
    chain = RegionCost("a.x…a.y", "chain", ("a.x", "a.y"), 0, 50, "a", _nodes("a", 2, 1))
    inner = RegionCost("a.y", "block", ("a.y",), 500, 100, "a", _nodes("a", 2, 2))
    profile = _profile()
    profile.regions += [inner, chain]
    assert [e.name for e in ranking.rank([], profile)] == ["a.x…a.y", "a", "b", "a→b"]


def test_what_a_region_encloses_and_costs_less_in_all_comes_before_it(unweighted):
    """A whole stage frees more per FLOP than any block in it (CSP's `stages.0`), but a budget that needs
    a little more than what comes before should take one block, not the stage. The block is ranked
    first; where the budget needs the stage's bytes, the stage replaces it, so no prefix recomputes more."""
    stage = RegionCost("s", "block", ("s.b0.conv", "s.b1.conv"), 10_000, 1000, nodes=_nodes("s", 8))  # 10 FLOP/B
    blocks = [
        RegionCost("s.b0", "block", ("s.b0.conv",), 3000, 200, "s", _nodes("s", 4)),  # 15 FLOP/B, 3000 in all
        RegionCost("s.b1", "block", ("s.b1.conv",), 12_000, 400, "s", _nodes("s", 4, 4)),  # more than the stage
    ]
    upgrade, pointwise = _upgrade("s.b0.conv", "s.b0.bn", 20.0, marginal=50)  # 1000 FLOPs in all
    other, _ = _upgrade("c.conv1", "c.bn1", 12.0)
    ranked = ranking.rank([other, upgrade], Profile([stage, *blocks], [], {}))
    assert [e.name for e in ranked] == ["s.b0.conv + s.b0.bn", "s.b0", "s", "c.conv1 + c.bn1"]
    order = ["s", "s.b0", "s.b1"]
    assert ranking.select(ranked[:1], [pointwise], order).upgrades == [upgrade]
    assert ranking.select(ranked[:2], [pointwise], order).groups == (("s.b0",),)
    three = ranking.select(ranked[:3], [pointwise], order)
    assert three.groups == (("s",),) and not three.upgrades
    assert [ranking.recompute_cost(ranking.select(ranked[:k], [pointwise], order)) for k in (1, 2, 3)] == [
        pytest.approx(time_model.seconds(1000)),
        pytest.approx(time_model.seconds(3000)),
        pytest.approx(time_model.seconds(10_000)),
    ]


def test_a_chain_that_costs_nothing_pulls_nothing_before_it(unweighted):
    """A BN→add→ReLU chain shares its BN with a conv→BN upgrade that costs more in all: the upgrade is not
    pulled before the chain, and after it, it could not apply (its BN runs inside the chain): dropped."""
    chain = RegionCost("a.bn…a.relu", "chain", ("a.bn", "a.relu"), 0, 100, "a", _nodes("a", 3, 1))
    upgrade, _ = _upgrade("a.conv", "a.bn", 30.0)
    ranked = ranking.rank([upgrade], Profile([chain], [], {}))
    assert [e.name for e in ranked] == ["a.bn…a.relu"]
