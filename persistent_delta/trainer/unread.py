"""The ids each publishing consumer has not read yet, kept as the writer commits them.

Owns: the unread ids that spare a publish the read of its consumer's unread ids from the
log (:func:`persistent_delta.trainer.consume.consume_read_ids` asks whether it may answer).

Design note
-----------
A publish needs the ids of the rows changed since its consumer's last read. Reading them from
the log costs the training thread a read transaction, a pass over every record since that
position and a merge of their ids. The writer already holds every step's records when it
commits them, so after each commit it marks their ids (all ids looked up, before the window
filter drops any: the answer must not depend on where a window started) in an unread set per
publishing consumer: a bitmap over the shard's rows (numpy, one byte a row, for shards up to
:data:`DENSE_ROWS` rows; ids outside it, and bigger shards, go to a list of id tensors merged on
the writer thread whenever it outgrows what it merged). A publish then takes its consumer's
unread set (a swap under a lock, :meth:`UnreadIds.take`), which starts a new one at the
position the publish moves the consumer to, and on the training thread adds the records
handed to the writer and not committed yet and lists the marked ids (:meth:`UnreadIds.unread`).

Nothing is missed between the two threads: the writer marks a commit's records *before* they
leave its queue, and a publish takes the records still queued (``pending``) *before* it takes
the unread set. A record is thus in one or the other, or in both (counted once).

An unread set answers only when it provably equals the log's answer
(:func:`persistent_delta.trainer.consume.consume_read_ids` checks): it was started by the
consumer's previous publish at the position the consumer still holds, the consumer is not
expired, nothing was deleted at or after it, and a read there starts there. Records written
to the log by anything but the writer (a restore's re-delivery) and deletions (``clear``) make
the tracker drop every unread set (:meth:`UnreadIds.drop`). Without an unread set that
answers (a consumer's first publish in this process, after a restart or a restore), the
publish reads the log, once, and marks unread ids from there on. (A ``get_unique`` of a publishing
consumer is refused: :mod:`persistent_delta.trainer.consume`.)

Memory: per consumer that publishes, per table, two bitmaps of one byte per local row (the one
filling and a spare), or for shards over :data:`DENSE_ROWS` rows at most about twice its
distinct unread ids (int64).
"""

from __future__ import annotations

import logging
import threading
from typing import Dict, Iterable, List, Mapping, Optional, Sequence

import numpy as np
import torch

from persistent_delta.log.codec import SIDE_KINDS
from persistent_delta.log.records import AppendRecord

logger = logging.getLogger(__name__)

__all__ = ["DENSE_ROWS", "UnreadIds", "UnreadSince"]

DENSE_ROWS = 1 << 22  # shards up to this many rows mark their ids in a bitmap (one byte a row)
_CLEAR_BY_ID = 32  # a bitmap is cleared id by id when it holds fewer ids than 1/32 of its rows
_MERGE_AT = 1 << 16  # a list of ids is merged once its unmerged ids exceed this and what it merged


class _TableIds:
    """One table's marked ids: a bitmap over ``[0, rows)`` (or none), and id tensors."""

    __slots__ = ("bitmap", "parts", "unmerged", "merged", "dtype")

    def __init__(self, bitmap: Optional[np.ndarray]) -> None:
        self.bitmap = bitmap
        self.parts: List[torch.Tensor] = []
        self.unmerged = 0
        self.merged = 0
        self.dtype: Optional[torch.dtype] = None

    def add(self, ids: torch.Tensor) -> None:
        if ids.device.type != "cpu":
            ids = ids.cpu()
        self.dtype = ids.dtype if self.dtype is None else torch.promote_types(self.dtype, ids.dtype)
        rest = ids
        if self.bitmap is not None and ids.dtype in (torch.int64, torch.int32):
            a = ids.numpy()
            lo, hi = int(a.min()), int(a.max())
            if lo >= 0 and hi < self.bitmap.size:
                self.bitmap[a] = True
                return
            inside = (a >= 0) & (a < self.bitmap.size)
            self.bitmap[a[inside]] = True
            rest = ids[torch.from_numpy(~inside)]  # (kept: a negative id must still reach check_row_ids)
        self.parts.append(rest.long())
        self.unmerged += int(rest.numel())
        if self.unmerged > max(_MERGE_AT, self.merged):
            self.parts = [torch.unique(torch.cat(self.parts))]
            self.merged, self.unmerged = int(self.parts[0].numel()), 0

    def ids(self) -> Optional[torch.Tensor]:
        """The marked ids, ascending and unique (None: none)."""
        found = None
        if self.bitmap is not None:
            found = torch.from_numpy(np.flatnonzero(self.bitmap))
        if self.parts:
            found = torch.unique(torch.cat(self.parts if found is None else [found, *self.parts]))
        if found is None or found.numel() == 0:
            return None
        assert self.dtype is not None
        return found if found.dtype == self.dtype else found.to(self.dtype)


