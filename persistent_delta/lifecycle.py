"""Handles left open: closed at interpreter exit, warned about when garbage-collected open.

Owns: what happens to an object nobody closed. A tracker left open at interpreter exit is
closed by :func:`close_at_exit` (its recorded batches are committed and flushed: nothing is lost
to a forgotten ``close()``); a consumer is *not* committed implicitly (that would break
at-least-once delivery) -- only its handles are released. Both warn with a ``ResourceWarning``
when garbage-collected open (:func:`warn_unclosed`), as files and sockets do.
"""

from __future__ import annotations

import atexit
import logging
import threading
import warnings
import weakref
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class Closable(Protocol):
    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...


_OPEN: "weakref.WeakSet[Any]" = weakref.WeakSet()
_LOCK = threading.Lock()


def close_at_exit(obj: Closable) -> None:
    """Close ``obj`` at interpreter exit if it is still open then."""
    with _LOCK:
        _OPEN.add(obj)


@atexit.register
def _close_open() -> None:
    with _LOCK:
        left = list(_OPEN)
    for obj in left:
        if obj.closed:
            continue
        logger.warning("closing %r at interpreter exit (it was never closed)", obj)
        try:
            obj.close()
        except Exception as exc:  # noqa: BLE001 - at exit there is no caller to raise to
            logger.error("closing %r at exit failed: %s", obj, exc)


def warn_unclosed(obj: Closable, what: str) -> None:
    """From ``__del__``: warn when ``obj`` is garbage-collected open."""
    if not getattr(obj, "_closed", True):
        warnings.warn(f"{what} was garbage-collected without close()", ResourceWarning, stacklevel=2)
