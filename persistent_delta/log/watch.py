"""Waiting for a log to change without spinning: inotify on the logs' data files.

Owns: how a waiting reader sleeps. LMDB writes committed pages into ``data.mdb`` with
``pwrite`` (no ``writemap``), which raises inotify's ``IN_MODIFY`` on the file, so a waiting
poll sleeps in ``select`` and wakes within microseconds of a commit, using no CPU meanwhile.
Where inotify is missing (not Linux, or out of watches) it falls back to sleeping in short
steps. Either way the caller re-checks the log after every wake-up: an event says only that
something was written.
"""

from __future__ import annotations

import os
import select
import time
from typing import List

from persistent_delta.log.libc import libc

_IN_MODIFY = 0x00000002
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000
_FALLBACK_STEP_S = 0.002


class FileWatch:
    """Wakes when any of ``paths`` is written. Close it when done."""

    def __init__(self, paths: List[str]) -> None:
        self._fd = -1
        c = libc()
        if c is None or not hasattr(c, "inotify_init1"):  # inotify missing: wait by sleeping
            return
        fd = c.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            return
        for p in paths:
            if c.inotify_add_watch(fd, os.fsencode(p), _IN_MODIFY) < 0:
                os.close(fd)
                return
        self._fd = fd

    def wait(self, timeout: float) -> None:
        """Sleep until a watched file is written or ``timeout`` seconds pass."""
        if timeout <= 0:
            return
        if self._fd < 0:
            time.sleep(min(timeout, _FALLBACK_STEP_S))
            return
        ready, _, _ = select.select([self._fd], [], [], timeout)
        if ready:
            try:
                while os.read(self._fd, 65536):
                    pass
            except BlockingIOError:
                pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
