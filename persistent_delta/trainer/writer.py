"""The background writer: takes captured records off the training thread and commits them.

Owns: when and how queued operations are committed (queue, backpressure, group commit,
failure), and the dispatch from each operation's type to what it writes.

Design note
-----------
The training thread only *captures* what a batch looked up (keeps references to the ids, copies
EMBEDDING rows into reused blocks on CPU, or starts device-to-host copies), and hands each step's records to :meth:`BackgroundWriter.submit` as one
:class:`~persistent_delta.trainer.operations.StepWrite`; a publish and ``auto_compact`` hand it a
:class:`~persistent_delta.trainer.operations.PublishRequest` or
:class:`~persistent_delta.trainer.operations.Compaction`. A single writer thread lets small steps
gather (up to ``linger_steps`` operations, ``linger_bytes`` or ``linger_s`` seconds, unless
someone waits for it), then, for each run of queued operations, taken until it holds
``linger_bytes`` of captured bytes (:func:`commit_operations`):

1. waits for pending device-to-host copies (CUDA events);
2. in **one** LMDB write transaction (group commit): drops rows the window filter has seen,
   deduplicates each (table, batch_idx) with the update mode's FIRST/LAST rule (so answers are
   unchanged), encodes (the kept rows of a captured block gathered straight into the record,
   in buffers reused from commit to commit), appends, persists the tracker's batch index, then
   writes each publish and runs each compaction, in submission order.

A publish is not handed over: the training thread commits it, with the step's records captured
so far, in one transaction of its own (:meth:`BackgroundWriter.commit_inline`), after whatever
the writer was handed before; the writer thread takes nothing meanwhile. Its transaction then
starts at once instead of after a hand-off to a thread that must first get the GIL and a core,
which on a busy host was a tail of tens of milliseconds; the work is the same, on the thread
that waits for it (the training thread gathered the rows already).

Memory is bounded: ``submit`` waits while more than ``max_pending_bytes`` or
``max_pending_steps`` are queued (backpressure); nothing is ever dropped. The writer also keeps
its encode buffers (at most 64 MiB: :class:`~persistent_delta.log.records.EncodeBuffers`). If a commit fails
(disk full, ...), the failed operations stay at the head of the queue, the writer stops, and the
next ``submit``/``barrier`` raises :class:`WriterError`; :meth:`BackgroundWriter.resume` retries
them (``PersistentDeltaTracker.resume`` for a tracker).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional, Tuple

import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta.config import WriterOptions
from persistent_delta.errors import InvalidInputError, LogClosedError, LogFullError, WriterError, WriterLogFullError
from persistent_delta.log import position_rules
from persistent_delta.log.codec import SIDE_KINDS
from persistent_delta.log.deltalog import DeltaLog, WriteTxn
from persistent_delta.log.records import AppendRecord, EncodeBuffers, encode_records, materialized, write_records
from persistent_delta.log.rows import compute_unique_rows, plan_unique_rows, unique_ids
from persistent_delta.log.schema import META_CURR_BATCH
from persistent_delta.threads import default_kept, set_for_this_thread
from persistent_delta.trainer import publish
from persistent_delta.trainer.operations import Compaction, Operation, PublishRequest, StepWrite
from persistent_delta.trainer.window import WindowFilter

logger = logging.getLogger(__name__)


_OPERATIONS = (StepWrite, PublishRequest, Compaction)


@dataclass
class _Queued:
    """An operation in the writer's queue, with what the queue accounts for it."""

    op: Operation
    nbytes: int  # memory it holds until written, counted against the writer's budget
    submitted: float = 0.0  # time.monotonic() when admitted to the queue

    @property
    def prompt(self) -> bool:
        """Commit without waiting to group more: someone waits to read a publish."""
        return isinstance(self.op, PublishRequest)


def tensor_bytes(t: Optional[torch.Tensor]) -> int:
    """Bytes of ``t``'s elements (0 for None)."""
    return 0 if t is None else t.numel() * t.element_size()


def held_bytes(op: Operation) -> int:
    """The memory ``op`` holds until the writer writes it (captured rows and records)."""
    if isinstance(op, StepWrite):
        return sum(tensor_bytes(r.ids) + tensor_bytes(r.states) for r in op.records)
    if isinstance(op, PublishRequest):
        return op.nbytes
    return 0


