"""Model checkpoints, restarts and restore: where a trainer's log continues.

Owns: what a (re)opened tracker does to its log, the checkpoint mark, the tracker's entry in
the model's state dict and the re-delivery rule.

**Opening** (:func:`open_tracker_log`): the log must hold the same tracking mode and table set
(or ``fresh`` empties it); the configured consumers are registered; the batch index continues
after the last one persisted (never reused); and since the opener holds the writer lock, any
earlier writer is gone, so its open batch is complete and is marked so (``closed_end``).

``tracker.state_dict()`` flushes, marks the checkpoint in the log (``checkpoint_floor`` = the
first batch after it) and returns the batch index and log identity. ``dmp.state_dict()``
carries the same state under a key of its rank's (:func:`state_key`) as a :class:`TrackerState`,
which marks the checkpoint when it is written, not when it is taken: a state dict built as the
target of a torch.distributed.checkpoint load changes nothing. Retention never deletes
records at or after the floor, and compaction never merges across it
(:mod:`persistent_delta.log.position_rules`). ``tracker.load_state_dict(sd)``, after restoring the model
from that checkpoint: the batches recorded after the checkpoint (``[floor, log end)``) belong
to a timeline that was lost, so their records are replaced by one *re-delivery* record per
table, stamped with a fresh batch index (indices are never reused), holding the ids those
batches touched and their states taken from the restored model. Every consumer then reads
those rows again -- values included, through ``publish`` -- and converges to the restored
model instead of keeping values from lost steps.

With an initialised process group the restore is a collective: the ranks agree on the batch
index to continue from (:func:`agree_batch_idx`).
"""

from __future__ import annotations

import copy
import logging
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_tracker.types import TrackingMode, UpdateMode

from persistent_delta.checkpoint.format import TRACKER_STATE_KEY as STATE_KEY
from persistent_delta.log import codec, position_rules
from persistent_delta.errors import ConfigMismatchError, InvalidInputError, OffsetOutOfRangeError, WorldSizeMismatchError
from persistent_delta.log.deltalog import DeltaLog, ReadTxn, WriteTxn
from persistent_delta.log.records import (AppendRecord, delete_below, delete_table_records, encode_records, last_appended,
                                     log_start, write_records)
from persistent_delta.log.rows import compute_unique_rows
from persistent_delta.log.schema import (
    LOOKUPS,
    META_CHECKPOINT_FLOOR,
    META_CLOSED_END,
    META_CREATED_TIME,
    META_CURR_BATCH,
    META_DEFERRED,
    META_DEFERRED_ROWS,
    META_LOG_ID,
    META_LOG_START,
    META_RESTART_GEN,
    META_SNAPSHOT_END,
    META_SNAPSHOT_OPEN,
    META_SNAPSHOT_START,
    META_TRACKER,
    META_UPDATE_MODE,
    SNAPSHOTS,
    Delivery,
    TrackerMeta,
    next_created_time,
)
from persistent_delta.trainer.sharding import LocalTable

logger = logging.getLogger(__name__)

STATE_VERSION = 2  # 2: with "world_size" (1 had none: not checked)
_REQUIRED = ("log_id", "rank", "tracking_mode", "curr_batch_idx")


