"""The package tier of the supported surface: the names ``persistent_delta.<package>`` exports.

Owns: :func:`lazy_exports`, the one way a package's ``__init__`` re-exports its supported names.

The surface has two tiers: the top level (``persistent_delta``, every error in
``persistent_delta.errors``) and, per package, the names its ``__init__`` lists in
``__all__`` -- ``from persistent_delta.fleet import RemoteConsumer``. Every other module path is
internal and may move between releases (the CHANGELOG lists moves). A package's names are
imported on first use, not with the package: importing one module of a package costs no more
than before, an optional dependency (``prometheus_client``, ``nats-py``) is needed only by the
names that use it, and no import cycle can run through an ``__init__``.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, List, Mapping, Tuple


def lazy_exports(package: str, exports: Mapping[str, str]) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of a package that re-exports ``exports``.

    Args:
        package: the package's ``__name__``.
        exports: each exported name -> the module of the package that defines it (``"consumer"``
            for ``persistent_delta.read.consumer``). A name must not be a submodule's name.

    Returns:
        ``(__getattr__, __dir__)``: assign them in the package's ``__init__``.
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(importlib.import_module(package), name, value)  # the next lookup is a plain attribute
        return value

    def __dir__() -> List[str]:
        return sorted(set(vars(importlib.import_module(package))) | set(exports))

    return __getattr__, __dir__


__all__ = ["lazy_exports"]