def dedup_records(records: List[AppendRecord], mode: UpdateMode) -> List[AppendRecord]:
    """Merge records that share (fqn, batch_idx) into one, keeping FIRST/LAST semantics.
    Records the window filter marked ``unique`` hold no id twice, nor one another's ids: they
    are kept as they are (one) or concatenated (several)."""
    groups: Dict[Tuple[str, int], List[AppendRecord]] = collections.OrderedDict()
    for r in records:
        groups.setdefault((r.fqn, r.batch_idx), []).append(r)
    out: List[AppendRecord] = []
    for (fqn, b), recs in groups.items():
        starts = [r.window_start for r in recs if r.window_start is not None]
        w = min(starts) if starts else None  # the merged record needs the window start of any part
        one = recs[0]
        if len(recs) == 1 and not one.unique and mode != UpdateMode.NONE and one.states is not None \
                and one.states.dim() == 2:
            out.append(_picked(one, mode, w))  # one record of a block: its kept rows are gathered on encode
            continue
        if len(recs) > 1 or not one.unique:
            recs = [materialized(r) for r in recs]  # rows kept as rows of a block: gathered to merge
        if all(r.unique for r in recs):
            if len(recs) == 1:
                out.append(recs[0])
                continue
            states = None if recs[0].states is None else torch.cat([r.states for r in recs])  # type: ignore[misc]
            out.append(AppendRecord(b, fqn, torch.cat([r.ids for r in recs]), states, window_start=w, unique=True))
            continue
        if mode == UpdateMode.NONE:
            ids = [r.ids for r in recs]
            out.append(AppendRecord(b, fqn, unique_ids(torch.cat(ids) if len(ids) > 1 else ids[0]), window_start=w))
            continue
        rows = compute_unique_rows([r.ids for r in recs], [r.states for r in recs], mode)  # type: ignore[misc]
        out.append(AppendRecord(b, fqn, rows.ids, rows.states, window_start=w))
    return out


def _picked(rec: AppendRecord, mode: UpdateMode, window_start: Optional[int]) -> AppendRecord:
    """The one record of its (table, batch), deduplicated by the update mode's rule, its kept
    rows left as rows of its 2-D states block: :func:`~persistent_delta.log.records.encode_records`
    gathers them straight into the encoded value (one copy of the rows, no block of the
    result's size allocated in between)."""
    plan = plan_unique_rows([rec.ids], [rec.states], mode)  # type: ignore[list-item]
    rows = rec.rows
    if plan.picked is not None:
        rows = plan.picked if rows is None else rows.index_select(0, plan.picked)
    return AppendRecord(rec.batch_idx, rec.fqn, plan.ids, rec.states, window_start=window_start, rows=rows)


