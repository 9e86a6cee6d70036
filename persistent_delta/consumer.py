"""``DeltaConsumer``: read a trainer's delta log from another process, Kafka-consumer style.

Design note
-----------
A log root holds one log per rank (``<root>/rank-<r>``); each log keeps its own consumer
entries, so a consumer has one position per rank. ``poll`` reads, per rank, the records in
``[position, end)`` (half-open; ``end`` is the log end: batches below it are complete) in one
read transaction, merges them per table with the log's update mode (``LAST`` for snapshots),
maps shard-local ids to global row ids with the shard metadata the tracker stores, and moves
the in-memory position to ``end``. ``commit`` makes the positions durable (one write
transaction per rank, through a consumer-role handle that needs no writer lock, so it works
while the trainer runs). Nothing advances durably before ``commit``: a crash between ``poll``
and ``commit`` re-delivers (at-least-once).

A registered consumer holds back the trainer's ``delete_on_read`` retention exactly like a
trainer-side consumer, because the tracker deletes below the smallest offset of every consumer
of the channel found in the log. A position below the log start (data deleted while the
consumer was not registered, or after ``clear``) cannot be served: ``poll`` raises
:class:`OffsetOutOfRangeError` unless a reset policy was chosen.

Channels: ``"lookups"`` reads what batches looked up (``records`` DB, ids + tracked states),
``"snapshots"`` reads current row values written by ``tracker.publish`` (``snapshots`` DB,
merged with ``UpdateMode.LAST``: the newest value of each row wins). Snapshot consumers do not
hold back lookup retention.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torchrec.distributed.model_tracker.types import UniqueRows, UpdateMode

from persistent_delta.config import LogOptions
from persistent_delta.errors import (
    ConfigMismatchError,
    InvalidInputError,
    LogClosedError,
    NotALogError,
    OffsetOutOfRangeError,
    UnknownConsumerError,
)
from persistent_delta.log import RECORDS, SNAPSHOTS, DeltaLog, ReadTxn, TableEntry, WriteTxn, is_log
from persistent_delta.store import read_unique
from persistent_delta.tracker import LOOKUPS, META_SNAPSHOT_END, SNAPSHOTS_CHANNEL, check_consumer_name

logger = logging.getLogger(__name__)

CHANNELS = (LOOKUPS, SNAPSHOTS_CHANNEL)
RESET_POLICIES = ("earliest", "latest")
_RANK_DIR = re.compile(r"^rank-(\d+)$")
PathLike = Union[str, "os.PathLike[str]"]


# ------------------------------------------------------------------------ layout & metadata


def rank_paths(root: PathLike) -> Dict[int, str]:
    """The log directory of every rank under ``root``, by rank (ascending).

    A ``root`` that is itself a log (a plain ``LmdbDeltaStore``) is rank 0.

    Raises:
        NotALogError: ``root`` holds no log.
    """
    root = os.fspath(root)
    if is_log(root):
        return {0: root}
    if not os.path.isdir(root):
        raise NotALogError(f"{root}: no such directory; pass the log root (the directory holding rank-<r>/)")
    found = {}
    for name in os.listdir(root):
        m = _RANK_DIR.match(name)
        if m and is_log(os.path.join(root, name)):
            found[int(m.group(1))] = os.path.join(root, name)
    if not found:
        raise NotALogError(
            f"{root} holds no persistent_delta log (expected {root}/rank-<r>/data.mdb); check the path, "
            "or start the trainer first"
        )
    return dict(sorted(found.items()))


@dataclass(frozen=True)
class ShardInfo:
    """Where a rank's shard of a table sits in the full table (written by the tracker).

    Global row id = local id + ``row_offset``; the shard holds columns
    ``[col_offset, col_offset + local_cols)`` of those rows.
    """

    table_name: str = ""
    sharding_type: str = ""
    row_offset: int = 0
    col_offset: int = 0
    local_rows: Optional[int] = None
    local_cols: Optional[int] = None
    global_rows: Optional[int] = None
    global_cols: Optional[int] = None

    @staticmethod
    def from_entry(entry: TableEntry) -> Optional["ShardInfo"]:
        """The shard metadata of a table entry, or None for a log without it (a plain store)."""
        md = entry.meta.get("shard")
        if not isinstance(md, dict):
            return None

        def opt(key: str) -> Optional[int]:
            v = md.get(key)
            return None if v is None else int(v)

        return ShardInfo(
            table_name=str(md.get("table_name", "")),
            sharding_type=str(md.get("sharding_type", "")),
            row_offset=int(md.get("row_offset", 0)),
            col_offset=int(md.get("col_offset", 0)),
            local_rows=opt("local_rows"),
            local_cols=opt("local_cols"),
            global_rows=opt("global_rows"),
            global_cols=opt("global_cols"),
        )


def log_update_mode(r: ReadTxn, channel: str = LOOKUPS) -> UpdateMode:
    """The merge rule of a channel: the log's update mode for lookups, LAST for snapshots."""
    if channel == SNAPSHOTS_CHANNEL:
        return UpdateMode.LAST
    value = r.meta("update_mode")
    return UpdateMode(value) if value is not None else UpdateMode.NONE


