"""glibc allocator thresholds for LMDB's write buffers, and a reader's reused result buffers.

Owns: the process-wide malloc tuning a writer or a reader may opt into
(:func:`tune_malloc`), and the recycling of a consumer's poll buffers once the caller has
released every tensor of an earlier poll (:class:`ResultBuffers`).

Without ``writemap`` LMDB copies every value into page buffers it ``malloc``\\ s per commit and
frees afterwards. glibc serves large buffers with ``mmap`` and returns freed heap tops to the OS,
so each commit page-faults its buffers in afresh, which dominates transactions with large
values (``benchmarks/append_throughput.py``). A reader meets the same with results glibc
returned to the OS after the previous poll. A consumer's polls do not need this: their row buffers come from
:class:`ResultBuffers`, which the consumer reuses itself; other readers' results (a
``read_range`` of its own, tools) do. Raising
``M_MMAP_THRESHOLD`` (to 32 MiB, glibc's maximum) and ``M_TRIM_THRESHOLD`` (to 512 MiB) keeps
those buffers in the heap.

The setting is process-wide: the process keeps up to 512 MiB of freed heap memory for reuse
instead of returning it, and blocks below 32 MiB come from the heap instead of their own
mappings. It also changes what everything else in the process allocates (torch tensors
included), so it is **opt-in**. A tracker's own per-step memory needs none of it (EMBEDDING's
captured rows and ``get_unique``'s results are reused :class:`ResultBuffers` blocks); in a
training process it then mostly changes how often the model's own tensors are faulted in,
which glibc's defaults decide from the process's allocation history (benchmarks/README.md, "The
step by CPU time, round 2"). To opt in: ``LogOptions(tune_malloc=True)``,
``PersistentTrackerConfig(tune_malloc=True)`` or ``PERSISTENT_DELTA_TUNE_MALLOC=1``. It is
applied once per process, when a log is opened (for writing or reading), and skipped when the process
already sets glibc's ``MALLOC_*_`` tunables in its environment, or off glibc (another
allocator, e.g. jemalloc via ``LD_PRELOAD``, ignores ``mallopt``).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
from typing import List, Optional

import torch

from persistent_delta.errors import InvalidInputError
from persistent_delta.log.libc import libc

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
        c = libc()
        if c is None or not hasattr(c, "gnu_get_libc_version"):  # glibc only
            return False
        mallopt = c.mallopt
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        if _applied:
            logger.debug("glibc mmap threshold %d, trim threshold %d", MMAP_THRESHOLD, TRIM_THRESHOLD)
        return _applied


class ResultBuffers:
    """A reader's poll buffers, handed out again once nothing views them.

    A poll's rows are one block of memory (``read.fetch.finish_ranks``) that the poll's tensors
    view, and that the caller may keep as long as it likes. A fresh block costs a page fault
    per 4 KiB page the first time it is written, many times the poll's own work while a trainer
    keeps the cores busy, and glibc hands out fresh pages whenever a poll's size passes its
    mmap threshold or it trims its heap: a replica's freshness tail.

    Each block here is an anonymous mapping that the poll's tensors hold a reference to
    (``torch.frombuffer``). When the caller has dropped every tensor of a poll, only this
    object refers to the block, and the next poll that fits reuses it with its pages already
    in place. Nothing is reused while any view of it is alive, so results stay the caller's.

    Memory: at most ``keep`` blocks stay referenced here (two: a loop that polls while it still
    holds the previous poll alternates between them). A new block is sized ``HEADROOM`` times
    the request, in whole pages; a free block is reused when the request fits and the block is
    at most ``REUSE_RATIO`` times it, and a free block larger than that (a catch-up poll's) is
    released at that request instead of kept idle. The idle memory is at most ``keep`` blocks
    of ``HEADROOM`` to ``REUSE_RATIO`` times a recent poll.
    """

    HEADROOM = 1.25
    REUSE_RATIO = 4
    _PAGE = mmap.PAGESIZE

    def __init__(self, keep: int = 2) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise InvalidInputError(f"keep must be a count >= 1, got {keep!r}")
        self._keep = keep
        self._blocks: List[mmap.mmap] = []  # oldest first
        self.reused = self.allocated = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of ``nbytes`` (contents undefined) over a block no tensor views."""
        if nbytes <= 0:
            return torch.empty(0, dtype=torch.uint8)
        limit = max(self.REUSE_RATIO * nbytes, self._size(nbytes))
        i = 0
        while i < len(self._blocks):  # (indexed, no loop variable: it would be one more reference)
            if self._free(i):
                size = len(self._blocks[i])
                if nbytes <= size <= limit:
                    self._blocks.append(self._blocks.pop(i))  # most recently used last
                    self.reused += 1
                    return torch.frombuffer(self._blocks[-1], dtype=torch.uint8, count=nbytes)
                if size > limit:  # a catch-up poll's block: released, not kept idle for small polls
                    del self._blocks[i]
                    continue
            i += 1
        block = mmap.mmap(-1, self._size(nbytes))
        self._blocks.append(block)
        if len(self._blocks) > self._keep:
            self._drop_one()
        self.allocated += 1
        return torch.frombuffer(block, dtype=torch.uint8, count=nbytes)

    def resize(self, keep: int) -> None:
        """Keep up to ``keep`` (>= 1) blocks from now on (fewer: the extra free ones go now)."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise InvalidInputError(f"keep must be a count >= 1, got {keep!r}")
        self._keep = keep
        while len(self._blocks) > keep:
            self._drop_one()

    def _size(self, nbytes: int) -> int:
        return -(-int(nbytes * self.HEADROOM) // self._PAGE) * self._PAGE

    def _drop_one(self) -> None:
        """Forget one block: a free one first (unmapped now), else the oldest (unmapped when
        the caller's last tensor of it goes)."""
        for i in range(len(self._blocks) - 1):
            if self._free(i):
                del self._blocks[i]
                return
        del self._blocks[0]

    def _free(self, i: int) -> bool:
        """No tensor views block ``i``: its only references are the list's and getrefcount's
        argument (each live tensor storage over it holds one more)."""
        return sys.getrefcount(self._blocks[i]) == 2

    def clear(self) -> None:
        """Forget every block (a closed reader's; those still viewed live on with their tensors)."""
        self._blocks.clear()

    def held_bytes(self) -> int:
        """Bytes of the blocks referenced here (in use by results or idle)."""
        return sum(len(b) for b in self._blocks)


__all__ = ["ResultBuffers", "tune_malloc"]
