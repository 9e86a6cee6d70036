"""Model checkpoints, restarts and restore: where a trainer's log continues.

Owns: what a (re)opened tracker does to its log, the checkpoint mark and the re-delivery rule.

**Opening** (:func:`open_tracker_log`): the log must hold the same tracking mode and table set
(or ``fresh`` empties it); the configured consumers are registered; the batch index continues
after the last one persisted (never reused); and since the opener holds the writer lock, any
earlier writer is gone, so its open batch is complete and is marked so (``closed_end``).

``tracker.state_dict()`` flushes, marks the checkpoint in the log (``checkpoint_floor`` = the
first batch after it) and returns the batch index and log identity. Retention never deletes
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

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_tracker.types import TrackingMode, UpdateMode

from persistent_delta.log import codec, position_rules
from persistent_delta.errors import ConfigMismatchError, InvalidInputError, OffsetOutOfRangeError
from persistent_delta.log.deltalog import DeltaLog, ReadTxn, WriteTxn
from persistent_delta.log.records import (AppendRecord, delete_below, delete_table_records, encode_records, last_appended,
                                     log_start, write_records)
from persistent_delta.log.rows import compute_unique_rows
from persistent_delta.log.schema import (
    CHANNELS,
    LOOKUPS,
    META_CHECKPOINT_FLOOR,
    META_CLOSED_END,
    META_CURR_BATCH,
    META_LOG_ID,
    META_RESTART_GEN,
    META_TRACKER,
    META_UPDATE_MODE,
    Delivery,
    TrackerMeta,
)
from persistent_delta.trainer.sharding import LocalTable

logger = logging.getLogger(__name__)

STATE_VERSION = 1
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

    ``dropped_ids``: filled with fqn -> the ids of the dropped lookups records. A shipper may
    have shipped a dropped batch of this rank before the restart (it ships each rank's log on
    its own), so a remote replica may hold that batch's published values: a restore
    re-delivers these ids too (:func:`redeliver`)."""
    complete = batch_idx + 1 if complete is None else complete
    lo, hi, gen = complete, batch_idx, None
    if dist.is_initialized() and dist.get_world_size() > 1:
        mine = log.read(position_rules.restart_generation)
        hi, neg_lo, gen = _max_over_ranks([batch_idx, -complete, mine + 1])
        lo = -neg_lo
    drop = not (hi == batch_idx and lo >= complete)

    def settle(w: WriteTxn) -> int:
        dropped = 0
        if drop:
            for fqn, entry in w.tables().items():
                if dropped_ids is not None:
                    ids = [r.ids for r in w.iter_records(entry.table_id, lo, None)]
                    if ids:
                        dropped_ids[fqn] = torch.unique(torch.cat([i.reshape(-1).long() for i in ids]))
                for channel in CHANNELS:
                    dropped += delete_table_records(w, entry, lo, None, channel)[0]
            w.set_meta(META_CURR_BATCH, hi)
        w.set_meta(META_CLOSED_END, max(int(w.meta(META_CLOSED_END, 0)), hi + 1))
        if gen is not None:
            w.set_meta(META_RESTART_GEN, gen)
        return dropped

    dropped = log.write(settle)
    if dropped or hi != batch_idx:
        logger.warning("%s: continuing at batch %d with the other ranks (persisted here: %d; complete on every "
                       "rank: below %d); dropped %d records of batches not complete on every rank. Batch indices "
                       "are never reused, so batches [%d, %d) read as empty on every rank", log.path, hi,
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
    logger.info("fresh=True: emptied the log %s", w.path)


def mark_checkpoint(w: WriteTxn, batch_idx: int) -> Dict[str, Any]:
    """Mark a model checkpoint taken at ``batch_idx``: records from ``batch_idx + 1`` on are
    kept for a restore. Returns the log id and the lookups consumers' positions."""
    w.set_meta(META_CHECKPOINT_FLOOR, batch_idx + 1)
    return {"log_id": w.meta(META_LOG_ID), "offsets": position_rules.committed_offsets(w)}


# The key under which ``dmp.state_dict()`` carries the tracker's state (:func:`hook_model_state`).
STATE_KEY = "persistent_delta_tracker"


def hook_model_state(module: nn.Module, save: Callable[[], Dict[str, Any]],
                     load: Callable[[Dict[str, Any]], None]) -> List[Any]:
    """Make the tracker's state part of the model's: ``module.state_dict()`` (which a DMP's
    ``state_dict()`` calls) gets ``save()`` under :data:`STATE_KEY`, and a state dict loaded
    into ``module`` (``dmp.load_state_dict``) hands its :data:`STATE_KEY` entry to ``load``,
    taking it out of the dict (so that no load reports it as unexpected). Returns the hook
    handles (``.remove()`` each to undo)."""

    def add(mod: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
        state_dict[prefix + STATE_KEY] = save()

    def take(mod: nn.Module, state_dict: Dict[str, Any], prefix: str, *rest: Any) -> None:
        state = state_dict.pop(prefix + STATE_KEY, None)
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


def check_state(state: Dict[str, Any], log_id: str, rank: int, tracking_mode: str, path: str) -> int:
    """Validate a tracker state dict against this log; returns its batch index.

    Raises:
        InvalidInputError: a key is missing.
        ConfigMismatchError: it belongs to another log, rank or tracking mode.
    """
    for key in _REQUIRED:
        if key not in state:
            raise InvalidInputError(f"tracker state_dict lacks {key!r}")
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


def share_dropped_ids(tables: Dict[str, LocalTable], dropped_ids: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The ids a restore re-delivers for the batches the restart dropped (:func:`resume_at`):
    this rank's own, and for a column-split table every rank's (its ranks hold the same rows,
    so the halves of each re-delivered row stay together). A collective when a process group
    of more than one rank is initialised."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return dict(dropped_ids)
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, dropped_ids)
    out = dict(dropped_ids)
    for fqn, table in tables.items():
        if table.local_cols != table.global_cols:
            parts = [d[fqn] for d in everyone if isinstance(d, dict) and fqn in d]
            if parts:
                out[fqn] = torch.unique(torch.cat(parts))
    return out


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