class BackgroundWriter:
    """Commits queued operations (:mod:`persistent_delta.trainer.operations`) to a
    :class:`DeltaLog` from a daemon thread.

    Thread-safety: ``submit``, ``commit_inline``, ``barrier``, ``stats`` and ``close`` may be
    called from any thread of the process that owns the log. One commit runs at a time: the
    writer thread's or a ``commit_inline``.

    ``committed``: called on the committing thread with the step records of each commit, after it
    committed and before its operations leave the queue (``pending_records`` stops listing
    them): a publish's unread ids (:mod:`persistent_delta.trainer.unread`).
    """

    def __init__(
        self,
        log: DeltaLog,
        mode: UpdateMode,
        options: Optional[WriterOptions] = None,
        window: Optional[WindowFilter] = None,
        committed: Optional[Callable[[List[AppendRecord]], None]] = None,
    ) -> None:
        self._log = log
        self._committed = committed  # told each commit's step records before they leave the queue
        self._mode = mode
        self._window = window
        self._buffers = EncodeBuffers()  # each commit encodes into these (one commit at a time)
        self._opts = options or WriterOptions()
        self._cv = threading.Condition()
        self._queue: Deque[_Queued] = collections.deque()
        self._pending_bytes = 0
        self._inflight: List[_Queued] = []  # operations taken by the writer, not yet committed
        self._urgent = 0  # threads waiting for the writer (barrier, backpressure): no lingering
        self._after_barrier = False  # the next transaction commits without lingering (see _linger)
        self._error: Optional[BaseException] = None
        self._closed = False
        self._stats: Dict[str, float] = {
            "commits": 0,
            "operations": 0,
            "records_written": 0,
            "bytes_written": 0,
            "bytes_captured": 0,
            "max_wait_s": 0.0,
            "total_wait_s": 0.0,
            "commit_time_s": 0.0,
            "publishes": 0,
            "publish_s": 0.0,  # each publish from its hand-off to its commit (writer-side clock)
        }
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"persistent-delta-writer:{log.path}", daemon=True)
        with default_kept():  # the writer thread sets its own count (threads.set_for_this_thread)
            self._thread.start()
            self._ready.wait()

    # ------------------------------------------------------------------ training-thread side
    def submit(self, op: Operation) -> None:
        """Queue ``op``; waits while the queue is over budget (backpressure).

        Args:
            op: a :class:`~persistent_delta.trainer.operations.StepWrite`,
                :class:`~persistent_delta.trainer.operations.PublishRequest` or
                :class:`~persistent_delta.trainer.operations.Compaction`.

        Raises:
            InvalidInputError: ``op`` is none of those.
            WriterError: an earlier commit failed (see ``__cause__``); :meth:`resume` retries.
        """
        if not isinstance(op, _OPERATIONS):
            raise InvalidInputError(f"the writer runs StepWrite, PublishRequest or Compaction, not {type(op).__name__}")
        entry = _Queued(op, held_bytes(op))
        with self._cv:
            self._raise_if_failed()
            t0 = time.perf_counter()
            if self._over_budget(entry.nbytes):
                self._urgent += 1
                self._cv.notify_all()
                try:
                    while self._over_budget(entry.nbytes):
                        self._cv.wait()
                        self._raise_if_failed()
                finally:
                    self._urgent -= 1
            waited = time.perf_counter() - t0
            self._stats["total_wait_s"] += waited
            self._stats["max_wait_s"] = max(self._stats["max_wait_s"], waited)
            entry.submitted = time.monotonic()
            self._queue.append(entry)
            self._pending_bytes += entry.nbytes
            self._stats["bytes_captured"] += entry.nbytes
            if (
                len(self._queue) == 1
                or len(self._queue) >= self._opts.linger_steps
                or self._pending_bytes >= self._opts.linger_bytes
                or entry.prompt
            ):
                self._cv.notify_all()  # the writer starts lingering, or stops

    def _over_budget(self, incoming: int) -> bool:
        if not self._queue and not self._inflight:
            return False  # always admit one operation, however large
        return (
            self._pending_bytes + incoming > self._opts.max_pending_bytes
            or len(self._queue) + len(self._inflight) >= self._opts.max_pending_steps
        )

    def barrier(self) -> None:
        """Wait until everything submitted so far is committed.

        Raises:
            WriterError: a commit failed.
        """
        with self._cv:
            self._drain()
            self._after_barrier = True
            self._raise_if_failed()

    def _drain(self) -> None:
        """(Lock held.) Wait until nothing is queued or in flight, or a commit failed."""
        self._urgent += 1
        self._cv.notify_all()
        try:
            while (self._queue or self._inflight) and self._error is None:
                self._cv.wait()
        finally:
            self._urgent -= 1

    def commit_inline(self, ops: List[Operation]) -> None:
        """Commit ``ops`` in one transaction on the calling thread, after everything submitted
        before them (waited for first), as the writer thread would commit them (a publish with
        its step's records: :meth:`persistent_delta.trainer.publish.Publisher.publish`). The
        writer thread takes nothing while it runs; ``submit`` from another thread queues
        behind it. A failed commit is handled as the writer thread's: the operations stay at
        the head of the queue, the writer stops, and the next ``submit``/``barrier`` raises
        :class:`WriterError` (:meth:`resume` retries them).

        Raises:
            InvalidInputError: an item of ``ops`` is not an operation.
            WriterError: an earlier commit failed (see ``__cause__``); :meth:`resume` retries.
        """
        bad = [type(op).__name__ for op in ops if not isinstance(op, _OPERATIONS)]
        if bad:
            raise InvalidInputError(f"the writer runs StepWrite, PublishRequest or Compaction, not {bad[0]}")
        with self._cv:
            self._raise_if_failed()
            self._drain()
            self._raise_if_failed()
            now = time.monotonic()
            taken = [_Queued(op, held_bytes(op), now) for op in ops]
            self._stats["bytes_captured"] += sum(t.nbytes for t in taken)
            self._inflight = taken  # (the writer thread waits while another thread commits)
        try:
            self._commit(taken)
        except BaseException as exc:
            logger.error("persistent_delta writer for %s failed: %s", self._log.path, exc)
            with self._cv:
                self._queue.extendleft(reversed(taken))
                self._pending_bytes += sum(t.nbytes for t in taken)
                self._inflight = []
                self._error = exc
                self._cv.notify_all()
            if not isinstance(exc, Exception):
                raise
            return
        with self._cv:
            self._inflight = []
            self._after_barrier = True  # as after the writer thread's publish: see _linger
            self._cv.notify_all()

    def pending_records(self) -> Optional[List[AppendRecord]]:
        """The records submitted and not yet committed (those of the transaction in flight,
        then the queued ones), for a reader that adds them to what the log holds instead of
        waiting for them (a publish's gather: what it submits next commits after these).
        None when one of those operations is not a :class:`StepWrite` (a publish or a
        compaction may move a consumer or merge records) or has device copies in flight: wait
        with :meth:`barrier` then. The records are the caller's to read only.

        Raises:
            WriterError: a commit failed.
        """
        with self._cv:
            self._raise_if_failed()
            ops = [t.op for t in self._inflight + list(self._queue)]
            steps = [op for op in ops if isinstance(op, StepWrite) and not op.events]
            if len(steps) < len(ops):
                return None
            return [r for op in steps for r in op.records]

    def queued(self) -> List[Operation]:
        """The operations submitted and not yet committed, in the order they will be written
        (the transaction in flight first). They are the caller's to read only."""
        with self._cv:
            return [t.op for t in self._inflight + list(self._queue)]

    def resume(self) -> None:
        """After a failure (e.g. disk full, once space is back): retry the failed operations."""
        with self._cv:
            self._error = None
            self._cv.notify_all()
        self.barrier()

    def _raise_if_failed(self) -> None:
        if self._closed:
            raise LogClosedError(f"{self._log.path}: the writer is closed")
        if self._error is not None:
            cls = WriterLogFullError if isinstance(self._error, LogFullError) else WriterError
            raise cls(
                f"{self._log.path}: the background writer failed: {self._error}. Nothing queued was dropped yet. "
                "Fix the cause (e.g. free disk space), then call the tracker's resume() (or the writer's) to "
                "commit the kept steps and continue; or close the tracker"
            ) from self._error

    def stats(self) -> Dict[str, float]:
        """Queue depth and bytes, commits, operations, bytes written, longest and total submit
        wait, commit time, publishes and their time from hand-off to commit (``publish_s``)."""
        with self._cv:
            out = dict(self._stats)
            out["queue_depth"] = len(self._queue) + len(self._inflight)
            out["queue_bytes"] = self._pending_bytes
            out["failed"] = self._error is not None
            return out

    def close(self, drain: bool = True) -> None:
        """Commit what is queued (when ``drain``), then stop the thread. Idempotent."""
        if self._closed:
            return
        try:
            if drain:
                self.barrier()
        finally:
            with self._cv:
                self._closed = True
                self._cv.notify_all()
            self._thread.join()

    # ------------------------------------------------------------------ writer thread
    def _run(self) -> None:
        try:
            set_for_this_thread(self._opts.torch_threads)
        finally:
            self._ready.set()
        while True:
            with self._cv:
                while not self._closed and (not self._queue or self._error is not None or self._inflight):
                    self._cv.wait()  # (in flight here: another thread's commit_inline)
                self._linger()
                if self._closed:
                    return
                taken = self._take()
                self._inflight = taken
            try:
                self._commit(taken)
            except BaseException as exc:  # noqa: BLE001 - reported to the training thread
                logger.error("persistent_delta writer for %s failed: %s", self._log.path, exc)
                with self._cv:
                    self._queue.extendleft(reversed(taken))
                    self._inflight = []
                    self._error = exc
                    self._cv.notify_all()
                continue
            with self._cv:
                self._inflight = []
                self._pending_bytes -= sum(t.nbytes for t in taken)
                if any(t.prompt for t in taken):
                    self._after_barrier = True  # a publish's transaction may have deleted: see _linger
                self._cv.notify_all()

    def _linger(self) -> None:
        """(Lock held.) Wait for more steps to group into one transaction, within limits."""
        if not self._queue or any(t.prompt for t in self._queue):
            return
        if self._after_barrier:
            # A barrier usually precedes a read that deletes (delete_on_read) in its own
            # transaction, and a publish may have deleted in the last one. LMDB cannot reuse
            # pages freed by the latest transaction in the very next one, so a large next
            # transaction would grow the file by its whole size. Keep that one small.
            self._after_barrier = False
            return
        deadline = self._queue[0].submitted + self._opts.linger_s
        while (
            len(self._queue) < self._opts.linger_steps
            and self._pending_bytes < self._opts.linger_bytes
            and not self._urgent
            and not self._queue[-1].prompt
            and not self._closed
        ):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cv.wait(left)

    def _take(self) -> List[_Queued]:
        """(Lock held.) The operations of the next transaction, off the queue's head: the
        oldest, and the next ones while those taken hold less than ``linger_bytes`` of captured
        bytes (so a step and the publish behind it still share one). Grouping shares a
        transaction's fixed costs among small steps; past ``linger_bytes`` there is nothing
        left to share, and a transaction of a backlog of large steps would hold all their
        pages at once: LMDB ``malloc``\\ s a transaction's pages and frees them at its commit,
        so a larger one page-faults more of them in and encodes past the writer's reused
        buffers (``benchmarks/append_throughput``)."""
        taken = [self._queue.popleft()]
        size = taken[0].nbytes
        while self._queue and size < self._opts.linger_bytes:
            size += self._queue[0].nbytes
            taken.append(self._queue.popleft())
        return taken

    def _commit(self, taken: List[_Queued]) -> None:
        t0 = time.perf_counter()
        n_records, nbytes = commit_operations(self._log, self._mode, [t.op for t in taken], self._window,
                                              self._buffers)
        if self._committed is not None:
            self._committed([r for t in taken if isinstance(t.op, StepWrite) for r in t.op.records])
        dt = time.perf_counter() - t0
        done = time.monotonic()
        published = [done - t.submitted for t in taken if isinstance(t.op, PublishRequest)]
        with self._cv:
            self._stats["publishes"] += len(published)
            self._stats["publish_s"] += sum(published)
            self._stats["commits"] += 1
            self._stats["operations"] += len(taken)
            self._stats["records_written"] += n_records
            self._stats["bytes_written"] += nbytes
            self._stats["commit_time_s"] += dt