def open_tracker_log(
    w: WriteTxn, want: TrackerMeta, shards: Dict[str, Dict[str, Any]], consumers: List[str], fresh: bool,
    row_shapes: Optional[Dict[str, Dict[str, Any]]] = None,
) -> Tuple[int, int]:
    """Check (or, with ``fresh``, empty) a tracker's log inside ``w``, store the shard metadata
    and row shapes (:func:`persistent_delta.trainer.capture.row_shapes`) of every table, register
    ``consumers`` (in-transaction delivery) and close a dead writer's open batch. Returns the
    batch index to continue from, and the end of the batches the previous writer completed
    (what :func:`resume_at` agrees on over ranks).

    Raises:
        ConfigMismatchError: the log holds another tracking mode, table set or update mode.
    """
    row_shapes = row_shapes or {}
    have = TrackerMeta.from_value(w.meta(META_TRACKER))
    stored_mode = w.meta(META_UPDATE_MODE)
    if fresh:
        _wipe(w)
        w.set_meta(META_CLOSED_END, 0)
    elif have is not None and (have.tracking_mode, have.tables) != (want.tracking_mode, want.tables):
        raise ConfigMismatchError(f"{w.path}: {_difference(have, want)}. Use the matching config, another path, or "
                                  "PersistentTrackerConfig(fresh=True) to start a fresh log (discarding this one)")
    elif have is None and stored_mode is not None and stored_mode != want.update_mode:
        raise ConfigMismatchError(
            f"{w.path} holds records with update mode {stored_mode!r}, not {want.update_mode!r}; use fresh=True "
            "or another path"
        )
    w.set_meta(META_TRACKER, want.to_value())
    w.set_meta(META_UPDATE_MODE, want.update_mode)
    for fqn, md in shards.items():
        entry = w.ensure_table(fqn)
        before = w.table(fqn)
        shapes = row_shapes.get(fqn, {})
        if before is None or entry.meta.get("shard") != md or any(getattr(entry, k) is None and v is not None
                                                                   for k, v in shapes.items()):
            entry.meta["shard"] = md
            entry.listed = before.listed if before is not None else False
            for k, v in shapes.items():  # what an empty result's rows look like, before any record
                if getattr(entry, k) is None:
                    setattr(entry, k, v)
            w.stage_table(entry)
    for name in consumers:
        position_rules.register(w, name, 0, LOOKUPS, Delivery.IN_TRANSACTION)
    curr_meta = int(w.meta(META_CURR_BATCH, 0))
    complete = max(curr_meta, int(w.meta(META_CLOSED_END, 0)))  # batches below it were complete
    curr = max(curr_meta, last_appended(w))
    # The end does not move here: the other ranks may still hold batches this rank never
    # completed; resume_at moves it once they agreed on what to drop.
    return curr, complete


