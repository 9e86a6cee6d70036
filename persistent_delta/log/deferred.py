"""Deferred rows of capped publishes: what a publish left for the next one, stored durably.

Owns: the stored form of a publish consumer's *deferred* rows -- the rows a capped
``tracker.publish(consumer, max_rows=..., max_bytes=...)`` did not carry (see
:mod:`persistent_delta.trainer.caps`) -- and the count a snapshots poll reports.

A publish that defers rows writes them, in its own write transaction (the one that moves its
consumer and writes its snapshot records), into the meta value ``publish_deferred``
(:data:`~persistent_delta.log.schema.META_DEFERRED`: consumer -> per table fqn, the shard-local
ids in the order they are due, int64 little-endian bytes, and a sequence number that every
such write bumps). A crash therefore keeps either the publish and its deferred rows, or neither
(the consumer then reads the same rows again). The deferred rows live outside the lookups
channel, so retention and ``delete_on_read`` never delete them. ``publish_deferred_rows``
(:data:`~persistent_delta.log.schema.META_DEFERRED_ROWS`: consumer -> rows) lets a reader count
them without reading the ids.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional

import torch

from persistent_delta.errors import CorruptRecordError
from persistent_delta.log.deltalog import ReadTxn, WriteTxn
from persistent_delta.log.schema import META_DEFERRED, META_DEFERRED_ROWS

__all__ = ["Deferred", "drop_deferred", "deferred_by_consumer", "deferred_rows", "read_deferred", "write_deferred"]


@dataclass
class Deferred:
    """One publish consumer's deferred rows.

    Attributes:
        seq: bumped by every write (a publish that captured another ``seq`` is stale).
        ids: table fqn -> shard-local ids (int64), in the order they are due; a table with
            none is absent.
    """

    seq: int = 0
    ids: Dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        """Deferred rows over all tables."""
        return int(sum(int(t.numel()) for t in self.ids.values()))

    def per_table(self) -> Dict[str, int]:
        """fqn -> deferred rows (tables with none absent)."""
        return {fqn: int(t.numel()) for fqn, t in self.ids.items() if t.numel()}


def _stored(r: ReadTxn) -> Dict[str, object]:
    raw = r.meta(META_DEFERRED)
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise CorruptRecordError(f"{r.path}: meta {META_DEFERRED!r} is not a map of consumers")
    return raw


def read_deferred(r: ReadTxn, name: str, rows_of: Optional[Mapping[str, int]] = None) -> Deferred:
    """``name``'s deferred rows (none stored: an empty :class:`Deferred` with ``seq`` 0).

    Args:
        r: a transaction of the log.
        name: the publish consumer (a lookups consumer's name).
        rows_of: fqn -> rows of this rank's shard of the table, to check the stored ids against
            (a table not in it is refused).

    Raises:
        CorruptRecordError: the stored value is not a deferred record, or holds an id outside
            its table's rows or an unknown table (nothing is gathered by such ids).
    """
    what = f"deferred rows of publish consumer {name!r} in {r.path}"
    raw = _stored(r).get(name)
    if raw is None:
        return Deferred()
    if not isinstance(raw, dict) or not isinstance(raw.get("seq"), int) or not isinstance(raw.get("ids"), dict):
        raise CorruptRecordError(f"{what}: not a deferred record")
    out = Deferred(seq=int(raw["seq"]))
    for fqn, blob in raw["ids"].items():
        if not isinstance(fqn, str) or not isinstance(blob, bytes) or len(blob) % 8:
            raise CorruptRecordError(f"{what}: table {fqn!r} holds no whole int64 ids")
        if not blob:
            continue
        ids = torch.frombuffer(bytearray(blob), dtype=torch.int64)
        if sys.byteorder != "little":  # pragma: no cover - stored little-endian
            ids = ids.byteswap()  # type: ignore[attr-defined]
        if rows_of is not None:
            limit = rows_of.get(fqn)
            if limit is None:
                raise CorruptRecordError(f"{what}: unknown table {fqn!r}")
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= limit:
                raise CorruptRecordError(f"{what}: table {fqn!r} holds id {lo if lo < 0 else hi} outside [0, {limit})")
        out.ids[fqn] = ids
    return out


def write_deferred(w: WriteTxn, name: str, ids: Mapping[str, torch.Tensor], seq: int) -> None:
    """Store ``ids`` (fqn -> ids in the order due) as ``name``'s deferred rows with sequence
    ``seq``, and their count."""
    kept = {fqn: t for fqn, t in ids.items() if t.numel()}
    stored = dict(_stored(w))
    counts = deferred_by_consumer(w)
    blobs = {fqn: t.to(torch.int64).contiguous().numpy().astype("<i8", copy=False).tobytes() for fqn, t in kept.items()}
    stored[name] = {"seq": seq, "ids": blobs}
    if kept:
        counts[name] = int(sum(int(t.numel()) for t in kept.values()))
    else:
        counts.pop(name, None)
    w.set_meta(META_DEFERRED, stored)
    w.set_meta(META_DEFERRED_ROWS, counts)


def drop_deferred(w: WriteTxn, name: str) -> None:
    """Forget ``name``'s deferred rows: the consumer was removed."""
    stored = dict(_stored(w))
    if name in stored:
        del stored[name]
        w.set_meta(META_DEFERRED, stored)
    counts = deferred_by_consumer(w)
    if counts.pop(name, None) is not None:
        w.set_meta(META_DEFERRED_ROWS, counts)


def deferred_by_consumer(r: ReadTxn) -> Dict[str, int]:
    """Publish consumer -> rows its publishes deferred and none has carried yet (consumers with
    none absent).

    Raises:
        CorruptRecordError: the stored counts are not a map of counts.
    """
    counts = r.meta(META_DEFERRED_ROWS)
    if counts is None:
        return {}
    if not isinstance(counts, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for k, v in counts.items()):
        raise CorruptRecordError(f"{r.path}: meta {META_DEFERRED_ROWS!r} is not a map of row counts")
    return {str(k): int(v) for k, v in counts.items() if v}


def deferred_rows(r: ReadTxn) -> int:
    """Rows that publishes of this log deferred and no publish has carried yet (all publish
    consumers); 0 when no publish was capped.

    Raises:
        CorruptRecordError: the stored counts are not a map of counts.
    """
    return int(sum(deferred_by_consumer(r).values()))
