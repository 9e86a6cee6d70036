"""The public surface: a small set of names by role at the package root, every error in
``persistent_delta.errors``, every exception a subclass of ``PersistentDeltaError``."""

from __future__ import annotations

import ast
import inspect
import os

import persistent_delta
from persistent_delta import errors

PKG = os.path.dirname(persistent_delta.__file__)


def test_the_root_exports_a_small_surface_that_imports():
    assert len(persistent_delta.__all__) <= 25
    assert len(set(persistent_delta.__all__)) == len(persistent_delta.__all__)
    for name in persistent_delta.__all__:
        assert getattr(persistent_delta, name) is not None, name


def test_every_error_lives_in_errors_and_derives_from_the_base():
    defined_elsewhere = []
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if not f.endswith(".py") or os.path.join(dirpath, f) == errors.__file__:
                continue
            path = os.path.join(dirpath, f)
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.ClassDef) and node.name.endswith(("Error", "Exception")):
                    defined_elsewhere.append(f"{os.path.relpath(path, PKG)}: {node.name}")
    assert not defined_elsewhere, defined_elsewhere
    found = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, BaseException)]
    assert len(found) > 10
    for cls in found:
        assert cls is errors.PersistentDeltaError or issubclass(cls, errors.PersistentDeltaError), cls
