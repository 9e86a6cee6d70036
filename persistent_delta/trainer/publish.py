"""Publish: the current values of the rows a consumer has not read yet, as snapshot records.

Owns: what a publish writes, and when. ``tracker.publish(consumer)`` takes the rows changed
since ``consumer`` last read (exactly what ``get_unique(consumer)`` would return, through the
same consume rule, :mod:`persistent_delta.trainer.consume`), reads their *current* values from this
rank's shards, and writes them to the snapshots channel (``KIND_SNAPSHOT`` records) stamped
with the current batch index and the wall-clock time of the call (header ``"t"``). Every
publish of a batch shares its stamp, readable once the batch ends, or at ``flush()``
(:func:`persistent_delta.log.position_rules.open_stamp`); a publish never moves the batch index. A serving
process reads them with ``DeltaConsumer(root, name, channel="snapshots")`` and applies them
(:func:`persistent_delta.serve.apply.apply_poll`: the newest stamp wins), so it converges to the
trainer's tables without sharing its memory. With ``delete_on_read``, snapshot records are
deleted once every snapshots consumer has committed past them.

A publish runs in two parts:

* :func:`capture`, in the training thread: takes the ids of the consumer's rows -- those the
  writer marked for it as it committed them since its previous publish
  (:mod:`persistent_delta.trainer.unread`), or, at its first publish in this process or after
  anything else moved it, the log's (a read transaction, nothing written) -- adding those of
  the steps handed to the writer and not yet committed (``pending``; the tracker waits for the
  writer instead only when its queue holds a log operation or device copies), and gathers their values straight into encoded snapshot
  records (one copy of the row bytes, into buffers the tracker reuses from publish to publish;
  the checksum is left to the writer). The values are those of the moment of the call;
  training may change the tables as soon as it returns.
* :func:`write_publish`, in the writer's transaction (the tracker hands the writer a
  :class:`~persistent_delta.trainer.operations.PublishWrite`; without a background writer it
  runs at once): moves the consumer past the rows read, writes the records and the new snapshot
  end, and enforces retention -- all in one transaction, so a crash leaves either the whole
  publish or none of it (the consumer then reads the same rows again at the next publish).

Row formats. A publish writes its rows once per row format asked for
(:data:`persistent_delta.log.codec.ROW_FORMATS`): the formats of the snapshots consumers
registered in the log when it is captured (:attr:`ConsumerEntry.format`) and those passed to
``tracker.publish(consumer, formats=...)``; ``"native"`` alone when nothing asks. The training
thread's part does not change with them: it gathers the native rows once. The conversions
(a cast for float16/bfloat16, FBGEMM's row-wise int8 quantization) run in
:func:`write_publish`, on the writer thread. A float format of the table's own dtype is the
native record (stored once). A column-wise shard's int8 record holds its float32 column half,
flagged ``"int8"``: the scale and bias are the whole row's, which no rank holds, so the
reader joins the halves and quantizes (:func:`persistent_delta.read.results.join_int8`).

A capped publish (``max_rows``/``max_bytes``, :mod:`persistent_delta.trainer.caps`) gathers only
the rows it carries and stores the rest as the consumer's deferred rows
(:mod:`persistent_delta.log.deferred`) in that same transaction; the next publish of the
consumer carries them first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Iterable, Optional, Sequence, Tuple

import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta.log import codec, position_rules
from persistent_delta.config import RetentionBound
from persistent_delta.errors import ConsumerConflictError
from persistent_delta.log.deltalog import ReadTxn, WriteTxn
from persistent_delta.log.deferred import read_deferred, write_deferred
from persistent_delta.log.records import AppendRecord, check_row_ids, log_start
from persistent_delta.log.schema import SNAPSHOTS, ConsumerEntry
from persistent_delta.log.zch_records import reinitialised, slot_moves
from persistent_delta.trainer import caps, consume
from persistent_delta.trainer.sharding import LocalTable, shard_weights
from persistent_delta.trainer.unread import UnreadIds, UnreadSince


@dataclass
class Captured:
    """A publish captured by :func:`capture`, waiting for :func:`write_publish`."""

    name: str
    entry: ConsumerEntry  # the consumer as read
    end: int  # the position the consumer moves to
    stamp: int  # batch index the records are stored under
    publish_time: float
    records: Dict[str, codec.Encoded] = field(default_factory=dict)  # fqn -> encoded snapshot record (native)
    rows: Dict[str, int] = field(default_factory=dict)  # fqn -> rows captured
    formats: Tuple[str, ...] = (codec.NATIVE,)  # the row formats to write (write_publish converts)
    column_half: FrozenSet[str] = frozenset()  # fqns of column-wise shards (int8: float32 halves)
    # (fqn, format) -> a reusable buffer of converted records (the writer's; see capture's buffers)
    format_buffers: Optional[Dict[Tuple[str, str], bytearray]] = None
    # caps (persistent_delta.trainer.caps): the rows deferred to the next publish, and the
    # stored deferred record read (its seq; whether it held rows)
    deferred: Dict[str, torch.Tensor] = field(default_factory=dict)
    due_seq: int = 0
    had_due: bool = False
    # managed-collision tables: fqn -> (shard-local slots, (taken, given) states) of the slot
    # reassignments since the consumer's last read, in order (written as snapshots side records)
    moves: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def deferred_rows(self) -> int:
        """Rows this publish defers to the next one (all tables)."""
        return int(sum(int(t.numel()) for t in self.deferred.values()))

    @property
    def nbytes(self) -> int:
        return sum(len(v) for v in self.records.values())


BUFFER_HEADROOM = 1.25  # a new reusable buffer is this much larger than the record that needed it


def publish_formats(r: ReadTxn, asked: Iterable[str] = (),
                    consumers: Optional[Dict[str, ConsumerEntry]] = None) -> Tuple[str, ...]:
    """The row formats a publish writes: those of the snapshots consumers registered in the
    log, and ``asked`` (checked names); ``("native",)`` when there are none. In
    :data:`~persistent_delta.log.codec.ROW_FORMATS` order. ``consumers``: ``r.consumers()``,
    when the caller read them already."""
    want = {codec.check_format(f) for f in asked}
    entries = (r.consumers() if consumers is None else consumers).values()
    want.update(e.format for e in entries if e.channel == SNAPSHOTS and e.format != codec.ANY_FORMAT)
    return tuple(f for f in codec.ROW_FORMATS if f in want) or (codec.NATIVE,)


def capture(
    r: ReadTxn, name: str, end: int, stamp: int, tables: Dict[str, LocalTable], publish_time: float,
    buffers: Optional[Dict[str, bytearray]] = None, pending: Sequence[AppendRecord] = (), formats: Sequence[str] = (),
    format_buffers: Optional[Dict[Tuple[str, str], bytearray]] = None,
    cap: Optional[caps.PublishCap] = None, accumulated: Optional[UnreadSince] = None,
    accumulator: Optional[UnreadIds] = None,
) -> Captured:
    """Read ``name``'s unread rows and gather their current values into encoded snapshot
    records (tables of ``tables`` only; empty tables are left out).

    ``formats``: row formats asked for besides those of the registered snapshots consumers
    (:func:`publish_formats`); the records hold native rows, :func:`write_publish` converts,
    into ``format_buffers`` ((fqn, format) -> buffer, kept by the caller like ``buffers``, under
    the same rule) when given.

    ``pending``: lookups records handed to the writer and not committed yet; their rows are
    unread too (:func:`persistent_delta.trainer.consume.consume_read_ids`). The
    :func:`write_publish` must run after the writer committed them, with no log operation in
    between.

    ``buffers`` (fqn -> buffer, kept by the caller across publishes): encode each table's
    record into its buffer, replaced by a larger one (``BUFFER_HEADROOM``) when too small, so
    that a steady stream of publishes reuses warm memory instead of allocating, zeroing and
    page-faulting its record bytes afresh each time. The caller must not capture into the
    same buffers again before this capture's :func:`write_publish` has run (the tracker waits for its
    writer first); their memory is the largest publish so far, per table.

    ``accumulated`` (taken from ``accumulator``): the ids the writer accumulated for ``name``
    since its previous publish (:mod:`persistent_delta.trainer.unread`), read instead of the
    log's records when they equal them (:func:`persistent_delta.trainer.consume.consume_read_ids`).

    ``cap``: what this publish may carry (:mod:`persistent_delta.trainer.caps`); the rows an
    earlier capped publish deferred are due first, and the rows that do not fit are deferred
    (``Captured.deferred``, stored by :func:`write_publish`). Only the rows carried are gathered.

    Raises:
        UnknownConsumerError: ``name`` is not a lookups consumer of this log.
        InvalidInputError: a pending record holds a negative id (the log never does); an
            unknown format; int8 asked for a table whose values are not float32 or float16.
        CorruptRecordError: the stored deferred rows are damaged.
    """
    consumers = r.consumers()  # (parsed once: the consume rule and the formats both read them)
    entry, unread = consume.consume_read_ids(r, name, pending, accumulated, accumulator, consumers)
    # managed-collision tables: the slot reassignments since the consumer's last read travel with
    # the publish, and every slot an eviction re-initialised is carried (in any tracking mode)
    moves = slot_moves(r, max(entry.offset, log_start(r)), end,
                       [(p.batch_idx, p.fqn, p.kind, p.ids, p.states) for p in pending if p.kind in codec.SIDE_KINDS])
    for fqn, (slots, states) in moves.items():
        if fqn in tables:
            again = slots[reinitialised(states)]
            if again.numel():
                have = unread.get(fqn)
                unread[fqn] = torch.unique(again if have is None else torch.cat([have.to(torch.int64), again]))
    due = read_deferred(r, name, {fqn: t.local_rows for fqn, t in tables.items()})
    out = Captured(name=name, entry=entry, end=end, stamp=stamp, publish_time=publish_time,
                   formats=publish_formats(r, formats, consumers), format_buffers=format_buffers, due_seq=due.seq,
                   had_due=bool(due.ids), moves={f: m for f, m in moves.items() if f in tables})
    if due.ids or cap is not None:
        unread, out.deferred = caps.select(due, unread, tables, cap)
    halves = set()
    views = shard_weights(tables, [fqn for fqn, ids in unread.items() if ids.numel() and fqn in tables])
    for fqn, ids in unread.items():
        if ids.numel() == 0 or fqn not in tables:
            continue
        check_row_ids(fqn, int(ids[0]))  # (ascending: the smallest) before gathering rows by them
        weights = views[fqn]
        if tables[fqn].local_cols != tables[fqn].global_cols:
            halves.add(fqn)
        for f in out.formats:  # refused here, in the caller's thread, not later by the writer
            codec.format_states(f, weights.dtype, tuple(weights.shape[1:]), fqn in halves)
        into = None
        if buffers is not None:
            size = codec.encoded_size(ids, weights.dtype, (int(ids.numel()), int(weights.shape[1])),
                                      codec.KIND_SNAPSHOT, publish_time)
            into = buffers.get(fqn)
            if into is None or len(into) < size:
                into = buffers[fqn] = bytearray(int(size * BUFFER_HEADROOM))
        out.records[fqn] = codec.encode_gathered(ids, weights, ids, codec.KIND_SNAPSHOT, publish_time,
                                                 checksum=False, into=into)  # (checksum: by the writer, write_publish)
        out.rows[fqn] = int(ids.numel())
    out.column_half = frozenset(halves)
    return out


def formatted_records(cap: Captured, fqn: str, value: codec.Encoded) -> Iterable[codec.Encoded]:
    """``fqn``'s captured (native, unchecksummed) record as the records to store, one per
    stored format of ``cap.formats``, checksummed: the native record itself when a format is
    stored as native, else its rows converted (cast on their way into
    the record, or :func:`persistent_delta.log.codec.quantize_int8`) into a record of their own."""
    rec = codec.decode_record(value, verify=False)
    assert rec.states is not None
    native_done = False
    for f in cap.formats:
        stored = codec.stored_format(f, rec.states.dtype)
        if stored == codec.NATIVE:
            if not native_done:
                native_done = True
                yield codec.checksum_record(value)
            continue
        half = fqn in cap.column_half
        dtype, tail = codec.format_states(stored, rec.states.dtype, tuple(rec.states.shape[1:]), half)
        # float formats (and int8 halves) are cast on their way into the record; int8 quantized first
        rows = codec.quantize_int8(rec.states) if dtype == torch.uint8 else rec.states
        into = None
        if cap.format_buffers is not None:
            size = codec.encoded_size(rec.ids, dtype, (int(rows.shape[0]), *tail), codec.KIND_SNAPSHOT,
                                      cap.publish_time, stored)
            into = cap.format_buffers.get((fqn, stored))
            if into is None or len(into) < size:
                into = cap.format_buffers[(fqn, stored)] = bytearray(int(size * BUFFER_HEADROOM))
        yield codec.encode_cast(rec.ids, rows, dtype, codec.KIND_SNAPSHOT, cap.publish_time, stored, into)


def write_publish(
    w: WriteTxn,
    cap: Captured,
    mode: UpdateMode,
    *,
    compact: bool,
    delete_on_read: bool,
    bound: Optional[RetentionBound] = None,
) -> None:
    """Write a captured publish inside ``w``: the consumer's new position (the consume rule's
    write half), the snapshot records, their stamp as the open one, and retention of both channels.

    With deferred rows (a capped publish), or when the capture found some (now carried), the
    consumer's deferred rows are stored in the same transaction
    (:func:`persistent_delta.log.deferred.write_deferred`).

    Raises:
        ConsumerConflictError: the consumer moved, or its deferred rows changed, since the
            capture (nothing is written).
    """
    consume.consume_commit(w, cap.name, cap.entry, cap.end, mode, compact=compact, delete_on_read=delete_on_read,
                           bound=bound)
    if cap.deferred or cap.had_due:
        stored = read_deferred(w, cap.name)
        if stored.seq != cap.due_seq:
            raise ConsumerConflictError(
                f"the deferred rows of consumer {cap.name!r} of {w.path} changed between its publish's capture and "
                "its commit; the publish is not committed")
        write_deferred(w, cap.name, cap.deferred, cap.due_seq + 1)
    for fqn, value in cap.records.items():
        entry = w.table(fqn)
        if entry is not None:
            for record in formatted_records(cap, fqn, value):
                w.put_record(entry.table_id, cap.stamp, record, channel=SNAPSHOTS)
    for fqn, (slots, states) in cap.moves.items():
        entry = w.table(fqn)
        if entry is not None:  # the publish's raw-id changes (a snapshots replica's RawIdMap)
            w.put_record(codec.side_table_id(entry.table_id), cap.stamp,
                         codec.encode_record(slots, states, codec.KIND_SLOTS), channel=SNAPSHOTS)
    position_rules.open_stamp(w, cap.stamp)  # readable once its batch ends (position_rules)
    if delete_on_read:
        position_rules.enforce_retention(w, SNAPSHOTS, bound)
