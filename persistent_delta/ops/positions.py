"""What every consumer of a local log root has read and what it still has to read.

Owns: the describe computation (per rank and consumer: offset, log start/end, lag in batches,
pending rows and bytes, seconds behind, last commit, position status and health) that
``persistent-delta offsets``, the exporter's metrics, ``top`` and the report all show.

Anchor: Kafka's ``kafka-consumer-groups --describe`` (CURRENT-OFFSET, LOG-END-OFFSET, LAG).
Bounds, statuses and pending counts come from :mod:`persistent_delta.log.position_rules`
(pending rows are counted from the same read start a consumer's poll would use); the health
(OK, LAGGING, STALLED, EXPIRED) from :mod:`persistent_delta.ops.health`. Every log is opened
read-only; nothing is ever created.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from persistent_delta.log import codec, position_rules
from persistent_delta.log.deltalog import DeltaLog, ReadTxn
from persistent_delta.log.layout import PathLike, rank_paths
from persistent_delta.log.records import pending_stats, publish_times
from persistent_delta.log.schema import LOOKUPS, SNAPSHOTS, Delivery, ShardInfo
from persistent_delta.log.zch_records import ZCH_META
from persistent_delta.ops.health import Health, health


# ------------------------------------------------------------------------------- describe


@dataclass
class ConsumerOffsets:
    """One consumer on one rank.

    ``lag`` = ``max(0, log_end - offset)`` batches; ``pending_rows`` / ``pending_bytes`` count
    the stored records a poll at ``offset`` would read, ``[read_start, log_end)`` (ids as
    stored, before de-duplication; value bytes). ``log_start``/``log_end`` are those of the
    consumer's channel. ``lag_s`` (snapshots consumers): seconds from the oldest unread
    publish's ``publish()`` call to now, 0.0 when nothing is unread, None when the unread
    records carry no time (written before times were stored) or for lookups. ``status`` is :func:`persistent_delta.log.position_rules.position_status`:
    ``ok``, ``read the open batch`` (a trainer consumer that read the batch being recorded:
    legal, one past the end), ``below log start``, ``past log end`` or ``expired``.
    ``health``: :func:`persistent_delta.ops.health.health` over its last commits: ``ok``,
    ``lagging``, ``stalled`` or ``expired``.
    """

    name: str
    channel: str
    offset: int
    log_start: int
    log_end: int
    lag: int
    pending_records: int
    pending_rows: int
    pending_bytes: int
    commit_time: Optional[float]
    registered_by: str
    status: str
    delivery: str = Delivery.IN_TRANSACTION.value
    lag_s: Optional[float] = None
    health: str = Health.OK.value


@dataclass
class TableStats:
    """Records stored for one table on one rank (``--tables``)."""

    fqn: str
    table_id: int
    records: int
    rows: int
    bytes: int
    first_batch: Optional[int]
    last_batch_idx: int
    snapshot_records: int
    snapshot_bytes: int
    sharding_type: str
    row_offset: int
    col_offset: int
    managed_collision: str = ""  # "mch" / "hash_zch" for a managed-collision table
    zch_records: int = 0  # its side records: raw ids and slot reassignments (persistent_delta.log.zch_records)
    zch_bytes: int = 0


@dataclass
class RankOffsets:
    """Everything ``offsets`` shows for one rank."""

    rank: int
    path: str
    log_start: int
    log_end: int
    snapshot_end: int
    consumers: List[ConsumerOffsets] = field(default_factory=list)
    tables: Optional[List[TableStats]] = None
    snapshot_start: int = 0
    # the newest publish stamp of other ranks this rank completed the batch of without publishing
    # in it (position_rules.snapshots_behind); None: not behind
    snapshots_behind: Optional[int] = None


def _table_stats(r: ReadTxn) -> List[TableStats]:
    out = []
    for fqn, e in sorted(r.tables().items()):
        recs = rows = nbytes = 0
        first: Optional[int] = None
        for rec in r.iter_records(e.table_id, 0, None, verify=False):
            first = rec.batch_idx if first is None else first
            recs, rows, nbytes = recs + 1, rows + int(rec.ids.numel()), nbytes + rec.nbytes
        snaps = list(r.iter_record_keys(e.table_id, 0, None, channel=SNAPSHOTS))
        side = list(r.iter_record_keys(codec.side_table_id(e.table_id), 0, None))
        shard = ShardInfo.from_entry(e) or ShardInfo()
        out.append(TableStats(
            fqn=fqn, table_id=e.table_id, records=recs, rows=rows, bytes=nbytes, first_batch=first,
            last_batch_idx=e.last_batch_idx, snapshot_records=len(snaps), snapshot_bytes=sum(n for _, _, n in snaps),
            sharding_type=shard.sharding_type, row_offset=shard.row_offset, col_offset=shard.col_offset,
            managed_collision=str(e.meta.get("shard", {}).get(ZCH_META) or "") if isinstance(e.meta.get("shard"), dict)
            else "", zch_records=len(side), zch_bytes=sum(n for _, _, n in side),
        ))
    return out


def _lag_s(r: ReadTxn, channel: str, begin: int, end: int, now: float) -> Optional[float]:
    if channel != SNAPSHOTS:
        return None
    if end <= begin:
        return 0.0
    times = publish_times(r, begin, end)
    return max(0.0, now - min(times.values())) if times else None


def _describe_rank(r: ReadTxn, rank: int, path: str, tables: bool, stall_after_s: Optional[float],
                   job_behind: bool = False) -> RankOffsets:
    now = time.time()
    start, end = position_rules.bounds(r, LOOKUPS)
    snap_start, snap_end = position_rules.bounds(r, SNAPSHOTS)
    out = RankOffsets(rank=rank, path=path, log_start=start, log_end=end, snapshot_end=snap_end,
                      snapshot_start=snap_start)
    for name, entry in sorted(r.consumers().items()):
        start, end = position_rules.bounds(r, entry.channel)
        begin = position_rules.read_start(r, entry.offset, entry.channel)
        n, rows, nbytes = pending_stats(r, entry.channel, begin, end)
        status = position_rules.position_status(entry, start, end, position_rules.served_from(r, entry.channel))
        gone = status in (position_rules.EXPIRED, position_rules.BELOW_START)
        out.consumers.append(ConsumerOffsets(
            name=name, channel=entry.channel, offset=entry.offset, log_start=start, log_end=end,
            lag=max(0, end - entry.offset), pending_records=n, pending_rows=rows, pending_bytes=nbytes,
            commit_time=entry.commit_time or None, registered_by=entry.registered_by,
            status=status,
            delivery=entry.delivery.value,
            lag_s=_lag_s(r, entry.channel, max(begin, entry.offset), end, now),
            health=health(entry.history, entry.offset, end, now, entry.commit_time, gone, stall_after_s,
                          job_behind and entry.channel == SNAPSHOTS).value,
        ))
    if tables:
        out.tables = _table_stats(r)
    return out


def describe(root: PathLike, tables: bool = False, stall_after_s: Optional[float] = None,
             empty_grace_s: float = 0.0) -> List[RankOffsets]:
    """Consumers of every rank: offset, log start/end, lag, pending rows and bytes, last commit;
    and the ranks behind on the snapshots channel (:attr:`RankOffsets.snapshots_behind`; their
    snapshots consumers' health is ``behind``).

    Opens each log read-only; never creates anything.

    Args:
        root: the log root.
        tables: also per-table record counts and sizes.
        stall_after_s: the health rule's least silence before ``stalled`` (default:
            :func:`persistent_delta.config.stall_after_s`).
        empty_grace_s: see :func:`persistent_delta.log.layout.rank_paths` (default 0: a rank
            whose data file is empty beside other ranks' logs is damage at once).

    Raises:
        NotALogError: ``root`` holds no log.
        DamagedLogError: a rank's data file is empty (0 bytes) while other ranks hold logs.
    """
    paths = rank_paths(root, empty_grace_s)
    ends: Dict[int, Tuple[int, int]] = {}
    for rank, path in paths.items():  # every rank's ends first: the rule is over the job's ranks
        with DeltaLog(path, readonly=True) as log:
            ends[rank] = log.read(lambda r: (position_rules.bounds(r, SNAPSHOTS)[1], position_rules.batches_ended(r)))
    behind = position_rules.snapshots_behind(ends)
    out = []
    for rank, path in paths.items():
        with DeltaLog(path, readonly=True) as log:
            out.append(log.read(lambda r: _describe_rank(r, rank, path, tables, stall_after_s, bool(behind))))
        out[-1].snapshots_behind = behind.get(rank)
    return out


__all__ = ["ConsumerOffsets", "RankOffsets", "TableStats", "describe"]