class WriterFeed:
    """The training thread's side of the writer: hands operations to a :class:`BackgroundWriter`
    (``background``), or, without one, commits each at once (:func:`commit_operations`), and
    waits for it. ``committed`` is told every committed step's records either way (the unread
    ids of publishing consumers, :mod:`persistent_delta.trainer.unread`). Training thread only.
    """

    def __init__(self, log: DeltaLog, mode: UpdateMode, window: Optional[WindowFilter],
                 committed: Callable[[List[AppendRecord]], None], options: Optional[WriterOptions] = None,
                 background: bool = True) -> None:
        self._log, self._mode, self._window, self._committed = log, mode, window, committed
        self._inline = (options or WriterOptions()).inline_publish
        self.writer: Optional[BackgroundWriter] = (
            BackgroundWriter(log, mode, options, window, committed=committed) if background else None)

    def hand_off(self, op: Operation) -> None:
        """Queue ``op`` for the writer thread, or, without one, commit it now."""
        if self.writer is not None:
            self.writer.submit(op)
        else:
            self.commit_now([op])

    def commit_now(self, ops: List[Operation]) -> None:
        """Commit ``ops`` in one transaction on this thread, after everything handed off before
        (:meth:`BackgroundWriter.commit_inline`; without a writer thread, at once). A failure
        with a writer thread is the writer's (raised by the next call); without one it raises."""
        if self.writer is not None:
            self.writer.commit_inline(ops)
            return
        commit_operations(self._log, self._mode, ops, self._window)
        self._committed([r for op in ops if isinstance(op, StepWrite) for r in op.records])

    def commit_publish(self, ops: List[Operation]) -> None:
        """A publish's operations (the step's records captured so far, then its request), in
        order after everything handed off before: committed on this thread in one transaction
        (:meth:`commit_now`) when ``WriterOptions.inline_publish``, else handed to the writer
        thread."""
        if self._inline or self.writer is None:
            self.commit_now(ops)
            return
        for op in ops:
            self.hand_off(op)

    def settle(self) -> None:
        """Wait until the writer committed what it was handed (a queued publish moves its
        consumer only when the writer commits it)."""
        if self.writer is not None:
            self.writer.barrier()

    def resume(self) -> None:
        """After a failed commit, once the cause is fixed: retry what the writer kept."""
        if self.writer is not None:
            self.writer.resume()

    def close(self) -> None:
        """Stop the writer thread without committing what is queued."""
        if self.writer is not None:
            self.writer.close(drain=False)

    def unsettled(self) -> List[AppendRecord]:
        """The records handed to the writer and not committed yet, for a read that adds them to
        the log's instead of waiting (publish); or, after waiting for the writer (:meth:`settle`),
        none. It waits when the queue holds a log operation (an earlier :class:`PublishRequest`:
        its record buffers are still in use, and it moves the consumer; a :class:`Compaction`) or
        device copies in flight."""
        pending = None if self.writer is None else self.writer.pending_records()
        if pending is None:
            self.settle()
            return []
        return pending


