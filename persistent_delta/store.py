"""``LmdbDeltaStore``: TorchRec's ``DeltaStore`` on a durable LMDB log.

A drop-in for ``DeltaStoreTrec`` with the same semantics, except where listed:

* records survive ``close()`` and process crashes; reopening the path gives back exactly what
  was there;
* ``get_unique`` returns empty tensors for a table with nothing left (TorchRec raises);
* ids come back in ascending order (TorchRec's order is unspecified);
* appending a ``batch_idx`` lower than the table's last one is refused (the log is append-only),
  as are float or negative ids, states whose rows differ from the ids, and missing states when
  the update mode needs them.

Each public mutation (``append``, ``delete``, ``compact``) is one LMDB write transaction.
"""

from __future__ import annotations

import logging
import os
import types
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torchrec.distributed.model_tracker.delta_store import DeltaStore
from torchrec.distributed.model_tracker.types import IndexedLookup, UniqueRows, UpdateMode

from persistent_delta import codec
from persistent_delta.config import Durability, LogOptions
from persistent_delta.errors import InvalidInputError
from persistent_delta.log import RECORDS, DeltaLog, ReadTxn, TableEntry, WriteTxn
from persistent_delta.merge import compute_unique_rows

logger = logging.getLogger(__name__)

_MAX_BATCH_IDX = (1 << 63) - 1


@dataclass
class AppendRecord:
    """One record to append: ``ids`` (1-D integer) and optional ``states`` of ``len(ids)`` rows."""

    batch_idx: int
    fqn: str
    ids: torch.Tensor
    states: Optional[torch.Tensor] = None
    kind: int = codec.KIND_LOOKUP
    window_start: Optional[int] = None  # set by the writer's window filter (see codec)
    unique: bool = False  # no id twice (set by the window filter; lets the writer skip its dedup)


def check_batch_idx(batch_idx: object, what: str = "batch_idx") -> int:
    """Validate a batch index (a non-negative int); returns it."""
    if isinstance(batch_idx, bool) or not isinstance(batch_idx, int):
        raise InvalidInputError(f"{what} must be an int, got {type(batch_idx).__name__}")
    if batch_idx < 0 or batch_idx > _MAX_BATCH_IDX:
        raise InvalidInputError(f"{what} must be in [0, 2**63), got {batch_idx}")
    return batch_idx


def validate_record(rec: AppendRecord, mode: UpdateMode) -> None:
    """Raise :class:`InvalidInputError` unless ``rec`` can be stored under ``mode``."""
    check_batch_idx(rec.batch_idx)
    if not isinstance(rec.fqn, str) or not rec.fqn:
        raise InvalidInputError(f"fqn must be a non-empty string, got {rec.fqn!r}")
    ids = rec.ids
    if not isinstance(ids, torch.Tensor):
        raise InvalidInputError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in codec.INTEGER_ID_DTYPES:
        raise InvalidInputError(f"ids of {rec.fqn!r} must have an integer dtype, got {ids.dtype}")
    if ids.dim() != 1:
        raise InvalidInputError(f"ids of {rec.fqn!r} must be 1-D, got shape {tuple(ids.shape)}")
    if ids.numel() and ids.dtype.is_signed and bool((ids < 0).any()):
        raise InvalidInputError(f"ids of {rec.fqn!r} must be non-negative row ids")
    states = rec.states
    if states is None:
        if mode != UpdateMode.NONE:
            raise InvalidInputError(f"update mode {mode.name} needs states for every record of {rec.fqn!r}")
        return
    if not isinstance(states, torch.Tensor):
        raise InvalidInputError(f"states must be a torch.Tensor or None, got {type(states).__name__}")
    if states.dim() == 0 or states.shape[0] != ids.numel():
        raise InvalidInputError(
            f"states of {rec.fqn!r} must have one row per id: {ids.numel()} ids, states shape {tuple(states.shape)}"
        )
    codec.dtype_name(states.dtype)


