"""The import picture: no module imports one above it; readers and tools import nothing of the
trainer. Layers as in the README's "Package layout"."""

from __future__ import annotations

import ast
import os
from typing import Dict, Set

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "persistent_delta")

LAYERS = [
    {"errors", "lifecycle", "threads"},
    {"config", "codec", "alloc"},
    {"schema", "layout", "watch", "natsserver"},
    {"lmdbenv"},
    {"log", "rows"},
    {"records", "zchlog"},
    {"delivery"},
    {"results", "sharding", "zch", "transport"},
    {"consumer", "apply", "remote", "raw_ids", "store", "window", "topk", "publish", "restore", "shard_files", "capture"},
    {"writer", "ordered", "ship"},
    {"tracker"},
    {"cli.offsets", "cli.replay", "cli.verify", "cli.vacuum", "cli.upgrade", "cli.ship", "cli.remote"},
    {"cli.apply"},
    {"cli.main"},
    {"cli"},
    {"__init__", "__main__"},
]
TRAINER = {"tracker", "capture", "writer", "window", "publish", "restore", "topk", "zch"}
READERS = {"consumer", "apply", "raw_ids", "results", "delivery", "records", "zchlog", "ordered", "cli.apply", "log", "store",
           "cli.offsets", "cli.replay", "cli.verify", "cli.vacuum", "cli.main", "cli", "shard_files", "transport",
           "ship", "remote", "natsserver", "cli.ship", "cli.remote", "threads"}


def _modules() -> Dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), PKG)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, f)
    return out


def _imports(path: str) -> Set[str]:
    found: Set[str] = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("persistent_delta"):
            base = node.module[len("persistent_delta"):].lstrip(".")
            if base:
                found.add(base)
            else:
                found.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name[len("persistent_delta."):] for a in node.names if a.name.startswith("persistent_delta."))
    return found


def _layer(name: str) -> int:
    for i, layer in enumerate(LAYERS):
        if name in layer:
            return i
    raise AssertionError(f"module {name!r} has no layer: add it to LAYERS (and the README's package layout)")


def test_every_module_has_a_layer_and_imports_only_below_it():
    modules = _modules()
    for name, path in modules.items():
        mine = _layer(name)
        for dep in _imports(path):
            if dep not in modules:
                continue  # a name imported from the package root (e.g. __init__'s re-exports)
            assert _layer(dep) < mine, f"{name} imports {dep} (not below it)"


def test_readers_and_tools_import_nothing_of_the_trainer():
    modules = _modules()
    for name in READERS:
        deps = _imports(modules[name])
        assert not deps & TRAINER, f"{name} imports trainer modules {sorted(deps & TRAINER)}"


def test_the_picture_can_fail():
    """The checker itself sees an upward import (so the tests above can fail)."""
    assert "tracker" in _imports(os.path.join(PKG, "__init__.py"))
    assert _layer("tracker") > _layer("consumer")
