"""The fetch step of a poll: reading a range of every rank's log into result types.

Owns: the read planning across ranks (what kafka-python calls the Fetcher). Per rank, inside
its read transaction, the unique rows of each table over the half-open range ``[read_start,
stop)`` are decided (:func:`plan_range`: a :class:`RankPlan`), then every rank's rows are
copied once into one buffer laid out the way the merge joins them (:func:`finish_ranks`), and
:func:`fetch_ranks` does both for one poll with every rank's transaction open at once. It also
sizes the batches a poll may read (:func:`stored_bytes`), for the byte cut of
:mod:`persistent_delta.read.polling`. Which range a poll reads (positions, stops) is the
consumer's and :mod:`persistent_delta.log.position_rules`'; the result types are
:mod:`persistent_delta.read.results`'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
from torchrec.distributed.model_tracker.types import UniqueRows

from persistent_delta.log import codec, position_rules
from persistent_delta.log.deltalog import DeltaLog, ReadTxn, read_all
from persistent_delta.log.deferred import deferred_rows
from persistent_delta.log.records import TablePlan, batch_bytes, last_stamps, plan_unique, publish_times
from persistent_delta.log.rows import IdMemo
from persistent_delta.log.schema import LOOKUPS, SNAPSHOTS, LogIdentity, ShardInfo
from persistent_delta.log.zch_records import ZchDelta, read_side
from persistent_delta.read.results import RankDelta, join_int8, table_delta, tiles_the_row


class PlannedTable(NamedTuple):
    """One table of a :class:`RankPlan`: its rows decided (:class:`~persistent_delta.log.records.
    TablePlan`) and what its :class:`~persistent_delta.read.results.TableDelta` needs besides."""

    plan: TablePlan
    shard: Optional[ShardInfo]
    stamps: Optional[torch.Tensor]  # see TableDelta
    side: Optional[ZchDelta]


@dataclass
class RankPlan:
    """One rank's read of a range, planned inside its read transaction (:func:`plan_range`):
    per table, the rows decided and not yet copied out of the map, with what the table's
    :class:`~persistent_delta.read.results.TableDelta` needs besides (shard, stamps, managed-collision side records)."""

    rank: int
    path: str
    start_idx: int
    end_idx: int
    tables: Dict[str, PlannedTable]
    publishes: Dict[int, float] = field(default_factory=dict)
    format: str = codec.NATIVE  # the row format of ``tables``
    passed_over: int = 0  # records of other row formats passed over
    formats: Dict[str, Dict[str, PlannedTable]] = field(default_factory=dict)  # a reader of every format: the others
    deferred: Optional[int] = None
    covers_from: Optional[int] = None  # snapshots: see RankDelta.covers_from
    log: Optional[LogIdentity] = None  # snapshots: see RankDelta.log

    def finish(self, rows: Optional[Dict[str, UniqueRows]] = None) -> RankDelta:
        """The :class:`~persistent_delta.read.results.RankDelta`: the tables' rows copied out of the map (inside the
        transaction the plan was made in), or taken from ``rows`` where it has them."""
        out = RankDelta(rank=self.rank, path=self.path, start_idx=self.start_idx, end_idx=self.end_idx,
                        publishes=self.publishes, passed_over=self.passed_over, deferred=self.deferred,
                        covers_from=self.covers_from, log=self.log)
        for fqn, (tp, shard, stamps, side) in self.tables.items():
            u = rows[fqn] if rows is not None and fqn in rows else tp.finish()
            out.tables[fqn] = table_delta(fqn, self.rank, self.start_idx, self.end_idx, u, shard, stamps, side,
                                          self.format)
        for f, planned in self.formats.items():
            out.formats[f] = {fqn: table_delta(fqn, self.rank, self.start_idx, self.end_idx, tp.finish(), shard, stamps,
                                               None, f) for fqn, (tp, shard, stamps, _) in planned.items()}
        return out


def plan_range(
    r: ReadTxn,
    rank: int,
    path: str,
    start_idx: int,
    end_idx: int,
    channel: str = LOOKUPS,
    tables: Optional[Sequence[str]] = None,
    memo: Optional[IdMemo] = None,
    fmt: str = codec.NATIVE,
) -> RankPlan:
    """:func:`read_range` up to the copy of the rows (finish the plan inside ``r``). ``fmt``:
    the reader's row format (snapshots); :data:`~persistent_delta.log.codec.ANY_FORMAT` reads
    native records into ``tables`` and every other format's into ``formats``.

    Raises:
        OffsetOutOfRangeError: ``start_idx`` can no longer be served in ``r`` (retention passed
            it after the caller checked it: :func:`~persistent_delta.log.position_rules.check_served`).
    """
    position_rules.check_served(r, start_idx, channel)
    mode = position_rules.update_mode(r, channel)
    if end_idx > start_idx:  # reach back to a window start only when there is something new to read
        start_idx = position_rules.read_start(r, start_idx, channel)
    end_idx = max(end_idx, start_idx)
    every = fmt == codec.ANY_FORMAT
    first = codec.NATIVE if every else fmt
    passed: Dict[str, int] = {}
    plans = plan_unique(r, mode, start_idx, end_idx, tables=tables, listed_only=False, channel=channel, memo=memo,
                        fmt=first, exact=every, passed=passed)
    entries = r.tables()
    out = RankPlan(rank=rank, path=path, start_idx=start_idx, end_idx=end_idx, tables={}, format=first)
    if channel == SNAPSHOTS:
        out.publishes = publish_times(r, start_idx, end_idx)
        out.deferred = deferred_rows(r)
        out.covers_from = position_rules.snapshots_covered_from(r, start_idx)
        out.log = r.identity()

    def planned(found: Dict[str, TablePlan], f: str) -> Dict[str, PlannedTable]:
        got: Dict[str, PlannedTable] = {}
        for fqn, tp in sorted(found.items()):
            shard = ShardInfo.from_entry(entries[fqn])
            stamps = None
            if channel == SNAPSHOTS and shard is not None and shard.replicated and tp.num_rows:
                stamps = last_stamps(r, fqn, start_idx, end_idx, fmt=f, exact=every)  # newest publish wins across ranks
            side = read_side(r, entries[fqn], start_idx, end_idx, shard.row_offset if shard else 0, channel) \
                if f == first else None  # snapshots: the slot reassignments publishes carried
            got[fqn] = PlannedTable(tp, shard, stamps, side)
        return got

    out.tables = planned(plans, first)
    if every:
        for f in sorted(passed):
            found = plan_unique(r, mode, start_idx, end_idx, tables=tables, listed_only=False, channel=channel, fmt=f,
                                exact=True)
            out.formats[f] = planned({fqn: tp for fqn, tp in found.items() if tp.num_rows}, f)
    else:
        out.passed_over = sum(passed.values())
    return out


def read_range(
    r: ReadTxn,
    rank: int,
    path: str,
    start_idx: int,
    end_idx: int,
    channel: str = LOOKUPS,
    tables: Optional[Sequence[str]] = None,
    memo: Optional[IdMemo] = None,
) -> RankDelta:
    """Per-table unique rows of one rank's log for a read at ``start_idx`` up to ``end_idx``,
    with global ids. The result reports the range actually read: it starts at
    :func:`~persistent_delta.log.position_rules.read_start` (the start of a filtered window the position
    lies inside). Results own their memory (safe to keep after the transaction). ``memo``:
    the poll's :class:`~persistent_delta.log.rows.IdMemo`, shared by its ranks."""
    return plan_range(r, rank, path, start_idx, end_idx, channel, tables, memo).finish()


