"""Writing a rank's shard files (the format is :mod:`persistent_delta.log.shard_files`').

Owns: :func:`save_local_shards`, the trainer side of the shard files a replica starts from.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Protocol

import torch
from safetensors.torch import save as safetensors_save

from persistent_delta.log.layout import PathLike, atomic_write_bytes
from persistent_delta.log.shard_files import SHARD_FILES_FORMAT, ZCH_RAW, ZCH_SLOT
from persistent_delta.trainer.sharding import LocalTable


class ShardSource(Protocol):
    """What :func:`save_local_shards` reads: a tracker (``PersistentDeltaTracker`` fits)."""

    rank: int
    curr_batch_idx: int

    @property
    def local_tables(self) -> Dict[str, LocalTable]: ...


def save_local_shards(tracker: ShardSource, shard_dir: PathLike) -> str:
    """Write this rank's shard of every tracked table to ``<shard_dir>/rank-<r>.safetensors``.

    Call it on every rank (the training thread, between steps) with the same directory.
    The file records the batch it was taken at and the stamp of the next publish
    (``tracker.next_stamp``): a replica starting from these files
    (:func:`persistent_delta.serve.apply.load_base`) must read the snapshots from that stamp or
    earlier, and its first poll is checked for it (:mod:`persistent_delta.read.base`). It also
    records the identity of the rank's log (``log_id``, ``log_stamp``:
    :class:`~persistent_delta.log.schema.LogIdentity`; :func:`~persistent_delta.log.shard_files.shard_identities`):
    files of a run before a start afresh say so.

    Args:
        tracker: the rank's tracker (its ``local_tables`` and ``rank`` are used).
        shard_dir: the shard-files directory (created if missing).

    Returns:
        The path written.
    """
    tensors: Dict[str, torch.Tensor] = {}
    shards: Dict[str, Dict[str, object]] = {}
    for fqn, t in sorted(tracker.local_tables.items()):
        tensors[fqn] = t.weights().detach().cpu().contiguous().clone()
        shards[fqn] = {
            "table_name": t.table_name, "sharding_type": t.sharding_type,
            "row_offset": t.row_offset, "col_offset": t.col_offset, "local_rows": t.local_rows,
            "local_cols": t.local_cols, "global_rows": t.global_rows, "global_cols": t.global_cols,
        }
    zch = getattr(tracker, "zch", None)  # managed-collision tables: this rank's raw id -> slot map too
    for fqn, (raw, slots) in (zch.current_maps() if zch is not None else {}).items():
        tensors[ZCH_RAW + fqn], tensors[ZCH_SLOT + fqn] = raw.contiguous(), slots.contiguous()
    meta = {"format": SHARD_FILES_FORMAT, "rank": str(tracker.rank), "shards": json.dumps(shards),
            "batch_idx": str(int(tracker.curr_batch_idx))}
    next_stamp = getattr(tracker, "next_stamp", None)  # a tracker that publishes: its next publish's stamp
    if next_stamp is not None:
        meta["next_stamp"] = str(int(next_stamp))
    log = getattr(tracker, "log", None)  # a tracker: the identity of the rank's log the shards belong to
    if log is not None:
        ident = log.read(lambda r: r.identity())
        meta["log_id"], meta["log_stamp"] = ident.log_id, str(ident.stamp)
    path = os.path.join(os.fspath(shard_dir), f"rank-{tracker.rank}.safetensors")
    atomic_write_bytes(path, safetensors_save(tensors, metadata=meta))
    return path