def encode_records(records: Sequence[AppendRecord], mode: UpdateMode) -> List[Tuple[AppendRecord, bytes]]:
    """Validate and encode ``records`` (done outside the write transaction)."""
    out = []
    for rec in records:
        validate_record(rec, mode)
        out.append((rec, codec.encode_record(rec.ids, rec.states, rec.kind, rec.window_start)))
    return out


def write_records(w: WriteTxn, encoded: Sequence[Tuple[AppendRecord, bytes]]) -> int:
    """Append encoded records inside a write transaction; returns bytes written.

    Refuses (before writing anything) a batch_idx lower than its table's last one.
    """
    entries: Dict[str, TableEntry] = {}
    for rec, _ in encoded:
        entry = entries.get(rec.fqn) or w.ensure_table(rec.fqn)
        if rec.batch_idx < entry.last_batch_idx:
            raise InvalidInputError(
                f"batch_idx {rec.batch_idx} for {rec.fqn!r} is lower than its last appended batch_idx "
                f"{entry.last_batch_idx}: the log is append-only"
            )
        entries[rec.fqn] = entry
        if rec.batch_idx > entry.last_batch_idx or not entry.listed or entry.states_dtype is None:
            entry = _touch(entry, rec)
            entries[rec.fqn] = entry
    nbytes = 0
    for rec, value in encoded:
        w.put_record(entries[rec.fqn].table_id, rec.batch_idx, value)
        nbytes += len(value)
    for fqn, entry in entries.items():
        before = w.table(fqn)
        if before is None or before.to_bytes() != entry.to_bytes():
            w.stage_table(entry)
    return nbytes


def _touch(entry: TableEntry, rec: AppendRecord) -> TableEntry:
    e = entry.copy()
    e.last_batch_idx = max(e.last_batch_idx, rec.batch_idx)
    e.listed = True
    e.ids_dtype = codec.dtype_name(rec.ids.dtype)
    if rec.states is not None:
        e.states_dtype = codec.dtype_name(rec.states.dtype)
        e.states_tail = [int(d) for d in rec.states.shape[1:]]
    return e


def read_unique(
    r: ReadTxn,
    mode: UpdateMode,
    from_idx: int = 0,
    end_idx: Optional[int] = None,
    tables: Optional[Sequence[str]] = None,
    listed_only: bool = True,
    db: str = RECORDS,
) -> Dict[str, UniqueRows]:
    """Unique rows per table over records with ``from_idx <= batch_idx < end_idx`` (half-open).

    A table with no records in range gets empty tensors. Results own their memory. ``db`` is
    ``RECORDS`` (lookups) or ``SNAPSHOTS`` (published values; merge those with ``LAST``).
    """
    out: Dict[str, UniqueRows] = {}
    for fqn, entry in r.tables().items():
        if listed_only and not entry.listed:
            continue
        if tables is not None and fqn not in tables:
            continue
        ids: List[torch.Tensor] = []
        states: List[torch.Tensor] = []
        for rec in r.iter_records(entry.table_id, from_idx, end_idx, db=db):
            ids.append(rec.ids)
            if rec.states is not None:
                states.append(rec.states)
        if not ids:
            out[fqn] = UniqueRows(ids=entry.empty_ids(), states=None if mode == UpdateMode.NONE else entry.empty_states())
            continue
        use_states = None if mode == UpdateMode.NONE else states
        out[fqn] = compute_unique_rows(ids, use_states, mode)
    return out


