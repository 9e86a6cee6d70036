"""What a remote consumer's poll delivers of the ranges it buffered.

Owns: which buffered ranges a poll takes per rank (:func:`take_ranges`: up to the end every
rank of the job has shipped, by :func:`persistent_delta.log.position_rules.poll_stops`, cut at
``max_batches`` and at the byte budget by :func:`persistent_delta.read.polling.byte_cut`; a
range is never split, and ranks at one position stop at one range end) and how they become a
:class:`~persistent_delta.read.results.RankDelta` (:func:`deliver`: merged per table by the
channel's update mode -- what a local consumer reading the same batches gets -- with a
managed-collision table's ``zch`` from the side records shipped with each range, by
:func:`persistent_delta.log.zch_records.side_delta`, the local reader's rule).
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Set

import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta.fleet.fetcher import BufferedRange, RankFetch
from persistent_delta.fleet.positions import RankPosition
from persistent_delta.fleet.wire import RankTables
from persistent_delta.log import position_rules
from persistent_delta.log.records import empty_rows
from persistent_delta.log.rows import compute_unique_rows
from persistent_delta.log.schema import LOOKUPS, ShardInfo, TableEntry
from persistent_delta.log.zch_records import is_managed, side_delta
from persistent_delta.read.polling import byte_cut, clip_stops
from persistent_delta.read.results import RankDelta, TableDelta, table_delta


def take_ranges(fetches: Mapping[int, RankFetch], positions: Mapping[int, RankPosition], expected: Optional[Set[int]],
                max_batches: Optional[int], max_bytes: Optional[int]) -> Dict[int, List[BufferedRange]]:
    """rank -> the buffered ranges a poll delivers (taken off the rank's buffer; see the
    module docs). Every rank of ``fetches`` is in the result."""
    known = {r: f for r, f in fetches.items() if positions[r].pos is not None}
    pos = {r: int(positions[r].pos) for r in known}  # type: ignore[arg-type]
    ends = {r: (f.ranges[-1].marker.end if f.ranges else pos[r]) for r, f in known.items()}
    hard = position_rules.poll_stops(pos, ends, expected, None)
    if max_bytes is not None:
        pieces: Dict[int, int] = {}  # range end -> its rows' bytes, summed over ranks
        for rank, f in known.items():
            for r in f.ranges:
                if r.marker.end <= hard[rank]:
                    pieces[r.marker.end] = pieces.get(r.marker.end, 0) + r.nbytes
        hard = clip_stops(pos, hard, byte_cut(pieces, max_bytes, max(hard.values(), default=0)))
    soft = {r: min(s, hard[r]) for r, s in position_rules.poll_stops(pos, ends, expected, max_batches).items()}
    common = common_stop(known, pos, hard, soft, expected)
    out: Dict[int, List[BufferedRange]] = {}
    for rank, f in sorted(fetches.items()):
        taken: List[BufferedRange] = []
        if rank in known:
            while f.ranges and f.ranges[0].marker.end <= hard[rank] and (
                    common is None or f.ranges[0].marker.end <= common) and (
                    common is not None or not taken or f.ranges[0].marker.end <= soft[rank]):
                taken.append(f.ranges.popleft())
        out[rank] = taken
    return out


def common_stop(known: Mapping[int, RankFetch], positions: Mapping[int, int], hard: Mapping[int, int],
                soft: Mapping[int, int], expected: Optional[Set[int]]) -> Optional[int]:
    """Where every rank stops when they all sit at the same position: the largest range end
    that every rank has buffered (within the poll's stops), so that each rank reads the same
    range (a complete poll: every publish's column halves and row shards together). Shippers
    cut ranges at the same multiples, so the ranks' range ends meet there at the latest.
    None when the positions differ (a rank was seeked alone) or the job is not known."""
    if expected is None or set(known) != expected or len(set(positions.values())) != 1:
        return None
    ends = None
    for rank, f in known.items():
        mine = {r.marker.end for r in f.ranges if r.marker.end <= hard[rank]}
        ends = mine if ends is None else ends & mine
    if not ends:
        return next(iter(positions.values()))  # nothing common yet: deliver nothing
    limit = min(soft.values())
    within = [e for e in ends if e <= limit]
    return max(within) if within else min(ends)


def deliver(f: RankFetch, p: RankPosition, taken: Sequence[BufferedRange], meta: Optional[RankTables], channel: str,
            fmt: str, tables: Optional[Sequence[str]], path: str, where: str) -> RankDelta:
    """Rank ``f``'s delta of the ranges ``taken`` (every table of the rank, or of ``tables``;
    empty ones too), and its position moved past them.

    Args:
        f: the rank's fetch state (its buffered bytes go down).
        p: its position (moved to the last range's end).
        taken: the ranges, in order.
        meta: the rank's table metadata (None: an empty delta, nothing taken off).
        channel: the channel.
        fmt: the row format read.
        tables: only these fqns (None: all).
        path: what the delta names as its source.
        where: the rank, for messages.
    """
    pos = p.pos if p.pos is not None else 0
    start = min([pos] + [r.marker.start for r in taken])
    end = taken[-1].marker.end if taken else pos
    rd = RankDelta(rank=f.rank, path=path, start_idx=start, end_idx=end)
    if taken and taken[0].marker.start == start and taken[0].marker.info.get("covers_from") is not None:
        rd.covers_from = int(taken[0].marker.info["covers_from"])  # no publish in [covers_from, start), as shipped
    for r in taken:
        for stamp, t in r.marker.info.get("publishes", []):
            rd.publishes[int(stamp)] = min(float(t), rd.publishes.get(int(stamp), float(t)))
        rd.passed_over += int(r.marker.info.get("passed_over", 0))
        if r.marker.info.get("deferred") is not None:  # the newest range's count (as its shipper read the log)
            rd.deferred = p.deferred = int(r.marker.info["deferred"])
    if rd.deferred is None:  # nothing new: still what the last range delivered said
        rd.deferred = p.deferred
    if meta is None:
        return rd
    mode = UpdateMode(meta.modes.get(channel, "none"))
    for fqn, entry_bytes in sorted(meta.entries.items()):
        if tables is None or fqn in tables:
            rd.tables[fqn] = _table(fqn, TableEntry.from_bytes(fqn, entry_bytes), taken, mode, f.rank, start, end,
                                    channel, fmt, where)
    for r in taken:
        f.buffered -= r.nbytes
    if taken:
        p.pos = end
        p.resume_seq = taken[-1].marker.seq + 1
    return rd


def _table(fqn: str, entry: TableEntry, taken: Sequence[BufferedRange], mode: UpdateMode, rank: int, start: int,
           end: int, channel: str, fmt: str, where: str) -> TableDelta:
    with_rows = [r for r in taken if fqn in r.tables]
    parts = [r.tables[fqn] for r in with_rows]
    stamps: Optional[torch.Tensor] = None
    if parts:
        states = [p.states for p in parts]
        ids = [p.ids for p in parts]
        rows = compute_unique_rows(ids, None if any(s is None for s in states) else states, mode)  # type: ignore[arg-type]
        raw = [r.stamps.get(fqn) for r in with_rows]
        if all(s is not None for s in raw):  # a replicated table: per row, its publish (newest wins)
            per = [s.view(-1, 1) for s in raw if s is not None]
            got = compute_unique_rows(ids, per, UpdateMode.LAST).states
            stamps = None if got is None else got.view(-1)
    else:
        rows = empty_rows(entry, mode, channel, fmt)
    shard = ShardInfo.from_entry(entry)
    zch = None
    # the same rule as a local read (zch_records); snapshots: the publishes' slot reassignments
    if is_managed(entry) and (channel == LOOKUPS or any(fqn in r.side for r in taken)):
        zch = side_delta(fqn, start, end, [rec for r in taken for rec in r.side.get(fqn, [])],
                         shard.row_offset if shard is not None else 0, f"{where} {fqn!r}")
    return table_delta(fqn, rank, start, end, rows, shard, stamps, zch, fmt)


__all__ = ["common_stop", "deliver", "take_ranges"]
