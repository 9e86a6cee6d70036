"""Record operations inside one transaction: validate, encode, append, read unique, compact,
delete.

Owns: what each record operation does to the stored records (and the ``log_start`` mark that
deletion leaves). The FIRST/LAST rule itself is :mod:`persistent_delta.log.rows`'; which range an
operation may cover safely is :mod:`persistent_delta.log.position_rules`'s. Every function takes the
transaction it runs in, so callers compose several operations into one commit.

Compaction design note: per table, two or more records in ``[start_idx, end_idx)`` become one
record stamped ``start_idx`` holding the unique rows by the update mode's rule. Reads that
start at or before ``start_idx`` and end at or after ``end_idx`` get the same answer; a read
that starts strictly inside the range would not, which is why callers go through
:func:`persistent_delta.log.position_rules.safe_compact`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torchrec.distributed.model_tracker.types import IndexedLookup, UniqueRows, UpdateMode

from persistent_delta.log import codec
from persistent_delta.errors import CorruptRecordError, InvalidInputError
from persistent_delta.log.deltalog import ReadTxn, WriteTxn
from persistent_delta.log.rows import IdMemo, RowPlan, compute_unique_rows, plan_unique_rows
from persistent_delta.log.schema import (
    LOOKUPS,
    META_LOG_START,
    META_SNAPSHOT_END,
    META_SNAPSHOT_START,
    SNAPSHOTS,
    TableEntry,
    check_batch_idx,
    check_fqn,
)

logger = logging.getLogger(__name__)


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
    rows: Optional[torch.Tensor] = None  # set: the record's states are states[rows] of a 2-D block (gathered on encode)


def materialized(rec: AppendRecord) -> AppendRecord:
    """``rec`` with its states gathered (``states[rows]``) when it holds them as rows of a block."""
    if rec.rows is None or rec.states is None:
        return rec
    return AppendRecord(rec.batch_idx, rec.fqn, rec.ids, rec.states.index_select(0, rec.rows), rec.kind,
                        rec.window_start, rec.unique)


def is_row_id(smallest: int) -> bool:
    """Whether ids whose smallest is ``smallest`` are row ids: the one rule for ids, which every
    id the log stores follows (a row id is a non-negative shard-local index)."""
    return smallest >= 0


def check_row_ids(fqn: str, smallest: int) -> None:
    """Raise unless ids of ``fqn`` whose smallest is ``smallest`` are row ids (:func:`is_row_id`).

    Args:
        fqn: the table the ids belong to (for the message).
        smallest: the smallest of the ids.

    Raises:
        InvalidInputError: ``smallest`` is negative.
    """
    if not is_row_id(smallest):
        raise InvalidInputError(f"ids of {fqn!r} must be non-negative row ids, got {smallest}")


def validate_record(rec: AppendRecord, mode: UpdateMode) -> None:
    """Raise :class:`InvalidInputError` unless ``rec`` can be stored under ``mode``."""
    check_batch_idx(rec.batch_idx)
    check_fqn(rec.fqn)
    ids = rec.ids
    if not isinstance(ids, torch.Tensor):
        raise InvalidInputError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in codec.INTEGER_ID_DTYPES:
        raise InvalidInputError(f"ids of {rec.fqn!r} must have an integer dtype, got {ids.dtype}")
    if ids.dim() != 1:
        raise InvalidInputError(f"ids of {rec.fqn!r} must be 1-D, got shape {tuple(ids.shape)}")
    if ids.numel() and ids.dtype.is_signed:
        check_row_ids(rec.fqn, int(ids.min()))
    states = rec.states
    if states is None:
        if mode != UpdateMode.NONE:
            raise InvalidInputError(f"update mode {mode.name} needs states for every record of {rec.fqn!r}")
        return
    if not isinstance(states, torch.Tensor):
        raise InvalidInputError(f"states must be a torch.Tensor or None, got {type(states).__name__}")
    if rec.rows is not None:
        if states.dim() != 2 or rec.rows.dim() != 1 or rec.rows.numel() != ids.numel():
            raise InvalidInputError(
                f"rows of {rec.fqn!r} must pick one row of a 2-D states block per id: {ids.numel()} ids, "
                f"{rec.rows.numel()} rows, states shape {tuple(states.shape)}"
            )
    elif states.dim() == 0 or states.shape[0] != ids.numel():
        raise InvalidInputError(
            f"states of {rec.fqn!r} must have one row per id: {ids.numel()} ids, states shape {tuple(states.shape)}"
        )
    codec.dtype_name(states.dtype)


def encode_records(
    records: Sequence[AppendRecord], mode: UpdateMode, buffers: Optional[EncodeBuffers] = None,
) -> List[Tuple[AppendRecord, codec.Encoded]]:
    """Validate and encode ``records``. A record holding its states as ``rows`` of a block is
    gathered straight into its encoded value (one copy). ``buffers``: encode into reused
    buffers (the values are then valid until the next call with the same ``buffers``)."""
    out: List[Tuple[AppendRecord, codec.Encoded]] = []
    for i, rec in enumerate(records):
        validate_record(rec, mode)
        into = None if buffers is None else buffers.get(i)
        value: codec.Encoded
        if rec.rows is not None and rec.states is not None:
            value = codec.encode_gathered(rec.ids, rec.states, rec.rows, rec.kind, into=into,
                                          window_start=rec.window_start)
        else:
            value = codec.encode_record(rec.ids, rec.states, rec.kind, rec.window_start, into=into)
        if buffers is not None and isinstance(value, bytearray):
            buffers.keep(i, value)
        out.append((rec, value))
    return out


class EncodeBuffers:
    """Buffers that :func:`encode_records` encodes into, by record position, reused call after
    call (a writer encoding every step's records skips allocating, zeroing and page-faulting a
    fresh buffer per record). A record larger than its slot's buffer gets a fresh one, which
    replaces it. Memory: at most ``max_bytes`` kept, in at most ``max_slots`` buffers.
    Not thread-safe: one writer's."""

    def __init__(self, max_bytes: int = 64 << 20, max_slots: int = 64) -> None:
        self._bufs: List[Optional[bytearray]] = []
        self._max_bytes, self._max_slots = max_bytes, max_slots
        self.nbytes = 0

    def get(self, i: int) -> Optional[bytearray]:
        """Slot ``i``'s buffer (None: none yet)."""
        return self._bufs[i] if i < len(self._bufs) else None

    def keep(self, i: int, buf: bytearray) -> None:
        """Make ``buf`` slot ``i``'s buffer, unless that passes the limits."""
        if i >= self._max_slots:
            return
        old = self.get(i)
        grown = self.nbytes - (0 if old is None else len(old)) + len(buf)
        if grown > self._max_bytes:
            return
        while len(self._bufs) <= i:
            self._bufs.append(None)
        self._bufs[i] = buf
        self.nbytes = grown


