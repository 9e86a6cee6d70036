"""The window filter: the writer drops rows already recorded in the current read window.

Owns: which captured rows the writer may leave out. Why leaving them out changes no answer, and
where a reader inside a filtered window starts, is :mod:`persistent_delta.log.position_rules`'s.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta.log import position_rules
from persistent_delta.log.deltalog import WriteTxn
from persistent_delta.log.records import AppendRecord, is_row_id
from persistent_delta.log.rows import first_or_last


class WindowFilter:
    """Drops rows whose id was already recorded in the current read window.

    The window starts at the largest offset of the trainer's lookup consumers (where the next
    ``get_unique`` compacts from). For ``UpdateMode.FIRST`` and ``NONE`` a repeated id inside
    the window can never change any consumer's answer -- every consumer reads from an offset
    at or below the window start, and keeps each id's first occurrence -- so the writer does
    not write it: this is ``auto_compact`` done as the batches arrive, and it writes far fewer
    bytes when a few ids take most lookups. ``LAST`` keeps every occurrence. Records
    are filtered in log order, so repeats inside one record or across the records of one
    commit go too: every id is written once per window (the records it keeps are marked
    ``unique`` and need no per-batch dedup).

    While a ``POLL_COMMIT`` lookups consumer is registered the filter is off, so its polls are
    exactly-once. A position may still land inside a window filtered earlier (a consumer
    registered later that stops with ``poll(max_batches)``, an offset reset): every filtered
    record carries its window start, and readers start from there (:func:`persistent_delta.log.position_rules.read_start`), so
    such a position delivers ``[window_start, position)`` again -- at-least-once, never a lost
    row. Per table, a bitmap over shard-local ids; tables with ids beyond ``max_rows`` are not
    filtered, nor records with a negative id (both are written whole). Linear in the ids
    filtered (gathers and scatters into direct-address tables, no sort) for tables up to
    ``_SLOT_ROWS`` rows; bigger ones sort the ids not yet in the window. The id work is numpy on
    views of the tensors: a record is a few thousand ids, too few to amortise torch's per-call
    overhead.
    """

    _UNSET = torch.iinfo(torch.int64).max
    _SLOT_ROWS = 1 << 22  # tables up to this many rows dedup with a direct-address table (8 B/row)

    def __init__(self, mode: UpdateMode, max_rows: int = 1 << 26) -> None:
        self.enabled = mode in (UpdateMode.FIRST, UpdateMode.NONE)
        self._slot = np.empty(0, dtype=np.int64)  # scratch for _first_new, all _UNSET
        self._max_rows = max_rows
        self._seen: Dict[str, torch.Tensor] = {}
        self._start: Optional[int] = None
        self.rows_dropped = 0

    def reset(self) -> None:
        """Forget the window (after clear(), a restore, or a deletion outside retention)."""
        self._seen = {}
        self._start = None

    def _bitmap(self, fqn: str, need: int) -> torch.Tensor:
        bitmap = self._seen.get(fqn)
        if bitmap is None or bitmap.numel() < need:
            grown = torch.zeros(max(need, 2 * (0 if bitmap is None else bitmap.numel())), dtype=torch.bool)
            if bitmap is not None:
                grown[: bitmap.numel()] = bitmap
            bitmap = self._seen[fqn] = grown
        return bitmap

    def _first_new(self, ids: np.ndarray, bitmap: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Positions in ``ids`` (int64, each in ``[0, len(bitmap))``), ascending, of the first
        occurrence of each id not set in ``bitmap``, and those ids."""
        pos = np.flatnonzero(~bitmap[ids])
        cand = ids[pos]
        if pos.size == 0:
            return pos, cand
        if bitmap.size > self._SLOT_ROWS:  # sparse fallback: the FIRST rule's own (it sorts)
            _, first = first_or_last(torch.from_numpy(cand), UpdateMode.FIRST)
            first = np.sort(first.numpy())
            return pos[first], cand[first]
        if self._slot.size < bitmap.size:
            self._slot = np.full(bitmap.size, self._UNSET, dtype=np.int64)
        slot = self._slot  # direct-address table: first position per id, linear time
        np.minimum.at(slot, cand, pos)
        first = slot[cand] == pos
        slot[cand] = self._UNSET  # back to unset, touching only these ids
        if first.all():
            return pos, cand
        return pos[first], cand[first]

    def filter(self, w: WriteTxn, records: List[AppendRecord],
               lazy: bool = False) -> Tuple[List[AppendRecord], Callable[[], None]]:
        """Filter ``records`` inside the write transaction ``w``. The window is updated at once;
        returns the records to write and an ``undo`` to call if the transaction does not commit
        (it restores the window exactly). ``lazy``: a record that keeps some rows of 2-D states
        holds them as ``rows`` of its block (gathered when encoded, see
        :func:`persistent_delta.log.records.encode_records`) instead of a gathered copy."""
        if not self.enabled:
            return records, lambda: None
        consumers = w.consumers()
        if position_rules.has_poll_commit_reader(consumers):
            self.reset()  # exactly-once for consumers that poll and commit apart: no filtering
            return records, lambda: None
        start = max((v.offset for v in position_rules.lookups_consumers(consumers).values()), default=0)
        old_seen, old_start = self._seen, self._start
        same_window = start == self._start
        self._seen = dict(old_seen) if same_window else {}
        self._start = start
        marked: List[Tuple[str, torch.Tensor]] = []  # (fqn, ids newly set), for undo
        out: List[AppendRecord] = []
        dropped = 0
        for r in records:
            n = r.ids.numel()
            if r.batch_idx < start:
                out.append(r)
                continue
            ids_np = None
            if n and r.ids.device.type == "cpu":
                ids_np = (r.ids if r.ids.dtype == torch.int64 else r.ids.long()).numpy()
            top = 0 if ids_np is None else int(ids_np.max()) + 1
            if ids_np is None or top > self._max_rows or not is_row_id(int(ids_np.min())):
                # written whole (a negative id reaches the codec's check and raises there), but
                # it still carries the window start: a reader positioned at
                # this batch must start at the window (records of the batch it joins may be
                # filtered)
                out.append(AppendRecord(r.batch_idx, r.fqn, r.ids, r.states, r.kind, start, r.unique))
                continue
            bitmap = self._bitmap(r.fqn, top)
            keep_np, ids_np = self._first_new(ids_np, bitmap.numpy())
            keep, ids = torch.from_numpy(keep_np), torch.from_numpy(ids_np)
            if keep.numel() == n:
                r = AppendRecord(r.batch_idx, r.fqn, r.ids, r.states, r.kind, window_start=start, unique=True)
            else:
                # (a record whose rows were all recorded already is still written, empty:
                # it carries the window start that readers positioned after it need)
                dropped += n - keep.numel()
                kept = ids if r.ids.dtype == torch.int64 else ids.to(r.ids.dtype)
                if lazy and r.states is not None and r.states.dim() == 2:
                    r = AppendRecord(r.batch_idx, r.fqn, kept, r.states, r.kind, start, unique=True, rows=keep)
                else:
                    states = None if r.states is None else r.states.index_select(0, keep)
                    r = AppendRecord(r.batch_idx, r.fqn, kept, states, r.kind, start, unique=True)
            if ids_np.size:
                bitmap.numpy()[ids_np] = True
                marked.append((r.fqn, ids))
            out.append(r)
        self.rows_dropped += dropped

        def undo() -> None:
            if same_window:  # bitmaps are shared with old_seen (or grown copies of them)
                for fqn, ids in marked:
                    bitmap = old_seen.get(fqn)
                    if bitmap is not None:
                        bitmap.index_fill_(0, ids[ids < bitmap.numel()], False)  # each was unset before
            self._seen, self._start = old_seen, old_start
            self.rows_dropped -= dropped

        return out, undo
