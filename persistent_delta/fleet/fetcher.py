"""Fetching a job's ranges from the stream, for a remote consumer: what each rank shipped,
assembled, authenticated and validated, and where batches are missing.

Owns: the job as a remote consumer sees it (each rank's table metadata, the ranks of the job,
the newest log identity of each rank, the streams read and their identities), reading each
rank's messages into complete buffered ranges (:meth:`Fetcher.fill`: a small per-rank
:class:`RankFetch`), the checks of a range before anything of it is kept (authentication,
format, the rank's table metadata, its shard's bounds), the rank's place on the stream
(:meth:`Fetcher.to_latest`, :meth:`Fetcher.to_earliest`) and its gaps
(:meth:`Fetcher.resolve_gap`). Where the consumer is -- its positions -- is
:class:`~persistent_delta.fleet.positions.RankPosition`'s; what a poll delivers is
:mod:`persistent_delta.fleet.delivery`'s.

Design note
-----------
Each rank's messages are read with batch direct gets from a stream sequence on (stateless on
the server: nothing to recreate after a server restart or a leader change), from the stream
that holds the rank: the job's one stream, or its rank group's when the job is laid out over
several (:mod:`persistent_delta.fleet.streams`). Parts are collected until their range's
marker arrives (:class:`~persistent_delta.fleet.assembly.RangeAssembler`); a range is buffered
only when complete (at most ``max_buffer`` bytes per rank before a poll delivers).

A range ending at or below the position is a re-send and is dropped (de-duplication beyond the
server's duplicate window). A range starting above the position means batches are missing
from the stream -- dropped by the stream's limits, or never shipped because the shipper was
expired by the trainer's retention bound -- and :meth:`Fetcher.resolve_gap` raises
:class:`OffsetOutOfRangeError` unless a reset policy moves the position (``"earliest"``: the
first range still on the stream; ``"latest"``: the end). A log started afresh (a new shipper
epoch whose log end is below the position, or a newer log identity) is treated the same way.
Never a silent gap. Nor for raw ids: a lookups range of a job with managed-collision tables
shipped without their side records (by an older shipper) raises :class:`FormatMismatchError`
instead of reading as "no reassignments". A snapshots progress marker (an empty range: the
rank's batches ended, :mod:`persistent_delta.fleet.wire`) only updates what the rank reported
(:attr:`RankFetch.reported` and :attr:`RankFetch.proven`: what
:func:`~persistent_delta.log.position_rules.snapshots_behind` reads)."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Set, Tuple, TypeVar

import torch
from torchrec.distributed.model_tracker.types import UniqueRows

from persistent_delta.errors import (
    AuthenticationError,
    CorruptRecordError,
    FormatMismatchError,
    InvalidInputError,
    OffsetOutOfRangeError,
    OlderLogError,
    PersistentDeltaError,
    RejectedMessageError,
    StreamDataError,
    TransportError,
)
from persistent_delta.fleet import subjects, wire
from persistent_delta.fleet.assembly import RangeAssembler, RangeContent
from persistent_delta.fleet.auth import Keyring, open_value, verify_message
from persistent_delta.fleet.positions import RankPosition
from persistent_delta.fleet.ranges import MarkerScan, scan_markers
from persistent_delta.fleet.streams import Layout
from persistent_delta.fleet.transport import Transport
from persistent_delta.fleet.wire import Marker, RankTables, SideRecord
from persistent_delta.log import codec
from persistent_delta.log.schema import LOOKUPS, SNAPSHOTS, LogIdentity, ShardInfo, TableEntry
from persistent_delta.log.zch_records import is_managed

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_GET_BATCH = 256
_GET_BYTES = 32 << 20
_STREAM_CHECK_S = 2.0  # how often a caught-up consumer asks whether the stream was created again


@dataclass
class BufferedRange:
    """A complete range of one rank, buffered until a poll delivers it."""

    marker: Marker
    tables: Dict[str, UniqueRows]
    nbytes: int
    side: Dict[str, List[SideRecord]] = field(default_factory=dict)  # managed-collision tables' side records
    stamps: Dict[str, torch.Tensor] = field(default_factory=dict)  # replicated tables: per row, its publish


@dataclass
class RankFetch:
    """What is fetched of one rank: the next stream sequence, the pending parts, the complete
    ranges buffered, and the gap found above them."""

    rank: int
    assembler: RangeAssembler
    seq: int = 1  # next stream sequence to read
    ranges: Deque[BufferedRange] = field(default_factory=deque)
    buffered: int = 0
    gap: Optional[BufferedRange] = None  # the first range found above the buffered end (tables {} when incomplete)
    gap_complete: bool = False
    left: Set[str] = field(default_factory=set)  # epochs an explicit epoch start replaced: their markers are replays
    # snapshots: (snapshots end, batches ended) as its newest marker at the buffered end said (None: not known)
    reported: Optional[Tuple[int, int]] = None
    proven: int = 0  # snapshots: one past the newest publish stamp its markers showed (Marker.proven_end)

    def expected(self, p: RankPosition) -> Optional[int]:
        """Where the next range should start: the buffered end, or the position."""
        return self.ranges[-1].marker.end if self.ranges else p.pos

    def seen_end(self, pos: int) -> int:
        """The stream's end as far as it was read (no request): the last buffered range's end,
        or the first range past a gap, or ``pos`` when it holds nothing."""
        if self.gap is not None:
            return max(pos, self.gap.marker.end)
        return max(pos, self.ranges[-1].marker.end) if self.ranges else pos


def check_ids(ids: torch.Tensor, shard: Optional[ShardInfo], where: str, seq: int) -> None:
    """Raise StreamDataError unless ``ids`` are 1-D int64 local row ids within the rank's shard."""
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise StreamDataError(f"{where}: ids of dtype {ids.dtype} and shape {tuple(ids.shape)}, want 1-D int64", seq=seq)
    rows = shard.local_rows if shard is not None else None
    if ids.numel() and (int(ids.min()) < 0 or (rows is not None and int(ids.max()) >= rows)):
        raise StreamDataError(f"{where}: ids outside the rank's shard [0, {rows})", seq=seq)