def resume_at(log: DeltaLog, batch_idx: int, complete: Optional[int] = None,
              dropped_ids: Optional[Dict[str, torch.Tensor]] = None) -> int:
    """Agree with the other ranks on where to continue after a (re)start: a collective when a
    process group of more than one rank is initialised.

    ``complete``: every batch below it was completed by this rank's previous writer (a killed
    one left its open batch incomplete; one that closed, even at exit after a failed collective,
    completed it). A batch counts as committed only when *every* rank completed it: this rank
    drops its records of batches at or above the smallest ``complete`` over ranks (no consumer
    saw them: polls stop at the end every rank completed), so no merged table misses a column
    half; and every rank continues at the largest ``batch_idx``, so no index is reused. The
    batches in between read as empty on every rank (the indices a restart skips). The same
    transaction marks the open batch of the dead writer complete (the opener holds the writer
    lock: nothing more can come) and, with several ranks, stores the agreed restart generation
    (:func:`persistent_delta.log.position_rules.restart_generation`): the ranks commit one
    after the other, and polls wait until they all have. Returns the index to continue from.

    Publishes are never dropped: a reader of one rank (a shipper ships each rank's log on its
    own) may have read a stamp the rank closed, so the snapshots end never moves back. The
    dead writer's open stamp is closed (its publish is complete), and when the newest stamp
    any rank holds is of a batch some rank never completed (the rank killed there may have
    died before its publish), every rank's snapshots end moves up past it: none reads as
    behind for a publish the SIGKILL cut short. A rank that did not publish there keeps its
    rows unread by its publishing consumer, so its next publish carries them. (A rank that
    also lacked an earlier stamp, one every rank completed, was told then, and is told again
    at the next publish it skips.) A kept publish carries values of the lost timeline for the
    rows changed after the checkpoint; the restore re-delivers those, so the next publish
    carries their restored values.

    ``dropped_ids``: filled with fqn -> the ids of the dropped lookups records. A shipper may
    have shipped a dropped batch of this rank before the restart, and a consumer that published
    had moved past its rows. A restore re-delivers these ids (:func:`redeliver`), so every
    consumer reads them again and the next publish carries them."""
    complete = batch_idx + 1 if complete is None else complete
    lo, hi, gen, raise_to = complete, batch_idx, None, None
    if dist.is_initialized() and dist.get_world_size() > 1:
        mine, published = log.read(lambda r: (position_rules.restart_generation(r), position_rules.published_end(r)))
        hi, neg_lo, gen, newest = _max_over_ranks([batch_idx, -complete, mine + 1, published])
        lo = -neg_lo
        raise_to = newest if newest > lo else None  # the newest stamp is of a batch some rank never completed
    drop = not (hi == batch_idx and lo >= complete)

    def settle(w: WriteTxn) -> int:
        dropped = 0
        if drop:
            for fqn, entry in w.tables().items():
                if dropped_ids is not None:
                    ids = [r.ids for r in w.iter_records(entry.table_id, lo, None, channel=LOOKUPS)]
                    if ids:
                        dropped_ids[fqn] = torch.unique(torch.cat([i.reshape(-1).long() for i in ids]))
                dropped += delete_table_records(w, entry, lo, None, LOOKUPS)[0]
            w.set_meta(META_CURR_BATCH, hi)
        w.set_meta(META_CLOSED_END, max(int(w.meta(META_CLOSED_END, 0)), hi + 1))
        if gen is not None:
            position_rules.close_stamps(w)  # the dead writer's publish is complete
            if raise_to is not None:
                w.set_meta(META_SNAPSHOT_END, max(int(w.meta(META_SNAPSHOT_END, 0)), raise_to))
            w.set_meta(META_RESTART_GEN, gen)
        return dropped

    dropped = log.write(settle)
    if dropped or hi != batch_idx:
        logger.warning("%s: continuing at batch %d with the other ranks (persisted here: %d; complete on every "
                       "rank: below %d); dropped %d lookups records of batches not complete on every rank. Batch "
                       "indices are never reused, so batches [%d, %d) read as empty on every rank", log.path, hi,
                       batch_idx, lo, dropped, lo, hi + 1)
    return hi


def _difference(have: TrackerMeta, want: TrackerMeta) -> str:
    """What differs between the stored tracker settings and the asked ones, and only that."""
    parts = []
    if have.tracking_mode != want.tracking_mode:
        parts.append(f"it was written with tracking mode {have.tracking_mode!r}, not {want.tracking_mode!r}")
    if have.tables != want.tables:
        gone, new = sorted(set(have.tables) - set(want.tables)), sorted(set(want.tables) - set(have.tables))
        what = []
        if gone:
            what.append(f"tables {gone} are in the log but not in the model")
        if new:
            what.append(f"tables {new} are in the model but not in the log")
        parts.append("its tables differ: " + "; ".join(what))
    return "; ".join(parts)


def _wipe(w: WriteTxn) -> None:
    """Empty the log (``fresh=True``): records of both channels, consumers, tables' listing and
    tracker meta, and give it a new identity (log id and creation time): a new log, whose batch
    numbers start again at 0."""
    delete_below(w, None)
    delete_below(w, None, SNAPSHOTS)
    for key in (META_LOG_START, META_SNAPSHOT_START, META_SNAPSHOT_END, META_SNAPSHOT_OPEN, META_CHECKPOINT_FLOOR,
                META_DEFERRED, META_DEFERRED_ROWS):
        w.delete_meta(key)  # what the previous run's batches left (its starts would hide the new run's)
    for name in list(w.consumers()):
        w.delete_consumer(name)
    for entry in w.tables().values():
        e = entry.copy()
        e.last_batch_idx = -1
        e.listed = False
        w.stage_table(e)
    w.set_meta(META_CURR_BATCH, 0)
    # a new identity: what the previous run shipped (or what a copy of it replays) is of another,
    # older log, and readers that saw this one refuse it (LogIdentity)
    was = w.identity()
    w.set_meta(META_LOG_ID, uuid.uuid4().hex)
    w.set_meta(META_CREATED_TIME, next_created_time(w.meta(META_CREATED_TIME)))
    logger.info("fresh=True: emptied the log %s (%s replaced by %s)", w.path, was.describe(), w.identity().describe())