# Regions of a poll's buffer start at multiples of this many bytes (a cache line; any dtype's
# alignment).
_ALIGN = 64


def finish_ranks(plans: Dict[int, RankPlan],
                 alloc: Optional[Callable[[int], torch.Tensor]] = None) -> Dict[int, RankDelta]:
    """Every rank's :class:`~persistent_delta.read.results.RankDelta` of one poll (inside every
    rank's transaction), the rows of all ranks and tables copied once, into one buffer laid out
    the way :func:`~persistent_delta.read.results.merge_table` joins them: per table, row-wise
    shards' rows one after another in id order, column-wise shards' rows side by side as full
    rows (when every shard holds the same ids and the slices tile the row).
    :meth:`~persistent_delta.read.results.DeltaPoll.merged` is then views of the buffer, not
    copies; anything else is laid out one rank after another and merged by copy.

    ``alloc(nbytes)``: where the buffer comes from (a uint8 tensor of ``nbytes``; default
    ``torch.empty``). A consumer passes :meth:`~persistent_delta.log.alloc.ResultBuffers.take`,
    which hands out again a buffer whose earlier poll the caller has released: faulting in
    fresh pages costs more than the copy itself (benchmarks/ has the figures).
    """
    regions: List[Tuple[int, int, List[Tuple[int, str, int, int]]]] = []  # (rows, row bytes, places)
    by_table: Dict[str, List[int]] = {}
    for rank in sorted(plans):
        for fqn, t in plans[rank].tables.items():
            if t.plan.num_rows and t.plan.row_bytes:
                by_table.setdefault(fqn, []).append(rank)
    for fqn, ranks in sorted(by_table.items()):
        parts = {k: plans[k].tables[fqn] for k in ranks}
        cols = _column_layout(list(parts.values()))
        if cols is not None:
            m, row_bytes, offsets = cols
            regions.append((m, row_bytes, [(k, fqn, 0, off) for k, off in zip(ranks, offsets)]))
            continue
        widths = {t.plan.row_bytes for t in parts.values()}
        if len(widths) != 1:
            for k, t in parts.items():  # rows of different widths (not one table's shards): one region each
                regions.append((t.plan.num_rows, t.plan.row_bytes, [(k, fqn, 0, 0)]))
            continue

        def first_gid(k: int) -> int:
            t = parts[k]
            assert t.plan.rows is not None
            return int(t.plan.rows.ids[0]) + (t.shard.row_offset if t.shard is not None else 0)

        placed, at = [], 0
        for k in sorted(ranks, key=lambda k: (first_gid(k), k)):
            placed.append((k, fqn, at, 0))
            at += parts[k].plan.num_rows
        regions.append((at, widths.pop(), placed))
    total = sum(-(-m * w // _ALIGN) * _ALIGN for m, w, _ in regions)
    buf = torch.empty(total, dtype=torch.uint8) if alloc is None else alloc(total)
    rows: Dict[int, Dict[str, UniqueRows]] = {k: {} for k in plans}
    at = 0
    for m, w, placed in regions:
        region = buf[at:at + m * w].view(m, w)
        at += -(-m * w // _ALIGN) * _ALIGN
        for k, fqn, row, col in placed:
            tp = plans[k].tables[fqn].plan
            rows[k][fqn] = tp.finish(region[row:row + tp.num_rows, col:col + tp.row_bytes])
    return {k: plans[k].finish(rows[k]) for k in plans}


def _column_layout(parts: List[PlannedTable]) -> Optional[Tuple[int, int, List[int]]]:
    """For column-wise shards that hold the same ids and whose 2-D state slices tile the full
    row (one shard per slice, one dtype): ``(rows, full row bytes, each shard's byte offset in
    the row)``; else None."""
    if len(parts) < 2:
        return None
    first = parts[0]
    if first.shard is None or first.plan.typed is None or first.plan.rows is None:
        return None
    dtype = first.plan.typed[0]
    slices = []
    for t in parts:
        typed, shard = t.plan.typed, t.shard
        if shard is None or typed is None or typed[0] != dtype or len(typed[1]) != 1 or t.plan.rows is None:
            return None
        if typed[1][0] != shard.local_cols or shard.row_offset != first.shard.row_offset:
            return None
        if t.plan.rows.ids is not first.plan.rows.ids and not torch.equal(t.plan.rows.ids, first.plan.rows.ids):
            return None
        slices.append((shard.col_offset, int(typed[1][0])))
    if not tiles_the_row(slices, first.shard.global_cols):
        return None
    itemsize = torch.empty((), dtype=dtype).element_size()
    return first.plan.num_rows, sum(w for _, w in slices) * itemsize, [off * itemsize for off, _ in slices]


def fetch_ranks(
    logs: Mapping[int, DeltaLog],
    positions: Mapping[int, int],
    stops: Mapping[int, int],
    channel: str = LOOKUPS,
    tables: Optional[Sequence[str]] = None,
    alloc: Optional[Callable[[int], torch.Tensor]] = None,
    fmt: str = codec.NATIVE,
) -> Dict[int, RankDelta]:
    """One poll's read: per rank, the unique rows of ``[read_start(positions[rank]),
    stops[rank])`` (half-open), every rank's read transaction open at once so that the rows of
    all ranks are copied out of the maps into one buffer (:func:`finish_ranks`).

    Args:
        logs: rank -> its open log.
        positions: rank -> the position to read from (the read may start earlier: see
            :func:`~persistent_delta.log.position_rules.read_start`).
        stops: rank -> the end of the read (exclusive).
        channel: ``"lookups"`` or ``"snapshots"``.
        tables: only these table fqns (default: all).
        alloc: where the poll's buffer comes from (see :func:`finish_ranks`).
        fmt: the reader's row format (:func:`plan_range`); an int8 read's column-wise tables
            come back as whole quantized rows (:func:`~persistent_delta.read.results.join_int8`).

    Returns:
        rank -> its :class:`~persistent_delta.read.results.RankDelta`, reporting the range
        actually read.
    """
    ordered = sorted(logs.items())

    def read(txns: List[ReadTxn]) -> Dict[int, RankDelta]:
        memo = IdMemo()  # column-wise shards: one table's ids are the same on every rank
        plans = {rank: plan_range(r, rank, log.path, positions[rank], stops[rank], channel, tables, memo, fmt)
                 for (rank, log), r in zip(ordered, txns)}
        return finish_ranks(plans, alloc)

    out = read_all([log for _, log in ordered], read)
    return join_int8(out) if fmt == codec.INT8 else out


def stored_bytes(
    logs: Mapping[int, DeltaLog], positions: Mapping[int, int], stops: Mapping[int, int], channel: str = LOOKUPS,
) -> Dict[int, int]:
    """The pieces a local poll is cut at by :func:`persistent_delta.read.polling.byte_cut`:
    each batch with records in ``[positions[rank], stops[rank])`` (half-open), keyed by the
    batch's end (``batch_idx + 1``), with the value bytes stored under it summed over ranks
    (keys and value lengths only: nothing is decoded).

    Args:
        logs: rank -> its open log.
        positions: rank -> the first batch counted.
        stops: rank -> the end of the count (exclusive).
        channel: ``"lookups"`` or ``"snapshots"``.

    Returns:
        batch end -> bytes; batches without records are absent.
    """
    out: Dict[int, int] = {}
    for rank, log in logs.items():
        pos, stop = positions[rank], stops[rank]
        for b, n in log.read(lambda r: batch_bytes(r, channel, pos, stop)).items():
            out[b + 1] = out.get(b + 1, 0) + n
    return out
