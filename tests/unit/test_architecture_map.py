"""docs/architecture.md's map for newcomers (feature -> modules -> tests) names only paths that
exist: package modules relative to ``persistent_delta/``, everything else to the repository."""

from __future__ import annotations

import os
import re
from typing import List

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(REPO, "docs", "architecture.md")
HEADING = "## Where each feature lives"


def map_paths(page: str = PAGE) -> List[str]:
    """Every path of the map's table: ``x.py``, ``x/``, ``tests/...``, ``docs/...``."""
    section = open(page).read().split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|") and not line.startswith("|---")][1:]
    found = []
    for row in rows:
        found += [p for p in re.findall(r"`([^`]+)`", row) if p.endswith((".py", "/", ".md", ".toml"))]
    return found


def missing(page: str = PAGE, repo: str = REPO) -> List[str]:
    out = []
    for p in map_paths(page):
        top = p.split("/", 1)[0]
        base = repo if top in ("tests", "docs", "pyproject.toml") else os.path.join(repo, "persistent_delta")
        if not os.path.exists(os.path.join(base, p)):
            out.append(p)
    return out


def test_the_map_names_features_modules_and_tests():
    paths = map_paths()
    assert any(p.startswith("tests/") for p in paths) and any(p.startswith("fleet/") for p in paths)
    section = open(PAGE).read().split(HEADING, 1)[1]
    for feature in ("restore", "ZCH", "replica apply", "publish", "shipping"):
        assert f"| {feature}" in section, feature


def test_every_path_in_the_map_exists():
    assert not missing(), missing()


def test_a_path_that_is_gone_is_found(tmp_path):
    page = tmp_path / "architecture.md"
    page.write_text(f"{HEADING}\n\n| feature | modules | tests |\n|---|---|---|\n"
                    "| publish | `trainer/publish.py`, `trainer/no_such.py` | `tests/unit/no_such_test.py` |\n")
    assert missing(str(page)) == ["trainer/no_such.py", "tests/unit/no_such_test.py"]