def channel_bounds(r: ReadTxn, channel: str) -> Tuple[int, int]:
    """``(start, end)`` of a channel: positions in ``[start, end]`` can be served, and a poll
    reads ``[position, end)``. Lookups: the log start and end. Snapshots: the first stored
    snapshot stamp (``end`` when none is stored) and one past the newest stamp."""
    if channel == LOOKUPS:
        return r.log_start(), r.log_end()
    end = int(r.meta(META_SNAPSHOT_END, 0))
    firsts = [r.first_batch_idx(e.table_id, db=SNAPSHOTS) for e in r.tables().values()]
    present = [f for f in firsts if f is not None]
    return (min(present) if present else end), end


def _check_channel(channel: str) -> str:
    if channel not in CHANNELS:
        raise InvalidInputError(f"channel must be one of {CHANNELS}, got {channel!r}")
    return channel


def channel_db(channel: str) -> str:
    """The records DB a channel reads."""
    return RECORDS if channel == LOOKUPS else SNAPSHOTS


# ----------------------------------------------------------------------------- poll results


@dataclass
class TableDelta:
    """One rank's delta of one table over ``[start_idx, end_idx)`` (half-open).

    ``rows`` holds shard-local ids (ascending, unique) and the states per the update mode
    (snapshots: the current row values of the shard's columns); ``global_ids`` are the same rows
    as int64 global row ids.
    """

    fqn: str
    rank: int
    start_idx: int
    end_idx: int
    rows: UniqueRows
    global_ids: torch.Tensor
    shard: Optional[ShardInfo] = None

    @property
    def ids(self) -> torch.Tensor:
        """Shard-local ids (``rows.ids``)."""
        ids: torch.Tensor = self.rows.ids
        return ids

    @property
    def states(self) -> Optional[torch.Tensor]:
        """States (``rows.states``), None when the log tracks ids only."""
        states: Optional[torch.Tensor] = self.rows.states
        return states

    @property
    def col_offset(self) -> int:
        """First column of the full table that this shard's state columns hold."""
        return self.shard.col_offset if self.shard is not None else 0


@dataclass
class RankDelta:
    """What one poll read from one rank: ``[start_idx, end_idx)`` and the per-table deltas."""

    rank: int
    path: str
    start_idx: int
    end_idx: int
    tables: Dict[str, TableDelta] = field(default_factory=dict)


@dataclass
class MergedDelta:
    """One table's delta over every rank, in global row ids.

    Attributes:
        global_ids: ascending unique global row ids touched on any rank.
        states: rows aligned with ``global_ids``; for a column-split table, the column shards
            concatenated to full rows when every shard holds the same ids and full-width state
            slices (embeddings, snapshots); otherwise None (see ``column_parts``).
        column_parts: col_offset -> UniqueRows (global ids, that column slice's states).
        column_split: whether shards hold different column ranges.
    """

    fqn: str
    global_ids: torch.Tensor
    states: Optional[torch.Tensor]
    column_parts: Dict[int, UniqueRows]
    column_split: bool
    global_rows: Optional[int] = None
    global_cols: Optional[int] = None
    ranks: List[int] = field(default_factory=list)


