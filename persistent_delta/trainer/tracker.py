"""``PersistentDeltaTracker``: TorchRec's ``ModelDeltaTracker`` on a durable log -- a facade.

Owns: the wiring of TorchRec's hooks and API to the modules that hold the rules. Capture and
hooks: :mod:`.capture`; what the writer runs: :mod:`.operations`; commits off the training
thread: :mod:`.writer` and :mod:`.window`; TorchRec's consume rule: :mod:`.consume`; what a
position means and what retention and compaction may do:
:mod:`persistent_delta.log.position_rules`; publish: :mod:`.publish`; checkpoints and restore:
:mod:`.restore`; top-k: :mod:`.topk`; ZCH raw ids: :mod:`.zch_capture`.

``DMP.forward`` calls ``step()`` before the lookups, so batch ``b``'s records carry ``b``. The
hot path (``record_lookup``) keeps references (EMBEDDING on CPU: a copy of the rows in a reused
block, :class:`~.capture.LookupBlocks`); ``step()`` hands the finished batch, with the
new batch index, to the background writer as a :class:`~.operations.StepWrite`. Every read
(``get_unique``, ``publish``) commits what was recorded, then runs TorchRec's consume rule (a
publish is queued to the writer as a :class:`~.operations.PublishWrite` once its values are
captured). Deliberate differences from TorchRec: see docs/concepts.md.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.model_tracker.model_delta_tracker import UPDATE_MODE_MAP, ModelDeltaTracker
from torchrec.distributed.model_tracker.types import Trackers, UniqueRows, UpdateMode
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from persistent_delta.log import codec, position_rules
from persistent_delta.trainer import caps, consume, publish, restore, topk
from persistent_delta.trainer.capture import Capture, Discovery, check_mode, read_states, register_hooks, row_shapes
from persistent_delta.trainer.capture import unregister_hooks
from persistent_delta.config import PersistentTrackerConfig, RetentionBound
from persistent_delta.errors import InvalidInputError, LogClosedError
from persistent_delta.log.alloc import ResultBuffers
from persistent_delta.log.layout import rank_dir
from persistent_delta.lifecycle import close_at_exit, warn_unclosed
from persistent_delta.log.lmdbenv import ConsumerClaims
from persistent_delta.log.deferred import drop_deferred, deferred_by_consumer
from persistent_delta.log.deltalog import DeltaLog, ReadTxn, WriteTxn
from persistent_delta.log.records import AppendRecord
from persistent_delta.log.schema import (
    LOOKUPS,
    META_CLOSED_END,
    META_CURR_BATCH,
    Delivery,
    TrackerMeta,
    check_consumer_name,
)
from persistent_delta.trainer.sharding import LocalTable, local_tables
from persistent_delta.torchrec_internals import dmp_wrapped_module
from persistent_delta.trainer.unread import UnreadIds
from persistent_delta.trainer.operations import Compaction, Operation, PublishWrite, StepWrite
from persistent_delta.trainer.writer import BackgroundWriter, commit_operations
from persistent_delta.trainer.window import WindowFilter
from persistent_delta.trainer.zch_capture import ZchCapture

logger = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["PersistentDeltaTracker", "PersistentTrackerConfig", "attach"]


class PersistentDeltaTracker(ModelDeltaTracker):
    """A durable ``ModelDeltaTracker`` for TorchRec sharded models.

    Build it with :func:`attach` (which registers it in the DMP), or directly with the DMP's
    wrapped module. The training thread of the process that built it calls every method;
    ``get_unique``/``clear``/``flush`` may also be called from another thread as long as calls
    do not overlap. The log may be read meanwhile by other processes (``DeltaConsumer``, tools).
    ``model`` is the module to track (the module a DMP wraps, for a DMP).

    Raises:
        InvalidInputError: bad config (no path, EMBEDDING on an EBC, bad consumer names).
        ConfigMismatchError: the log holds another tracking mode or table set (use ``fresh``).
        LogLockedError: another process writes this rank's log.
    """

    def __init__(self, model: nn.Module, config: PersistentTrackerConfig) -> None:
        if not isinstance(config, PersistentTrackerConfig):
            raise InvalidInputError("config must be a PersistentTrackerConfig")
        config.validate()
        self._config = config
        self._mode = config.tracking_mode
        self._update_mode: UpdateMode = UPDATE_MODE_MAP[self._mode]
        self._auto_compact = config.auto_compact
        self._retention = config.retention or RetentionBound.resolve()
        self._consumers: List[str] = [check_consumer_name(c) for c in (config.consumers or [self.DEFAULT_CONSUMER])]
        self._closed = True
        writer_options = config.writer_options()
        self._discovery = Discovery(model, list(config.fqns_to_skip))
        self.tracked_modules: Dict[str, nn.Module] = self._discovery.tracked_modules
        self.table_to_fqn: Dict[str, str] = self._discovery.table_to_fqn
        self.feature_to_fqn: Dict[str, str] = self._discovery.feature_to_fqn
        check_mode(self._mode, self.tracked_modules)
        # track_eval=False: a lookup is skipped while the tracked modules are in eval mode (one of
        # them answers for all: model.eval() sets every module's flag)
        self._eval_probe: Optional[nn.Module] = None if config.track_eval else next(iter(self.tracked_modules.values()), None)
        self._tables: Dict[str, LocalTable] = local_tables(self.tracked_modules, self.table_to_fqn)
        # publish(): a record buffer per table, reused (publish.capture; free again once the
        # writer committed the previous publish, which publish() waits for before capturing)
        self._publish_buffers: Dict[str, bytearray] = {}
        self._format_buffers: Dict[Tuple[str, str], bytearray] = {}  # the same, of converted records (writer)
        # get_unique(): the rows' memory, reused once the caller dropped an earlier result (a
        # fresh result of the window's size page-faults in every read)
        self._results = ResultBuffers()
        self.rank = config.rank if config.rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
        self.path = rank_dir(config.path, self.rank)
        self._log = DeltaLog(self.path, options=config.log_options())
        self._claims = ConsumerClaims(self.path)  # one active user per consumer name: us, for ours
        world = dist.get_world_size() if dist.is_initialized() else (1 if config.rank is None else None)
        want = TrackerMeta(self._mode.value, self._update_mode.value, sorted(self._tables), self.rank, world)
        self._capture = Capture(self._mode, self.feature_to_fqn, writer_options.max_pending_steps)
        self.zch = ZchCapture(  # this rank's managed-collision tables (raw ids, slot reassignments)
            model, {f: (t.table_name, t.row_offset, t.local_rows) for f, t in self._tables.items()},
            self._capture.add, self._recording_batch_idx, config)
        shards = {f: {**t.metadata(self._discovery.module_kind(f)), **self.zch.describe(f)} for f, t in self._tables.items()}
        shapes = {fqn: row_shapes(self._mode, t) for fqn, t in self._tables.items()}
        # fqn -> ids of batches this restart dropped (not complete on every rank): a restore re-delivers them
        self._dropped_ids: Dict[str, torch.Tensor] = {}
        try:
            self.curr_batch_idx: int = restore.resume_at(self._log, *self._log.write(
                lambda w: restore.open_tracker_log(w, want, shards, self._consumers, config.fresh, shapes)),
                dropped_ids=self._dropped_ids)
            for c in self._consumers:
                self._claims.claim(c, "track it")
        except BaseException:
            self._claims.release_all()
            self._log.close()
            raise
        self.curr_compact_index = self.curr_batch_idx
        # capped publishes: consumer -> rows still deferred (persistent_delta.log.deferred), as stored
        self._publish_deferred: Dict[str, int] = self._log.read(deferred_by_consumer)
        # The newest closed publish stamp: a publish never takes one (a snapshots consumer may have
        # read past it); the publishes of a batch share its stamp until it closes, at the batch's
        # end or flush() (position_rules.open_stamp). A (re)start closes what an earlier writer left
        # open, and the index it continues at counts as closed (an earlier writer may have published
        # at it), the same on every rank (resume_at agreed on it).
        self._last_stamp = max(self._log.write(position_rules.close_stamps) - 1, self.curr_batch_idx)
        self._open_stamp: Optional[int] = None  # the stamp of this batch's publishes, not closed yet
        self._window = WindowFilter(self._update_mode)
        # TorchRec's consume rule, as every read applies it (compaction is moot when the
        # window filter already stores each row once per window).
        self._read_rule: Dict[str, Any] = dict(
            compact=not self._window.enabled, delete_on_read=config.delete_on_read, bound=self._retention)
        # publish(): per publishing consumer, the ids committed since its last publish (:mod:`.unread`)
        self._unread = UnreadIds({fqn: t.local_rows for fqn, t in self._tables.items()})
        self._writer: Optional[BackgroundWriter] = None
        if config.async_writes:
            self._writer = BackgroundWriter(self._log, self._update_mode, writer_options, self._window,
                                            committed=self._unread.add)
        self._closed = False
        self._hooked = register_hooks(
            self.tracked_modules, self._mode, self.record_lookup, self.trigger_compaction if self._auto_compact else None
        )
        self.zch.hook()  # managed-collision tables: raw ids and slot reassignments (persistent_delta.trainer.zch_capture)
        # A restore the first step must see (dmp.load_state_dict), or a warning it never came.
        self._pending_restore: Optional[Dict[str, Any]] = None
        self._unrestored = self._log.read(restore.unrestored)
        # The model's state dict carries the tracker's (on the module inside DDP: the DMP moves
        # a DDP's "module." prefix, and loads that module's part of a state dict as its own).
        self._state_hooks: List[Any] = restore.hook_model_state(
            model.module if isinstance(model, DistributedDataParallel) else model, self.rank, self._model_state,
            self._restore_at_first_step)
        close_at_exit(self)
        logger.info("persistent delta tracker on %s: mode %s, %d tables, consumers %s, batch %d",
                    self.path, self._mode.name, len(self._tables), self._consumers, self.curr_batch_idx)

    # ------------------------------------------------------------------ hot path
    def step(self) -> None:
        """Advance the batch index (DMP.forward calls it before the lookups) and hand the
        finished batch to the writer."""
        self._check()
        if self._unrestored is not None or self._pending_restore is not None:
            self._first_step()
        self.curr_batch_idx += 1
        if self._open_stamp is not None and self._open_stamp < self.curr_batch_idx:
            self._last_stamp, self._open_stamp = max(self._last_stamp, self._open_stamp), None  # this step closes it
        self._hand_off(self._take_step())

    def _first_step(self) -> None:
        """Before the first step: restore the state a ``dmp.load_state_dict`` brought (now that
        the optimizer state is loaded too), or warn that the log runs past the latest
        checkpoint and nothing restored the tracker (a collective when a restore is due: every
        rank takes its first step)."""
        pending, self._pending_restore = self._pending_restore, None
        if pending is not None:
            self.load_state_dict(pending)
            return
        floor, last = self._unrestored or (0, 0)
        self._unrestored = None
        msg = (f"{self.path}: the log holds batches {floor}..{last} recorded after the latest model checkpoint "
               f"(taken at batch {floor - 1}) and training continues without a tracker restore: if the model was "
               "restored from that checkpoint, every replica keeps the rows of those lost steps. Restore the tracker "
               "with the model: dmp.load_state_dict(checkpoint) with a checkpoint from dmp.state_dict() (it carries "
               "the tracker's state), or tracker.load_state_dict(state) before the first step")
        logger.warning("%s", msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _recording_batch_idx(self) -> int:
        """The batch being recorded (what a side record captured now is stamped with)."""
        return self.curr_batch_idx

    def _take_step(self) -> StepWrite:
        """The records captured so far, with the batch index to persist alongside them."""
        records, events = self._capture.take()
        return StepWrite(records=records, curr_batch_idx=self.curr_batch_idx, events=events)

    def _hand_off(self, op: Operation) -> None:
        """Queue ``op`` for the writer thread, or, without one, commit it now."""
        if self._writer is not None:
            self._writer.submit(op)
        else:
            commit_operations(self._log, self._update_mode, [op], self._window)
            if isinstance(op, StepWrite):
                self._unread.add(op.records)

    def record_lookup(self, kjt: KeyedJaggedTensor, states: torch.Tensor, emb_module: Optional[nn.Module] = None,
                      raw_ids: Optional[torch.Tensor] = None) -> None:
        """Record one lookup of the current batch (TorchRec's callables call it): ``kjt`` holds
        shard-local ids, ``states`` the lookup output (EMBEDDING), ``emb_module`` the grouped
        embedding module (optimizer-state modes)."""
        if self._closed:
            raise LogClosedError(f"{self.path}: the tracker is closed")
        if self._eval_probe is not None and not self._eval_probe.training:
            return  # an eval forward, not tracked (track_eval=False)
        self._capture.lookup(self.curr_batch_idx, kjt, states, emb_module)

    def trigger_compaction(self) -> None:
        """Post-odist callable (``auto_compact``): queue a compaction of
        ``[largest consumer position, curr_batch_idx)`` for the writer thread, once per batch."""
        if self._closed or self.curr_compact_index >= self.curr_batch_idx:
            return
        end = self.curr_batch_idx
        self._hand_off(Compaction(end))  # the batch being recorded stays captured: it is not in [.., end)
        self.curr_compact_index = end

    def _commit_recorded(self) -> None:
        """Commit everything recorded so far, the current batch included (no fsync)."""
        self._check()
        self._hand_off(self._take_step())
        self._settle()

    def _unsettled(self) -> List[AppendRecord]:
        """The records handed to the writer and not committed yet, for a read that adds them to
        the log's instead of waiting (publish); or, after waiting for the writer (:meth:`_settle`),
        none. It waits when the queue holds a log operation (an earlier :class:`PublishWrite`: its
        record buffers are still in use, and it moves the consumer; a :class:`Compaction`) or
        device copies in flight."""
        pending = None if self._writer is None else self._writer.pending_records()
        if pending is None:
            self._settle()
            return []
        return pending

    def _settle(self) -> None:
        """Wait until the writer committed what it was handed (a queued publish moves its
        consumer only when the writer commits it); records of the open batch stay captured."""
        self._check()
        if self._writer is not None:
            self._writer.barrier()

    # ------------------------------------------------------------------ reads
    def get_unique(
        self,
        consumer: Optional[str] = None,
        top_percentage: Optional[float] = 1.0,
        per_table_percentage: Optional[Dict[str, Tuple[float, str]]] = None,
        sorted_by_indices: Optional[bool] = True,
    ) -> Dict[str, UniqueRows]:
        """Rows changed since ``consumer`` (default ``"default"``) last read, per table fqn, as
        ``UniqueRows`` (shard-local ids ascending; states per tracking mode; a table with nothing
        new gives ``(0, *row_shape)`` tensors); commits its new position.

        ``top_percentage`` (0, 1] keeps each table's rows that changed most, and
        ``per_table_percentage`` (fqn -> (fraction, ``""``/``"norm"``/``"default"``)) overrides it
        per table (:mod:`persistent_delta.trainer.topk`); rows left out are **not** re-delivered.
        ``sorted_by_indices=False`` orders kept rows by score, highest first.

        Raises:
            UnknownConsumerError: ``consumer`` is not registered (also an ``AssertionError``).
            InvalidInputError: a fraction outside (0, 1], or top-k in ID_ONLY mode.
            ConsumerRoleError: ``consumer`` publishes (:meth:`publish`): a consumer either reads
                or publishes; use another name to read.
        """
        name = check_consumer_name(consumer or self.DEFAULT_CONSUMER)
        fractions = topk.fractions(self._mode, list(self._tables), top_percentage, per_table_percentage)
        if self._pending_restore is not None:
            self._first_step()
        self._commit_recorded()
        self._unread.drop(name)  # (it moves the consumer: a publish of it reads the log next)
        end, mode = self.curr_batch_idx + 1, self._update_mode
        rows = self._log.write(lambda w: consume.consume(w, name, end, mode, alloc=self._results.take, **self._read_rule))
        rows = read_states(self._mode, self._tables, rows)
        if fractions is not None:
            rows = {fqn: topk.top(self._mode, self._tables.get(fqn), r, fractions.get(fqn, 1.0), bool(sorted_by_indices))
                    for fqn, r in rows.items()}
        return rows

    def get_unique_ids(self, consumer: Optional[str] = None) -> Dict[str, torch.Tensor]:
        """Ids changed since ``consumer`` last read, per table fqn (commits its position)."""
        return {fqn: rows.ids for fqn, rows in self.get_unique(consumer).items()}

    def consume_exact(self, consumer: str, read: Callable[[ReadTxn, int, int], T], empty: T,
                      delete_on_read: Optional[bool] = None) -> T:
        """Run ``read(txn, start, end)`` over ``consumer``'s unread batches (the current one
        included) and commit its position (:func:`.consume.consume_exact`): for readers of side
        records such as :mod:`persistent_delta.adapters.raw_ids`. ``delete_on_read`` defaults to
        the tracker's."""
        name = check_consumer_name(consumer)
        self._commit_recorded()
        self._unread.drop(name)
        end, rule = self.curr_batch_idx + 1, self._read_rule
        dor = rule["delete_on_read"] if delete_on_read is None else delete_on_read
        return self._log.write(lambda w: consume.consume_exact(
            w, name, end, lambda start: read(w, start, end), empty, delete_on_read=dor, bound=rule["bound"]))

    def clear(self, consumer: Optional[str] = None) -> None:
        """As TorchRec: ``None`` deletes every tracked row; a consumer's name deletes all only
        when it is the only consumer (otherwise nothing)."""
        name = None if consumer is None else check_consumer_name(consumer)
        self._commit_recorded()
        self._window.reset()  # deleted rows must be recorded again
        self._unread.drop()
        self._log.write(lambda w: position_rules.clear(w, name))

    def compact(self, start_idx: int, end_idx: int) -> None:
        """Compact ``[start_idx, end_idx)`` now (one transaction), split at consumer positions
        and the checkpoint floor (logged) so no read changes
        (:func:`persistent_delta.log.position_rules.safe_compact`).

        Raises:
            AssertionError: ``start_idx >= end_idx`` (the type TorchRec raises).
        """
        if start_idx >= end_idx:
            raise AssertionError(f"start_idx {start_idx} must be smaller than end_idx, but got {end_idx}")
        self._commit_recorded()
        self._log.write(lambda w: position_rules.safe_compact(w, self._update_mode, max(0, start_idx), end_idx))

    # ------------------------------------------------------------------ publish, checkpoints
    def publish(self, consumer: str, formats: Sequence[str] = (), max_rows: Optional[int] = None,
                max_bytes: Optional[int] = None, order: str = "oldest") -> Dict[str, int]:
        """Write snapshot records of the rows changed since ``consumer``'s last publish, with their
        values now (:mod:`.publish`). Returns fqn -> rows once captured; the writer commits them
        (and the consumer's position) in one transaction in the background (``flush()`` waits).
        ``consumer`` publishes only: :meth:`get_unique` of it is refused, and so is a publish of
        a consumer that reads (the role is recorded in the log at its first use).

        The records are stamped with the batch being recorded (``curr_batch_idx``, which a
        publish never moves): every publish of one batch shares the stamp, readable once the
        batch ends (the next step), or at :meth:`flush` or :meth:`close`; after a ``flush`` in
        the same batch, the next stamp. Not a collective, but every rank must publish at the
        same steps: a rank that completes a batch the others published in without publishing
        is behind, and the job's snapshots polls stop at its end
        (:func:`persistent_delta.log.position_rules.snapshots_behind`).

        The rows are written once per row format asked for: those of the registered snapshots
        consumers, and ``formats`` (for readers not registered in the log, such as remote
        consumers); ``"native"`` when nothing asks. Conversions run on the writer thread.

        ``max_rows``/``max_bytes`` cap what this publish carries on this rank (:mod:`.caps`):
        the rest is deferred, durably, to the next publish of ``consumer``, due before rows
        changed later (``order="oldest"``). Rows deferred by earlier publishes are carried by
        this one first, capped or not. ``stats()["publish_deferred_rows"]`` (and a snapshots
        poll's ``deferred``) says how many rows are still deferred.

        Raises:
            InvalidInputError: an unknown format, or ``"int8"`` for a table whose values are
                not float32 or float16; a cap that is not a positive int, an unknown order, or
                a ``max_bytes`` below one row.
            UnknownConsumerError: ``consumer`` is not registered.
            ConsumerRoleError: ``consumer`` reads (:meth:`get_unique`); use another name to publish.
        """
        name, t = check_consumer_name(consumer), time.time()
        formats = tuple(formats)
        for f in formats:
            codec.check_format(f)
        self._check()
        cap = caps.check_cap(max_rows, max_bytes, order, self._tables)
        if self._pending_restore is not None:
            self._first_step()
        step: Optional[StepWrite] = self._take_step()
        if step is not None and (step.records or step.events):
            self._hand_off(step)
            step = None  # (an empty one goes with the publish: one transaction, not two)
        pending = self._unsettled()
        # the batch's stamp (shared by its publishes), or the first after the closed ones; the
        # batch index never moves (every rank's batches keep their numbers, however often it publishes)
        end, stamp = self.curr_batch_idx + 1, max(self.curr_batch_idx, self._last_stamp + 1)
        # the ids committed since the consumer's last publish (taken after the pending records:
        # a record leaves those only once the accumulator has it), and a new accumulation from end
        accumulated = self._unread.take(name, end)
        try:
            captured = self._log.read(lambda r: publish.capture(r, name, end, stamp, self._tables, t,
                                                                self._publish_buffers, pending, formats,
                                                                self._format_buffers, cap, accumulated,
                                                                self._unread))
        except BaseException as exc:
            self._unread.drop(name)  # the consumer stays where it was
            if step is not None:
                self._hand_off(step)
            if isinstance(exc, InvalidInputError) and pending:
                self._settle()  # a queued step holds the bad id: the writer's error (WriterError) says so
            raise
        if step is not None:
            self._hand_off(step)
        self._hand_off(PublishWrite(captured, **self._read_rule))
        self._open_stamp = stamp
        self._publish_deferred[name] = captured.deferred_rows
        return captured.rows

    def state_dict(self) -> Dict[str, Any]:
        """The tracker's part of a model checkpoint. Flushes first and marks the checkpoint in
        the log (retention keeps what a restore of it needs). Save it with the model.
        ``dmp.state_dict()`` carries the same state, marked only once it is written
        (:class:`~persistent_delta.trainer.restore.TrackerState`)."""
        state = self._checkpoint_state()
        self._mark_checkpoint(state["curr_batch_idx"])
        return state

    def _checkpoint_state(self) -> Dict[str, Any]:
        """The state a checkpoint taken now holds, after committing what was recorded; marks nothing."""
        self._commit_recorded()
        info = self._log.read(restore.checkpoint_info)
        return {"version": restore.STATE_VERSION, "log_id": info["log_id"], "rank": self.rank,
                "world_size": restore.world_size(), "tracking_mode": self._mode.value,
                "curr_batch_idx": self.curr_batch_idx, "offsets": info["offsets"]}

    def _model_state(self) -> restore.TrackerState:
        """What ``dmp.state_dict()`` carries: the state, which marks the checkpoint once written."""
        state = self._checkpoint_state()
        return restore.TrackerState(state, restore.CheckpointMark(self._mark_checkpoint, state["curr_batch_idx"]))

    def checkpoint_state(self) -> restore.TrackerState:
        """The state ``dmp.state_dict()`` carries (committed first); marks the checkpoint only
        once written or ``.mark()``-ed (:mod:`.increments` marks an increment once complete)."""
        return self._model_state()

    def _mark_checkpoint(self, batch: int) -> None:
        """Mark a checkpoint of ``batch`` in the log, durably (any thread: a DCP writer's)."""
        if self._closed:
            raise LogClosedError(f"{self.path}: the tracker was closed before its state was saved, so the checkpoint "
                                 "cannot be marked; save dmp.state_dict() before tracker.close()")
        self.zch.rebase()  # a replica that starts after the checkpoint gets the whole raw-id map
        self._log.write(lambda w: restore.mark_checkpoint(w, batch))
        self._log.flush()

    def load_state_dict(self, state: Dict[str, Any]) -> Dict[str, int]:
        """Restore with a model checkpoint, after loading the model's weights and optimizer
        state: rows touched after the checkpoint are re-delivered to every consumer with their
        restored states (:mod:`.restore`); a collective with a process group. Returns fqn ->
        rows re-delivered (empty when the log ended at the checkpoint). With :func:`attach`,
        ``dmp.load_state_dict`` of a checkpoint from ``dmp.state_dict()`` calls it at the next
        step; the batch indices continue after the re-delivery batch (indices are never
        reused, so the lost timeline's indices are skipped).

        ``state``: ``tracker.state_dict()``, or what ``dmp.state_dict()`` carried (a
        :class:`~persistent_delta.trainer.restore.TrackerState`), as loaded.

        Raises:
            ConfigMismatchError: the state belongs to another log, rank or tracking mode.
            WorldSizeMismatchError: it was saved with another world size, or it is the
                unloaded target of a DCP load (no state for this rank was found).
            OffsetOutOfRangeError: the records since that checkpoint were already deleted.
        """
        self._pending_restore = self._unrestored = None
        self._commit_recorded()
        self._unread.drop()  # a restore writes re-delivered rows to the log itself
        log_id = self._log.read(lambda r: r.meta("log_id"))
        ckpt = restore.check_state(state, log_id, self.rank, self._mode.value, self.path, restore.world_size())
        # A kill can leave ranks one step apart: all continue from the same batch index.
        dropped = restore.share_dropped_ids(self._tables, self._dropped_ids)  # before the agreement: its last collective
        self._dropped_ids = {}
        last, gen = restore.agree_batch_idx(self._log, self.curr_batch_idx)
        if ckpt >= last:
            self.curr_batch_idx = self.curr_compact_index = ckpt
            self._log.write(lambda w: w.set_meta(META_CURR_BATCH, ckpt))
            return {}
        redelivered = self._log.write(
            lambda w: restore.redeliver(w, self._mode, self._update_mode, self._tables, ckpt, last, self.zch.redeliver, gen,
                                        dropped))
        self._window.reset()
        self.curr_batch_idx = self.curr_compact_index = last + 1
        self._log.flush()
        return redelivered

    def _restore_at_first_step(self, state: Dict[str, Any]) -> None:
        """``dmp.load_state_dict`` brought the tracker's state: restore it before the next
        step, ``get_unique`` or ``publish``, once the optimizer state is loaded as well (the
        restore reads it)."""
        self._check()
        self._pending_restore = state

    # ------------------------------------------------------------------ consumers
    @property
    def per_consumer_batch_idx(self) -> Dict[str, int]:
        """Committed position (next batch_idx to read) of every lookups consumer."""
        self._settle()
        return self._log.read(position_rules.committed_offsets)

    def add_consumer(self, name: str, from_latest: bool = False) -> None:
        """Register a consumer (durably). It starts at position 0 (everything still in the
        log), or after the current batch with ``from_latest``. An existing name is a no-op."""
        check_consumer_name(name)
        self._settle()
        offset = self.curr_batch_idx + 1 if from_latest else 0
        self._claims.claim(name, "add it to the tracker")
        self._log.write(lambda w: position_rules.register(w, name, offset, LOOKUPS, Delivery.IN_TRANSACTION))
        if name not in self._consumers:
            self._consumers.append(name)

    def remove_consumer(self, name: str) -> None:
        """Unregister a consumer (durably); it no longer holds back retention."""
        check_consumer_name(name)
        self._settle()

        def unregister(w: WriteTxn) -> None:
            position_rules.unregister(w, name)
            drop_deferred(w, name)  # its deferred rows go with it

        self._log.write(unregister)
        self._unread.drop(name)
        self._publish_deferred.pop(name, None)
        self._claims.release(name)
        if name in self._consumers:
            self._consumers.remove(name)

    # ------------------------------------------------------------------ misc TorchRec API
    def get_tracked_modules(self) -> Dict[str, nn.Module]:
        return self.tracked_modules

    def fqn_to_feature_names(self) -> Dict[str, List[str]]:
        return self._discovery.fqn_to_feature_map

    def get_latest(self) -> Dict[str, torch.Tensor]:
        """fqn -> this rank's current optimizer state (momentum1) of each tracked table."""
        states = {fqn: t.optimizer_state() for fqn, t in self._tables.items()}
        return {fqn: s for fqn, s in states.items() if s is not None}

    @property
    def local_tables(self) -> Dict[str, LocalTable]:
        """fqn -> this rank's shard of each tracked table."""
        return dict(self._tables)

    @property
    def next_stamp(self) -> int:
        """The stamp a publish made now would carry: the batch being recorded, or the next one
        when a publish was stamped with it already (a stamp is never reused). Shard files record
        it (:func:`~persistent_delta.trainer.save_shards.save_local_shards`): a replica starting
        from them reads the snapshots from it or earlier (:mod:`persistent_delta.read.base`)."""
        return max(self.curr_batch_idx, self._last_stamp + 1)

    @property
    def log(self) -> DeltaLog:
        return self._log

    def stats(self) -> Dict[str, float]:
        """Writer statistics (queue depth/bytes, commits, bytes written, longest wait, ...), and
        ``publish_deferred_rows``: the rows this process's latest capped publishes deferred and no
        publish has carried yet (all consumers; see :meth:`publish`); ``publish_log_reads``: the
        publishes that read their consumer's unread ids from the log, as a consumer's first
        publish in this process does (the others take them from :mod:`.unread`)."""
        out: Dict[str, float] = self._writer.stats() if self._writer is not None else {}
        out["publish_deferred_rows"] = sum(self._publish_deferred.values())
        out["publish_log_reads"] = self._unread.log_reads
        return out

    def resume(self) -> None:
        """After a ``WriterError`` (e.g. the disk was full), once the cause is fixed: commit the
        steps the writer kept (nothing was dropped) and flush; training continues. Raises
        again if the cause persists."""
        self._check()
        if self._writer is not None:
            self._writer.resume()
        self.flush()

    # ------------------------------------------------------------------ lifecycle
    def flush(self) -> None:
        """Durability barrier: everything recorded so far is committed and fsynced when this
        returns. Call it before declaring a model checkpoint complete. The publishes of the
        batch being recorded become readable (a later publish in this batch takes the next
        stamp)."""
        self._commit_recorded()
        if self._open_stamp is not None:
            self._log.write(position_rules.close_stamps)
            self._last_stamp, self._open_stamp = max(self._last_stamp, self._open_stamp), None
        self._log.flush()

    def close(self) -> None:
        """Flush, stop the writer, unregister the callables and close the log. Idempotent."""
        if self._closed:
            return
        try:
            self._commit_recorded()
            self._log.write(lambda w: _close_batches(w, self.curr_batch_idx + 1))
            self._log.flush()
        finally:
            self._closed = True
            if self._writer is not None:
                self._writer.close(drain=False)
            unregister_hooks(self._hooked, self)
            for handle in self._state_hooks:
                handle.remove()
            self._state_hooks = []
            self.zch.unhook()
            self._claims.release_all()
            self._hooked = []
            dmp = getattr(self, "_dmp", None)
            if dmp is not None and dmp.model_trackers.get(Trackers.DELTA_TRACKER.name) is self:
                del dmp.model_trackers[Trackers.DELTA_TRACKER.name]
            self._log.close()

    def _check(self) -> None:
        if self._closed:
            raise LogClosedError(f"{self.path}: the tracker is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def __del__(self) -> None:
        warn_unclosed(self, f"PersistentDeltaTracker on {getattr(self, 'path', '?')}")

    def __enter__(self) -> "PersistentDeltaTracker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_batches(w: WriteTxn, end: int) -> None:
    """At close: every batch below ``end`` (the open one included) is complete, and so are its publishes."""
    w.set_meta(META_CLOSED_END, end)
    position_rules.close_stamps(w)


def attach(dmp: nn.Module, config: PersistentTrackerConfig) -> PersistentDeltaTracker:
    """Build a :class:`PersistentDeltaTracker` for a ``DistributedModelParallel`` and register
    it, so that ``dmp.get_delta_tracker()`` returns it and ``DMP.forward`` steps it.

    The tracker's state joins the model's: ``dmp.state_dict()`` carries it under a key of its
    rank's, ``"persistent_delta_tracker.rank_<rank>"`` (one opaque value, so that
    torch.distributed.checkpoint keeps every rank's own; writing it marks a checkpoint, taking
    it does not), and ``dmp.load_state_dict(checkpoint)`` takes that entry out and restores the
    tracker before the next step, ``get_unique`` or ``publish`` (after the optimizer state is
    loaded too), as ``tracker.load_state_dict`` does; the key ``"persistent_delta_tracker"`` of
    older checkpoints loads too. A model without a tracker loads such a checkpoint as well: the
    DMP reports the key in ``unexpected_keys`` (pop it first to keep the report empty). If the
    log holds batches after its latest checkpoint mark and the first step comes with no
    restore, the tracker warns (logging and ``RuntimeWarning``).

    Raises:
        InvalidInputError: ``dmp`` is not a DMP, or it already has a delta tracker.
    """
    trackers, wrapped = getattr(dmp, "model_trackers", None), dmp_wrapped_module(dmp)
    if trackers is None or wrapped is None:
        raise InvalidInputError("attach() needs a torchrec DistributedModelParallel")
    existing = trackers.get(Trackers.DELTA_TRACKER.name)
    if existing is not None:
        raise InvalidInputError(f"this DMP already has a delta tracker ({type(existing).__name__}); close it first")
    tracker = PersistentDeltaTracker(wrapped, config)
    tracker._dmp = dmp  # type: ignore[attr-defined]
    trackers[Trackers.DELTA_TRACKER.name] = tracker
    return tracker
