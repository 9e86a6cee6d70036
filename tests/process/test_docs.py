"""The docs site builds strictly (no broken link, missing reference or warning), and every code
block of README.md and docs/ runs as written (Python blocks and the `persistent-delta` commands
of console blocks), so an example cannot drift from the API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from doc_blocks import REPO, RESULT, blocks, doc_pages

SUPPORT = os.path.dirname(os.path.abspath(__import__("doc_blocks").__file__))
RUNNABLE = [p for p in doc_pages() if any(b.runs for b in blocks(p))]
MAX_FRAGMENTS = 6  # blocks left unrun (marked <!-- fragment -->): keep them rare


def _mkdocs(*args: str, cwd: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore", NO_MKDOCS_2_WARNING="1")
    return subprocess.run([sys.executable, "-m", "mkdocs", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)


def test_the_site_builds_strictly(tmp_path):
    t0 = time.monotonic()
    proc = _mkdocs("build", "--strict", "--config-file", os.path.join(REPO, "mkdocs.yml"),
                   "--site-dir", str(tmp_path / "site"), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-6000:]
    for page in ("index.html", "reference/cli/index.html", "reference/settings/index.html",
                 "reference/errors/index.html", "reference/api/read/index.html", "glossary/index.html"):
        assert (tmp_path / "site" / page).exists(), page
    cli = (tmp_path / "site" / "reference/cli/index.html").read_text()
    assert "--shard-files" in cli and "--to-earliest" in cli  # generated from the parser
    assert time.monotonic() - t0 < 120


@pytest.mark.slow  # a second full build; the check that the strict build can fail
def test_a_broken_link_fails_the_strict_build(tmp_path):
    """The strict build can fail: a copy of the docs with a link to a missing page is refused."""
    import shutil

    shutil.copytree(os.path.join(REPO, "docs"), tmp_path / "docs")
    shutil.copy(os.path.join(REPO, "mkdocs.yml"), tmp_path / "mkdocs.yml")
    os.symlink(os.path.join(REPO, "persistent_delta"), tmp_path / "persistent_delta")
    with open(tmp_path / "docs" / "glossary.md", "a") as f:
        f.write("\nSee [nowhere](no-such-page.md).\n")
    proc = _mkdocs("build", "--strict", "--site-dir", str(tmp_path / "site"), cwd=str(tmp_path))
    assert proc.returncode != 0
    assert "no-such-page.md" in proc.stderr


def test_fragments_are_rare_and_the_readme_runs_its_quickstart():
    every = [b for p in doc_pages() for b in blocks(p)]
    fragments = [f"{b.page}:{b.line}" for b in every if b.fragment]
    assert len(fragments) <= MAX_FRAGMENTS, fragments
    readme = blocks("README.md")
    assert any(b.runs and b.lang == "python" for b in readme)
    assert any(b.runs and b.lang == "console" for b in readme)


def test_every_code_block_runs():
    """One child process runs every page's blocks (torch and TorchRec imported once), each page
    in a fresh directory; every failure is reported with its page and line."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.join(SUPPORT, "doc_blocks.py"), *RUNNABLE],
                          capture_output=True, text=True, timeout=900, env=env)
    results = [json.loads(line[len(RESULT):]) for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    failed = [f"{r['page']}:{r['line']} ({r['lang']})\n{r['error']}" for r in results if not r["ok"]]
    assert not failed, "\n\n".join(failed)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(results) == sum(b.runs for p in RUNNABLE for b in blocks(p)), proc.stderr[-4000:]