def mark_checkpoint(w: WriteTxn, batch_idx: int) -> None:
    """Mark a model checkpoint taken at ``batch_idx``: records from ``batch_idx + 1`` on are
    kept for a restore."""
    w.set_meta(META_CHECKPOINT_FLOOR, batch_idx + 1)


def checkpoint_info(r: ReadTxn) -> Dict[str, Any]:
    """The log id and the lookups consumers' positions (what a tracker state records)."""
    return {"log_id": r.meta(META_LOG_ID), "offsets": position_rules.committed_offsets(r)}


def world_size() -> Optional[int]:
    """The default process group's size, or None without one (what a tracker state records)."""
    return dist.get_world_size() if dist.is_initialized() else None


# STATE_KEY (checkpoint.format.TRACKER_STATE_KEY, which consolidate reads without the trainer):
# the key under which ``dmp.state_dict()`` carried the tracker's state before it had one key per
# rank (still loaded), and the start of each rank's key (:func:`state_key`).


def state_key(rank: int) -> str:
    """The key of rank ``rank``'s tracker state in ``dmp.state_dict()``. One key per rank: a
    checkpoint format that stores a key every rank has only once (torch.distributed.checkpoint,
    whose plans dedupe keys over ranks) keeps each rank's own state."""
    return f"{STATE_KEY}.rank_{rank}"


# How to fix a WorldSizeMismatchError (each message says what was found first).
_OTHER_WORLD = ("Restore with the world size the checkpoint was saved with; to go on with another, start a fresh log "
                "(PersistentTrackerConfig(fresh=True) or another path) and give replicas a new base")


class CheckpointMark:
    """Marks the checkpoint of a :class:`TrackerState` in its tracker's log, once: ``mark(batch)``
    is the tracker's (flush, the mark, a managed-collision rebase). Any thread may call it."""

    def __init__(self, mark: Callable[[int], None], batch_idx: int) -> None:
        self._mark, self.batch_idx, self.done = mark, batch_idx, False

    def __call__(self) -> None:
        if not self.done:
            self._mark(self.batch_idx)
            self.done = True


class TrackerState:
    """One rank's tracker state as ``dmp.state_dict()`` carries it (under :func:`state_key`):
    one opaque value, not a mapping, so torch.distributed.checkpoint stores it whole (pickled),
    and its key, every rank's own, keeps the ranks apart.

    Taking it marks nothing, so that a state dict built as the target of a DCP load changes
    nothing in the log. *Writing* it marks the checkpoint: the first time it is pickled
    (``torch.save``, DCP's save, ``pickle``), it runs its :class:`CheckpointMark`. A copy
    (``copy.copy``, ``copy.deepcopy``: DCP's async staging) shares the mark, so the copy marks
    when it is written. What a load returns (unpickled) holds the saved state and no mark.

    Attributes:
        state: the tracker's state (``tracker.state_dict()``'s keys).
    """

    __slots__ = ("state", "_mark")

    def __init__(self, state: Dict[str, Any], mark: Optional[CheckpointMark] = None) -> None:
        self.state = dict(state)
        self._mark = mark

    @property
    def loaded(self) -> bool:
        """Whether it came from a checkpoint (unpickled), not from this process's ``state_dict()``."""
        return self._mark is None

    def mark(self) -> None:
        """Mark its checkpoint in the log now, if pickling it has not (once; nothing for a loaded
        state): for a checkpoint that writes a copy of the state first and marks once complete."""
        if self._mark is not None:
            self._mark()

    def __reduce__(self) -> Tuple[Any, ...]:
        if self._mark is not None:
            self._mark()
        return (TrackerState, (self.state,))

    def __copy__(self) -> "TrackerState":
        return TrackerState(self.state, self._mark)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "TrackerState":
        return TrackerState(copy.deepcopy(self.state, memo), self._mark)

    def __repr__(self) -> str:
        return f"TrackerState({self.state!r}, loaded={self.loaded})"


