"""Publish: the current values of the rows a consumer has not read yet, as snapshot records.

Owns: what a publish writes. ``tracker.publish(consumer)`` takes the rows changed since
``consumer`` last read (exactly what ``get_unique(consumer)`` would return, through the same
consume rule of :mod:`persistent_delta.delivery`), reads their *current* values from this
rank's shards, and writes them to the snapshots channel (``KIND_SNAPSHOT`` records) stamped
with the current batch index, all in one transaction. A serving process reads them with
``DeltaConsumer(root, name, channel="snapshots")`` and applies them (the newest stamp wins), so
it converges to the trainer's tables without sharing its memory. With ``delete_on_read``,
snapshot records are deleted once every snapshots consumer has committed past them.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta import codec, delivery
from persistent_delta.config import RetentionBound
from persistent_delta.log import WriteTxn
from persistent_delta.schema import META_SNAPSHOT_END, SNAPSHOTS
from persistent_delta.sharding import LocalTable


def write_snapshots(
    w: WriteTxn, tables: Dict[str, LocalTable], ids_per_table: Dict[str, torch.Tensor], stamp: int
) -> Dict[str, int]:
    """Write the current values of ``ids_per_table`` (shard-local ids) as snapshot records
    stamped ``stamp``; returns rows written per table."""
    written: Dict[str, int] = {}
    for fqn, ids in ids_per_table.items():
        entry = w.table(fqn)
        if entry is None or ids.numel() == 0 or fqn not in tables:
            continue
        values = tables[fqn].weights()[ids.long()]
        w.put_record(entry.table_id, stamp, codec.encode_record(ids, values, codec.KIND_SNAPSHOT), channel=SNAPSHOTS)
        written[fqn] = int(ids.numel())
    w.set_meta(META_SNAPSHOT_END, max(stamp + 1, int(w.meta(META_SNAPSHOT_END, 0))))
    return written


def publish(
    w: WriteTxn,
    name: str,
    end: int,
    stamp: int,
    mode: UpdateMode,
    tables: Dict[str, LocalTable],
    *,
    compact: bool,
    delete_on_read: bool,
    bound: Optional[RetentionBound] = None,
) -> Dict[str, int]:
    """One publish inside ``w``: consume ``name``'s rows up to ``end``, write their current
    values stamped ``stamp``, apply retention of both channels. Returns rows written per table."""
    rows = delivery.consume(w, name, end, mode, compact=compact, delete_on_read=delete_on_read, bound=bound)
    written = write_snapshots(w, tables, {f: r.ids for f, r in rows.items()}, stamp)
    if delete_on_read:
        delivery.apply_retention(w, SNAPSHOTS)
    return written
