"""One word, one meaning: a word the glossary retires (docs/glossary.md, "Retired words") does
not come back in a code identifier, a docs page or a test's name, and the import rules have no
layer named ``base`` (the word is kept for a full checkpoint)."""

from __future__ import annotations

import ast
import os
import re
from typing import Dict, Iterator, List, Set, Tuple

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GLOSSARY = os.path.join(REPO, "docs", "glossary.md")
CODE_DIRS = ("persistent_delta", "tests", "tools", "examples", "benchmarks", "docs")
LAYER_ROW = "[tool.persistent_delta.packages]"

# Renames asked of the owners of modules being moved in this round (file -> patterns still
# there); an entry goes once its file is renamed or gone.
PENDING: Dict[str, Set[str]] = {}


def retired(glossary: str = GLOSSARY) -> List[Tuple[str, List[str]]]:
    """The rows of the glossary's "Retired words" table: (the row's text, its patterns)."""
    text = open(glossary).read()
    section = text.split("## Retired words", 1)[1]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("retired", "") or set(cells[0]) <= set("-"):
            continue
        rows.append((line, re.findall(r"`([^`]+)`", cells[2])))
    return rows


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def _py_files(root: str = REPO) -> Iterator[str]:
    for top in CODE_DIRS:
        for dirpath, dirs, files in os.walk(os.path.join(root, top)):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "site")]
            for f in files:
                if f.endswith(".py"):
                    yield os.path.join(dirpath, f)


def identifiers(path: str) -> Set[str]:
    """Every name a file defines or uses (functions, classes, arguments, variables, attributes,
    imports, keywords), snake-cased and lowercased, and the module's own name."""
    found = {os.path.basename(path)[:-3]}
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.arg):
            found.add(node.arg)
        elif isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.update(node.name.split("."))
        elif isinstance(node, ast.keyword) and node.arg:
            found.add(node.arg)
    return {_snake(n) for n in found}


def _docs_pages(root: str = REPO) -> Iterator[str]:
    yield os.path.join(root, "README.md")
    for top in ("docs", "examples"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for f in files:
                if f.endswith(".md") and os.path.join(dirpath, f) != os.path.join(root, "docs", "glossary.md"):
                    yield os.path.join(dirpath, f)


def _test_names(root: str = REPO) -> Iterator[Tuple[str, str]]:
    for dirpath, _, files in os.walk(os.path.join(root, "tests")):
        for f in files:
            if f.startswith("test_") and f.endswith(".py"):
                path = os.path.join(dirpath, f)
                yield path, f[:-3]
                for node in ast.walk(ast.parse(open(path).read(), path)):
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
                        yield path, node.name


def offences(root: str = REPO, glossary: str = GLOSSARY) -> List[str]:
    """Where a retired word is used: ``path: pattern (where)``, pending renames left out."""
    out: List[str] = []
    rel = lambda p: os.path.relpath(p, root)  # noqa: E731
    for line, patterns in retired(glossary):
        if LAYER_ROW in line:
            with open(os.path.join(root, "pyproject.toml"), "rb") as f:
                layers = tomllib.load(f)["tool"]["persistent_delta"]["packages"]
            out += [f"pyproject.toml: {p} (an import-rules layer)" for p in patterns if p in layers]
            continue
        for pattern in patterns:
            low = pattern.lower()
            variants = {low, low.replace(" ", "_")}
            for path in _py_files(root):
                if pattern in PENDING.get(rel(path), ()):
                    continue
                hits = sorted(n for n in identifiers(path) if any(v in n for v in variants))
                if hits:
                    out.append(f"{rel(path)}: {pattern} (identifiers {hits[:5]})")
            for path in _docs_pages(root):
                text = re.sub(r"\s+", " ", open(path).read().lower())
                if any(v in text for v in variants):
                    out.append(f"{rel(path)}: {pattern} (docs text)")
            for path, name in _test_names(root):
                if pattern not in PENDING.get(rel(path), ()) and any(v in name.lower() for v in variants):
                    out.append(f"{rel(path)}: {pattern} (test name {name})")
    return sorted(set(out))


def test_the_glossary_retires_words_with_patterns():
    rows = retired()
    assert len(rows) >= 3
    for line, patterns in rows:
        assert patterns, line


def test_no_retired_word_comes_back():
    found = offences()
    assert not found, "\n".join(found)


def test_a_retired_word_brought_back_is_found(tmp_path):
    """The check can fail: an identifier, a docs sentence, a test name and a layer, each with a
    retired word, in a copy of the tree's shape."""
    for d in ("persistent_delta", "tests", "docs"):
        os.makedirs(tmp_path / d)
    (tmp_path / "README.md").write_text("Nothing retired here.\n")
    (tmp_path / "persistent_delta" / "m.py").write_text("def take(accumulatedIds):\n    return accumulatedIds\n")
    (tmp_path / "docs" / "page.md").write_text("The delivery\nrule says where a read starts.\n")
    (tmp_path / "tests" / "test_delivery_again.py").write_text("def test_x():\n    pass\n")
    (tmp_path / "pyproject.toml").write_text('[tool.persistent_delta.packages]\nbase = { imports = [], role = "" }\n')
    found = offences(str(tmp_path), GLOSSARY)
    assert any(f.startswith("persistent_delta/m.py: accumulat") for f in found), found
    assert any(f.startswith("docs/page.md: delivery rule") for f in found), found
    assert any(f.startswith("tests/test_delivery_again.py: test_delivery (test name") for f in found), found
    assert "pyproject.toml: base (an import-rules layer)" in found, found