def write_records(w: WriteTxn, encoded: Sequence[Tuple[AppendRecord, codec.Encoded]], channel: str = LOOKUPS) -> int:
    """Append encoded records inside a write transaction; returns bytes written.

    Refuses (before writing anything) a lookups batch_idx lower than its table's last one.
    """
    entries: Dict[str, TableEntry] = {}
    for rec, _ in encoded:
        entry = entries.get(rec.fqn) or w.ensure_table(rec.fqn)
        if rec.kind in codec.SIDE_KINDS:
            if channel != LOOKUPS:
                raise InvalidInputError(f"record kind {rec.kind} belongs to the lookups channel")
        elif channel == LOOKUPS:
            if rec.batch_idx < entry.last_batch_idx:
                raise InvalidInputError(
                    f"batch_idx {rec.batch_idx} for {rec.fqn!r} is lower than its last appended batch_idx "
                    f"{entry.last_batch_idx}: the log is append-only"
                )
            _check_row_shape(entry, rec)
            if rec.batch_idx > entry.last_batch_idx or not entry.listed or entry.states_dtype is None:
                entry = _touched(entry, rec)
        entries[rec.fqn] = entry
    nbytes = 0
    for rec, value in encoded:
        table_id = entries[rec.fqn].table_id
        if rec.kind in codec.SIDE_KINDS:  # a managed-collision table's side records (see codec)
            table_id = codec.side_table_id(table_id)
        w.put_record(table_id, rec.batch_idx, value, channel=channel)
        nbytes += len(value)
    for fqn, entry in entries.items():
        before = w.table(fqn)
        if before is None or before.to_bytes() != entry.to_bytes():
            w.stage_table(entry)
    return nbytes