def compact_range(w: WriteTxn, mode: UpdateMode, start_idx: int, end_idx: int) -> Dict[str, int]:
    """Per table, merge two or more records in ``[start_idx, end_idx)`` into one record stamped
    ``start_idx`` (FIRST/LAST rule). Returns records merged per table."""
    merged: Dict[str, int] = {}
    for fqn, entry in w.tables().items():
        ids: List[torch.Tensor] = []
        states: List[torch.Tensor] = []
        for rec in w.iter_records(entry.table_id, start_idx, end_idx):
            # Copy: the views die when their pages are deleted below.
            ids.append(rec.ids.clone())
            if rec.states is not None:
                states.append(rec.states.clone())
        if len(ids) <= 1:
            continue
        if mode == UpdateMode.NONE:
            rows = compute_unique_rows(ids, None, mode)
        else:
            rows = compute_unique_rows(ids, states, mode)
        w.delete_records(entry.table_id, start_idx, end_idx)
        w.put_record(entry.table_id, start_idx, codec.encode_record(rows.ids, rows.states))
        merged[fqn] = len(ids)
    return merged


def delete_below(w: WriteTxn, up_to_idx: Optional[int]) -> Tuple[int, int]:
    """Delete records with ``batch_idx < up_to_idx`` (all when None); returns (records, bytes).

    ``None`` also unlists every table, as ``DeltaStoreTrec.delete()`` forgets them.
    """
    n = nbytes = 0
    if up_to_idx is None:
        w.raise_log_start(max((e.last_batch_idx for e in w.tables().values()), default=-1) + 1)
        for entry in w.tables().values():
            rn, rb = w.delete_records(entry.table_id, 0, None)
            n, nbytes = n + rn, nbytes + rb
            if entry.listed:
                e = entry.copy()
                e.listed = False
                w.stage_table(e)
        return n, nbytes
    w.raise_log_start(up_to_idx)
    for entry in w.tables().values():
        rn, rb = w.delete_records(entry.table_id, 0, up_to_idx)
        n, nbytes = n + rn, nbytes + rb
    return n, nbytes


