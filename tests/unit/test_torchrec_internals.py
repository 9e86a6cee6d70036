"""TorchRec and FBGEMM internals are read in one module: ``persistent_delta.torchrec_internals``.

Every module of the layers that handle TorchRec objects (the trainer, the serving side, the
TorchRec adapters) reaches a private attribute of a TorchRec or FBGEMM object only
through its named functions, so a TorchRec upgrade that renames one breaks in one place.
"""

from __future__ import annotations

import ast
import pathlib
from typing import List

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "persistent_delta"
LAYERS = ("trainer", "serve", "adapters")  # the layers that hold TorchRec modules
HOME = "torchrec_internals.py"  # at the top level of the package, where every layer reaches it
# Private attributes of the library's own objects, reached from the module that defines them.
OWN = {"_dmp"}  # the tracker's DMP, set by tracker.attach()


def private_reads(source: str) -> List[str]:
    """``obj._name`` on anything but ``self``/``cls``, and ``getattr``/``hasattr``/``setattr``
    with a ``"_name"`` string on anything but them, as ``line: expression``."""
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
            on_self = isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls")
            if value.startswith("_") and not value.startswith("__") and not on_self:
                name = value
        if name is not None and name not in OWN:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_torchrec_internals_reads_private_attributes():
    assert (PACKAGE / HOME).is_file()
    offenders = {
        f"{layer}/{path.name}": reads
        for layer in LAYERS
        for path in sorted((PACKAGE / layer).glob("*.py"))
        if (reads := private_reads(path.read_text()))
    }
    assert offenders == {}, f"private attributes read outside {HOME}: {offenders}"


def test_the_check_sees_a_private_read():
    assert private_reads("def f(m):\n    return m._emb_module\n") == ["2: m._emb_module"]
    assert private_reads("def f(m):\n    return getattr(m, '_lookups', [])\n") == ["2: getattr(m, '_lookups', [])"]
    assert private_reads("class A:\n    def f(self):\n        return self._x\n") == []
    assert private_reads("class A:\n    def f(self):\n        return getattr(self, '_x', None)\n") == []