def _check_row_shape(entry: TableEntry, rec: AppendRecord) -> None:
    """A table's state rows keep one dtype and shape from its first append on (also after
    ``delete(None)``): mixed rows could not be merged or read back. Before the first append the
    entry may hold the tracker's guess from attach, which the first append replaces."""
    if rec.states is None or entry.states_dtype is None or entry.last_batch_idx < 0:
        return
    dtype, tail = codec.dtype_name(rec.states.dtype), [int(d) for d in rec.states.shape[1:]]
    if (dtype, tail) != (entry.states_dtype, list(entry.states_tail or [])):
        raise InvalidInputError(
            f"states of {rec.fqn!r} have dtype {dtype} and row shape {tail}, but the table's rows are "
            f"{entry.states_dtype} {list(entry.states_tail or [])}: a table keeps one row shape (use another fqn)"
        )


def _touched(entry: TableEntry, rec: AppendRecord) -> TableEntry:
    e = entry.copy()
    e.last_batch_idx = max(e.last_batch_idx, rec.batch_idx)
    e.listed = True
    e.ids_dtype = codec.dtype_name(rec.ids.dtype)
    if rec.states is not None:
        e.states_dtype = codec.dtype_name(rec.states.dtype)
        e.states_tail = [int(d) for d in rec.states.shape[1:]]
    return e


def empty_rows(entry: TableEntry, mode: UpdateMode, channel: str = LOOKUPS, fmt: str = codec.NATIVE) -> UniqueRows:
    """What a table with nothing in range returns: empty ids, and states of shape
    ``(0, *row_shape)`` in the table's dtype (or row format ``fmt``'s, for a whole row; the
    table's when it has none) unless the mode keeps ids only."""
    states = None if mode == UpdateMode.NONE else entry.empty_states(channel)
    if states is not None and fmt not in (codec.NATIVE, codec.ANY_FORMAT):
        try:
            dtype, tail = codec.format_states(fmt, states.dtype, tuple(states.shape[1:]))
            states = torch.empty((0, *tail), dtype=dtype)
        except InvalidInputError:
            pass  # int8 of a table that cannot be quantized: its publishes hold no int8 rows
    return UniqueRows(ids=entry.empty_ids(), states=states)