# torch.load(weights_only=True) may rebuild it (only from its dict of plain values)
torch.serialization.add_safe_globals([TrackerState])


def state_of(value: Any, rank: int) -> Dict[str, Any]:
    """The tracker state dict in ``value`` (a :class:`TrackerState`, or a dict of the layout
    before it).

    Raises:
        WorldSizeMismatchError: ``value`` is a state this process built and nothing loaded
            into it (the target of a load that found no state for this rank).
        InvalidInputError: ``value`` is neither.
    """
    if isinstance(value, TrackerState):
        if not value.loaded:
            raise WorldSizeMismatchError(
                f"no tracker state for rank {rank} was loaded: the state dict holds the one this process built as the "
                "load target (the load found none for this rank: the checkpoint was saved with another world size, "
                f"or without the tracker). {_OTHER_WORLD}")
        return value.state
    if isinstance(value, dict):
        return value
    raise InvalidInputError(f"a tracker state is a TrackerState or a dict, not {type(value).__name__}")


def take_state(state_dict: Dict[str, Any], prefix: str, rank: int) -> Optional[Dict[str, Any]]:
    """Take the tracker's entries out of a state dict loaded into the module at ``prefix`` (so
    that no load reports them as unexpected) and return this rank's state: its own key's, or
    the key of the layout before one key per rank; None when it holds neither.

    Raises:
        WorldSizeMismatchError: it holds tracker states of other ranks and none of this one (a
            checkpoint of another rank, or of another world size): loading another rank's
            state would restore the wrong log. Or this rank's key holds None (what a DCP load
            with ``allow_partial_load`` leaves where the checkpoint had no such key) or the
            target's own unloaded :class:`TrackerState`: nothing of this rank was loaded.
    """
    mine, head = prefix + state_key(rank), prefix + STATE_KEY + ".rank_"
    others = sorted(k for k in state_dict if k.startswith(head) and k != mine)
    found = mine in state_dict
    value = state_dict.pop(mine, None)
    for k in others:
        state_dict.pop(k)
    if not found and others:
        raise WorldSizeMismatchError(
            f"the checkpoint holds the tracker states {others} and none for rank {rank} (key {mine!r}): it was saved "
            f"by other ranks (another world size, or another rank's file). Load each rank's own state. {_OTHER_WORLD}")
    if not found:
        value = state_dict.pop(prefix + STATE_KEY, None)
        return None if value is None else state_of(value, rank)
    if value is None:  # what a DCP load with allow_partial_load leaves under a key it did not find
        raise WorldSizeMismatchError(
            f"no tracker state for rank {rank} was loaded (key {mine!r} holds None: a DCP load with "
            "allow_partial_load found none for this rank: the checkpoint was saved with another world size, or "
            f"without the tracker). {_OTHER_WORLD}")
    return state_of(value, rank)


