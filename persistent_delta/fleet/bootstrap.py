"""A full base state from the stream, for a remote consumer that joins late or after its
position expired.

Owns: reading every rank's base from the job's ``base`` store
(:func:`persistent_delta.fleet.ship.upload_base` puts them there), checking each against the
rank's table metadata and newest log, assembling the full tables, and moving every rank's
position just past the base's publish (:func:`bootstrap`, behind
:meth:`~persistent_delta.fleet.remote.RemoteConsumer.bootstrap`).
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, Optional

import torch

from persistent_delta.errors import InvalidInputError, NotALogError, StreamDataError, TransportError
from persistent_delta.fleet import subjects, wire
from persistent_delta.fleet.auth import open_value
from persistent_delta.fleet.fetcher import Fetcher
from persistent_delta.log import codec
from persistent_delta.log.schema import LogIdentity, ShardInfo, TableEntry
from persistent_delta.read.base import BaseTables

logger = logging.getLogger(__name__)


def bootstrap(fetcher: Fetcher, progress: Optional[Callable[[int, int], None]]) -> BaseTables:
    """Every rank's base, as full tables, and each rank's position moved just past it (in
    memory). See :meth:`~persistent_delta.fleet.remote.RemoteConsumer.bootstrap` for the
    errors."""
    stamps: Dict[int, int] = {}
    full: Dict[str, torch.Tensor] = {}
    bases: Dict[int, Dict[str, torch.Tensor]] = {}
    logs: Dict[int, Optional[LogIdentity]] = {}
    job = fetcher.job
    try:
        fetcher.refresh_meta()  # the ranks' newest logs, as their shippers stored them
    except TransportError:
        pass
    ranks = sorted(fetcher.expected or fetcher.meta)
    for done, rank in enumerate(ranks):
        if progress is not None:
            progress(done, len(ranks))
        name = subjects.base_name(rank)
        buf = fetcher.retrying(lambda: fetcher.conn.object_get(job, name))
        if buf is None or rank not in fetcher.meta:
            raise NotALogError(f"job {job!r}: rank {rank} has no base (or no table metadata) on {fetcher.server}; "
                               "upload one with persistent_delta.fleet.ship.upload_base on every rank")
        body = open_value(fetcher.ring, job, subjects.BASE, name, buf)
        stamps[rank], bases[rank], logs[rank] = wire.decode_base(body, fetcher.where(rank))
        fetcher.newest(rank, logs[rank], f"the base (batch {stamps[rank]})", subject=name)
        if logs[rank] is None:
            logger.warning("%s: the base carries no log identity (uploaded without one): it cannot be checked "
                           "against the rank's newest log", fetcher.where(rank))
        check_base(fetcher, rank, stamps[rank], bases[rank])
    for rank, tables in bases.items():
        meta = fetcher.meta[rank]
        for fqn, values in tables.items():
            shard = ShardInfo.from_entry(TableEntry.from_bytes(fqn, meta.entries[fqn]))
            rows = shard.global_rows if shard is not None and shard.global_rows is not None else values.shape[0]
            cols = shard.global_cols if shard is not None and shard.global_cols is not None else values.shape[1]
            t = full.setdefault(fqn, torch.zeros(rows, cols, dtype=values.dtype))
            r0, c0 = (shard.row_offset, shard.col_offset) if shard is not None else (0, 0)
            if t.dtype != values.dtype or r0 + values.shape[0] > t.shape[0] or c0 + values.shape[1] > t.shape[1]:
                raise StreamDataError(f"{fetcher.where(rank)}: the base of {fqn!r} does not fit the full table "
                                      f"{tuple(t.shape)} {t.dtype} at ({r0}, {c0})")
            t[r0:r0 + values.shape[0], c0:c0 + values.shape[1]] = values
    if progress is not None:
        progress(len(ranks), len(ranks))
    if len(set(stamps.values())) > 1:
        raise InvalidInputError(f"job {job!r}: the ranks' bases were taken at different publishes "
                                f"{stamps}; upload them at the same step on every rank")
    for rank, stamp in stamps.items():
        f, p = fetcher.fetches[rank], fetcher.positions[rank]
        fetcher.clear(f, p)
        p.pos, f.seq, p.epoch, p.resume_seq = stamp + 1, 1, None, 1
        p.log = logs.get(rank) or fetcher.logs.get(rank)
    return BaseTables(full, positions={rank: stamp + 1 for rank, stamp in stamps.items()}, batches=stamps,
                      source=f"the base of job {job!r} (bootstrap)")


def check_base(fetcher: Fetcher, rank: int, stamp: int, tables: Dict[str, torch.Tensor]) -> None:
    """A rank's base against its table metadata: every table, 2-D floats, the shard's shape,
    the table's value dtype where known (the stamp's bounds are :func:`wire.decode_base`'s).

    Raises:
        StreamDataError: it does not match.
    """
    where = f"{fetcher.where(rank)}: base"
    entries = fetcher.meta[rank].entries
    if set(tables) != set(entries):
        raise StreamDataError(f"{where} holds tables {sorted(tables)[:20]}, the rank's metadata lists "
                              f"{sorted(entries)[:20]}")
    for fqn, values in tables.items():
        entry = TableEntry.from_bytes(fqn, entries[fqn])
        shard = ShardInfo.from_entry(entry)
        if values.dim() != 2 or not values.is_floating_point():
            raise StreamDataError(f"{where} of {fqn!r} is {values.dtype} of shape {tuple(values.shape)}, want "
                                  "2-D floats")
        want = (shard.local_rows if shard is not None else None, shard.local_cols if shard is not None else None)
        for got, w, what in ((values.shape[0], want[0], "rows"), (values.shape[1], want[1], "columns")):
            if w is not None and got != w:
                raise StreamDataError(f"{where} of {fqn!r} has {got} {what}, the rank's shard has {w}")
        dtype = entry.values_dtype
        if dtype is not None and codec.dtype_from_name(dtype) != values.dtype:
            raise StreamDataError(f"{where} of {fqn!r} is {values.dtype}, the table's values are {dtype}")


__all__ = ["bootstrap", "check_base"]
