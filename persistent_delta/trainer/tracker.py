"""``PersistentDeltaTracker``: TorchRec's ``ModelDeltaTracker`` on a durable log -- a facade.

Owns: the wiring of TorchRec's hooks and API to the modules that hold the rules. Capture and
hooks: :mod:`.capture`; what the writer runs: :mod:`.operations`; commits off the training
thread: :mod:`.writer` and :mod:`.window`; TorchRec's consume rule: :mod:`.consume`; what a
position means and what retention and compaction may do:
:mod:`persistent_delta.log.position_rules`; publish: :mod:`.publish`; restarts, checkpoints and
restore: :mod:`.tracker_state` on the rules of :mod:`.restore`; top-k: :mod:`.topk`; ZCH raw ids:
:mod:`.zch_capture`; registering in a DMP: :mod:`.attach`.

``DMP.forward`` calls ``step()`` before the lookups, so batch ``b``'s records carry ``b``. The
hot path (``record_lookup``) keeps references (EMBEDDING on CPU: a copy of the rows in a reused
block, :class:`~.capture.LookupBlocks`); ``step()`` hands the finished batch, with the
new batch index, to the background writer as a :class:`~.operations.StepWrite`. Every read
(``get_unique``, ``publish``) commits what was recorded, then runs TorchRec's consume rule (a
publish is queued to the writer as a :class:`~.operations.PublishRequest` once its values are
gathered). Deliberate differences from TorchRec: see docs/concepts.md.
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
from persistent_delta.log.deferred import drop_deferred
from persistent_delta.log.deltalog import DeltaLog, ReadTxn, WriteTxn
from persistent_delta.log.schema import LOOKUPS, Delivery, TrackerMeta, check_consumer_name
from persistent_delta.trainer.sharding import LocalTable, local_tables
from persistent_delta.trainer.tracker_state import TrackerCheckpoints, close_batches, resume
from persistent_delta.trainer.unread import UnreadIds
from persistent_delta.trainer.operations import Compaction, PublishRequest, StepWrite
from persistent_delta.trainer.writer import WriterFeed
from persistent_delta.trainer.window import WindowFilter
from persistent_delta.trainer.zch_capture import ZchCapture

logger = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["PersistentDeltaTracker", "PersistentTrackerConfig"]


class PersistentDeltaTracker(ModelDeltaTracker):
    """A durable ``ModelDeltaTracker`` for TorchRec sharded models.

    Build it with :func:`~persistent_delta.trainer.attach.attach` (which registers it in the
    DMP), or directly with the DMP's wrapped module. The training thread of the process that
    built it calls every method; ``get_unique``/``clear``/``flush`` may also be called from
    another thread as long as calls do not overlap. The log may be read meanwhile by other
    processes (``DeltaConsumer``, tools).
    ``model`` is the module to track (the module a DMP wraps, for a DMP); ``dmp``: the DMP that
    holds the tracker, if any (``close()`` removes it from there).

    Raises:
        InvalidInputError: bad config (no path, EMBEDDING on an EBC, bad consumer names).
        ConfigMismatchError: the log holds another tracking mode or table set (use ``fresh``).
        LogLockedError: another process writes this rank's log.
    """

    def __init__(self, model: nn.Module, config: PersistentTrackerConfig, *, dmp: Optional[nn.Module] = None) -> None:
        if not isinstance(config, PersistentTrackerConfig):
            raise InvalidInputError("config must be a PersistentTrackerConfig")
        config.validate()
        self._mode, self._dmp = config.tracking_mode, dmp  # (_dmp: close() removes the tracker from it)
        self._update_mode: UpdateMode = UPDATE_MODE_MAP[self._mode]
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
            self._capture.add, lambda: self.curr_batch_idx, config)  # (the batch being recorded)
        shards = {f: {**t.metadata(self._discovery.module_kind(f)), **self.zch.describe(f)} for f, t in self._tables.items()}
        shapes = {fqn: row_shapes(self._mode, t) for fqn, t in self._tables.items()}
        start, dropped_ids = resume(self._log, self._claims, want, shards, self._consumers, config.fresh, shapes)
        self.curr_batch_idx: int = start
        self.curr_compact_index = self.curr_batch_idx
        self._window = WindowFilter(self._update_mode)
        # the tracker's part of model checkpoints (its state, the mark, the restore: :mod:`.tracker_state`)
        self._checkpoints = TrackerCheckpoints(self._log, self.path, self.rank, self._mode, self._tables, self.zch,
                                               self._window, dropped_ids)
        # TorchRec's consume rule, as every read applies it (compaction is moot when the
        # window filter already stores each row once per window).
        self._read_rule: Dict[str, Any] = dict(
            compact=not self._window.enabled, delete_on_read=config.delete_on_read,
            bound=config.retention or RetentionBound.resolve())
        # publish(): per publishing consumer, the ids committed since its last publish (:mod:`.unread`)
        self._unread = UnreadIds({fqn: t.local_rows for fqn, t in self._tables.items()})
        # publish(): reused buffers, the rows still deferred, the stamps (:class:`.publish.Publisher`)
        self._publisher = publish.Publisher(self._log, self._tables, self._unread, self.curr_batch_idx)
        self._feed = WriterFeed(self._log, self._update_mode, self._window, self._unread.add, writer_options,
                                background=config.async_writes)
        self._writer = self._feed.writer  # the background writer (None: each operation committed at once)
        self._closed = False
        self._hooked = register_hooks(
            self.tracked_modules, self._mode, self.record_lookup, self.trigger_compaction if config.auto_compact else None
        )
        self.zch.hook()  # managed-collision tables: raw ids and slot reassignments (persistent_delta.trainer.zch_capture)
        # The model's state dict carries the tracker's (on the module inside DDP: the DMP moves
        # a DDP's "module." prefix, and loads that module's part of a state dict as its own).
        self._checkpoints.hook(model.module if isinstance(model, DistributedDataParallel) else model,
                               self._model_state, self._restore_at_first_step)
        close_at_exit(self)
        logger.info("persistent delta tracker on %s: mode %s, %d tables, consumers %s, batch %d",
                    self.path, self._mode.name, len(self._tables), self._consumers, self.curr_batch_idx)

    # ------------------------------------------------------------------ hot path
    def step(self) -> None:
        """Advance the batch index (DMP.forward calls it before the lookups) and hand the
        finished batch to the writer."""
        self._check()
        if self._checkpoints.due:
            self._first_step()
        self.curr_batch_idx += 1
        self._publisher.batch_ended(self.curr_batch_idx)
        self._feed.hand_off(self._take_step())

    def _first_step(self) -> None:
        """Before the first step: restore the state a ``dmp.load_state_dict`` brought, or warn
        that none came (:meth:`.TrackerCheckpoints.first_step`; a collective when a restore is
        due: every rank takes its first step)."""
        msg = self._checkpoints.first_step(self.load_state_dict)
        if msg is not None:
            logger.warning("%s", msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _take_step(self) -> StepWrite:
        """The records captured so far, with the batch index to persist alongside them."""
        records, events = self._capture.take()
        return StepWrite(records=records, curr_batch_idx=self.curr_batch_idx, events=events)

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
        self._feed.hand_off(Compaction(end))  # the batch being recorded stays captured: it is not in [.., end)
        self.curr_compact_index = end

    def _commit_recorded(self) -> None:
        """Commit everything recorded so far, the current batch included (no fsync)."""
        self._check()
        self._feed.hand_off(self._take_step())
        self._settle()

    def _settle(self) -> None:
        """Wait until the writer committed what it was handed (a queued publish moves its
        consumer only when the writer commits it); records of the open batch stay captured."""
        self._check()
        self._feed.settle()

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
        if self._checkpoints.pending is not None:
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
        values now (:mod:`.publish`). Returns fqn -> rows once captured. They (and the consumer's
        position, and the step's records captured so far) are committed in one transaction: by
        the writer thread (``flush()`` waits), or with ``WriterOptions.inline_publish`` by this
        call, after what the writer thread was handed before.
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
        formats = tuple(codec.check_format(f) for f in formats)
        self._check()
        cap = caps.check_cap(max_rows, max_bytes, order, self._tables)
        if self._checkpoints.pending is not None:
            self._first_step()
        # the batch's stamp (shared by its publishes), or the first after the closed ones; the
        # batch index never moves (every rank's batches keep their numbers, however often it publishes)
        request = PublishRequest(name, self.curr_batch_idx + 1, self.next_stamp, t, formats, cap, **self._read_rule)
        return self._publisher.publish(self._feed, request, self._take_step())

    def state_dict(self) -> Dict[str, Any]:
        """The tracker's part of a model checkpoint. Flushes first and marks the checkpoint in
        the log (retention keeps what a restore of it needs). Save it with the model.
        ``dmp.state_dict()`` carries the same state, marked only once it is written
        (:class:`~persistent_delta.trainer.restore.TrackerState`)."""
        self._commit_recorded()
        state = self._checkpoints.state(self.curr_batch_idx)
        self._checkpoints.mark(self.curr_batch_idx)
        return state

    def _model_state(self) -> restore.TrackerState:
        """What ``dmp.state_dict()`` carries: the state, which marks the checkpoint once written."""
        self._commit_recorded()
        return self._checkpoints.model_state(self.curr_batch_idx)

    def checkpoint_state(self) -> restore.TrackerState:
        """The state ``dmp.state_dict()`` carries (committed first); marks the checkpoint only
        once written or ``.mark()``-ed (:mod:`.increments` marks an increment once complete)."""
        return self._model_state()

    def load_state_dict(self, state: Dict[str, Any]) -> Dict[str, int]:
        """Restore with a model checkpoint, after loading the model's weights and optimizer
        state: rows touched after the checkpoint are re-delivered to every consumer with their
        restored states (:mod:`.restore`); a collective with a process group. Returns fqn ->
        rows re-delivered (empty when the log ended at the checkpoint and the restart dropped no
        batch of it on any rank: :func:`~.restore.resume_at`). With :func:`attach`,
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
        self._commit_recorded()
        self._unread.drop()  # a restore writes re-delivered rows to the log itself
        self.curr_batch_idx, redelivered = self._checkpoints.restore(state, self.curr_batch_idx)
        self.curr_compact_index = self.curr_batch_idx
        return redelivered

    def _restore_at_first_step(self, state: Dict[str, Any]) -> None:
        """``dmp.load_state_dict`` brought the tracker's state: restore it before the next
        step, ``get_unique`` or ``publish``, once the optimizer state is loaded as well (the
        restore reads it)."""
        self._check()
        self._checkpoints.pending = state

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
        self._publisher.forget(name)
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
        return self._publisher.next_stamp(self.curr_batch_idx)

    @property
    def log(self) -> DeltaLog:
        return self._log

    def stats(self) -> Dict[str, float]:
        """Writer statistics (queue depth/bytes, commits, bytes written, longest wait, ...), and
        ``publish_deferred_rows``: the rows this process's latest capped publishes deferred and no
        publish has carried yet (all consumers; see :meth:`publish`); ``publish_log_reads``: the
        publishes that read their consumer's unread ids from the log, as a consumer's first
        publish in this process does (the others take them from :mod:`.unread`)."""
        return {**(self._writer.stats() if self._writer is not None else {}), **self._publisher.stats()}

    def resume(self) -> None:
        """After a ``WriterError`` (e.g. the disk was full), once the cause is fixed: commit the
        steps the writer kept (nothing was dropped) and flush; training continues. Raises
        again if the cause persists."""
        self._check()
        self._feed.resume()
        self.flush()

    # ------------------------------------------------------------------ lifecycle
    def flush(self) -> None:
        """Durability barrier: everything recorded so far is committed and fsynced when this
        returns. Call it before declaring a model checkpoint complete. The publishes of the
        batch being recorded become readable (a later publish in this batch takes the next
        stamp)."""
        self._commit_recorded()
        self._publisher.close_stamps()
        self._log.flush()

    def close(self) -> None:
        """Flush, stop the writer, unregister the callables and close the log. Idempotent."""
        if self._closed:
            return
        try:
            self._commit_recorded()
            self._log.write(lambda w: close_batches(w, self.curr_batch_idx + 1))
            self._log.flush()
        finally:
            self._closed = True
            self._feed.close()
            unregister_hooks(self._hooked, self)
            self._checkpoints.unhook()
            self.zch.unhook()
            self._claims.release_all()
            self._hooked = []
            if self._dmp is not None and self._dmp.model_trackers.get(Trackers.DELTA_TRACKER.name) is self:
                del self._dmp.model_trackers[Trackers.DELTA_TRACKER.name]
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
