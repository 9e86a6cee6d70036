"""The C library of this process, loaded once without running a program.

Owns: how the log's modules reach libc (``madvise``, ``mincore``, ``inotify``, ``mallopt``).
``ctypes.util.find_library("c")`` runs ``/sbin/ldconfig -p`` in a child process: a replica
paid that fork at its first wait for a publish, and its child held a copy of every descriptor
(the consumer's claim lock included) until it ran ``ldconfig``, so a restart right after a
``SIGKILL`` could find the claim still held. ``dlopen(NULL)`` gives the running program's
symbols, libc's among them, with no child process.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Optional

_lock = threading.Lock()
_handle: Optional[ctypes.CDLL] = None
_loaded = False


def libc() -> Optional[ctypes.CDLL]:
    """This process's C library (``errno`` kept for ``ctypes.get_errno``), or None where it
    cannot be loaded. Callers check the functions they need (``AttributeError`` where missing)
    and set their ``argtypes``."""
    global _handle, _loaded
    with _lock:
        if not _loaded:
            _loaded = True
            try:
                _handle = ctypes.CDLL(None, use_errno=True)
            except OSError:
                _handle = None
        return _handle


__all__ = ["libc"]
