"""The import-linter contracts of pyproject.toml fail on what they forbid: a cycle planted between two
fxfuse.ops modules breaks the acyclic contract over fxfuse.ops (the one compiled.py and batch_norm_act.py
had before update_running_stats moved to ops/running_stats.py)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT_IMPORTS.is_file(), reason="import-linter is not installed")


def _lint_ops(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--contract", "ops-acyclic"],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
    )


@pytest.fixture
def tree(tmp_path):
    """The package's sources and the contracts, alone in a directory (no built extension: grimp only reads)."""
    shutil.copytree(ROOT / "fxfuse", tmp_path / "fxfuse", ignore=shutil.ignore_patterns("*.so", "__pycache__", "csrc"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def test_the_ops_contract_holds_and_fails_on_a_planted_cycle(tree):
    kept = _lint_ops(tree)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    # batch_norm_act imports running_stats; a deferred import back closes a cycle, as compiled.py's did.
    with open(tree / "fxfuse" / "ops" / "running_stats.py", "a") as f:
        f.write("\n\ndef _planted():\n    from .batch_norm_act import batch_norm_act  # noqa: F401\n")
    broken = _lint_ops(tree)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "No cycles are allowed in fxfuse.ops" in broken.stdout
    assert ".running_stats -> .batch_norm_act" in broken.stdout