@dataclass
class TablePlan:
    """One table's unique rows over a range, planned inside a read transaction (the rule
    applied to the ids, :class:`~persistent_delta.log.rows.RowPlan`) and not yet copied out of the
    map: :meth:`finish` copies them, into a place of the caller's choosing, before the
    transaction ends. ``typed``: the states' dtype and trailing shape (None: ids only);
    ``empty``: the result of a table with nothing in range."""

    rows: Optional[RowPlan]
    typed: Optional[Tuple[torch.dtype, Tuple[int, ...]]] = None
    empty: Optional[UniqueRows] = None

    @property
    def num_rows(self) -> int:
        """Rows the result holds."""
        return int(self.rows.ids.numel()) if self.rows is not None else 0

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of states (0 for ids only)."""
        if self.rows is None or self.rows.parts is None or self.typed is None:
            return 0
        return int(self.rows.parts[0].shape[1])

    def finish(self, out: Optional[torch.Tensor] = None) -> UniqueRows:
        """The unique rows, states copied into ``out`` when given (``uint8``,
        ``(num_rows, row_bytes)``, each row contiguous, rows at any stride: the result's
        states are a typed view of it) or into memory of their own."""
        if self.rows is None:
            assert self.empty is not None
            return self.empty
        if self.rows.parts is None or self.typed is None:
            return UniqueRows(ids=self.rows.ids, states=None)
        if out is None:
            got = self.rows.new_rows()
            assert got is not None
        else:
            self.rows.gather_into(out)
            got = out
        return UniqueRows(ids=self.rows.ids, states=codec.rows_as_states(got, *self.typed))


def plan_unique(
    r: ReadTxn,
    mode: UpdateMode,
    from_idx: int = 0,
    end_idx: Optional[int] = None,
    tables: Optional[Sequence[str]] = None,
    listed_only: bool = True,
    channel: str = LOOKUPS,
    memo: Optional[IdMemo] = None,
    extra_ids: Optional[Mapping[str, Sequence[torch.Tensor]]] = None,
    fmt: str = codec.NATIVE,
    exact: bool = False,
    passed: Optional[Dict[str, int]] = None,
) -> Dict[str, TablePlan]:
    """:func:`read_unique` up to the copy of the rows: per table, a :class:`TablePlan` whose
    rows view the map (finish it inside ``r``).

    ``fmt``: only records of this row format (:func:`persistent_delta.log.codec.serves`;
    ``exact``: of exactly this format, a native record never serving a float format); the
    others are passed over and counted in ``passed`` (format -> records)."""
    if extra_ids and mode != UpdateMode.NONE:
        raise ValueError("extra_ids: ids-only reads (UpdateMode.NONE) only")
    out: Dict[str, TablePlan] = {}
    for fqn, entry in r.tables().items():
        if listed_only and not entry.listed:
            continue
        if tables is not None and fqn not in tables:
            continue
        # The records as numpy views, their states as byte rows (see codec.decode_record_rows):
        # one cheap torch tensor each on the way into the rule, the type given back once.
        ids: List[torch.Tensor] = []
        rows: List[torch.Tensor] = []
        typed: Optional[Tuple[torch.dtype, Tuple[int, ...]]] = None
        for rec in r.iter_record_rows(entry.table_id, from_idx, end_idx, channel=channel):
            if not (rec.format == fmt if exact else codec.serves(rec.format, rec.states_dtype, fmt)):
                if passed is not None:
                    passed[rec.format] = passed.get(rec.format, 0) + 1
                continue
            ids.append(codec.from_view(rec.ids))
            if rec.rows is not None and rec.states_dtype is not None:
                if typed is None:
                    typed = (rec.states_dtype, rec.states_tail)
                elif typed != (rec.states_dtype, rec.states_tail):
                    raise CorruptRecordError(
                        f"table {fqn!r}: records of states {typed} and {(rec.states_dtype, rec.states_tail)}")
                rows.append(codec.from_view(rec.rows))
        if extra_ids:
            ids.extend(extra_ids.get(fqn, ()))
        if not ids:
            out[fqn] = TablePlan(None, empty=empty_rows(entry, mode, channel, fmt))
            continue
        states = rows if len(rows) == len(ids) else None
        out[fqn] = TablePlan(plan_unique_rows(ids, states, mode, memo, fqn), typed if states is not None else None)
    return out


def read_unique(
    r: ReadTxn,
    mode: UpdateMode,
    from_idx: int = 0,
    end_idx: Optional[int] = None,
    tables: Optional[Sequence[str]] = None,
    listed_only: bool = True,
    channel: str = LOOKUPS,
    memo: Optional[IdMemo] = None,
    extra_ids: Optional[Mapping[str, Sequence[torch.Tensor]]] = None,
    alloc: Optional[Callable[[int], torch.Tensor]] = None,
) -> Dict[str, UniqueRows]:
    """Unique rows per table over records with ``from_idx <= batch_idx < end_idx`` (half-open).

    A table with no records in range gets :func:`empty_rows`. Results own their memory.
    ``memo``: one poll's :class:`~persistent_delta.log.rows.IdMemo` over its ranks (by table).
    ``extra_ids`` (``UpdateMode.NONE`` only): more ids per table, counted with its records'
    (those of tables not read, as unlisted ones or fqns the log lacks, are ignored).
    ``alloc(nbytes)``: where the states' memory comes from (a uint8 tensor of ``nbytes``; one
    for all tables, whose states are views of it; default: each table's own ``torch.empty``).
    A tracker passes :meth:`~persistent_delta.log.alloc.ResultBuffers.take`.
    """
    plans = plan_unique(r, mode, from_idx, end_idx, tables, listed_only, channel, memo, extra_ids)
    if alloc is None:
        return {fqn: p.finish() for fqn, p in plans.items()}
    sizes = {fqn: p.num_rows * p.row_bytes for fqn, p in plans.items()}
    spans = {fqn: -(-n // _ALIGN) * _ALIGN for fqn, n in sizes.items()}
    buf = alloc(sum(spans.values()))
    out: Dict[str, UniqueRows] = {}
    at = 0
    for fqn, p in plans.items():
        if not sizes[fqn]:
            out[fqn] = p.finish()
            continue
        out[fqn] = p.finish(buf[at:at + sizes[fqn]].view(p.num_rows, p.row_bytes))
        at += spans[fqn]
    return out


# Tables' rows start at multiples of this many bytes in a read_unique buffer (a cache line;
# any dtype's alignment).
_ALIGN = 64


def read_lookups(r: ReadTxn, start_idx: int, end_idx: Optional[int]) -> Dict[str, List[IndexedLookup]]:
    """Per listed table, copies of its records in ``[start_idx, end_idx)`` as ``IndexedLookup``."""
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


def compact_range(w: WriteTxn, mode: UpdateMode, start_idx: int, end_idx: int) -> Dict[str, int]:
    """Per table, merge two or more lookups records in ``[start_idx, end_idx)`` into one record
    stamped ``start_idx`` (the update mode's rule). Returns records merged per table."""
    merged: Dict[str, int] = {}
    for fqn, entry in w.tables().items():
        ids: List[torch.Tensor] = []
        states: List[torch.Tensor] = []
        windows: List[int] = []
        covers = start_idx + 1
        for rec in w.iter_records(entry.table_id, start_idx, end_idx):
            # Copy: the views die when their pages are deleted below.
            ids.append(rec.ids.clone())
            if rec.states is not None:
                states.append(rec.states.clone())
            if rec.window_start is not None:
                windows.append(rec.window_start)
            covers = max(covers, rec.batch_idx + 1, rec.covers_end or 0)
        if len(ids) <= 1:
            continue
        rows = compute_unique_rows(ids, states if len(states) == len(ids) else None, mode)
        w.delete_records(entry.table_id, start_idx, end_idx)
        # The merged record keeps the earliest window start it holds, and says which batches it
        # covers: a read starting inside them starts at the merged record (read_start's input).
        window = min(windows) if windows else None
        w.put_record(entry.table_id, start_idx,
                     codec.encode_record(rows.ids, rows.states, codec.KIND_LOOKUP, window, covers))
        merged[fqn] = len(ids)
    return merged


def log_start(r: ReadTxn) -> int:
    """Lookups below this batch were deleted (retention, ``clear``)."""
    return int(r.meta(META_LOG_START, 0))


def raise_log_start(w: WriteTxn, start: int) -> None:
    """Record that lookups below ``start`` are gone (never lowers it)."""
    if start > log_start(w):
        w.set_meta(META_LOG_START, start)


def snapshot_start(r: ReadTxn) -> int:
    """Snapshot records stamped below this batch were deleted (retention)."""
    return int(r.meta(META_SNAPSHOT_START, 0))


def last_appended(r: ReadTxn) -> int:
    """The highest batch_idx appended to any table (-1 for none)."""
    return max((e.last_batch_idx for e in r.tables().values()), default=-1)


def delete_table_records(
    w: WriteTxn, entry: TableEntry, start_idx: int, end_idx: Optional[int], channel: str = LOOKUPS
) -> Tuple[int, int]:
    """Delete a table's records in ``[start_idx, end_idx)`` of a channel, its side records
    (lookups: raw ids and slot reassignments; snapshots: the slot reassignments publishes
    carried) too; returns (records, bytes)."""
    n, nbytes = w.delete_records(entry.table_id, start_idx, end_idx, channel=channel)
    sn, sb = w.delete_records(codec.side_table_id(entry.table_id), start_idx, end_idx, channel=channel)
    return n + sn, nbytes + sb


def delete_below(w: WriteTxn, up_to_idx: Optional[int], channel: str = LOOKUPS) -> Tuple[int, int]:
    """Delete records with ``batch_idx < up_to_idx`` (all when None); returns (records, bytes).

    On the lookups channel it raises ``log_start`` to ``up_to_idx``; ``None`` also unlists
    every table, as ``DeltaStoreTrec.delete()`` forgets them. On the snapshots channel it
    raises the snapshot start (:func:`snapshot_start`) to ``up_to_idx``.
    """
    n = nbytes = 0
    if channel == LOOKUPS:
        raise_log_start(w, last_appended(w) + 1 if up_to_idx is None else up_to_idx)
    else:
        mark = int(w.meta(META_SNAPSHOT_END, 0)) if up_to_idx is None else up_to_idx
        if mark > snapshot_start(w):
            w.set_meta(META_SNAPSHOT_START, mark)
    for entry in w.tables().values():
        rn, rb = delete_table_records(w, entry, 0, up_to_idx, channel)
        n, nbytes = n + rn, nbytes + rb
        if up_to_idx is None and channel == LOOKUPS and entry.listed:
            e = entry.copy()
            e.listed = False
            w.stage_table(e)
    return n, nbytes


def pending_stats(r: ReadTxn, channel: str, start_idx: int, end_idx: int) -> Tuple[int, int, int]:
    """``(records, rows, bytes)`` stored in ``[start_idx, end_idx)`` over every table (rows as
    stored, before de-duplication; value bytes; side records of managed-collision tables
    included)."""
    recs = rows = nbytes = 0
    if end_idx <= start_idx:
        return 0, 0, 0
    for entry in r.tables().values():
        ids = [entry.table_id, codec.side_table_id(entry.table_id)]
        for table_id in ids:  # a managed-collision table's side records count too
            for rec in r.iter_records(table_id, start_idx, end_idx, verify=False, channel=channel):
                recs, rows, nbytes = recs + 1, rows + int(rec.ids.numel()), nbytes + rec.nbytes
    return recs, rows, nbytes


def batch_bytes(r: ReadTxn, channel: str, start_idx: int, end_idx: Optional[int]) -> Dict[int, int]:
    """batch_idx -> value bytes stored under it in ``[start_idx, end_idx)``, over every table
    (keys and value lengths only: nothing is decoded or copied)."""
    out: Dict[int, int] = {}
    for entry in r.tables().values():
        for b, _, n in r.iter_record_keys(entry.table_id, start_idx, end_idx, channel=channel):
            out[b] = out.get(b, 0) + n
    return out


def publish_times(r: ReadTxn, start_idx: int, end_idx: int) -> Dict[int, float]:
    """stamp -> wall-clock time of the publish that wrote the snapshot records stamped in
    ``[start_idx, end_idx)`` (record headers only; publishes that wrote no records, or were
    written before the time was stored, are absent)."""
    out: Dict[int, float] = {}
    if end_idx <= start_idx:
        return out
    for entry in r.tables().values():
        for b, _, value in r.iter_record_views(entry.table_id, start_idx, end_idx, channel=SNAPSHOTS):
            t = codec.record_publish_time(value)
            if t is not None:
                out[b] = min(t, out.get(b, t))
    return out


def last_stamps(r: ReadTxn, fqn: str, start_idx: int, end_idx: int, channel: str = SNAPSHOTS,
                fmt: str = codec.NATIVE, exact: bool = False) -> torch.Tensor:
    """Per unique id of ``fqn``'s records in ``[start_idx, end_idx)`` (ascending, as
    :func:`read_unique` returns them), the batch index of the last record holding it: the
    publish a snapshot row's value comes from. Empty when the table has no records there.
    ``fmt``/``exact``: the records of that row format only, as :func:`plan_unique` reads them."""
    entry = r.table(fqn)
    ids: List[torch.Tensor] = []
    stamps: List[torch.Tensor] = []
    if entry is not None:
        for rec in r.iter_records(entry.table_id, start_idx, end_idx, channel=channel):
            dtype = None if rec.states is None else rec.states.dtype
            if not (rec.format == fmt if exact else codec.serves(rec.format, dtype, fmt)):
                continue
            ids.append(rec.ids)
            stamps.append(torch.full((int(rec.ids.numel()), 1), rec.batch_idx, dtype=torch.int64))
    if not ids:
        return torch.empty(0, dtype=torch.int64)
    rows = compute_unique_rows(ids, stamps, UpdateMode.LAST)
    assert rows.states is not None
    out: torch.Tensor = rows.states.reshape(-1)
    return out
