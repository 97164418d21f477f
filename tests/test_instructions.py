"""benchmarks/instructions.py: instructions counted under callgrind, the same whatever else the machine runs."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

pytestmark = pytest.mark.skipif(
    shutil.which("valgrind") is None or not os.path.exists("/usr/include/valgrind/callgrind.h"),
    reason="needs valgrind and its headers",
)

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {benchmarks!r})
    import instructions
    if not instructions.active():
        sys.exit(instructions.reexec_under_callgrind(sys.argv))
    small = [instructions.count(lambda: sum(range(2000)), 20) for _ in range(3)]
    large = instructions.count(lambda: sum(range(8000)), 20)
    print(small[1].total, small[2].total, large.total, large.kernels)
    """
)


def test_counts_repeat_and_grow_with_the_work(tmp_path):
    script = tmp_path / "count.py"
    script.write_text(SCRIPT.format(benchmarks=str(BENCHMARKS)))
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    first, again, large, kernels = map(float, done.stdout.split())  # after a first count, which runs a few % more
    assert abs(again - first) <= 0.01 * first
    assert 3 < large / first < 6
    assert kernels == 0  # Python's sum calls no compute kernel
    assert not list(tmp_path.glob("fxfuse-callgrind-*"))  # its dumps and shim are removed


def _instructions():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import instructions
    finally:
        sys.path.remove(str(BENCHMARKS))
    return instructions


# A callgrind dump in its compressed form: a name is spelled out the first time its id appears.
DUMP = """\
events: Ir
fn=(1) main
0 100
cfn=(2) dnnl_primitive_execute
calls=2 0
0 700
cfn=(3) at::native::cpublas::gemm(at::native::TransposeType, long)
calls=1 0
0 50
cfn=(4) helper
calls=1 0
0 30
fn=(2)
0 400
cfn=(5) jit_kernel
calls=1 0
0 300
cfn=(3)
calls=1 0
0 40
fn=(4)
0 10
cfn=(2)
calls=1 0
0 20
fn=(3)
0 50
totals: 920
"""


def test_kernel_instructions_add_the_calls_into_kernels_once():
    # main's calls into both kernels (700 + 50), helper's into one (20); dnnl's own calls, to a jit kernel
    # and to the gemm, are inside a kernel already.
    assert _instructions().kernel_instructions(DUMP.splitlines(keepends=True)) == 770


def test_count_outside_callgrind_is_refused():
    instructions = _instructions()
    assert not instructions.active()
    with pytest.raises(KeyError):
        instructions.count(lambda: None, 1)