def hook_model_state(module: nn.Module, rank: int, save: Callable[[], TrackerState],
                     load: Callable[[Dict[str, Any]], None]) -> List[Any]:
    """Make the tracker's state part of the model's: ``module.state_dict()`` (which a DMP's
    ``state_dict()`` calls) gets ``save()`` under :func:`state_key` of ``rank``, and a state
    dict loaded into ``module`` (``dmp.load_state_dict``) hands this rank's state to ``load``
    (:func:`take_state`). Returns the hook handles (``.remove()`` each to undo)."""

    def add(mod: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
        state_dict[prefix + state_key(rank)] = save()

    def take(mod: nn.Module, state_dict: Dict[str, Any], prefix: str, *rest: Any) -> None:
        state = take_state(state_dict, prefix, rank)
        if state is not None:
            load(state)

    return [module.register_state_dict_post_hook(add), module.register_load_state_dict_pre_hook(take)]


def unrestored(r: ReadTxn) -> Optional[Tuple[int, int]]:
    """``(floor, last)`` when the log holds records of batches ``[floor, last]`` after its
    latest model checkpoint mark (``floor``: the first batch after the checkpoint), else None.
    A tracker that starts on such a log and trains without a restore keeps those lost steps'
    rows in every replica."""
    floor = r.meta(META_CHECKPOINT_FLOOR)
    if floor is None:
        return None
    last = last_appended(r)
    return (int(floor), last) if last >= int(floor) else None


def check_state(state: Any, log_id: str, rank: int, tracking_mode: str, path: str,
                world: Optional[int] = None) -> int:
    """Validate a tracker state (a dict or a :class:`TrackerState`) against this log and the
    world size ``world`` (None: unknown); returns its batch index.

    Raises:
        InvalidInputError: a key is missing.
        WorldSizeMismatchError: it was saved with another world size (or nothing was loaded
            into it: :func:`state_of`).
        ConfigMismatchError: it belongs to another log, rank or tracking mode.
    """
    state = state_of(state, rank)
    for key in _REQUIRED:
        if key not in state:
            raise InvalidInputError(f"tracker state_dict lacks {key!r}")
    saved_world = state.get("world_size")
    if saved_world is not None and world is not None and int(saved_world) != world:
        raise WorldSizeMismatchError(
            f"{path}: this tracker state was saved with world size {saved_world}, and this job runs {world} ranks: "
            f"each rank's log and its tables' shards belong to the layout it was written with. {_OTHER_WORLD}")
    if (state["log_id"], state["rank"], state["tracking_mode"]) != (log_id, rank, tracking_mode):
        raise ConfigMismatchError(
            f"{path}: this tracker state was saved for log {state['log_id']} rank {state['rank']} mode "
            f"{state['tracking_mode']!r}, not log {log_id} rank {rank} mode {tracking_mode!r}"
        )
    return int(state["curr_batch_idx"])


def _max_over_ranks(values: List[int]) -> List[int]:
    """Each value's maximum over the ranks of the default process group (a collective). NCCL
    reduces device tensors only, gloo host tensors."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


def agree_batch_idx(log: DeltaLog, batch_idx: int) -> Tuple[int, Optional[int]]:
    """The largest ``batch_idx`` over ranks and the next restart generation (a collective when
    a process group of more than one rank is initialised; ``(batch_idx, None)`` otherwise: a
    single rank's log needs no generation)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        hi, gen = _max_over_ranks([batch_idx, log.read(position_rules.restart_generation) + 1])
        return hi, gen
    return batch_idx, None


def share_dropped_ids(tables: Dict[str, LocalTable],
                      dropped_ids: Dict[str, torch.Tensor]) -> Tuple[Dict[str, torch.Tensor], bool]:
    """The ids a restore re-delivers for the batches the restart dropped (:func:`resume_at`):
    this rank's own, and for a column-split table every rank's (its ranks hold the same rows,
    so the halves of each re-delivered row stay together); and whether any rank has some (then
    every rank restores by re-delivery, even with the checkpoint at the log's last batch, so
    that all continue at the same batch). A collective when a process group of more than one
    rank is initialised."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return dict(dropped_ids), any(t.numel() for t in dropped_ids.values())
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, dropped_ids)
    out = dict(dropped_ids)
    for fqn, table in tables.items():
        if table.local_cols != table.global_cols:
            parts = [d[fqn] for d in everyone if isinstance(d, dict) and fqn in d]
            if parts:
                out[fqn] = torch.unique(torch.cat(parts))
    return out, any(isinstance(d, dict) and any(t.numel() for t in d.values()) for d in everyone)


def current_states(mode: TrackingMode, table: LocalTable, ids: torch.Tensor) -> Optional[torch.Tensor]:
    """The state the tracker would record for ``ids`` now (the FIRST/LAST baseline)."""
    if mode == TrackingMode.ID_ONLY:
        return None
    if mode == TrackingMode.EMBEDDING:
        return table.weights()[ids.long()].clone()
    state = table.optimizer_state()
    if state is None:
        raise OffsetOutOfRangeError(f"{table.fqn}: no optimizer state to rebuild tracked states from")
    rows = state[ids.long()].clone()
    if mode == TrackingMode.MOMENTUM_LAST:
        rows = rows.norm(dim=1) if rows.dim() > 1 else rows.abs()
    return rows


def redeliver(
    w: WriteTxn,
    mode: TrackingMode,
    update_mode: UpdateMode,
    tables: Dict[str, LocalTable],
    checkpoint_batch: int,
    log_end_batch: int,
    side: Optional[Callable[[WriteTxn, int, int], List[AppendRecord]]] = None,
    gen: Optional[int] = None,
    dropped_ids: Optional[Dict[str, torch.Tensor]] = None,
) -> Dict[str, int]:
    """Replace the records of batches ``[checkpoint_batch + 1, log_end_batch + 1)`` (the lost
    timeline) by one re-delivery record per table stamped ``log_end_batch + 1``, and continue
    the log there. Returns rows re-delivered per table. ``side(w, first, stamp)`` does the same
    for side records (managed-collision slots: :meth:`persistent_delta.trainer.zch_capture.ZchCapture.redeliver`)
    and returns the records to write at the stamp. ``gen``: the restart generation the ranks
    agreed (:func:`agree_batch_idx`), stored in the same transaction: polls wait while the
    ranks' generations differ, so none reads the lost timeline on one rank and its
    replacement on another. ``dropped_ids``: fqn -> ids of batches the restart dropped
    (:func:`resume_at`; for a column-split table, every rank's), re-delivered too: they were
    part of the lost timeline, and a shipper may have shipped them.

    Raises:
        OffsetOutOfRangeError: records after the checkpoint were already deleted.
    """
    first = checkpoint_batch + 1
    if log_start(w) > first:
        raise OffsetOutOfRangeError(
            f"cannot restore to batch {checkpoint_batch}: records from batch {log_start(w)} on are all that is "
            "left (retention deleted the rest). Restore the latest checkpoint (its state_dict() marks what to keep)"
        )
    stamp = log_end_batch + 1
    records: List[AppendRecord] = []
    for fqn, entry in w.tables().items():
        ids = [r.ids.clone() for r in w.iter_records(entry.table_id, first, stamp)]
        w.delete_records(entry.table_id, first, stamp)
        if dropped_ids and fqn in dropped_ids and dropped_ids[fqn].numel():
            ids.append(dropped_ids[fqn].to(ids[0].dtype if ids else torch.int64))
        if not ids or fqn not in tables:
            continue
        touched = compute_unique_rows(ids, None, UpdateMode.NONE).ids
        if touched.numel() == 0:
            continue
        records.append(AppendRecord(stamp, fqn, touched, current_states(mode, tables[fqn], touched)))
    if side is not None:
        records += side(w, first, stamp)
    if records:
        write_records(w, encode_records(records, update_mode))
    w.set_meta(META_CURR_BATCH, stamp)
    w.set_meta(META_CHECKPOINT_FLOOR, first)
    if gen is not None:
        w.set_meta(META_RESTART_GEN, gen)
    logger.info(
        "restored to batch %d: re-delivering rows of batches [%d, %d) as batch %d (those batches now read as "
        "empty: indices are never reused, so a consumer never mixes the lost timeline with the new one): %s",
        checkpoint_batch, first, stamp, stamp, {r.fqn: int(r.ids.numel()) for r in records if r.kind == codec.KIND_LOOKUP},
    )
    return {r.fqn: int(r.ids.numel()) for r in records if r.kind == codec.KIND_LOOKUP}
