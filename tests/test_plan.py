"""fusion/plan.py: a plan scoped to a submodule keeps what lies under it, with names relative to it; what a site is."""

from fxfuse.fusion.plan import Choice, Options, Plan, SiteData


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


def test_a_sites_layers_are_its_named_layers_not_its_activation():
    site = SiteData(("conv", "bn", "act"), ("conv2d", "batch_norm2d", "relu"), "fxfuse::conv_bn_act")
    assert site.layers == {"conv", "bn"}
    linear = SiteData(("fc", "scale"), ("linear", "layer_scale"), "fxfuse::act_linear_scale")
    assert linear.layers == {"fc"}


def test_an_activation_without_a_name_of_its_own_makes_every_name_a_layer():
    # timm's BatchNormAct2d: the activation runs inside the BN module, so the site has one name less.
    site = SiteData(("conv", "bn"), ("conv2d", "batch_norm2d", "relu"), "fxfuse::conv_bn_act")
    assert site.layers == {"conv", "bn"}
    bn_act = SiteData(("bn",), ("batch_norm2d", "silu"), "fxfuse::batch_norm_act")
    assert bn_act.layers == {"bn"}


def test_the_choice_is_not_part_of_a_plans_identity():
    choice = Choice("budget", budget=0.3)
    assert Plan(frozenset(), choice=choice) == Plan(frozenset())
    assert Plan(frozenset({("a.conv",)}), choice=choice).scoped("a").choice is None  # only the whole model's plan