class LmdbDeltaStore(DeltaStore):
    """TorchRec ``DeltaStore`` whose records live in an LMDB log directory.

    Thread-safety: methods may be called from any thread of the opening process. Only one
    process may hold a store open on a path (writer lock); readers use :class:`DeltaLog` with
    ``readonly=True`` or :class:`~persistent_delta.DeltaConsumer`.

    Args:
        path: the log directory (created if missing).
        updateMode: the update mode of the records. Reopening a log with another mode raises
            :class:`~persistent_delta.errors.ConfigMismatchError`.
        durability: see :class:`~persistent_delta.Durability` (default ``ON_FLUSH``).
        map_size: initial LMDB map size (grows by itself).
        readonly: open for reading only; mutations raise ``ReadOnlyLogError``.
        options: full :class:`LogOptions`, instead of the two shortcuts above.

    Raises:
        LogLockedError: another process holds the log open for writing.
        FormatMismatchError, ConfigMismatchError, NotALogError: see their docs.
    """

    def __init__(
        self,
        path: Union[str, "os.PathLike[str]"],
        updateMode: UpdateMode = UpdateMode.NONE,
        *,
        durability: Optional[Union[Durability, str]] = None,
        map_size: Optional[int] = None,
        readonly: bool = False,
        options: Optional[LogOptions] = None,
    ) -> None:
        if not isinstance(updateMode, UpdateMode):
            raise InvalidInputError(f"updateMode must be a torchrec UpdateMode, got {updateMode!r}")
        self.updateMode = updateMode
        opts = options or LogOptions.from_env(durability=durability, map_size=map_size)
        self._log = DeltaLog(os.fspath(path), readonly=readonly, update_mode=updateMode.value, options=opts)

    @property
    def log(self) -> DeltaLog:
        """The underlying :class:`DeltaLog`."""
        return self._log

    @property
    def path(self) -> str:
        return self._log.path

    # ------------------------------------------------------------------ DeltaStore API
    def append(
        self,
        batch_idx: int,
        fqn: str,
        ids: torch.Tensor,
        states: Optional[torch.Tensor] = None,
        raw_ids: Optional[torch.Tensor] = None,
        runtime_meta: Optional[torch.Tensor] = None,
    ) -> None:
        """Append one record of ``fqn`` at ``batch_idx`` (one transaction).

        Raises:
            InvalidInputError: bad ids/states, or ``batch_idx`` below the table's last one.
        """
        if raw_ids is not None or runtime_meta is not None:
            raise InvalidInputError("raw_ids/runtime_meta (RawIdTracker) are not stored by LmdbDeltaStore")
        self.append_many([AppendRecord(batch_idx, fqn, ids, states)])

    def append_many(self, records: Sequence[AppendRecord]) -> int:
        """Append several records in one transaction (group commit); returns bytes written."""
        encoded = encode_records(records, self.updateMode)
        if not encoded:
            return 0
        return self._log.write(lambda w: write_records(w, encoded))

    def delete(self, up_to_idx: Optional[int] = None) -> None:
        """Delete records with ``batch_idx < up_to_idx``; ``None`` deletes everything."""
        if up_to_idx is not None:
            check_batch_idx(up_to_idx, "up_to_idx")
        n, nbytes = self._log.write(lambda w: delete_below(w, up_to_idx))
        logger.debug("deleted %d records (%d bytes) below %s in %s", n, nbytes, up_to_idx, self.path)

    def compact(self, start_idx: int, end_idx: int) -> None:
        """Merge, per table, two or more records in ``[start_idx, end_idx)`` into one record
        stamped ``start_idx``.

        Raises:
            AssertionError: ``start_idx >= end_idx`` (the type TorchRec raises).
        """
        check_batch_idx(start_idx, "start_idx")
        check_batch_idx(end_idx, "end_idx")
        if start_idx >= end_idx:
            raise AssertionError(f"start_idx {start_idx} must be smaller than end_idx, but got {end_idx}")
        merged = self._log.write(lambda w: compact_range(w, self.updateMode, start_idx, end_idx))
        if merged:
            logger.debug("compacted [%d, %d) in %s: %s", start_idx, end_idx, self.path, merged)

    def get_unique(self, from_idx: int = 0) -> Dict[str, UniqueRows]:
        """Per table, unique ids (ascending) with states per update mode, from ``from_idx``.

        A table with nothing left gives empty tensors.
        """
        return self._log.read(lambda r: read_unique(r, self.updateMode, from_idx))

    def get_indexed_lookups(self, start_idx: int, end_idx: int) -> Dict[str, List[IndexedLookup]]:
        """Per listed table, copies of its records with ``start_idx <= batch_idx < end_idx``."""
        return self._log.read(lambda r: _lookups(r, start_idx, end_idx))

    @property
    def per_fqn_lookups(self) -> Mapping[str, List[IndexedLookup]]:
        """Read-only view: fqn -> all records as ``IndexedLookup`` (copies; costly on big logs)."""
        return types.MappingProxyType(self._log.read(lambda r: _lookups(r, 0, None)))

    # ------------------------------------------------------------------ lifecycle
    def flush(self) -> None:
        """Make everything appended so far survive an OS crash (fsync)."""
        self._log.flush()

    def close(self) -> None:
        """Close the log; later calls raise ``LogClosedError``. Idempotent."""
        self._log.close()

    def __enter__(self) -> "LmdbDeltaStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LmdbDeltaStore({self.path!r}, updateMode={self.updateMode})"


def _lookups(r: ReadTxn, start_idx: int, end_idx: Optional[int]) -> Dict[str, List[IndexedLookup]]:
    out: Dict[str, List[IndexedLookup]] = {}
    for fqn, entry in r.tables().items():
        if not entry.listed:
            continue
        out[fqn] = [
            IndexedLookup(
                batch_idx=rec.batch_idx,
                ids=rec.ids.clone(),
                states=None if rec.states is None else rec.states.clone(),
            )
            for rec in r.iter_records(entry.table_id, start_idx, end_idx)
        ]
    return out
