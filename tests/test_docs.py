"""The documents a user reads: README.md stays a user's README, links between the docs resolve, the tree stays small.

Issue 32's limits: README.md at most 25 KB (dated results live in RESULTS.md), every relative link and anchor in the
user-facing Markdown files points at something that exists, and the tracked tree stays under 40 MiB so that a lent
GPU call (64 MiB) can carry it with a model part.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "RESULTS.md", ROOT / "benchmarks" / "README.md", ROOT / "apps" / "README.md",
        *sorted((ROOT / "studies").glob("**/README.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


def test_readme_is_at_most_25_kb_and_results_hold_the_dated_results():
    assert (ROOT / "README.md").stat().st_size <= 25_000
    results = (ROOT / "RESULTS.md").read_text()
    dated = re.findall(r"^#+ .*\b20\d\d-\d\d-\d\d\b", results, flags=re.MULTILINE)
    assert dated, "RESULTS.md has no dated section"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(doc):
    problems = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (doc.parent / path).resolve() if path else doc
        if not resolved.exists():
            problems.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            problems.append(f"{target}: no such heading")
    assert not problems, f"{doc.relative_to(ROOT)}: " + "; ".join(problems)


def test_tracked_tree_is_under_40_mib():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    total = sum((ROOT / name).stat().st_size for name in files.decode().split("\0")
                if name and (ROOT / name).is_file())
    assert total < 40 * 2**20, f"tracked tree is {total / 2**20:.1f} MiB (limit 40): compress records, drop old runs"
