"""fusion/passes/__init__.py: PASSES declares every pass the same way, each with the reason for its position."""

from fxfuse.fusion.passes import PASSES, Pass
from fxfuse.fusion.passes.driver import FusionPass


def test_every_pass_is_declared_the_same_way_with_a_reason():
    assert all(isinstance(p, Pass) and callable(p.run) and p.why.strip() for p in PASSES)
    assert len({p.run for p in PASSES}) == len(PASSES)


def test_inplace_add_runs_after_the_fusing_passes_and_rebuild_last():
    # inplace_add adds into fused outputs, which exist only once every site is rewritten; rebuild must
    # see every node that may write into a BN→act output, add_into included.
    assert PASSES[-2].run.__module__.endswith("inplace_add")
    assert PASSES[-1].run.__module__.endswith("passes.rebuild")
    assert sum(not isinstance(p.run, FusionPass) for p in PASSES) == 4  # bn_act_conv, cat_input, inplace_add, rebuild