class UnreadSince:
    """A consumer's unread set: the ids of the lookups records with ``batch_idx >= start``
    committed since it was opened (per table)."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.tables: Dict[str, _TableIds] = {}


class UnreadIds:
    """Per publishing consumer, the ids of the rows changed since its last publish.

    Thread-safety: :meth:`add` runs on the writer thread (or the training thread, without a
    background writer), the others on the training thread; one lock orders them.

    Args:
        rows: fqn -> local rows of each tracked table (those not listed are not tracked).
    """

    def __init__(self, rows: Mapping[str, int]) -> None:
        self._rows = dict(rows)
        self._lock = threading.Lock()
        self._open: Dict[str, UnreadSince] = {}
        self._spare: Dict[str, List[np.ndarray]] = {}  # fqn -> clean bitmaps
        self.log_reads = 0  # publishes whose unread ids were read from the log (none answered)

    def _table(self, acc: UnreadSince, fqn: str) -> _TableIds:
        t = acc.tables.get(fqn)
        if t is None:
            rows = self._rows[fqn]
            bitmap = None
            if rows <= DENSE_ROWS:
                spare = self._spare.get(fqn)
                bitmap = spare.pop() if spare else np.zeros(rows, dtype=np.bool_)
            t = acc.tables[fqn] = _TableIds(bitmap)
        return t

    def add(self, records: Iterable[AppendRecord]) -> None:
        """Mark the ids of ``records``, just committed, in every unread set they belong to
        (lookups records of a listed table at or after its start). Call it before the
        records leave the writer's queue (see the module docs)."""
        with self._lock:
            if not self._open:
                return
            try:
                for rec in records:
                    if rec.kind in SIDE_KINDS or rec.fqn not in self._rows or rec.ids.numel() == 0:
                        continue
                    for acc in self._open.values():
                        if rec.batch_idx >= acc.start:
                            self._table(acc, rec.fqn).add(rec.ids)
            except Exception:  # noqa: BLE001 - never the writer's failure: the next publishes read the log
                logger.exception("unread ids: marking them failed; the next publishes read the log")
                self._open.clear()

    def take(self, name: str, start: int) -> Optional[UnreadSince]:
        """``name``'s unread set so far (None: it has none), and a new one from ``start`` (the
        position the publish moves it to). Call it after taking the pending records."""
        with self._lock:
            acc = self._open.get(name)
            self._open[name] = UnreadSince(start)
        return acc

    def drop(self, name: Optional[str] = None) -> None:
        """Forget ``name``'s unread set (None: every one): its next publish reads the log."""
        with self._lock:
            if name is None:
                self._open.clear()
            else:
                self._open.pop(name, None)

    def unread(self, acc: UnreadSince, pending: Sequence[AppendRecord] = ()) -> Dict[str, torch.Tensor]:
        """The ids of ``acc`` (taken) and of ``pending`` (records handed to the writer and not
        committed; those at or after its start), ascending and unique per table; tables with
        none are left out. ``acc`` is used up: its bitmaps are cleared and kept for reuse."""
        for rec in pending:
            if rec.kind not in SIDE_KINDS and rec.fqn in self._rows and rec.batch_idx >= acc.start and rec.ids.numel():
                self._table_unlocked(acc, rec.fqn).add(rec.ids)
        out: Dict[str, torch.Tensor] = {}
        for fqn, t in acc.tables.items():
            ids = t.ids()
            if ids is not None:
                out[fqn] = ids
            if t.bitmap is not None:
                if ids is not None and ids.numel() * _CLEAR_BY_ID < t.bitmap.size:
                    inside = ids[(ids >= 0) & (ids < t.bitmap.size)] if t.parts else ids
                    t.bitmap[inside.numpy()] = False
                elif ids is not None:
                    t.bitmap.fill(False)  # (a memset: cheaper than a scatter of many ids)
                with self._lock:
                    self._spare.setdefault(fqn, []).append(t.bitmap)
        acc.tables = {}
        return out

    def _table_unlocked(self, acc: UnreadSince, fqn: str) -> _TableIds:
        with self._lock:  # (the spare bitmaps are shared with the writer thread)
            return self._table(acc, fqn)
