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
    print(small[1], small[2], large)
    """
)


def test_counts_repeat_and_grow_with_the_work(tmp_path):
    script = tmp_path / "count.py"
    script.write_text(SCRIPT.format(benchmarks=str(BENCHMARKS)))
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    first, again, large = map(float, done.stdout.split())  # after a first count, which runs a few % more
    assert abs(again - first) <= 0.01 * first
    assert 3 < large / first < 6
    assert not list(tmp_path.glob("fxfuse-callgrind-*"))  # its dumps and shim are removed


def test_count_outside_callgrind_is_refused():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import instructions
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert not instructions.active()
    with pytest.raises(KeyError):
        instructions.count(lambda: None, 1)
