"""Publishing current row values, and restoring the tracker with a model checkpoint.

Design note
-----------
**Publish.** ``tracker.publish(consumer)`` takes the rows changed since ``consumer`` last read
(exactly what ``get_unique(consumer)`` would return, with the same offset commit and
retention), reads their *current* values from this rank's shards, and writes them as snapshot
records (``KIND_SNAPSHOT``, in the ``snapshots`` DB) stamped with the current batch index, all
in one transaction. A serving process reads them with
``DeltaConsumer(root, name, channel="snapshots")`` and applies them (latest stamp wins), so it
converges to the trainer's tables without sharing its memory. Snapshot records are deleted once
every snapshot-channel consumer has committed past them (with ``delete_on_read``).

**Checkpoint and restore.** ``tracker.state_dict()`` flushes, marks the checkpoint in the log
(``checkpoint_floor`` = the first batch after it) and returns the batch index and log identity.
Retention never deletes records at or after the floor, and compaction never merges across it.
``tracker.load_state_dict(sd)`` after restoring the model from that checkpoint: the batches
recorded after the checkpoint (``[floor, log end)``) belong to a timeline that was lost, so their
records are replaced by one *re-delivery* record per table, stamped with a fresh batch index
(indices are never reused), holding the ids those batches touched and their states taken from
the restored model. Every consumer then reads those rows again -- values included, through
``publish`` -- and converges to the restored model instead of keeping values from lost steps.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional

import torch
from torchrec.distributed.model_tracker.types import TrackingMode, UpdateMode

from persistent_delta import codec
from persistent_delta.errors import OffsetOutOfRangeError
from persistent_delta.log import SNAPSHOTS, WriteTxn
from persistent_delta.merge import compute_unique_rows
from persistent_delta.sharding import LocalTable
from persistent_delta.store import AppendRecord, encode_records, write_records

logger = logging.getLogger(__name__)


def write_snapshots(w: WriteTxn, tables: Dict[str, LocalTable], ids_per_table: Dict[str, torch.Tensor], stamp: int) -> Dict[str, int]:
    """Write the current values of ``ids_per_table`` (shard-local ids) as snapshot records
    stamped ``stamp``; returns rows written per table."""
    written: Dict[str, int] = {}
    for fqn, ids in ids_per_table.items():
        entry = w.table(fqn)
        if entry is None or ids.numel() == 0 or fqn not in tables:
            continue
        values = tables[fqn].weights()[ids.long()]
        w.put_record(entry.table_id, stamp, codec.encode_record(ids, values, codec.KIND_SNAPSHOT), db=SNAPSHOTS)
        written[fqn] = int(ids.numel())
    return written


def snapshot_retention(w: WriteTxn, snapshot_offsets: List[int]) -> int:
    """Delete snapshot records every snapshot-channel consumer has committed past."""
    if not snapshot_offsets:
        return 0
    up_to = min(snapshot_offsets)
    n = 0
    for entry in w.tables().values():
        n += w.delete_records(entry.table_id, 0, up_to, db=SNAPSHOTS)[0]
    return n


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
) -> Dict[str, int]:
    """Replace the records of batches ``[checkpoint_batch + 1, log_end_batch + 1)`` (the lost
    timeline) by one re-delivery record per table stamped ``log_end_batch + 1``.

    Returns rows re-delivered per table.

    Raises:
        OffsetOutOfRangeError: records after the checkpoint were already deleted.
    """
    first = checkpoint_batch + 1
    if w.log_start() > first:
        raise OffsetOutOfRangeError(
            f"cannot restore to batch {checkpoint_batch}: records from batch {w.log_start()} on are all that is "
            "left (retention deleted the rest). Restore the latest checkpoint (its state_dict() marks what to keep)"
        )
    stamp = log_end_batch + 1
    records: List[AppendRecord] = []
    for fqn, entry in w.tables().items():
        ids = [r.ids.clone() for r in w.iter_records(entry.table_id, first, stamp)]
        w.delete_records(entry.table_id, first, stamp)
        if not ids or fqn not in tables:
            continue
        touched = compute_unique_rows(ids, None, UpdateMode.NONE).ids
        if touched.numel() == 0:
            continue
        records.append(AppendRecord(stamp, fqn, touched, current_states(mode, tables[fqn], touched)))
    if records:
        write_records(w, encode_records(records, update_mode))
    logger.info(
        "restored to batch %d: re-delivering rows of batches [%d, %d) as batch %d: %s",
        checkpoint_batch, first, stamp, stamp, {r.fqn: int(r.ids.numel()) for r in records},
    )
    return {r.fqn: int(r.ids.numel()) for r in records}
