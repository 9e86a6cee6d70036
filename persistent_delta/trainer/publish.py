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

A publish is one straight path, a :class:`~persistent_delta.trainer.operations.PublishRequest`
gathered and then committed, with the step's records captured so far, in one transaction:

* :meth:`Publisher.gather`, in the training thread: takes the ids of the consumer's rows -- those the
  writer marked for it as it committed them since its previous publish
  (:mod:`persistent_delta.trainer.unread`), or, at its first publish in this process or after
  anything else moved it, the log's (a read transaction, nothing written) -- adding those of
  the steps handed to the writer and not yet committed (``pending``; the tracker waits for the
  writer instead only when its queue holds a log operation or device copies), and gathers their
  values once, straight into each table's native snapshot record (one copy of the row bytes,
  into buffers reused from publish to publish; the checksum is left to the writer), kept in the
  request with a view of the rows (:class:`~persistent_delta.trainer.operations.GatheredRows`).
  The values are those of the moment of the call; training may change the tables as soon as it
  returns.
* :func:`write_publish`, in that transaction, committed by the thread that called ``publish()``
  after everything handed to the writer thread before (``WriterOptions.inline_publish``: no
  wait for the writer thread to be scheduled), or by the writer thread (the default): moves the consumer past the rows read, encodes and writes each table's records, one per
  stored row format, from the gathered rows (:func:`encode_formats`), the new snapshot end, and
  enforces retention -- all in one transaction, so a crash leaves either the whole publish or
  none of it (the consumer then reads the same rows again at the next publish).