def _cat_rows(parts: Sequence[UniqueRows]) -> UniqueRows:
    """Concatenate row sets of disjoint row ranges; duplicate ids (replicated tables) keep the
    first part's row. Ascending ids."""
    nonempty = [p for p in parts if p.ids.numel()]
    if not nonempty:
        return parts[0]
    ids = torch.cat([p.ids for p in nonempty])
    order = torch.argsort(ids, stable=True)
    ids = ids[order]
    keep = torch.ones(ids.numel(), dtype=torch.bool)
    keep[1:] = ids[1:] != ids[:-1]
    states = None
    if all(p.states is not None for p in nonempty):
        states = torch.cat([p.states for p in nonempty])[order][keep]  # type: ignore[misc]
    return UniqueRows(ids=ids[keep], states=states)


def merge_table(fqn: str, parts: Sequence[TableDelta]) -> MergedDelta:
    """Merge one table's per-rank deltas into global row ids (see :class:`MergedDelta`).

    Raises:
        InvalidInputError: ``parts`` is empty.
    """
    if not parts:
        raise InvalidInputError(f"{fqn}: nothing to merge")
    groups: Dict[int, List[TableDelta]] = {}
    for p in parts:
        groups.setdefault(p.col_offset, []).append(p)
    column_parts = {
        off: _cat_rows([UniqueRows(ids=p.global_ids, states=p.states) for p in ps]) for off, ps in sorted(groups.items())
    }
    shard = next((p.shard for p in parts if p.shard is not None), None)
    global_cols = shard.global_cols if shard is not None else None
    split = len(column_parts) > 1
    if not split:
        only = next(iter(column_parts.values()))
        ids, states = only.ids, only.states
    else:
        ids = torch.unique(torch.cat([c.ids for c in column_parts.values()]), sorted=True)
        widths = {off: ps[0].shard.local_cols if ps[0].shard is not None else None for off, ps in groups.items()}
        states = _assemble_columns(column_parts, widths, global_cols, ids)
    return MergedDelta(
        fqn=fqn,
        global_ids=ids,
        states=states,
        column_parts=column_parts,
        column_split=split,
        global_rows=shard.global_rows if shard is not None else None,
        global_cols=global_cols,
        ranks=sorted(p.rank for p in parts),
    )


def _assemble_columns(
    column_parts: Dict[int, UniqueRows], widths: Dict[int, Optional[int]], global_cols: Optional[int], ids: torch.Tensor
) -> Optional[torch.Tensor]:
    """Full rows from column slices, or None unless the slices tile ``[0, global_cols)`` and
    every slice holds exactly ``ids`` with 2-D states of its width."""
    pos = 0
    for off, part in column_parts.items():  # ascending col_offset
        width = widths.get(off)
        st = part.states
        if off != pos or width is None or st is None or st.dim() != 2 or st.shape[1] != width:
            return None
        if not torch.equal(part.ids, ids):
            return None
        pos += width
    if global_cols is None or pos != global_cols:
        return None
    return torch.cat([p.states for p in column_parts.values()], dim=1)  # type: ignore[misc]


