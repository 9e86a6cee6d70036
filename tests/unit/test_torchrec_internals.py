"""TorchRec and FBGEMM internals are read in one module: ``persistent_delta.trainer.torchrec_internals``.

Every other module of the trainer reaches a private attribute of a TorchRec or FBGEMM object
only through its named functions, so a TorchRec upgrade that renames one breaks in one place.
"""

from __future__ import annotations

import ast
import pathlib
from typing import List

TRAINER = pathlib.Path(__file__).resolve().parents[2] / "persistent_delta" / "trainer"
HOME = "torchrec_internals.py"
# Private attributes of the library's own objects, reached from the module that defines them.
OWN = {"_dmp"}  # the tracker's DMP, set by tracker.attach()


def private_reads(source: str) -> List[str]:
    """``obj._name`` on anything but ``self``/``cls``, and ``getattr``/``hasattr``/``setattr``
    with a ``"_name"`` string, as ``line: expression``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        name = None
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                name = node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            value = node.args[1].value
            if value.startswith("_") and not value.startswith("__"):
                name = value
        if name is not None and name not in OWN:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_torchrec_internals_reads_private_attributes():
    offenders = {
        path.name: reads
        for path in sorted(TRAINER.glob("*.py"))
        if path.name != HOME and (reads := private_reads(path.read_text()))
    }
    assert offenders == {}, f"private attributes read outside {HOME}: {offenders}"


def test_the_check_sees_a_private_read():
    assert private_reads("def f(m):\n    return m._emb_module\n") == ["2: m._emb_module"]
    assert private_reads("def f(m):\n    return getattr(m, '_lookups', [])\n") == ["2: getattr(m, '_lookups', [])"]
    assert private_reads("class A:\n    def f(self):\n        return self._x\n") == []
