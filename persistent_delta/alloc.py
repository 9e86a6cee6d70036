"""glibc allocator thresholds for LMDB's write buffers and a reader's results.

Owns: the process-wide malloc tuning a writer or a reader may opt into.

Without ``writemap`` LMDB copies every value into page buffers it ``malloc``\\ s per commit and
frees afterwards. glibc serves large buffers with ``mmap`` and returns freed heap tops to the OS,
so each commit page-faults its buffers in afresh: transactions with large values were 2.5-4x
slower here (see ``benchmarks/append_throughput.py``). A reader meets the same with results
glibc returned to the OS after the previous poll (fresh pages cost ~0.45 ms per MB to fault in
on this VM). A poll's rows are one allocation (``results.finish_ranks``), which glibc keeps by
itself while it is under 32 MiB; larger polls, and other readers' results, need this. Raising
``M_MMAP_THRESHOLD`` (to 32 MiB, glibc's maximum) and ``M_TRIM_THRESHOLD`` (to 512 MiB) keeps
those buffers in the heap.

The setting is process-wide: the process keeps up to 512 MiB of freed heap memory for reuse
instead of returning it, and blocks below 32 MiB come from the heap instead of their own
mappings. It also changes what everything else in the process allocates (torch tensors
included), so it is **opt-in**: ``LogOptions(tune_malloc=True)``,
``PersistentTrackerConfig(tune_malloc=True)`` or ``PERSISTENT_DELTA_TUNE_MALLOC=1``. It is
applied once per process, when a log is opened (for writing or reading), and skipped when the process
already sets glibc's ``MALLOC_*_`` tunables in its environment, or off glibc (another
allocator, e.g. jemalloc via ``LD_PRELOAD``, ignores ``mallopt``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from typing import Optional

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 512 << 20
_USER_TUNABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")

_lock = threading.Lock()
_applied: Optional[bool] = None


def tune_malloc() -> bool:
    """Apply the thresholds above once per process; returns whether they are in effect."""
    global _applied
    with _lock:
        if _applied is not None:
            return _applied
        _applied = False
        user = [k for k in _USER_TUNABLES if k in os.environ]
        if user:
            logger.info("malloc thresholds left as set by the environment (%s)", ", ".join(user))
            return False
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name or "libc.so.6")
            mallopt = libc.mallopt
            libc.gnu_get_libc_version  # noqa: B018 - glibc only
        except (OSError, AttributeError):
            return False
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        if _applied:
            logger.debug("glibc mmap threshold %d, trim threshold %d", MMAP_THRESHOLD, TRIM_THRESHOLD)
        return _applied


__all__ = ["tune_malloc"]