class Fetcher:
    """Reads one job's channel for a remote consumer (see the module docs). Not thread-safe:
    the consumer's thread calls it.

    Args:
        conn: the transport (the fetcher never closes it).
        ring: the job's keyring: everything read is verified with it.
        job: the job.
        channel: the channel read.
        format: the row format of the snapshot rows kept.
        server: the server(s), for messages.
        max_buffer: complete ranges buffered per rank at most (bytes).
        retry_s: how long :meth:`retrying` retries while the server is unreachable.
        reject: called with each message, value or range skipped (never applied).
    """

    def __init__(self, conn: Transport, ring: Keyring, job: str, channel: str, format: str, server: str,
                 max_buffer: int, retry_s: float, reject: Callable[[PersistentDeltaError], None]) -> None:
        self.conn, self.ring, self.job, self.channel, self.format = conn, ring, job, channel, format
        self.server, self.max_buffer, self.retry_s, self.reject = server, max_buffer, retry_s, reject
        self.layout = Layout(job)  # the job's streams (read from its meta bucket at open)
        self.meta: Dict[int, RankTables] = {}
        self.expected: Optional[Set[int]] = None  # the job's ranks (None: no world size known)
        self.logs: Dict[int, LogIdentity] = {}  # rank -> the newest identity of its log seen authenticated
        self.scans: Dict[int, MarkerScan] = {}
        self.stream_ids: Dict[str, str] = {}  # stream name -> its identity when last looked (Transport.stream_id)
        self.stream_checked = 0.0  # when (monotonic) they were last looked at
        self.fetches: Dict[int, RankFetch] = {}  # rank -> what is fetched of it
        self.positions: Dict[int, RankPosition] = {}  # rank -> the consumer's position on it

    def where(self, rank: int) -> str:
        return f"rank {rank} of job {self.job} ({self.channel}) on {self.server}"

    def retrying(self, fn: Callable[[], _T]) -> _T:
        """``fn()``, retried while the server is unreachable, up to ``retry_s``."""
        deadline = time.monotonic() + self.retry_s
        while True:
            try:
                return fn()
            except TransportError as exc:
                if not exc.retriable or time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def clear(self, f: RankFetch, p: RankPosition) -> None:
        """Drop what is buffered of a rank (its position is set anew)."""
        p.stale = ""
        f.ranges.clear()
        f.buffered = 0
        f.gap = None
        f.reported, f.proven = None, 0
        f.assembler = RangeAssembler(self.job, self.channel, f.rank, self.max_buffer)

    # ------------------------------------------------------------------ the job's metadata
    def refresh_meta(self) -> List[int]:
        """Read every rank's table metadata (authenticated, of the rank's newest log); returns
        the ranks of the job seen for the first time (their fetch state and position added)."""
        for key, (value, _) in self.conn.kv_entries(self.job, subjects.META, subjects.TABLES_KEYS).items():
            try:
                rt = RankTables.decode(open_value(self.ring, self.job, subjects.META, key, value), f"job {self.job} {key}")
                if key != subjects.tables_key(rt.rank) or (self.expected is not None and rt.rank not in self.expected):
                    raise StreamDataError(f"job {self.job} {key}: holds the table metadata of rank {rt.rank}",
                                          subject=key)
                self.newest(rt.rank, rt.identity, f"the table metadata {key}", key)
            except (RejectedMessageError, CorruptRecordError) as exc:  # not authentic, not this job's, malformed
                self.reject(exc)
                continue
            self.meta[rt.rank] = rt
            if rt.world_size is not None and self.expected is None:
                self.expected = set(range(rt.world_size))
        new = []
        for rank in sorted(self.meta) if self.expected is None else sorted(self.expected & set(self.meta)):
            if rank not in self.fetches:
                stream = self.layout.stream(rank)
                if stream not in self.stream_ids:
                    self.stream_ids[stream] = self.conn.stream_id(self.job, stream=stream)
                self.fetches[rank] = RankFetch(rank, RangeAssembler(self.job, self.channel, rank, self.max_buffer))
                self.positions[rank] = RankPosition(rank)
                new.append(rank)
        return new

    def newest(self, rank: int, ident: Optional[LogIdentity], what: str, subject: str = "", seq: int = 0) -> None:
        """Adopt ``ident`` as rank ``rank``'s log when it is newer than the newest seen (a
        consumer never goes back to an older one).

        Raises:
            OlderLogError: ``ident`` is of an older log of the rank (``what`` names the message).
        """
        if ident is None:
            return
        cur = self.logs.get(rank)
        if ident.older_than(cur):
            assert cur is not None
            raise OlderLogError(f"{self.where(rank)}: {what} is of {ident.describe()}, older than the rank's "
                                f"{cur.describe()}: the previous run's data (before a start afresh), replayed or left "
                                "on the stream; skipped", subject=subject, seq=seq)
        if cur is None or cur.older_than(ident):
            self.logs[rank] = ident
            self.scans.setdefault(rank, MarkerScan()).adopt(ident)

    def missing_ranks(self) -> List[int]:
        """Ranks of the job whose shipper has not stored its table metadata yet."""
        return sorted((self.expected or set()) - set(self.meta))

    def job_tables(self) -> List[str]:
        return sorted({fqn for rt in self.meta.values() for fqn in rt.entries})

    def managed(self, rank: int) -> bool:
        """Whether the lookups channel of ``rank`` has managed-collision tables (their side
        records travel with every range)."""
        meta = self.meta.get(rank)
        return self.channel == LOOKUPS and meta is not None and any(
            is_managed(TableEntry.from_bytes(fqn, b)) for fqn, b in meta.entries.items())

    # ------------------------------------------------------------------ where a rank is on the stream
    def scan(self, rank: int) -> MarkerScan:
        """Rank ``rank``'s latest genuine range, read forward (the last message may be a replay)."""
        scan = self.scans.setdefault(rank, MarkerScan())
        scan.adopt(self.logs.get(rank))
        return self.retrying(lambda: scan_markers(self.conn, self.ring, self.job, self.channel, rank, scan,
                                                  self.reject, stream=self.layout.stream(rank)))

    def to_latest(self, f: RankFetch, p: RankPosition) -> None:
        m = self.scan(f.rank).latest
        self.clear(f, p)
        p.log = self.logs.get(f.rank)
        if m is None:
            p.pos, f.seq, p.epoch = None, 1, None
            return
        p.pos, f.seq, p.epoch = m.end, m.seq + 1, m.epoch
        p.resume_seq = f.seq

    def to_earliest(self, f: RankFetch, p: RankPosition) -> None:
        self.clear(f, p)
        p.pos, f.seq, p.epoch, p.resume_seq = None, 1, None, 1
        p.log = self.logs.get(f.rank)

    def recreated(self, rank: int) -> bool:
        """Whether the stream of ``rank`` was deleted and created again since this consumer last
        looked (its sequence numbers started again at 1). Every stream read is looked at: the
        ranks of each one created again are read again from its start -- ranges at or below a position are re-sends, a range above it is the gap it is."""
        self.stream_checked = time.monotonic()
        changed = set()
        for name, was in list(self.stream_ids.items()):
            now = self.conn.stream_id(self.job, stream=name)
            if now != was:
                changed.add(name)
                self.stream_ids[name] = now
        if not changed:
            return False
        logger.warning("remote consumer of job %s: stream(s) %s were deleted and created again; reading them from "
                       "their start", self.job, sorted(changed))
        for r, f in self.fetches.items():
            if self.layout.stream(r) in changed:
                f.seq = self.positions[r].resume_seq = 1
                f.gap, f.gap_complete = None, False
                self.scans.pop(r, None)
        return self.layout.stream(rank) in changed

    def resolve_gap(self, f: RankFetch, p: RankPosition, reset: Optional[str], name: str) -> None:
        """A gap at the position: raise, or apply the reset policy."""
        assert f.gap is not None
        if self.recreated(f.rank):
            return  # read again from the new stream's start (the caller fills)
        gap, m = f.gap, f.gap.marker
        if reset is None:
            afresh = p.log is not None and p.log.older_than(m.log)
            why = (f"batches [{p.pos}, {m.start}) are not on the stream: dropped by its limits, or never shipped "
                   "because the shipper fell past the trainer's retention bound"
                   if (p.pos is None or m.start > p.pos) and not afresh
                   else f"the log was started afresh: a new shipper epoch, its batch numbers restarted at {m.start}")
            raise OffsetOutOfRangeError(
                f"remote consumer {name!r} is at batch {p.pos} of {self.where(f.rank)}, but the stream's next "
                f"range is [{m.start}, {m.end}) ({why}). Pass reset='earliest' or 'latest', or seek()"
            )
        logger.warning("remote consumer %r: %s: position %s out of range (next range [%d, %d)); reset to %s", name,
                       self.where(f.rank), p.pos, m.start, m.end, reset)
        if reset == "latest":
            self.to_latest(f, p)
            return
        # "earliest": the first complete range on the stream from here on
        seq = f.seq
        self.clear(f, p)
        f.seq, p.epoch, p.log = seq, m.epoch, m.log
        if f.gap_complete:
            p.pos = m.start
            f.ranges.append(gap)
            f.buffered = gap.nbytes
        else:
            p.pos = None

    # ------------------------------------------------------------------ reading
    def fill(self, f: RankFetch, p: RankPosition) -> None:
        """Read rank ``f``'s stream messages into complete buffered ranges (bounded)."""
        subject = subjects.rank_filter(self.job, self.channel, f.rank)
        end_subject = subjects.end_subject(self.job, self.channel, f.rank)
        stream = self.layout.stream(f.rank)
        while f.gap is None and f.buffered < self.max_buffer:
            msgs, more = self.conn.get_batch(self.job, subject, f.seq, _GET_BATCH,
                                              min(_GET_BYTES, max(1 << 20, self.max_buffer - f.buffered)),
                                              stream=stream)
            if not msgs:
                if time.monotonic() - self.stream_checked >= _STREAM_CHECK_S and self.recreated(f.rank):
                    continue  # caught up on a stream since created again below this sequence
                return
            for seq, subj, headers, data in msgs:
                try:  # anything that does not authenticate is skipped (and reported): never applied
                    verify_message(self.ring, self.job, subj, headers, data, seq)
                except AuthenticationError as exc:
                    f.seq = seq + 1
                    self.reject(exc)
                    continue
                if self.ring.insecure and wire.FORMAT_HEADER not in headers:
                    f.seq = seq + 1  # unauthenticated and not ours: foreign
                    self.reject(StreamDataError(f"{self.where(f.rank)}: message {seq} on {subj[:200]!r} is not "
                                                "a persistent_delta message", subject=subj, seq=seq))
                    continue
                wire.check_format(headers, self.where(f.rank))  # authenticated: refused again by the next poll
                f.seq = seq + 1
                try:
                    if subj != end_subject:
                        f.assembler.add_part(headers, data, seq, subj)
                        continue
                    m = Marker.decode(data, seq, self.where(f.rank), headers)
                except StreamDataError as exc:
                    self.reject(exc)
                    continue
                if m.side is None and self.managed(f.rank):
                    f.seq = seq  # refused again by the next poll, never skipped
                    raise FormatMismatchError(
                        f"{self.where(f.rank)}: range [{m.start}, {m.end}) was shipped without the side records of "
                        "its managed-collision tables (an older shipper): a raw-id map built from it would be wrong; "
                        "upgrade the shipper, and seek() this consumer past that range or to a base")
                self.on_marker(f, p, m)
                if f.gap is not None or f.buffered >= self.max_buffer:
                    return
            if not more:
                return  # caught up: a new marker wakes the next poll (no request that would come back empty)

    def on_marker(self, f: RankFetch, p: RankPosition, m: Marker) -> None:
        try:  # a range of an older log of the rank than the newest seen: the previous run's, replayed
            self.newest(f.rank, m.log, f"range marker {m.seq} [{m.start}, {m.end})", seq=m.seq)
        except OlderLogError as exc:
            self.reject(exc)
            return  # its parts stay pending until the next marker takes its own (and drops the others)
        if p.epoch is not None and m.epoch != p.epoch and (m.epoch in f.left or (m.prev is not None and any(
                r.marker.epoch == m.epoch for r in f.ranges))):
            return  # a replay of an epoch an explicit epoch start replaced
        if m.end == m.start and not m.listing:
            self.on_progress(f, p, m)
            return
        try:
            if m.digests is None and not self.ring.insecure:
                raise StreamDataError(f"{self.where(f.rank)}: range marker {m.seq} does not list its parts' digests",
                                      seq=m.seq)
            got = f.assembler.complete(m)
            if got is not None:
                got = self.keep_format(m, got)
                self.validate(f.rank, m, got)
        except (RejectedMessageError, CorruptRecordError) as exc:
            self.reject(exc)
            return  # as if never sent: never applied, and no position moves past it
        tables, side, stamps = (None, {}, {}) if got is None else (got.tables, got.side, got.stamps)
        expected = f.expected(p)
        restarted = expected is not None and (
            (p.epoch is not None and m.epoch != p.epoch and int(m.info.get("log_end", m.end)) < expected)
            or (p.log is not None and p.log.older_than(m.log)))  # a newer log of the rank: batches count anew
        if expected is None:  # a new consumer at "earliest": the first range on the stream
            if tables is None:
                return
            p.pos = expected = m.start
            p.log = m.log
        nbytes = 0 if tables is None else sum(
            int(u.ids.nbytes) + (0 if u.states is None else int(u.states.nbytes)) for u in tables.values()) + sum(
            int(ids.nbytes) + int(states.nbytes) for recs in side.values() for _, ids, states in recs)
        if restarted or (m.end > expected and (m.start > expected or tables is None)):
            # batches missing at the position: the log was started afresh (its batch numbers
            # restarted below us), or the stream lacks [expected, m.start) or this range's parts
            f.gap, f.gap_complete = BufferedRange(m, tables or {}, nbytes, side, stamps), tables is not None
            return
        if m.end <= expected:
            return  # a re-send (or a range already delivered): never applied twice
        assert tables is not None
        f.ranges.append(BufferedRange(m, tables, nbytes, side, stamps))
        f.reported, f.proven = (m.end, m.batches_ended), m.proven_end(f.proven)
        f.buffered += nbytes
        if m.log is not None:
            p.log = m.log
        if p.epoch is not None and m.epoch != p.epoch and m.prev is None:
            f.left.add(p.epoch)  # an explicit epoch start: the old epoch's markers are replays from now on
        p.epoch = m.epoch

    def on_progress(self, f: RankFetch, p: RankPosition, m: Marker) -> None:
        """A progress marker (:mod:`~persistent_delta.fleet.wire`: no rows, the rank's batches
        ended): kept when it continues what the rank buffered, of the same log (never a
        position, a gap or an epoch change: the ranges' markers decide those)."""
        expected = f.expected(p)
        if (expected is None or m.end == expected) and (m.log is None or p.log is None or m.log == p.log):
            was = f.reported[1] if f.reported is not None and f.reported[0] == m.end else m.end
            f.reported, f.proven = (m.end, max(was, m.batches_ended)), m.proven_end(f.proven)

    def keep_format(self, m: Marker, got: RangeContent) -> RangeContent:
        """The range's rows of this consumer's row format, by the filter of a local read
        (:func:`persistent_delta.log.codec.serves`); the parts of other formats are counted
        in the marker's info (``passed_over``)."""
        if self.channel != SNAPSHOTS:
            return got
        tables: Dict[str, UniqueRows] = {}
        stamps: Dict[str, torch.Tensor] = {}
        passed = 0
        for fqn, u in got.tables.items():
            if codec.serves(codec.NATIVE, None if u.states is None else u.states.dtype, self.format):
                tables[fqn] = u
                if fqn in got.stamps:
                    stamps[fqn] = got.stamps[fqn]
            else:
                passed += 1
        for fmt, rows in got.formats.items():
            if fmt != self.format:
                passed += len(rows)
                continue
            tables.update(rows)
            stamps.update(got.format_stamps.get(fmt, {}))
        m.info["passed_over"] = passed
        return RangeContent(tables, got.side, stamps)

    def validate(self, rank: int, m: Marker, got: RangeContent) -> None:
        """Check a complete range against the rank's table metadata before anything of it is kept.

        Raises:
            StreamDataError: a table not in the metadata, ids not int64 / 1-D / within the rank's
                shard, states of another dtype or row shape, stamps out of bounds.
        """
        meta = self.meta.get(rank)
        where = f"{self.where(rank)}: range [{m.start}, {m.end}) (marker {m.seq})"
        if meta is None:
            raise StreamDataError(f"{where}: the rank has no table metadata", seq=m.seq)
        if any(fqn not in meta.entries for fqn in list(got.tables) + list(got.side)):
            self.refresh_meta()  # a table new since the metadata was read: its shipper stored it again
            meta = self.meta[rank]
        for fqn, u in got.tables.items():
            if fqn not in meta.entries:
                raise StreamDataError(f"{where}: table {fqn[:200]!r} is not in the rank's metadata", seq=m.seq)
            entry = TableEntry.from_bytes(fqn, meta.entries[fqn])
            check_ids(u.ids, ShardInfo.from_entry(entry), f"{where} table {fqn!r}", m.seq)
            want = entry.empty_states(self.channel)
            if want is not None and self.format != codec.NATIVE:
                shard = ShardInfo.from_entry(entry)
                half = shard is not None and shard.local_cols is not None and shard.local_cols != shard.global_cols
                try:
                    dtype, tail = codec.format_states(self.format, want.dtype, tuple(want.shape[1:]), half)
                except InvalidInputError as exc:
                    raise StreamDataError(f"{where} table {fqn!r}: {exc}", seq=m.seq) from exc
                want = torch.empty((0, *tail), dtype=dtype)
            if want is None:
                if u.states is not None:
                    raise StreamDataError(f"{where} table {fqn!r}: rows carry states, the table has none", seq=m.seq)
            elif u.states is None or u.states.dtype != want.dtype or \
                    tuple(u.states.shape) != (u.ids.numel(), *want.shape[1:]):
                got_s = None if u.states is None else (u.states.dtype, tuple(u.states.shape))
                raise StreamDataError(f"{where} table {fqn!r}: states {got_s}, the table's metadata says "
                                      f"{want.dtype} rows of shape {tuple(want.shape[1:])} for {u.ids.numel()} ids",
                                      seq=m.seq)
        for fqn, t in got.stamps.items():
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= m.end):
                raise StreamDataError(f"{where} table {fqn!r}: publish stamps outside [0, {m.end})", seq=m.seq)
        for fqn in got.side:
            if fqn not in meta.entries:
                raise StreamDataError(f"{where}: side records of {fqn[:200]!r}, not a table of the rank", seq=m.seq)


__all__ = ["BufferedRange", "Fetcher", "RankFetch", "check_ids"]
