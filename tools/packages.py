"""The package picture and the package rules, read from one table: ``[tool.persistent_delta.packages]``
in ``pyproject.toml``.

``python tools/packages.py`` prints the picture docs/architecture.md shows; ``--check`` exits 1 and lists every
import that breaks a rule (tests/unit/test_packages.py runs the same checks).
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from typing import Dict, List, NamedTuple, Set, Tuple

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(REPO, "persistent_delta")
ROOT_MODULES = {"__init__", "__main__"}


class Rule(NamedTuple):
    imports: Tuple[str, ...]
    role: str


def load_rules(pyproject: str = os.path.join(REPO, "pyproject.toml")) -> Dict[str, Rule]:
    """The package table: package name -> (packages it may import, its role)."""
    with open(pyproject, "rb") as f:
        table = tomllib.load(f)["tool"]["persistent_delta"]["packages"]
    return {name: Rule(tuple(v["imports"]), v["role"]) for name, v in table.items()}


def modules(pkg_dir: str = PKG) -> Dict[str, str]:
    """Every module of the package, dotted relative to it (``log.codec``, ``__init__``) -> path."""
    out = {}
    for dirpath, dirs, files in os.walk(pkg_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), pkg_dir)[:-3].replace(os.sep, ".")
                out[rel] = os.path.join(dirpath, f)
    return out


def package_of(module: str) -> str:
    """The package a module belongs to: its folder, ``core`` for a top-level module, ``root``
    for ``__init__``/``__main__``."""
    if module in ROOT_MODULES:
        return "root"
    head, _, rest = module.partition(".")
    return head if rest else "core"


def imports(path: str) -> List[Tuple[int, str, List[str]]]:
    """Every import of a persistent_delta module in a file, at any depth (function-level
    imports count): (line, imported module dotted relative to the package, names imported)."""
    found = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "persistent_delta":
                found.append((node.lineno, "__init__", [a.name for a in node.names]))
            elif node.module.startswith("persistent_delta."):
                found.append((node.lineno, node.module[len("persistent_delta."):], [a.name for a in node.names]))
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise ValueError(f"{path}:{node.lineno}: relative import (write it absolute)")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("persistent_delta."):
                    found.append((node.lineno, a.name[len("persistent_delta."):], []))
    return found


def _resolve(target: str, names: List[str], mods: Dict[str, str]) -> List[str]:
    """The modules an import reaches: ``from persistent_delta.log import codec`` reaches
    ``log.codec``; ``from persistent_delta.log.codec import X`` reaches ``log.codec``."""
    if target in mods:
        return [target]
    if target == "__init__" or target + ".__init__" in mods:
        prefix = "" if target == "__init__" else target + "."
        reached = [prefix + n for n in names if prefix + n in mods]
        return reached or [prefix + "__init__" if prefix else "__init__"]
    return []


def violations(rules: Dict[str, Rule], pkg_dir: str = PKG) -> List[str]:
    """Every import that breaks a package rule, every private name used across modules, and
    every module whose package has no rule."""
    mods = modules(pkg_dir)
    bad = []
    for mod, path in mods.items():
        mine = package_of(mod)
        if mine not in rules:
            bad.append(f"{mod}: package {mine!r} has no rule in [tool.persistent_delta.packages]")
            continue
        for line, target, names in imports(path):
            for dep in _resolve(target, names, mods):
                theirs = package_of(dep)
                if theirs != mine and theirs not in rules[mine].imports:
                    bad.append(f"{mod}:{line} imports {dep} ({mine} may import only {list(rules[mine].imports)})")
                if dep != mod and dep != "__init__" and any(n.startswith("_") for n in names if n != dep.rsplit(".", 1)[-1]):
                    bad.append(f"{mod}:{line} imports private names {[n for n in names if n.startswith('_')]} from {dep}")
        bad.extend(f"{mod}: {msg}" for msg in _private_attribute_uses(path, mods))
    bad.extend(_cycles(mods))
    return bad


def _private_attribute_uses(path: str, mods: Dict[str, str]) -> List[str]:
    """``module._name`` where ``module`` was imported from persistent_delta."""
    tree = ast.parse(open(path).read(), path)
    aliases: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("persistent_delta"):
            base = node.module[len("persistent_delta"):].lstrip(".")
            for a in node.names:
                if (base + "." + a.name if base else a.name) in mods:
                    aliases.add(a.asname or a.name)
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            out.append(f"line {node.lineno} uses {node.value.id}.{node.attr}, a private name of another module")
    return out


def _cycles(mods: Dict[str, str]) -> List[str]:
    """Import cycles among modules (module-level imports only: a function-level import is how
    a cycle is broken on purpose, so only top-level statements count here)."""
    graph: Dict[str, Set[str]] = {}
    for mod, path in mods.items():
        deps: Set[str] = set()
        for node in ast.parse(open(path).read(), path).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("persistent_delta"):
                target = node.module[len("persistent_delta"):].lstrip(".") or "__init__"
                deps.update(d for d in _resolve(target, [a.name for a in node.names], mods) if d != mod)
        graph[mod] = deps
    state: Dict[str, int] = {}
    found: List[str] = []

    def visit(m: str, stack: List[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                found.append("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]) if d in stack else d)
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return found


def picture(rules: Dict[str, Rule], pkg_dir: str = PKG) -> str:
    """The package picture: each package, its modules, what it may import and its role."""
    by_pkg: Dict[str, List[str]] = {}
    for mod in modules(pkg_dir):
        p = package_of(mod)
        if mod.endswith("__init__") and p != "root":
            continue
        by_pkg.setdefault(p, []).append(mod.rsplit(".", 1)[-1])
    lines = ["persistent_delta/"]
    for name, rule in rules.items():
        label = {"core": "(top level)", "root": "(package root)"}.get(name, name + "/")
        lines.append(f"  {label:<15} {rule.role}")
        lines.append(f"  {'':<15}   modules: {', '.join(by_pkg.get(name, []))}")
        lines.append(f"  {'':<15}   imports: {', '.join(rule.imports) or 'nothing of the package'}")
    return "\n".join(lines)


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="list every import that breaks a rule; exit 1 if any")
    args = p.parse_args(argv)
    rules = load_rules()
    if args.check:
        bad = violations(rules)
        print("\n".join(bad) if bad else "every import keeps the package rules")
        return 1 if bad else 0
    print(picture(rules))
    return 0


if __name__ == "__main__":
    sys.exit(main())