Row formats. A publish writes its rows once per row format asked for
(:data:`persistent_delta.log.codec.ROW_FORMATS`): the formats of the snapshots consumers
registered in the log when it is gathered (:attr:`ConsumerEntry.format`) and those passed to
``tracker.publish(consumer, formats=...)``; ``"native"`` alone when nothing asks. The training
thread's part does not change with them: it gathers the native rows once. The conversions
(a cast for float16/bfloat16, FBGEMM's row-wise int8 quantization) run in
:func:`write_publish`, in the publish's transaction, from the gathered rows. A float format of the
table's own dtype is the native record (stored once). A column-wise shard's int8 record holds its
float32 column half, flagged ``"int8"``: the scale and bias are the whole row's, which no rank
holds, so the reader joins the halves and quantizes (:func:`persistent_delta.read.results.join_int8`).

A capped publish (``max_rows``/``max_bytes``, :mod:`persistent_delta.trainer.caps`) gathers only
the rows it carries and stores the rest as the consumer's deferred rows
(:mod:`persistent_delta.log.deferred`) in that same transaction; the next publish of the
consumer carries them first.
"""

from __future__ import annotations

from typing import Dict, Iterable, Iterator, List, Optional, Protocol, Sequence, Tuple, TypeVar

import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta.errors import ConsumerConflictError, InvalidInputError
from persistent_delta.log import codec, position_rules
from persistent_delta.log.deltalog import DeltaLog, ReadTxn, WriteTxn
from persistent_delta.log.deferred import deferred_by_consumer, read_deferred, write_deferred
from persistent_delta.log.records import AppendRecord, check_row_ids, log_start
from persistent_delta.log.schema import SNAPSHOTS, ConsumerEntry
from persistent_delta.log.zch_records import reinitialised, slot_moves
from persistent_delta.trainer import caps, consume
from persistent_delta.trainer.operations import GatheredRows, Operation, PublishRequest, StepWrite
from persistent_delta.trainer.sharding import LocalTable, shard_weights
from persistent_delta.trainer.unread import UnreadIds, UnreadSince

T = TypeVar("T")
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


def reusable(buffers: Dict[T, bytearray], key: T, size: int) -> bytearray:
    """``buffers[key]``, replaced by a larger one (``BUFFER_HEADROOM``) when shorter than ``size``."""
    into = buffers.get(key)
    if into is None or len(into) < size:
        into = buffers[key] = bytearray(int(size * BUFFER_HEADROOM))
    return into


class Feed(Protocol):
    """What a publish needs of the writer (:class:`persistent_delta.trainer.writer.WriterFeed`)."""

    def hand_off(self, op: Operation) -> None: ...

    def commit_publish(self, ops: List[Operation]) -> None: ...

    def settle(self) -> None: ...

    def unsettled(self) -> List[AppendRecord]: ...


class Publisher:
    """One tracker's publishes on this rank: the tables they read, the buffers they reuse from
    publish to publish, each consumer's unread ids (:mod:`persistent_delta.trainer.unread`), the
    rows still deferred per consumer, and the stamps.

    Stamps: a publish never takes a closed stamp (a snapshots consumer may have read past it);
    the publishes of a batch share its stamp until it closes, at the batch's end or ``flush()``
    (:func:`persistent_delta.log.position_rules.open_stamp`). Opening closes what an earlier
    writer left open, and the batch index the tracker continues at counts as closed (an earlier
    writer may have published at it), the same on every rank (``resume_at`` agreed on it).

    Thread-safety: the training thread calls every method; the requests :meth:`gather` fills
    are written by one commit at a time (:func:`write_publish`: the training thread's own, or
    the writer thread's), which alone uses the converted records' buffers. The caller must not
    gather again before the previous request was written: its records live in the reused
    buffers (:meth:`publish` waits for the writer first).

    Args:
        log: this rank's log (read: the deferred rows; written: the stamps closed).
        tables: fqn -> this rank's shard of each tracked table.
        unread: the ids the writer committed since each consumer's previous publish.
        curr_batch_idx: the batch index the tracker continues at.
    """

    def __init__(self, log: DeltaLog, tables: Dict[str, LocalTable], unread: UnreadIds, curr_batch_idx: int) -> None:
        self._log, self._tables, self._unread = log, tables, unread
        self.deferred: Dict[str, int] = log.read(deferred_by_consumer)  # consumer -> rows still deferred (stats)
        self._records: Dict[str, bytearray] = {}  # fqn -> the native record's buffer (training thread)
        self._converted: Dict[Tuple[str, str], bytearray] = {}  # (fqn, format) -> buffer (the committing thread)
        self._last_stamp = max(log.write(position_rules.close_stamps) - 1, curr_batch_idx)  # the newest closed
        self._open_stamp: Optional[int] = None  # the stamp of this batch's publishes, not closed yet

    def forget(self, consumer: str) -> None:
        """``consumer`` was unregistered: its unread ids and deferred count go."""
        self._unread.drop(consumer)
        self.deferred.pop(consumer, None)

    def stats(self) -> Dict[str, float]:
        """``publish_deferred_rows`` and ``publish_log_reads`` of ``tracker.stats()``."""
        return {"publish_deferred_rows": sum(self.deferred.values()), "publish_log_reads": self._unread.log_reads}

    def next_stamp(self, curr_batch_idx: int) -> int:
        """The stamp a publish made now carries (``tracker.next_stamp``)."""
        return max(curr_batch_idx, self._last_stamp + 1)

    def batch_ended(self, curr_batch_idx: int) -> None:
        """A step began batch ``curr_batch_idx``: an open stamp below it is closed."""
        if self._open_stamp is not None and self._open_stamp < curr_batch_idx:
            self._last_stamp, self._open_stamp = max(self._last_stamp, self._open_stamp), None

    def close_stamps(self) -> None:
        """Close the open stamp now (``flush()``): its publishes become readable, a later one takes the next."""
        if self._open_stamp is not None:
            self._log.write(position_rules.close_stamps)
            self._last_stamp, self._open_stamp = max(self._last_stamp, self._open_stamp), None

    def publish(self, feed: Feed, request: PublishRequest, step: StepWrite) -> Dict[str, int]:
        """Gather ``request``, ``step``'s records (those captured so far) counted as pending,
        then commit both in one transaction after what ``feed`` was handed before
        (:meth:`Feed.commit_publish`). A step with device copies in flight is handed to the
        writer first instead (it waits for them) and the publish goes with an empty one.
        Returns fqn -> rows gathered.

        Raises:
            as :meth:`gather`; the step is handed to the writer all the same.
        """
        if step.events:
            feed.hand_off(step)
            step = StepWrite(curr_batch_idx=step.curr_batch_idx)
        pending = [*feed.unsettled(), *step.records]
        try:
            self.gather(request, pending)
        except BaseException as exc:
            feed.hand_off(step)
            if isinstance(exc, InvalidInputError) and pending:
                feed.settle()  # a pending step holds the bad id: the writer's error (WriterError) says so
            raise
        feed.commit_publish([step, request])
        self._open_stamp = request.stamp
        return request.rows

    def gather(self, request: PublishRequest, pending: Sequence[AppendRecord] = ()) -> None:
        """Fill ``request`` in: read its consumer's unread rows (a read transaction of the log)
        and gather their current values (tables of this tracker only; empty tables are left
        out). The request is then the writer's to write (:func:`write_publish`).

        ``pending``: lookups records handed to the writer and not committed yet; their rows are
        unread too (:func:`persistent_delta.trainer.consume.consume_read_ids`). The request must
        be written after the writer committed them, with no log operation in between.

        The consumer's unread ids come from those the writer marked for it since its previous
        publish (:mod:`persistent_delta.trainer.unread`) when they equal the log's; a new unread
        set starts at ``request.end``, dropped again if the gather fails.

        ``request.cap``: what this publish may carry (:mod:`persistent_delta.trainer.caps`); the rows an
        earlier capped publish deferred are due first, and the rows that do not fit are deferred
        (``request.deferred``, stored by :func:`write_publish`). Only the rows carried are gathered.

        Raises:
            UnknownConsumerError: the consumer is not a lookups consumer of this log.
            ConsumerRoleError: it reads (``get_unique``).
            InvalidInputError: a pending record holds a negative id (the log never does); an
                unknown format; int8 asked for a table whose values are not float32 or float16.
            CorruptRecordError: the stored deferred rows are damaged.
        """
        # the ids committed since the consumer's last publish (taken after the pending records:
        # a record leaves those only once the unread set has it), and a new unread set from end
        taken = self._unread.take(request.consumer, request.end)
        try:
            self._log.read(lambda r: self._gather(r, request, pending, taken))
        except BaseException:
            self._unread.drop(request.consumer)  # the consumer stays where it was
            raise
        request.buffers = self._converted
        self.deferred[request.consumer] = request.deferred_rows

    def _gather(self, r: ReadTxn, request: PublishRequest, pending: Sequence[AppendRecord],
                 taken: Optional[UnreadSince]) -> None:
        """:meth:`gather` inside the read transaction ``r``."""
        name, tables = request.consumer, self._tables
        consumers = r.consumers()  # (parsed once: the consume rule and the formats both read them)
        entry, unread = consume.consume_read_ids(r, name, pending, taken, self._unread, consumers)
        # managed-collision tables: the slot reassignments since the consumer's last read travel with
        # the publish, and every slot an eviction re-initialised is carried (in any tracking mode)
        moves = slot_moves(r, max(entry.offset, log_start(r)), request.end,
                           [(p.batch_idx, p.fqn, p.kind, p.ids, p.states) for p in pending if p.kind in codec.SIDE_KINDS])
        for fqn, (slots, states) in moves.items():
            if fqn in tables:
                again = slots[reinitialised(states)]
                if again.numel():
                    have = unread.get(fqn)
                    unread[fqn] = torch.unique(again if have is None else torch.cat([have.to(torch.int64), again]))
        due = read_deferred(r, name, {fqn: t.local_rows for fqn, t in tables.items()})
        request.entry, request.due_seq, request.had_due = entry, due.seq, bool(due.ids)
        request.moves = {f: m for f, m in moves.items() if f in tables}
        if due.ids or request.cap is not None:
            unread, request.deferred = caps.select(due, unread, tables, request.cap)
        formats = publish_formats(r, request.asked, consumers)
        views = shard_weights(tables, [fqn for fqn, ids in unread.items() if ids.numel() and fqn in tables])
        for fqn, ids in unread.items():
            if ids.numel() == 0 or fqn not in tables:
                continue
            check_row_ids(fqn, int(ids[0]))  # (ascending: the smallest) before gathering rows by them
            weights = views[fqn]
            half = tables[fqn].local_cols != tables[fqn].global_cols
            tail = tuple(weights.shape[1:])
            for f in formats:  # refused here, in the caller's thread, not later by the writer
                codec.format_states(f, weights.dtype, tail, half)
            stored = tuple(dict.fromkeys(codec.stored_format(f, weights.dtype) for f in formats))
            size = codec.encoded_size(ids, weights.dtype, (int(ids.numel()), int(weights.shape[1])),
                                      codec.KIND_SNAPSHOT, request.publish_time)
            record, values = codec.gather_record(ids, weights, ids, codec.KIND_SNAPSHOT, request.publish_time,
                                                 into=reusable(self._records, fqn, size))
            request.tables[fqn] = GatheredRows(ids, values, record, stored, half)


def encode_formats(request: PublishRequest, fqn: str) -> Iterator[codec.Encoded]:
    """The records to store for table ``fqn`` of ``request``, one per stored format, each
    encoded once from the gathered rows and checksummed: the native record as it was gathered,
    the others converted (cast on their way into the record, or
    :func:`persistent_delta.log.codec.quantize_int8` first) into the writer's reusable buffers."""
    g = request.tables[fqn]
    for fmt in g.formats:
        if fmt == codec.NATIVE:
            yield codec.checksum_record(g.record)
            continue
        dtype, tail = codec.format_states(fmt, g.values.dtype, tuple(g.values.shape[1:]), g.column_half)
        rows = codec.quantize_int8(g.values) if dtype == torch.uint8 else g.values
        into = None
        if request.buffers is not None:
            size = codec.encoded_size(g.ids, dtype, (int(rows.shape[0]), *tail), codec.KIND_SNAPSHOT,
                                      request.publish_time, fmt)
            into = reusable(request.buffers, (fqn, fmt), size)
        yield codec.encode_cast(g.ids, rows, dtype, codec.KIND_SNAPSHOT, request.publish_time, fmt, into)


def write_publish(w: WriteTxn, request: PublishRequest, mode: UpdateMode) -> None:
    """Write a gathered publish inside ``w`` (the writer's step): the consumer's new position
    (the consume rule's write half, with the request's rule), the snapshot records, their stamp
    as the open one, and retention of both channels.

    With deferred rows (a capped publish), or when the gather found some (now carried), the
    consumer's deferred rows are stored in the same transaction
    (:func:`persistent_delta.log.deferred.write_deferred`).

    Raises:
        ConsumerConflictError: the consumer moved, or its deferred rows changed, since the
            gather (nothing is written).
        InvalidInputError: the request was never gathered.
    """
    name = request.consumer
    if request.entry is None:
        raise InvalidInputError(f"the publish of consumer {name!r} was handed to the writer before its rows were gathered")
    consume.consume_commit(w, name, request.entry, request.end, mode, compact=request.compact,
                           delete_on_read=request.delete_on_read, bound=request.bound)
    if request.deferred or request.had_due:
        stored = read_deferred(w, name)
        if stored.seq != request.due_seq:
            raise ConsumerConflictError(
                f"the deferred rows of consumer {name!r} of {w.path} changed between its publish's gather and "
                "its commit; the publish is not committed")
        write_deferred(w, name, request.deferred, request.due_seq + 1)
    for fqn in request.tables:
        entry = w.table(fqn)
        if entry is not None:
            for record in encode_formats(request, fqn):
                w.put_record(entry.table_id, request.stamp, record, channel=SNAPSHOTS)
    for fqn, (slots, states) in request.moves.items():
        entry = w.table(fqn)
        if entry is not None:  # the publish's raw-id changes (a snapshots replica's RawIdMap)
            w.put_record(codec.side_table_id(entry.table_id), request.stamp,
                         codec.encode_record(slots, states, codec.KIND_SLOTS), channel=SNAPSHOTS)
    position_rules.open_stamp(w, request.stamp)  # readable once its batch ends (position_rules)
    if request.delete_on_read:
        position_rules.enforce_retention(w, SNAPSHOTS, request.bound)
