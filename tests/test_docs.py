"""The Markdown docs: README.md stays short, and every relative link and #anchor resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250  # issue 29: a README a newcomer reads in ten minutes


def _prose(path: Path) -> str:
    return re.sub(r"```.*?```", "", path.read_text(), flags=re.S)


def _anchors(path: Path) -> set[str]:
    # GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens.
    headings = re.findall(r"^#+\s+(.*)$", _prose(path), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", _prose(doc)):
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (doc.parent / path).resolve() if path else doc
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link}: no heading #{anchor} in {target.name}")
    assert not broken, f"{doc.name}: " + "; ".join(broken)
