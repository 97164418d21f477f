"""fusion/plan.py: a plan scoped to a submodule keeps what lies under it, with names relative to it."""

from fxfuse.fusion.plan import Options, Plan


def test_scoped_keeps_the_names_under_the_path():
    plan = Plan(
        frozenset({("a.conv", "a.bn"), ("b.conv",), ("a:relu",)}),
        (("a.0", "a.1"), ("b.0",), ("a.2", "b.1")),
        frozenset({("a.0", "a.1"), ("a.2", "b.1")}),
    )
    scoped = plan.scoped("a")
    assert scoped.sites == {("conv", "bn"), (":relu",)}
    assert scoped.regions == (("0", "1"),)
    assert scoped.flat_links == {("0", "1")}


def test_no_plan_or_no_path_is_the_plan_itself():
    plan = Plan(regions=(("a.0",),))
    assert plan.scoped("a") is plan  # no site selection: every site, and regions as given
    chosen = Plan(frozenset())
    assert chosen.scoped("") is chosen


def test_options_scope_their_plan_and_keep_the_rest():
    options = Options("auto", Plan(frozenset({("a.conv",)})), 0.5, True)
    scoped = options.scoped("a")
    assert (scoped.mode, scoped.memory_budget, scoped.channels_last) == ("auto", 0.5, True)
    assert scoped.plan.sites == {("conv",)}
    assert Options("fast").pass_mode == "fast" and Options("auto").pass_mode == "memory"
