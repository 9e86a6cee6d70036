"""``PersistentDeltaTracker``: TorchRec's ``ModelDeltaTracker`` on a durable log.

Design note
-----------
The tracker attaches the way TorchRec's does: ``record_lookup`` is registered as the
post-lookup callable of ``ShardedEmbeddingCollection``/``ShardedEmbeddingBagCollection``
(ID_ONLY, EMBEDDING) or as the optimizer-state callable of their grouped lookups (MOMENTUM_*,
ROWWISE_ADAGRAD), and ``trigger_compaction`` as the post-odist callable when ``auto_compact``.
``DMP.forward`` calls ``step()`` before the lookups, so batch ``b``'s records carry ``b``.

Hot path: ``record_lookup`` splits the batch's ids per table and keeps references (CPU) or
starts non-blocking device-to-host copies (GPU); ``step()`` hands the finished batch, together
with the new batch index, to the background writer, which commits it in one transaction.

Reads follow TorchRec's ``ModelDeltaTrackerTrec`` rules exactly (consumer offsets, compaction
from the largest offset, ``delete_on_read`` below the smallest one), but offsets live in the
log and every ``get_unique`` is one write transaction: compact, read, commit the consumer's new
offset, apply retention. The smallest offset is taken over *all* consumers registered in the
log, including out-of-process ones, so they hold back retention like a Kafka consumer group.

Deliberate differences from TorchRec (all listed in the README):

* offsets start at 0, not -1 (the same reads: batch indices are >= 0);
* a table with nothing to return gives empty tensors (TorchRec raises), ids are ascending;
* MOMENTUM_LAST works on CPU (TorchRec reads ``momentum1_dev``, empty on CPU), and optimizer
  states are read per table of a TBE group (TorchRec indexes the concatenation of all tables
  of the group with local ids, which is wrong for every table but the first);
* ``top_percentage``/``per_table_percentage`` are honoured (TorchRec ignores them).
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup, GroupedPooledEmbeddingsLookup
from torchrec.distributed.model_tracker.model_delta_tracker import (
    UPDATE_MODE_MAP,
    ModelDeltaTracker,
    ModelDeltaTrackerTrec,
)
from torchrec.distributed.model_tracker.types import (
    DeltaTrackerConfig,
    Trackers,
    TrackingMode,
    UniqueRows,
    UpdateMode,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from persistent_delta.config import Durability, LogOptions, WriterOptions
from persistent_delta.errors import (
    ConfigMismatchError,
    InvalidInputError,
    LogClosedError,
    UnknownConsumerError,
)
from persistent_delta.log import DeltaLog, WriteTxn
from persistent_delta.sharding import LocalTable, feature_index, local_tables
from persistent_delta.snapshot import redeliver, snapshot_retention, write_snapshots
from persistent_delta.store import AppendRecord, compact_range, delete_below, read_unique
from persistent_delta.writer import BackgroundWriter, WindowFilter, WriteTask, commit_tasks

logger = logging.getLogger(__name__)

_CONSUMER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")
META_TRACKER = "tracker"
META_CURR_BATCH = "curr_batch_idx"
META_CHECKPOINT_FLOOR = "checkpoint_floor"  # records from here on are kept for a restore
META_SNAPSHOT_END = "snapshot_end"  # one past the newest snapshot stamp
LOOKUPS = "lookups"  # consumer channel: what batches looked up (get_unique, DeltaConsumer)
SNAPSHOTS_CHANNEL = "snapshots"  # consumer channel: published current row values


def lookup_offsets(consumers: Dict[str, Dict[str, Any]]) -> Dict[str, int]:
    """Offsets of the consumers of recorded lookups (snapshot readers are not among them)."""
    return {k: int(v["offset"]) for k, v in consumers.items() if v.get("channel", LOOKUPS) == LOOKUPS}


def has_external_lookups_consumer(consumers: Dict[str, Dict[str, Any]]) -> bool:
    """Whether an out-of-process consumer reads the lookups channel."""
    return any(
        v.get("registered_by", "trainer") != "trainer" for v in consumers.values() if v.get("channel", LOOKUPS) == LOOKUPS
    )


def compact_split(w: WriteTxn, mode: UpdateMode, start: int, end: int, floor: Optional[int]) -> None:
    """Compact ``[start, end)``, split at the checkpoint floor so that no merged record mixes
    batches from before and after the last checkpoint (a restore re-reads those after it)."""
    if start >= end:
        return
    if floor is not None and start < int(floor) < end:
        compact_range(w, mode, start, int(floor))
        compact_range(w, mode, int(floor), end)
    else:
        compact_range(w, mode, start, end)


def check_consumer_name(name: object) -> str:
    """Validate a consumer name: 1-128 chars of letters, digits and ``._:@/-``."""
    if not isinstance(name, str) or not _CONSUMER_NAME.match(name):
        raise InvalidInputError(
            f"invalid consumer name {name!r}: use 1-128 characters of letters, digits and ._:@/- "
            "(starting with a letter or digit)"
        )
    return name


@dataclass
class PersistentTrackerConfig(DeltaTrackerConfig):
    """TorchRec's ``DeltaTrackerConfig`` plus where and how to persist.

    Args:
        path: log root; rank ``r`` writes ``<path>/rank-<r>``. Required.
        durability: what a crash can lose (see :class:`~persistent_delta.Durability`).
        fresh: start a fresh log, discarding what ``<path>/rank-<r>`` holds. Without it, opening
            a log written with another tracking mode or table set raises ``ConfigMismatchError``.
        async_writes: commit from a background thread (default). ``False`` commits each step
            on the training thread (simpler to reason about, slower).
        max_pending_bytes / max_pending_steps: writer backpressure bounds.
        map_size: initial LMDB map size (it grows by itself).
        tune_malloc: ``True`` raises glibc's malloc thresholds for this process (faster
            commits of large records; process-wide, see :mod:`persistent_delta.alloc`). Default:
            ``PERSISTENT_DELTA_TUNE_MALLOC``, else off.
        writer_torch_threads: intra-op threads of the writer thread's tensor work (default 1;
            0 leaves torch's setting).
        linger_steps / linger_s / linger_bytes: group commit of small steps (see
            :class:`~persistent_delta.config.WriterOptions`).
        rank: this process's rank; default ``torch.distributed.get_rank()`` (0 when not
            initialised).
    """

    path: str = ""
    durability: Durability = Durability.ON_FLUSH
    fresh: bool = False
    async_writes: bool = True
    max_pending_bytes: int = WriterOptions.max_pending_bytes
    max_pending_steps: int = WriterOptions.max_pending_steps
    map_size: Optional[int] = None
    tune_malloc: Optional[bool] = None  # None: LogOptions' default / PERSISTENT_DELTA_TUNE_MALLOC
    writer_torch_threads: int = WriterOptions.torch_threads
    linger_steps: int = WriterOptions.linger_steps
    linger_s: float = WriterOptions.linger_s
    linger_bytes: int = WriterOptions.linger_bytes
    rank: Optional[int] = None


def rank_dir(root: str, rank: int) -> str:
    """The log directory of ``rank`` under ``root``."""
    return os.path.join(os.fspath(root), f"rank-{rank}")


class PersistentDeltaTracker(ModelDeltaTracker):
    """A durable ``ModelDeltaTracker`` for TorchRec sharded models.

    Build it with :func:`attach` (which registers it in the DMP), or directly with the DMP's
    wrapped module. The training thread of the process that built it calls every method;
    ``get_unique``/``clear``/``flush`` may also be called from another thread as long as calls
    do not overlap. The log may be read meanwhile by other processes (``DeltaConsumer``, tools).

    Args:
        model: the module to track (``dmp._dmp_wrapped_module`` for a DMP).
        config: :class:`PersistentTrackerConfig`.

    Raises:
        InvalidInputError: bad config (no path, EMBEDDING on an EBC, bad consumer names).
        ConfigMismatchError: the log holds another tracking mode or table set (use ``fresh``).
        LogLockedError: another process writes this rank's log.
    """

    # TorchRec's fqn cleaning (strip DMP/DDP prefixes), so fqns match its tracker's exactly.
    _clean_fqn_fn = ModelDeltaTrackerTrec._clean_fqn_fn

    def __init__(self, model: nn.Module, config: PersistentTrackerConfig) -> None:
        if not isinstance(config, PersistentTrackerConfig):
            raise InvalidInputError("config must be a PersistentTrackerConfig")
        if not config.path:
            raise InvalidInputError("PersistentTrackerConfig.path is required (the log root directory)")
        if not isinstance(config.tracking_mode, TrackingMode):
            raise InvalidInputError(f"tracking_mode must be a TrackingMode, got {config.tracking_mode!r}")
        self._config = config
        self._mode = config.tracking_mode
        self._update_mode: UpdateMode = UPDATE_MODE_MAP[self._mode]
        self._delete_on_read = config.delete_on_read
        self._auto_compact = config.auto_compact
        self._consumers: List[str] = [check_consumer_name(c) for c in (config.consumers or [self.DEFAULT_CONSUMER])]
        self._closed = True

        # Table discovery reuses TorchRec's own fqn rules (fqns_to_skip, prefix stripping).
        self._model = model
        self._fqns_to_skip = list(config.fqns_to_skip)
        self._fqn_to_feature_map: Dict[str, List[str]] = {}
        self.tracked_modules: Dict[str, nn.Module] = {}
        self.table_to_fqn: Dict[str, str] = {}
        self.feature_to_fqn: Dict[str, str] = {}
        ModelDeltaTrackerTrec.fqn_to_feature_names(self)  # type: ignore[arg-type]
        for fqn, features in self._fqn_to_feature_map.items():
            for f in features:
                self.feature_to_fqn.setdefault(f, fqn)
        for module in self.tracked_modules.values():
            if isinstance(module, ShardedEmbeddingBagCollection) and self._mode == TrackingMode.EMBEDDING:
                raise InvalidInputError(
                    "TrackingMode.EMBEDDING is not supported for EmbeddingBagCollection: its lookup returns pooled "
                    "embeddings (as in TorchRec). Use ID_ONLY or an optimizer-state mode"
                )
        self._tables: Dict[str, LocalTable] = local_tables(self.tracked_modules, self.table_to_fqn)
        self._feature_index: Dict[int, Dict[str, int]] = {}

        self.rank = config.rank if config.rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
        self.path = rank_dir(config.path, self.rank)
        opts = LogOptions.from_env(durability=config.durability, map_size=config.map_size, tune_malloc=config.tune_malloc)
        self._log = DeltaLog(self.path, options=opts)
        try:
            self._offsets: Dict[str, int] = {}
            self.curr_batch_idx: int = 0
            self._open_log()
        except BaseException:
            self._log.close()
            raise
        self.curr_compact_index = self.curr_batch_idx
        self._pending: List[AppendRecord] = []
        self._events: List[Any] = []
        self._window = WindowFilter(self._update_mode)
        self._writer: Optional[BackgroundWriter] = None
        if config.async_writes:
            self._writer = BackgroundWriter(
                self._log,
                self._update_mode,
                WriterOptions(
                    max_pending_bytes=config.max_pending_bytes,
                    max_pending_steps=config.max_pending_steps,
                    torch_threads=config.writer_torch_threads,
                    linger_steps=config.linger_steps,
                    linger_s=config.linger_s,
                    linger_bytes=config.linger_bytes,
                ),
                self._window,
            )
        self._closed = False
        self._hooked: List[Tuple[nn.Module, str]] = []
        self._register_hooks()
        logger.info(
            "persistent delta tracker on %s: mode %s, %d tables, consumers %s, batch %d",
            self.path, self._mode.name, len(self._tables), sorted(self._offsets), self.curr_batch_idx,
        )

    # ------------------------------------------------------------------ opening
    def _tracker_meta(self) -> Dict[str, Any]:
        return {
            "tracking_mode": self._mode.value,
            "update_mode": self._update_mode.value,
            "tables": sorted(self._tables),
            "rank": self.rank,
        }

    def _open_log(self) -> None:
        want = self._tracker_meta()
        fresh = self._config.fresh

        def setup(w: WriteTxn) -> Tuple[Dict[str, int], int]:
            have = w.meta(META_TRACKER)
            stored_mode = w.meta("update_mode")
            if fresh:
                _wipe(w)
            else:
                if have is not None and (have["tracking_mode"], have["tables"]) != (want["tracking_mode"], want["tables"]):
                    raise ConfigMismatchError(
                        f"{self.path} was written with tracking mode {have['tracking_mode']!r} and tables "
                        f"{have['tables']}, not {want['tracking_mode']!r} and {want['tables']}. Use the matching "
                        "config, another path, or PersistentTrackerConfig(fresh=True) to start a fresh log"
                    )
                if have is None and stored_mode is not None and stored_mode != self._update_mode.value:
                    raise ConfigMismatchError(
                        f"{self.path} holds records with update mode {stored_mode!r}, not "
                        f"{self._update_mode.value!r}; use fresh=True or another path"
                    )
            w.set_meta(META_TRACKER, want)
            w.set_meta("update_mode", self._update_mode.value)
            for fqn, t in self._tables.items():
                entry = w.ensure_table(fqn)
                md = t.metadata("ebc" if isinstance(self._module_of(fqn), ShardedEmbeddingBagCollection) else "ec")
                before = w.table(fqn)
                if before is None or entry.meta.get("shard") != md:
                    entry.meta["shard"] = md
                    entry.listed = before.listed if before is not None else False
                    w.stage_table(entry)
            consumers = w.consumers()
            now = time.time()
            for c in self._consumers:
                if c not in consumers:
                    consumers[c] = {"offset": 0, "commit_time": now, "registered_by": "trainer", "channel": LOOKUPS}
                    w.set_consumer(c, consumers[c])
            curr = int(w.meta(META_CURR_BATCH, 0))
            last = max((e.last_batch_idx for e in w.tables().values()), default=-1)
            return lookup_offsets(consumers), max(curr, last)

        self._offsets, self.curr_batch_idx = self._log.write(setup)

    def _module_of(self, fqn: str) -> Optional[nn.Module]:
        prefix = fqn.rsplit(".", 2)[0]
        return self.tracked_modules.get(prefix)

    def _register_hooks(self) -> None:
        for module in self.tracked_modules.values():
            if self._mode in (TrackingMode.ID_ONLY, TrackingMode.EMBEDDING):
                module.register_post_lookup_tracker_fn(self.record_lookup)  # type: ignore[operator]
                self._hooked.append((module, "post_lookup_tracker_fn"))
            else:
                for lookup in module._lookups:  # type: ignore[union-attr]
                    inner = lookup.module if isinstance(lookup, torch.nn.parallel.DistributedDataParallel) else lookup
                    if not isinstance(inner, (GroupedEmbeddingsLookup, GroupedPooledEmbeddingsLookup)):
                        continue
                    for emb in inner._emb_modules:
                        if emb._emb_module.split_optimizer_states() in ([], None) or not any(
                            s for s in emb._emb_module.split_optimizer_states()
                        ):
                            raise InvalidInputError(
                                f"tracking mode {self._mode.name} needs an optimizer with state (EXACT_ADAGRAD, "
                                "EXACT_ROWWISE_ADAGRAD, ...); this table group's optimizer keeps none (e.g. EXACT_SGD)"
                            )
                    inner.register_optim_state_tracker_fn(self.record_lookup)
                    self._hooked.append((inner, "optim_state_tracker_fn"))
            if self._auto_compact:
                module.register_post_odist_tracker_fn(self.trigger_compaction)  # type: ignore[operator]
                self._hooked.append((module, "post_odist_tracker_fn"))

    # ------------------------------------------------------------------ hot path
    def step(self) -> None:
        """Advance the batch index (DMP.forward calls it before the lookups) and hand the
        finished batch to the writer."""
        self._check()
        self.curr_batch_idx += 1
        self._submit()

    def _submit(self) -> None:
        self._hand_off(self._take_batch())

    def _take_batch(self, op: Optional[Callable[[WriteTxn], Any]] = None) -> WriteTask:
        """The records captured so far, with the batch index to persist alongside them."""
        task = WriteTask(records=self._pending, meta={META_CURR_BATCH: self.curr_batch_idx}, events=self._events, op=op)
        self._pending, self._events = [], []
        return task

    def _hand_off(self, task: WriteTask) -> None:
        if self._writer is not None:
            self._writer.submit(task)
        else:
            commit_tasks(self._log, self._update_mode, [task], self._window)

    def _capture(self, t: torch.Tensor) -> torch.Tensor:
        """Keep ``t`` for the writer: a detached reference on CPU; on a device, a non-blocking
        copy into pinned host memory, waited for by the writer (the stream is not stalled)."""
        t = t.detach()
        if t.device.type == "cpu":
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        if t.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self._events.append(ev)
        return host

    def _add(self, fqn: str, ids: torch.Tensor, states: Optional[torch.Tensor]) -> None:
        self._pending.append(
            AppendRecord(self.curr_batch_idx, fqn, self._capture(ids), None if states is None else self._capture(states))
        )

    def record_lookup(
        self,
        kjt: KeyedJaggedTensor,
        states: torch.Tensor,
        emb_module: Optional[nn.Module] = None,
        raw_ids: Optional[torch.Tensor] = None,
    ) -> None:
        """Record one lookup of the current batch (called by TorchRec's callables).

        Args:
            kjt: the looked-up features (shard-local ids).
            states: the lookup output (EMBEDDING) or unused (other modes).
            emb_module: the grouped embedding module (optimizer-state modes).
        """
        if self._closed:
            raise LogClosedError(f"{self.path}: the tracker is closed")
        keys = kjt.keys()
        if not keys:
            return
        values = kjt.values()
        lengths = kjt.length_per_key()
        per_key = values.split(lengths)
        # One record per feature, no copies here: the writer merges a table's records of a
        # batch (FIRST/LAST rule) off the training thread.
        if self._mode == TrackingMode.ID_ONLY:
            for key, ids in zip(keys, per_key):
                self._add(self.feature_to_fqn[key], ids, None)
        elif self._mode == TrackingMode.EMBEDDING:
            n = values.numel()
            if n == 0:
                return
            if states.numel() % n != 0:
                raise InvalidInputError(f"ids and embeddings size mismatch: {n} ids, {states.numel()} values")
            per_key_emb = states.view(n, -1).split(lengths)
            for key, ids, emb in zip(keys, per_key, per_key_emb):
                self._add(self.feature_to_fqn[key], ids, emb)
        else:
            if emb_module is None:
                raise InvalidInputError(f"tracking mode {self._mode.name} needs the embedding module")
            index = self._feature_index.get(id(emb_module))
            if index is None:
                index = self._feature_index[id(emb_module)] = feature_index(emb_module)
            opt_states = emb_module._emb_module.split_optimizer_states()  # type: ignore[union-attr, operator]
            for key, ids in zip(keys, per_key):
                state = opt_states[index[key]][0]
                rows = state[ids]
                if self._mode == TrackingMode.MOMENTUM_LAST:
                    rows = rows.norm(dim=1) if rows.dim() > 1 else rows.abs()
                self._add(self.feature_to_fqn[key], ids, rows)

    def trigger_compaction(self) -> None:
        """Post-odist callable (``auto_compact``): queue a compaction of
        ``[max consumer offset, curr_batch_idx)`` for the writer thread, once per batch."""
        if self._closed or self.curr_compact_index >= self.curr_batch_idx:
            return
        end = self.curr_batch_idx
        mode = self._update_mode

        def compact(w: WriteTxn) -> None:
            # The largest offset is read inside the transaction: an out-of-process consumer
            # may have committed since, and no offset may fall strictly inside the range.
            consumers = w.consumers()
            if has_external_lookups_consumer(consumers):
                return  # see _consume: never merge across an out-of-process reader's position
            offsets = lookup_offsets(consumers).values()
            compact_split(w, mode, max(0, max(offsets, default=0)), end, w.meta(META_CHECKPOINT_FLOOR))

        self._hand_off(self._take_batch(op=compact))
        self.curr_compact_index = end

    # ------------------------------------------------------------------ reads
    def _drain(self) -> None:
        """Commit everything recorded so far (the current batch included)."""
        self._check()
        self._submit()
        if self._writer is not None:
            self._writer.barrier()

    def get_unique(
        self,
        consumer: Optional[str] = None,
        top_percentage: Optional[float] = 1.0,
        per_table_percentage: Optional[Dict[str, Tuple[float, str]]] = None,
        sorted_by_indices: Optional[bool] = True,
    ) -> Dict[str, UniqueRows]:
        """Rows changed since ``consumer`` last read, per table fqn; commits its new offset.

        Args:
            consumer: a registered consumer (default ``"default"``).
            top_percentage: keep this fraction (0, 1] of each table's rows, those that changed
                most: EMBEDDING by ``||current row - tracked first value||``, MOMENTUM_LAST by
                the momentum norm, MOMENTUM_DIFF/ROWWISE_ADAGRAD by the state difference.
                Rows left out are **not** re-delivered: the offset still advances past them.
            per_table_percentage: fqn -> (fraction, criterion) overriding ``top_percentage``
                per table; criterion must be ``""``, ``"norm"`` or ``"default"``.
            sorted_by_indices: ids ascending (default); ``False`` orders kept rows by score
                (highest first) when a fraction below 1 applies.

        Returns:
            fqn -> ``UniqueRows`` (shard-local ids; states per tracking mode). A table with
            nothing new gives empty tensors.

        Raises:
            UnknownConsumerError: ``consumer`` is not registered.
            InvalidInputError: a fraction outside (0, 1], or top-k in ID_ONLY mode.
        """
        consumer = check_consumer_name(consumer or self.DEFAULT_CONSUMER)
        fractions = self._fractions(top_percentage, per_table_percentage)
        self._drain()
        end = self.curr_batch_idx + 1

        def read(w: WriteTxn) -> Tuple[Dict[str, UniqueRows], Dict[str, int]]:
            return self._consume(w, consumer, end)

        rows, self._offsets = self._log.write(read)
        if self._mode in (TrackingMode.MOMENTUM_DIFF, TrackingMode.ROWWISE_ADAGRAD):
            for fqn, r in rows.items():
                state = self._tables[fqn].optimizer_state() if fqn in self._tables else None
                if state is not None and r.states is not None:
                    r.states = state[r.ids.long()] - r.states
        if fractions is not None:
            rows = {fqn: self._top(fqn, r, fractions.get(fqn, 1.0), bool(sorted_by_indices)) for fqn, r in rows.items()}
        return rows

    def _consume(self, w: WriteTxn, consumer: str, end: int) -> Tuple[Dict[str, UniqueRows], Dict[str, int]]:
        """TorchRec's read rule inside one transaction: compact ``[max offset, end)``, read from
        the consumer's offset, commit ``end`` as its offset, apply ``delete_on_read``."""
        consumers = w.consumers()
        entry = consumers.get(consumer)
        if entry is None or entry.get("channel", LOOKUPS) != LOOKUPS:
            raise UnknownConsumerError(
                f"consumer {consumer!r} is not registered in {self.path} (registered: "
                f"{sorted(lookup_offsets(consumers))}); add it with add_consumer()"
            )
        offsets = lookup_offsets(consumers)
        floor = w.meta(META_CHECKPOINT_FLOOR)
        # TorchRec compacts [largest offset, end) here. It never changes an answer; it only
        # makes later reads of that range cheaper. Skipped (1) while an out-of-process consumer
        # reads the lookups: it may hold an uncommitted position inside the range (polled, not
        # yet committed), and a merged record stamped at the range start would be behind it;
        # (2) with the window filter on (FIRST/NONE): the range holds each id once already.
        if not self._window.enabled and not has_external_lookups_consumer(consumers):
            compact_split(w, self._update_mode, max(0, max(offsets.values())), end, floor)
        rows = read_unique(w, self._update_mode, from_idx=w.read_start(offsets[consumer]))
        entry = dict(entry)
        entry.update(offset=end, commit_time=time.time())
        w.set_consumer(consumer, entry)
        offsets[consumer] = end
        if self._delete_on_read:
            up_to = min(offsets.values())
            if floor is not None:
                up_to = min(up_to, int(floor))  # keep what a restore of the last checkpoint needs
            n, nbytes = delete_below(w, up_to)
            if n:
                logger.debug("delete_on_read: %d records (%d bytes) below batch %d", n, nbytes, up_to)
        return rows, offsets

    def _fractions(
        self, top: Optional[float], per_table: Optional[Dict[str, Tuple[float, str]]]
    ) -> Optional[Dict[str, float]]:
        top = 1.0 if top is None else float(top)
        out = {fqn: top for fqn in self._tables}
        for fqn, spec in (per_table or {}).items():
            frac, criterion = (spec, "") if isinstance(spec, (int, float)) else spec
            if criterion not in ("", "norm", "default"):
                raise InvalidInputError(f"per_table_percentage[{fqn!r}]: unknown criterion {criterion!r}")
            out[fqn] = float(frac)
        for fqn, f in out.items():
            if not 0.0 < f <= 1.0 or math.isnan(f):
                raise InvalidInputError(f"fraction for {fqn!r} must be in (0, 1], got {f}")
        if all(f == 1.0 for f in out.values()):
            return None
        if self._mode == TrackingMode.ID_ONLY:
            raise InvalidInputError("top_percentage needs tracked states: ID_ONLY has no measure of change")
        return out

    def _scores(self, fqn: str, rows: UniqueRows) -> torch.Tensor:
        states = rows.states
        assert states is not None
        if self._mode == TrackingMode.EMBEDDING:
            current = self._tables[fqn].weights()[rows.ids.long()]
            diff = current.float() - states.float().view(current.shape)
            scores: torch.Tensor = diff.norm(dim=1)
            return scores
        s = states.float()
        scores = s.abs() if s.dim() == 1 else s.reshape(s.shape[0], -1).norm(dim=1)
        return scores

    def _top(self, fqn: str, rows: UniqueRows, fraction: float, sort_ids: bool) -> UniqueRows:
        n = rows.ids.numel()
        if fraction >= 1.0 or n == 0:
            return rows
        k = max(1, math.ceil(fraction * n))
        scores = self._scores(fqn, rows)
        picked = torch.topk(scores, k, sorted=True).indices
        if sort_ids:
            picked = picked.sort().values
        return UniqueRows(ids=rows.ids[picked], states=None if rows.states is None else rows.states[picked])

    def get_unique_ids(self, consumer: Optional[str] = None) -> Dict[str, torch.Tensor]:
        """Ids changed since ``consumer`` last read, per table fqn (commits its offset)."""
        return {fqn: rows.ids for fqn, rows in self.get_unique(consumer).items()}

    def clear(self, consumer: Optional[str] = None) -> None:
        """As TorchRec: ``None`` deletes every tracked row; a consumer's name deletes all only
        when it is the only consumer (otherwise nothing)."""
        self._drain()
        self._window.reset()  # deleted rows must be recorded again
        if consumer is None:
            self._log.write(lambda w: delete_below(w, None))
            return
        name = check_consumer_name(consumer)

        def clear_one(w: WriteTxn) -> None:
            consumers = w.consumers()
            if name not in consumers:
                raise UnknownConsumerError(f"consumer {name!r} is not registered in {self.path}")
            if len(consumers) == 1:
                delete_below(w, None)

        self._log.write(clear_one)

    # ------------------------------------------------------------------ publish, checkpoints
    def publish(self, consumer: str) -> Dict[str, int]:
        """Write the current values of the rows changed since ``consumer`` last read as
        snapshot records (one transaction: read, snapshot, offset commit, retention).

        A serving process applies them with ``DeltaConsumer(root, name, channel="snapshots")``.

        Args:
            consumer: a registered (lookups) consumer whose offset tracks what was published.

        Returns:
            fqn -> rows published.
        """
        name = check_consumer_name(consumer)
        self._drain()
        end = self.curr_batch_idx + 1
        stamp = self.curr_batch_idx

        def txn(w: WriteTxn) -> Tuple[Dict[str, int], Dict[str, int]]:
            rows, offsets = self._consume(w, name, end)
            written = write_snapshots(w, self._tables, {f: r.ids for f, r in rows.items()}, stamp)
            w.set_meta(META_SNAPSHOT_END, max(stamp + 1, int(w.meta(META_SNAPSHOT_END, 0))))
            if self._delete_on_read:
                snapshot_retention(w, [
                    int(v["offset"]) for v in w.consumers().values() if v.get("channel") == SNAPSHOTS_CHANNEL
                ])
            return written, offsets

        written, self._offsets = self._log.write(txn)
        return written

    def state_dict(self) -> Dict[str, Any]:
        """The tracker's part of a model checkpoint. Flushes first and marks the checkpoint in
        the log (retention keeps what a restore of it needs). Save it with the model."""
        self._drain()
        batch = self.curr_batch_idx

        def mark(w: WriteTxn) -> Dict[str, Any]:
            w.set_meta(META_CHECKPOINT_FLOOR, batch + 1)
            return {"log_id": w.meta("log_id"), "offsets": lookup_offsets(w.consumers())}

        info = self._log.write(mark)
        self._log.flush()
        return {
            "version": 1,
            "log_id": info["log_id"],
            "rank": self.rank,
            "tracking_mode": self._mode.value,
            "curr_batch_idx": batch,
            "offsets": info["offsets"],
        }

    def load_state_dict(self, state: Dict[str, Any]) -> Dict[str, int]:
        """Restore with a model checkpoint (call it after loading the model's weights and
        optimizer state). If the log went past the checkpoint, the rows touched since are
        re-delivered to every consumer with their restored states (see :mod:`.snapshot`).
        With an initialised process group it is a collective: call it on every rank (the
        ranks agree on the batch index to continue from).

        Returns:
            fqn -> rows re-delivered (empty when the log ended at the checkpoint).

        Raises:
            ConfigMismatchError: the state belongs to another log, rank or tracking mode.
            OffsetOutOfRangeError: the records since that checkpoint were already deleted.
        """
        self._drain()
        for key in ("log_id", "rank", "tracking_mode", "curr_batch_idx"):
            if key not in state:
                raise InvalidInputError(f"tracker state_dict lacks {key!r}")
        log_id = self._log.read(lambda r: r.meta("log_id"))
        if (state["log_id"], state["rank"], state["tracking_mode"]) != (log_id, self.rank, self._mode.value):
            raise ConfigMismatchError(
                f"{self.path}: this tracker state was saved for log {state['log_id']} rank {state['rank']} mode "
                f"{state['tracking_mode']!r}, not log {log_id} rank {self.rank} mode {self._mode.value!r}"
            )
        ckpt = int(state["curr_batch_idx"])
        last = self.curr_batch_idx
        if dist.is_initialized() and dist.get_world_size() > 1:
            # A kill can leave ranks one step apart; continue all of them from the same batch
            # index so that batch ranges mean the same on every rank (replay merges ranks).
            agreed = torch.tensor([last], dtype=torch.int64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            last = int(agreed.item())
        if ckpt >= last:
            self.curr_batch_idx = max(last, ckpt)
            self.curr_compact_index = self.curr_batch_idx
            self._log.write(lambda w: w.set_meta(META_CURR_BATCH, self.curr_batch_idx))
            return {}

        def txn(w: WriteTxn) -> Dict[str, int]:
            out = redeliver(w, self._mode, self._update_mode, self._tables, ckpt, last)
            w.set_meta(META_CURR_BATCH, last + 1)
            w.set_meta(META_CHECKPOINT_FLOOR, ckpt + 1)
            return out

        redelivered = self._log.write(txn)
        self._window.reset()
        self.curr_batch_idx = last + 1
        self.curr_compact_index = self.curr_batch_idx
        self._log.flush()
        return redelivered

    # ------------------------------------------------------------------ consumers
    @property
    def per_consumer_batch_idx(self) -> Dict[str, int]:
        """Committed offset (next batch_idx to read) of every registered consumer."""
        self._check()
        self._offsets = self._log.read(lambda r: lookup_offsets(r.consumers()))
        return dict(self._offsets)

    def add_consumer(self, name: str, from_latest: bool = False) -> None:
        """Register a consumer (durably). It starts at the log start, or after the current
        batch with ``from_latest``. Registering an existing name is a no-op."""
        check_consumer_name(name)
        offset = self.curr_batch_idx + 1 if from_latest else 0

        def add(w: WriteTxn) -> None:
            if w.consumer(name) is None:
                w.set_consumer(
                    name, {"offset": offset, "commit_time": time.time(), "registered_by": "trainer", "channel": LOOKUPS}
                )

        self._check()
        self._log.write(add)
        if name not in self._consumers:
            self._consumers.append(name)

    def remove_consumer(self, name: str) -> None:
        """Unregister a consumer (durably); it no longer holds back retention."""
        check_consumer_name(name)
        self._check()
        if not self._log.write(lambda w: w.delete_consumer(name)):
            raise UnknownConsumerError(f"consumer {name!r} is not registered in {self.path}")
        if name in self._consumers:
            self._consumers.remove(name)

    # ------------------------------------------------------------------ misc TorchRec API
    def get_tracked_modules(self) -> Dict[str, nn.Module]:
        return self.tracked_modules

    def fqn_to_feature_names(self) -> Dict[str, List[str]]:
        return self._fqn_to_feature_map

    def get_latest(self) -> Dict[str, torch.Tensor]:
        """fqn -> this rank's current optimizer state (momentum1) of each tracked table."""
        out = {}
        for fqn, t in self._tables.items():
            s = t.optimizer_state()
            if s is not None:
                out[fqn] = s
        return out

    def compact(self, start_idx: int, end_idx: int) -> None:
        """Compact ``[start_idx, end_idx)`` now (one transaction)."""
        if start_idx >= end_idx:
            raise AssertionError(f"start_idx {start_idx} must be smaller than end_idx, but got {end_idx}")
        self._drain()
        self._log.write(lambda w: compact_range(w, self._update_mode, max(0, start_idx), end_idx))

    @property
    def local_tables(self) -> Dict[str, LocalTable]:
        """fqn -> this rank's shard of each tracked table."""
        return dict(self._tables)

    @property
    def log(self) -> DeltaLog:
        return self._log

    def stats(self) -> Dict[str, float]:
        """Writer statistics (queue depth/bytes, commits, bytes written, longest wait, ...)."""
        return self._writer.stats() if self._writer is not None else {}

    # ------------------------------------------------------------------ lifecycle
    def flush(self) -> None:
        """Durability barrier: everything recorded so far is committed and fsynced when this
        returns. Call it before declaring a model checkpoint complete."""
        self._drain()
        self._log.flush()

    def close(self) -> None:
        """Flush, stop the writer, unregister the callables and close the log. Idempotent."""
        if self._closed:
            return
        try:
            self._drain()
            # the batch being recorded is complete now: let out-of-process readers see it
            closed_end = self.curr_batch_idx + 1
            self._log.write(lambda w: w.set_meta("closed_end", closed_end))
            self._log.flush()
        finally:
            self._closed = True
            if self._writer is not None:
                self._writer.close(drain=False)
            for module, attr in self._hooked:
                if getattr(module, attr, None) is not None and getattr(getattr(module, attr), "__self__", None) is self:
                    setattr(module, attr, None)
            self._hooked = []
            dmp = getattr(self, "_dmp", None)
            if dmp is not None and dmp.model_trackers.get(Trackers.DELTA_TRACKER.name) is self:
                del dmp.model_trackers[Trackers.DELTA_TRACKER.name]
            self._log.close()

    def _check(self) -> None:
        if self._closed:
            raise LogClosedError(f"{self.path}: the tracker is closed")

    def __enter__(self) -> "PersistentDeltaTracker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wipe(w: WriteTxn) -> None:
    """Empty the log (``fresh=True``): records, consumers, tables' listing and tracker meta."""
    delete_below(w, None)
    for name in list(w.consumers()):
        w.delete_consumer(name)
    for entry in w.tables().values():
        e = entry.copy()
        e.last_batch_idx = -1
        e.listed = False
        w.stage_table(e)
    w.set_meta(META_CURR_BATCH, 0)
    logger.info("fresh=True: emptied the log")


def attach(dmp: nn.Module, config: PersistentTrackerConfig) -> PersistentDeltaTracker:
    """Build a :class:`PersistentDeltaTracker` for a ``DistributedModelParallel`` and register
    it, so that ``dmp.get_delta_tracker()`` returns it and ``DMP.forward`` steps it.

    Raises:
        InvalidInputError: ``dmp`` is not a DMP, or it already has a delta tracker.
    """
    trackers = getattr(dmp, "model_trackers", None)
    if trackers is None or not hasattr(dmp, "_dmp_wrapped_module"):
        raise InvalidInputError("attach() needs a torchrec DistributedModelParallel")
    existing = trackers.get(Trackers.DELTA_TRACKER.name)
    if existing is not None:
        raise InvalidInputError(
            f"this DMP already has a delta tracker ({type(existing).__name__}); close it first"
        )
    wrapped = dmp._dmp_wrapped_module
    assert isinstance(wrapped, nn.Module)
    tracker = PersistentDeltaTracker(wrapped, config)
    tracker._dmp = dmp  # type: ignore[attr-defined]
    trackers[Trackers.DELTA_TRACKER.name] = tracker
    return tracker
