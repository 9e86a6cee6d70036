"""The supported surface has two tiers, and the docs and examples import only from them:

* the top level: ``persistent_delta`` (its ``__all__``), every error from
  ``persistent_delta.errors``, the test servers of ``persistent_delta.testing``;
* the package tier: ``persistent_delta.<package>``, the names a package's ``__init__``
  re-exports (its ``__all__``), each package saying in its docstring what they are for.

Every other module path is internal: it may move from one release to the next (the CHANGELOG
lists moves)."""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import re
from typing import Iterator, List, Tuple

import persistent_delta

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOP_MODULES = ("errors", "testing")  # top-level modules whose public names are supported
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```\s*$", re.M | re.S)


def packages() -> List[str]:
    """Every subpackage of persistent_delta (``log``, ``read``, ...)."""
    return sorted(m.name for m in pkgutil.iter_modules(persistent_delta.__path__) if m.ispkg)


def supported(module: str, name: str) -> bool:
    """Whether ``from <module> import <name>`` uses a supported tier."""
    if module == "persistent_delta":
        return name in persistent_delta.__all__ or name in packages() or name in TOP_MODULES
    rest = module[len("persistent_delta."):]
    if rest in TOP_MODULES:
        return not name.startswith("_") and hasattr(importlib.import_module(module), name)
    if rest in packages():
        return name in getattr(importlib.import_module(module), "__all__", ())
    return False


def python_sources(root: str = REPO) -> Iterator[Tuple[str, int, str]]:
    """(file, its line of the code's first line, code): every python block of README.md and the docs pages, every example."""
    pages = [os.path.join(root, "README.md")]
    for top in ("docs", "examples"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            pages += [os.path.join(dirpath, f) for f in sorted(files) if f.endswith(".md")]
    for page in pages:
        if not os.path.exists(page):
            continue
        text = open(page).read()
        for m in FENCE.finditer(text):
            if m.group("lang") in ("python", "py", "pycon"):
                line = text[:m.start()].count("\n") + 2
                body = "\n".join(s[len(m.group("indent")):] for s in m.group("body").splitlines())
                yield os.path.relpath(page, root), line, body
    for dirpath, _, files in os.walk(os.path.join(root, "examples")):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                yield os.path.relpath(path, root), 1, open(path).read()


def unsupported_imports(root: str = REPO) -> List[str]:
    out = []
    for path, first, code in python_sources(root):
        where = lambda node: f"{path}:{first + node.lineno - 1}"  # noqa: E731
        try:
            tree = ast.parse(code)
        except SyntaxError as exc:
            out.append(f"{path}:{first}: does not parse ({exc.msg})")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "persistent_delta":
                bad = [a.name for a in node.names if not supported(node.module, a.name)]
                if bad:
                    out.append(f"{where(node)}: from {node.module} import {', '.join(bad)}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    parts = a.name.split(".")
                    if parts[0] == "persistent_delta" and len(parts) > 1 and parts[1] not in (*packages(), *TOP_MODULES):
                        out.append(f"{where(node)}: import {a.name}")
                    elif len(parts) > 2 and parts[0] == "persistent_delta":
                        out.append(f"{where(node)}: import {a.name}")
    return out


def test_every_package_documents_its_tier():
    for name in packages():
        mod = importlib.import_module(f"persistent_delta.{name}")
        assert (mod.__doc__ or "").strip(), f"persistent_delta/{name}/__init__.py has no docstring"
        exported = getattr(mod, "__all__", None)
        assert exported is not None, f"persistent_delta/{name}/__init__.py has no __all__ (its supported names)"
        for n in exported:
            assert getattr(mod, n, None) is not None, f"persistent_delta.{name}.{n} is exported but missing"


def test_docs_and_examples_import_only_the_supported_tiers():
    found = unsupported_imports()
    assert not found, "import these from persistent_delta or persistent_delta.<package>:\n" + "\n".join(found)


def test_a_deep_import_in_the_docs_is_found(tmp_path):
    """The check can fail: a page teaching a module path below a package's tier."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("```python\nfrom persistent_delta import DeltaConsumer\n```\n")
    (tmp_path / "docs" / "page.md").write_text(
        "Text.\n\n```python\nfrom persistent_delta.log.layout import atomic_write_bytes\nimport persistent_delta.read.consumer\n```\n")
    found = unsupported_imports(str(tmp_path))
    assert found == ["docs/page.md:4: from persistent_delta.log.layout import atomic_write_bytes",
                     "docs/page.md:5: import persistent_delta.read.consumer"], found