def commit_operations(
    log: DeltaLog, mode: UpdateMode, ops: List[Operation], window: Optional[WindowFilter] = None,
    buffers: Optional[EncodeBuffers] = None,
) -> Tuple[int, int]:
    """Commit ``ops`` in one write transaction; returns (records, bytes) appended.

    Waits for the steps' device copies, then inside the transaction (the window filter reads the
    consumer offsets): drops rows already recorded in the window -- first, so that the
    per-(table, batch) dedup that follows only sorts what is new -- dedups, encodes and appends
    every :class:`StepWrite`'s records, persists the latest batch index among them, then runs
    each :class:`PublishRequest` and :class:`Compaction` in order (:func:`write_log_operation`).
    The rows the filter keeps of a captured block are gathered straight into their encoded
    record (one copy); ``buffers``: the caller's reused encode buffers (one thread's).

    Raises:
        InvalidInputError: a record cannot be stored (e.g. a negative id); nothing is written.
    """
    steps = [op for op in ops if isinstance(op, StepWrite)]
    for step in steps:
        for ev in step.events:
            ev.synchronize()
    records: List[AppendRecord] = [r for step in steps for r in step.records]
    dedup = all(step.dedup for step in steps)
    batch_idx = next((s.curr_batch_idx for s in reversed(steps) if s.curr_batch_idx is not None), None)
    log_ops = [op for op in ops if not isinstance(op, StepWrite)]
    undo: List[Callable[[], None]] = []

    def rollback() -> None:
        while undo:
            undo.pop()()

    def write_group(w: WriteTxn) -> Tuple[int, int]:
        rollback()  # a retried transaction (map growth) filters again from the same window
        # side records (managed-collision raw ids, slot reassignments) are written as captured
        kept = [r for r in records if r.kind not in SIDE_KINDS]
        side = [r for r in records if r.kind in SIDE_KINDS] if len(kept) < len(records) else []
        if window is not None and kept:
            kept, revert = window.filter(w, kept, lazy=True)
            undo.append(revert)
        if dedup:
            kept = dedup_records(kept, mode)
        encoded = encode_records(kept + side, mode, buffers)
        n = write_records(w, encoded) if encoded else 0
        if batch_idx is not None:
            w.set_meta(META_CURR_BATCH, batch_idx)
        for op in log_ops:
            write_log_operation(w, mode, op)
        if batch_idx is not None:
            position_rules.close_stamps(w, batch_idx)  # the publishes of the batches that ended are readable
        return len(encoded), n

    try:
        return log.write(write_group)
    except BaseException:
        rollback()  # nothing was committed: the window must not remember these rows
        raise


def write_log_operation(w: WriteTxn, mode: UpdateMode, op: Operation) -> None:
    """Run a publish or a compaction inside ``w`` (``mode``: the log's update mode).

    Raises:
        InvalidInputError: ``op`` is neither a :class:`PublishRequest` nor a :class:`Compaction`.
        ConsumerConflictError: a publish's consumer moved since its capture.
    """
    if isinstance(op, PublishRequest):
        publish.write_publish(w, op, mode)
    elif isinstance(op, Compaction):
        position_rules.compact_behind(w, mode, op.end)
    else:
        raise InvalidInputError(f"not a log operation of the writer: {type(op).__name__}")


__all__ = ["BackgroundWriter", "WriterFeed", "commit_operations", "dedup_records", "held_bytes", "write_log_operation"]