@dataclass
class DeltaPoll:
    """The result of :meth:`DeltaConsumer.poll`: per rank, the range read and per-table deltas."""

    channel: str
    ranks: Dict[int, RankDelta]

    def tables(self) -> Dict[str, List[TableDelta]]:
        """fqn -> that table's per-rank deltas (rank order). Row-wise shards hold disjoint
        global ids; column-wise shards the same ids with different ``col_offset``."""
        out: Dict[str, List[TableDelta]] = {}
        for rank in sorted(self.ranks):
            for fqn, delta in self.ranks[rank].tables.items():
                out.setdefault(fqn, []).append(delta)
        return out

    def merged(self) -> Dict[str, MergedDelta]:
        """fqn -> the table's delta merged over ranks, in global row ids."""
        return {fqn: merge_table(fqn, parts) for fqn, parts in self.tables().items()}

    def ranges(self) -> Dict[int, Tuple[int, int]]:
        """rank -> ``(start_idx, end_idx)`` read (half-open)."""
        return {r: (d.start_idx, d.end_idx) for r, d in self.ranks.items()}

    @property
    def num_rows(self) -> int:
        """Rows delivered, summed over ranks and tables."""
        return sum(int(t.ids.numel()) for d in self.ranks.values() for t in d.tables.values())

    @property
    def empty(self) -> bool:
        """Whether no rank read any batch (the position did not move)."""
        return all(d.end_idx <= d.start_idx for d in self.ranks.values())

    def __iter__(self) -> Iterator[TableDelta]:
        for parts in self.tables().values():
            yield from parts


def read_range(
    r: ReadTxn,
    rank: int,
    path: str,
    start_idx: int,
    end_idx: int,
    channel: str = LOOKUPS,
    tables: Optional[Sequence[str]] = None,
) -> RankDelta:
    """Per-table unique rows of one rank's log over ``[start_idx, end_idx)`` (half-open), with
    global ids. Results own their memory (safe to keep after the transaction)."""
    mode = log_update_mode(r, channel)
    if channel == LOOKUPS:
        # a position inside a window of the writer's filter starts at the window (see log.read_start)
        start_idx = r.read_start(start_idx)
    end_idx = max(end_idx, start_idx)
    rows = read_unique(r, mode, start_idx, end_idx, tables=tables, listed_only=False, db=channel_db(channel))
    entries = r.tables()
    out = RankDelta(rank=rank, path=path, start_idx=start_idx, end_idx=end_idx)
    for fqn, u in sorted(rows.items()):
        shard = ShardInfo.from_entry(entries[fqn])
        gids = u.ids.to(torch.int64)
        if shard is not None and shard.row_offset:
            gids = gids + shard.row_offset
        out.tables[fqn] = TableDelta(fqn, rank, start_idx, end_idx, u, gids, shard)
    return out


# ------------------------------------------------------------------------------ the consumer


