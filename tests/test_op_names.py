"""One name per op in every layer (docs/design.md, "One name per op"): fxfuse::<op> has its wrapper
`fxfuse.ops.<op>` in fxfuse/ops/<op>.py, its schema and device-generic implementation in
csrc/generic/<op>.cpp and its tests in tests/test_ops_<op>.py."""

from pathlib import Path

import pytest
import torch

import fxfuse.ops
from fxfuse import _extension

ROOT = Path(__file__).resolve().parents[1]
# The BN(+activation) building blocks of batch_norm_act, conv_bn_act and bn_act_conv: no wrapper of
# their own (ops/batch_norm_act.py registers them, generic/bn_act.cpp defines and implements them); and the
# running statistics update they all call (ops/running_stats.py, generic/running_stats.cpp).
BN_ACT = {"bn_stats", "bn_act", "bn_act_", "bn_act_backward", "bn_act_backward_", "bn_act_backward_into_grad_"}
INTERNAL = BN_ACT | {"update_running_stats_"}
# max_pool2d's backward rebuilds ATen's indices with it (ops/max_pool2d.py, generic/max_pool2d.cpp).
INTERNAL |= {"max_pool2d_indices"}
# The file (csrc/generic/<family>.cpp) of each internal op's schema; a public op's, and its backward's, is
# generic/<op>.cpp.
FAMILY = dict.fromkeys(BN_ACT, "bn_act")
FAMILY |= {"update_running_stats_": "running_stats", "max_pool2d_indices": "max_pool2d"}
# What the op modules share (fxfuse/ops/__init__.py says what each holds).
SHARED = {
    "__init__",
    "activations",
    "checks",
    "compiled",
    "direct",
    "flops",
    "higher_order",
    "linear_common",
    "rebuild",
    "routing",
    "running_stats",
}
# The cat_ variants of four ops (their input's concatenated pieces kept instead): defined in Python over
# the base ops' kernels, their Autograd kernels the base ops' (csrc/autograd/<base>.cpp), so one family
# named cat_input in every layer and no generic .cpp.
CAT_VARIANTS = {f"cat_{base}" for base in ("batch_norm_act", "conv_bn_act", "bn_act_conv", "conv2d")}


@pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")
def test_ops_lists_every_public_op():
    names = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("fxfuse::")}
    public = {n for n in names - INTERNAL if not n.endswith("_backward")}
    assert sorted(fxfuse.ops.OPS) == sorted(public - CAT_VARIANTS)
    assert CAT_VARIANTS <= public


def test_every_module_of_ops_is_an_op_or_shared():
    modules = {path.stem for path in (ROOT / "fxfuse" / "ops").glob("*.py")}
    assert modules - SHARED - {"cat_input"} == set(fxfuse.ops.OPS)


@pytest.mark.parametrize("op", sorted(CAT_VARIANTS))
def test_the_cat_variants_are_one_family_named_cat_input(op):
    from fxfuse.ops import cat_input

    function = getattr(fxfuse.ops, op)
    assert (function.__name__, function.__module__) == (op, "fxfuse.ops.cat_input")
    assert op.removeprefix("cat_") in cat_input.BASES
    for path in ("tests/test_ops_cat_input.py", "tests/test_passes_cat_input.py", "fxfuse/fusion/passes/cat_input.py"):
        assert (ROOT / path).is_file()


@pytest.mark.parametrize("op", fxfuse.ops.OPS)
def test_one_name_in_every_layer(op):
    function = getattr(fxfuse.ops, op)
    assert (function.__name__, function.__module__) == (op, f"fxfuse.ops.{op}")
    assert (ROOT / "tests" / f"test_ops_{op}.py").is_file()
    assert f'm.impl("{op}", ' in (ROOT / "fxfuse" / "csrc" / "generic" / f"{op}.cpp").read_text()


@pytest.mark.skipif(not _extension.loaded(), reason="fxfuse._C is not built")
def test_each_schema_is_a_fragment_beside_its_generic_kernel():
    """As torchvision's csrc/ops/<op>.cpp: fxfuse::<op>'s schema is in a TORCH_LIBRARY_FRAGMENT of
    generic/<op>.cpp, and the namespace's one TORCH_LIBRARY (module.cpp) defines none."""
    csrc = ROOT / "fxfuse" / "csrc"
    texts = {path.relative_to(csrc).as_posix(): path.read_text() for path in csrc.rglob("*") if path.is_file()}
    names = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("fxfuse::")}
    for name in sorted(names - CAT_VARIANTS):
        family = FAMILY.get(name, name.removesuffix("_backward"))
        assert [rel for rel, text in texts.items() if f'"{name}(' in text] == [f"generic/{family}.cpp"], name
        assert "TORCH_LIBRARY_FRAGMENT(fxfuse, m) {" in texts[f"generic/{family}.cpp"]
    assert [rel for rel, text in texts.items() if "TORCH_LIBRARY(fxfuse, m)" in text] == ["module.cpp"]
    assert "TORCH_LIBRARY(fxfuse, m) {}" in texts["module.cpp"]