class DeltaConsumer:
    """A consumer of a trainer's delta log, in any process (the trainer's included).

    Opens every rank's log under ``root`` in the calling process (never share one across
    fork/spawn: open it in the process that uses it). Not thread-safe: use it from one thread
    at a time. Ranks are discovered when it is built.

    Args:
        root: the log root (``<root>/rank-<r>``), or a single log directory (rank 0).
        name: the consumer name (letters, digits, ``._:@/-``).
        channel: ``"lookups"`` (default) or ``"snapshots"`` (see the module docs).
        reset: what to do when the position cannot be served (below the log start, or past
            its end): None raises :class:`OffsetOutOfRangeError`, ``"earliest"`` moves to the
            log start, ``"latest"`` to the log end. Also where a new registration starts
            (default: the log start).
        register: register the name in every rank's log when it is missing (durably, so it
            holds back retention from now on). With False a missing name raises.
        tables: only these table fqns (default: all).
        options: :class:`LogOptions` for opening the logs.

    Raises:
        NotALogError: ``root`` holds no log.
        UnknownConsumerError: ``register=False`` and the name is missing on a rank.
        ConfigMismatchError: the name is registered for the other channel.
        InvalidInputError: bad name, channel or reset policy.
    """

    def __init__(
        self,
        root: PathLike,
        name: str,
        channel: str = LOOKUPS,
        reset: Optional[str] = None,
        register: bool = True,
        tables: Optional[Sequence[str]] = None,
        options: Optional[LogOptions] = None,
    ) -> None:
        self.name = check_consumer_name(name)
        self.channel = _check_channel(channel)
        if reset is not None and reset not in RESET_POLICIES:
            raise InvalidInputError(f"reset must be None, 'earliest' or 'latest', got {reset!r}")
        self.reset = reset
        self.root = os.fspath(root)
        self._tables = list(tables) if tables is not None else None
        self._logs: Dict[int, DeltaLog] = {}
        self._closed = False
        try:
            for rank, path in rank_paths(self.root).items():
                self._logs[rank] = DeltaLog(path, writer_lock=False, options=options)
            self._committed = {rank: self._load(rank, log, register) for rank, log in self._logs.items()}
        except BaseException:
            self.close()
            raise
        self._positions = dict(self._committed)
        logger.info("consumer %r (%s) on %s: positions %s", self.name, self.channel, self.root, self._positions)

    # ------------------------------------------------------------------ registration
    def _check_entry(self, rank: int, entry: Dict[str, Any]) -> int:
        have = entry.get("channel", LOOKUPS)
        if have != self.channel:
            raise ConfigMismatchError(
                f"consumer {self.name!r} is registered for channel {have!r} on rank {rank}, not {self.channel!r}; "
                "use another name, or delete it (persistent-delta offsets ROOT --delete NAME --execute)"
            )
        return int(entry["offset"])

    def _load(self, rank: int, log: DeltaLog, register: bool) -> int:
        entry = log.read(lambda r: r.consumer(self.name))
        if entry is not None:
            return self._check_entry(rank, entry)
        if not register:
            raise UnknownConsumerError(
                f"consumer {self.name!r} is not registered in {log.path}; pass register=True or register it with "
                f"`persistent-delta offsets {self.root} --register {self.name} --execute`"
            )

        def add(w: WriteTxn) -> int:
            found = w.consumer(self.name)
            if found is not None:  # registered meanwhile by another process
                return self._check_entry(rank, found)
            start, end = channel_bounds(w, self.channel)
            offset = end if self.reset == "latest" else start
            w.set_consumer(self.name, {
                "offset": offset, "commit_time": time.time(), "registered_by": "external", "channel": self.channel,
            })
            logger.info("registered consumer %r in %s at batch %d", self.name, log.path, offset)
            return offset

        return log.write(add)

    # ------------------------------------------------------------------ reading
    def poll(self, max_batches: Optional[int] = None) -> DeltaPoll:
        """Read, per rank, the batches from the position up to the log end (at most
        ``max_batches`` of them) and move the in-memory position past them.

        Args:
            max_batches: read at most this many batches per rank (default: all available).

        Returns:
            A :class:`DeltaPoll`; ``poll.empty`` when nothing new was available.

        Raises:
            OffsetOutOfRangeError: a position is below the log start (its batches were
                deleted) or past the log end, and no reset policy was chosen.
            LogClosedError: the consumer is closed.
        """
        self._check()
        if max_batches is not None and (isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1):
            raise InvalidInputError(f"max_batches must be a positive int or None, got {max_batches!r}")
        ranks: Dict[int, RankDelta] = {}
        for rank, log in self._logs.items():
            pos = self._positions[rank]

            def read(r: ReadTxn, rank: int = rank, log: DeltaLog = log, pos: int = pos) -> RankDelta:
                start, end = channel_bounds(r, self.channel)
                pos = self._in_range(rank, log.path, pos, start, end)
                stop = end if max_batches is None else min(end, pos + max_batches)
                return read_range(r, rank, log.path, pos, stop, self.channel, self._tables)

            delta = log.read(read)
            ranks[rank] = delta
            self._positions[rank] = delta.end_idx
        return DeltaPoll(channel=self.channel, ranks=ranks)

    def _in_range(self, rank: int, path: str, pos: int, start: int, end: int) -> int:
        # Snapshots are deleted only below every snapshot consumer's commit: nothing a
        # registered consumer needs is ever gone, so only "past the end" is out of range.
        below = self.channel == LOOKUPS and pos < start
        above = pos > end + 1  # end + 1: a trainer-side reader commits one past the open batch
        if not (below or above):
            return pos
        if self.reset is None:
            why = (
                f"below the log start {start}: those batches were deleted (retention or clear while this consumer "
                "was not registered)" if below else f"past the log end {end} (the log was started afresh?)"
            )
            raise OffsetOutOfRangeError(
                f"consumer {self.name!r} is at batch {pos} on rank {rank}, {why}, in {path}. Pass reset='earliest' "
                f"or 'latest', or run `persistent-delta offsets {self.root} --reset {self.name} --to-earliest --execute`"
            )
        new = start if self.reset == "earliest" else end
        logger.warning("consumer %r rank %d: position %d out of [%d, %d]; reset to %s (%d)", self.name, rank, pos, start, end, self.reset, new)
        return new

    # ------------------------------------------------------------------ positions
    def commit(self) -> Dict[int, int]:
        """Make the current positions durable: one write transaction per rank (works while
        the trainer runs; not atomic across ranks). Returns the committed positions.

        Raises:
            UnknownConsumerError: the entry was deleted meanwhile (``offsets --delete``, or
                the trainer started a fresh log); build a new consumer to register again.
        """
        self._check()
        for rank, log in self._logs.items():
            pos = self._positions[rank]

            def write(w: WriteTxn, pos: int = pos, path: str = log.path) -> None:
                entry = w.consumer(self.name)
                if entry is None:
                    raise UnknownConsumerError(
                        f"consumer {self.name!r} was deleted from {path} while it was running; create a new "
                        "DeltaConsumer to register it again"
                    )
                entry = dict(entry)
                entry.update(offset=pos, commit_time=time.time())
                w.set_consumer(self.name, entry)

            log.write(write)
            self._committed[rank] = pos
        return dict(self._committed)

    def position(self) -> Dict[int, int]:
        """rank -> the next batch_idx ``poll`` reads (in memory; durable after ``commit``)."""
        self._check()
        return dict(self._positions)

    def committed(self) -> Dict[int, int]:
        """rank -> the durably committed offset, as stored in the log now."""
        self._check()
        out = {}
        for rank, log in self._logs.items():
            entry = log.read(lambda r: r.consumer(self.name))
            if entry is None:
                raise UnknownConsumerError(f"consumer {self.name!r} is no longer registered in {log.path}")
            out[rank] = int(entry["offset"])
        return out

    def end_offsets(self) -> Dict[int, int]:
        """rank -> the channel's end now (one past the last complete batch)."""
        self._check()
        return {rank: log.read(lambda r: channel_bounds(r, self.channel)[1]) for rank, log in self._logs.items()}

    def seek(self, batch_idx: int, rank: Optional[int] = None) -> None:
        """Move the position (every rank's, or one rank's) to ``batch_idx``; in memory until
        ``commit``. The range is checked by the next ``poll``.

        Raises:
            InvalidInputError: a negative or non-int ``batch_idx``, or an unknown rank.
        """
        self._check()
        if isinstance(batch_idx, bool) or not isinstance(batch_idx, int) or batch_idx < 0:
            raise InvalidInputError(f"batch_idx must be a non-negative int, got {batch_idx!r}")
        if rank is not None and rank not in self._positions:
            raise InvalidInputError(f"rank {rank} has no log under {self.root} (ranks: {sorted(self._positions)})")
        for r in [rank] if rank is not None else list(self._positions):
            self._positions[r] = batch_idx

    @property
    def ranks(self) -> List[int]:
        """The ranks read (discovered when the consumer was built)."""
        return sorted(self._logs)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close every log handle (positions not committed are dropped). Idempotent."""
        self._closed = True
        for log in self._logs.values():
            log.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check(self) -> None:
        if self._closed:
            raise LogClosedError(f"consumer {self.name!r} on {self.root} is closed")

    def __enter__(self) -> "DeltaConsumer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DeltaConsumer({self.root!r}, {self.name!r}, channel={self.channel!r})"
