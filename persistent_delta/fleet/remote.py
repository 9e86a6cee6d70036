"""Remote consumers: a job's deltas read from its stream, on any host.

Owns: a remote consumer's positions (per rank, in batch indices, stored and replicated in
the job's ``offsets`` bucket), its one-active-process claim, and its poll/commit cycle. The
result types are :mod:`persistent_delta.read.results`' (the same :class:`DeltaPoll` as a local
:class:`~persistent_delta.DeltaConsumer`: ``merged()``, ``zch()`` and ``apply`` work unchanged;
a managed-collision table's ``TableDelta.zch`` comes from the side records shipped with each
range, by :func:`persistent_delta.log.zch_records.side_delta`, the local reader's rule); which
batches a poll may deliver is :func:`persistent_delta.log.position_rules.poll_stops` (complete batches
only: every rank of the job); the message format is :mod:`persistent_delta.fleet.wire`'s, read
through a :class:`~persistent_delta.fleet.transport.Transport` (NATS JetStream for a server URL).

Design note
-----------
Each rank's messages are read with batch direct gets from a stream sequence on (stateless on
the server: nothing to recreate after a server restart or a leader change), from the stream
that holds the rank: the job's one stream, or its rank group's when the job is laid out over
several (:mod:`persistent_delta.fleet.streams`; the layout is read at open from the job's
``meta`` bucket, so a consumer sees no difference). A rank's stream sequence and the identity
of each stream read are stored with the positions. Parts are
collected until their range's marker arrives; a range is buffered only when complete (at
most ``max_buffer_bytes`` per rank before the poll delivers). A poll delivers, per rank, the
buffered ranges up to the smallest end over the job's ranks, merged per table by the
channel's update mode (what a local consumer reading the same batches gets), and moves the
position past them; ``commit`` stores each rank's position and the stream sequence after its
last marker, so a restart resumes exactly there (at-least-once: a crash between ``poll`` and
``commit`` re-delivers).

A range ending at or below the position is a re-send and is dropped (de-duplication beyond the
server's duplicate window). A range starting above the position means batches are missing
from the stream -- dropped by the stream's limits, or never shipped because the shipper was
expired by the trainer's retention bound -- and the poll raises
:class:`OffsetOutOfRangeError` unless a reset policy moves the position (``"earliest"``: the
first range still on the stream; ``"latest"``: the end). A log started afresh (a new shipper
epoch whose log end is below the position) is treated the same way. Never a silent gap. Nor
for raw ids: a lookups range of a job with managed-collision tables shipped without their side
records (by an older shipper) raises :class:`FormatMismatchError` instead of reading as "no
reassignments".

One active process per consumer name: a key in the job's ``locks`` bucket created
exclusively and refreshed by a heartbeat; a killed holder's key expires after the bucket's
TTL (:attr:`StreamOptions.lock_ttl_s`), and a second user is refused with
:class:`LogLockedError` naming the holder.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple, TypeVar

import torch
from torchrec.distributed.model_tracker.types import UniqueRows, UpdateMode

from persistent_delta.log import codec, position_rules
from persistent_delta.fleet import subjects, wire
from persistent_delta.config import LogOptions
from persistent_delta.errors import (
    AuthenticationError,
    CorruptRecordError,
    FormatMismatchError,
    InvalidInputError,
    JobNotFoundError,
    KeyConflictError,
    LogClosedError,
    LogLockedError,
    NotALogError,
    OffsetOutOfRangeError,
    OlderLogError,
    PersistentDeltaError,
    RejectedMessageError,
    StreamDataError,
    TransportError,
    UnknownConsumerError,
)
from persistent_delta.lifecycle import warn_unclosed
from persistent_delta.log.records import empty_rows
from persistent_delta.read.base import BaseTables
from persistent_delta.read.polling import byte_cut, check_poll_args, clip_stops, tell_behind
from persistent_delta.read.results import DeltaPoll, RankDelta, join_int8, table_delta
from persistent_delta.log.rows import compute_unique_rows
from persistent_delta.log.schema import (
    COMMIT_HISTORY,
    LOOKUPS,
    SNAPSHOTS,
    CommitPoint,
    LogIdentity,
    ShardInfo,
    TableEntry,
    check_batch_idx,
    check_channel,
    check_consumer_name,
    check_read_format,
    check_table_filter,
    valid_commit_time,
)
from persistent_delta.threads import intra_op_threads
from persistent_delta.fleet.transport import ConnectOptions, ServerSpec, StreamOptions, Transport, open_transport
from persistent_delta.fleet.auth import KeySpec, Keyring, open_value, resolve_keyring, verify_message
from persistent_delta.fleet.ranges import MarkerScan, scan_markers
from persistent_delta.fleet.streams import Layout, recorded_layout
from persistent_delta.fleet.wire import MAX_BATCH_IDX, Marker, RangeAssembler, RangeContent, RankTables, SideRecord
from persistent_delta.log.zch_records import is_managed, side_delta

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
_GET_BATCH = 256
_GET_BYTES = 32 << 20
_RECHECK_S = 0.05
_STREAM_CHECK_S = 2.0  # how often a caught-up consumer asks whether the stream was created again


@dataclass
class _Range:
    marker: Marker
    tables: Dict[str, UniqueRows]
    nbytes: int
    side: Dict[str, List[SideRecord]] = field(default_factory=dict)  # managed-collision tables' side records
    stamps: Dict[str, torch.Tensor] = field(default_factory=dict)  # replicated tables: per row, its publish


@dataclass
class _RankState:
    rank: int
    pos: Optional[int]  # None: not known yet (a new consumer at "earliest" before any range)
    seq: int  # next stream sequence to read
    epoch: Optional[str]
    assembler: RangeAssembler
    resume_seq: int = 1  # stream sequence to resume from at the position (stored by commit)
    ranges: Deque[_Range] = field(default_factory=deque)
    buffered: int = 0
    gap: Optional[_Range] = None  # the first range found above the buffered end (tables {} when incomplete)
    gap_complete: bool = False
    left: Set[str] = field(default_factory=set)  # epochs an explicit epoch start replaced: their markers are replays
    history: Tuple[CommitPoint, ...] = ()  # its last commits (the health window), stored with the position
    deferred: Optional[int] = None  # snapshots: the newest delivered range's count of deferred rows
    log: Optional[LogIdentity] = None  # the rank's log the position counts batches of (None: not known)
    stale: str = ""  # why the stored position is of an older log than the rank's newest (reset=None: raised)
    # snapshots: (snapshots end, batches ended) as its newest marker at the buffered end said (None: not known)
    reported: Optional[Tuple[int, int]] = None


def _check_ids(ids: torch.Tensor, shard: Optional[ShardInfo], where: str, seq: int) -> None:
    """Raise StreamDataError unless ``ids`` are 1-D int64 local row ids within the rank's shard."""
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise StreamDataError(f"{where}: ids of dtype {ids.dtype} and shape {tuple(ids.shape)}, want 1-D int64", seq=seq)
    rows = shard.local_rows if shard is not None else None
    if ids.numel() and (int(ids.min()) < 0 or (rows is not None and int(ids.max()) >= rows)):
        raise StreamDataError(f"{where}: ids outside the rank's shard [0, {rows})", seq=seq)


def offsets_key(name: str, channel: str) -> str:
    return f"{subjects.token(name)}.{channel}"


def lock_key(name: str) -> str:
    return subjects.token(name)


#: The key of a rank's commit history in its stored position entry.
HISTORY_KEY = "hist"


def stored_history(entry: object) -> Tuple[CommitPoint, ...]:
    """The commit history kept in a rank's stored position entry (``"hist"``: a list of
    ``[time, pos, end]``, oldest first; ``end`` -1 when unknown), at most the last
    :data:`~persistent_delta.log.schema.COMMIT_HISTORY`.

    The history only feeds the health rule, so a missing one (an entry written before it) and a
    malformed one (not a list, or a point that is not ``[time, int, int]``, the time as
    :func:`~persistent_delta.log.schema.valid_commit_time` bounds it) read as no history
    rather than failing the consumer or the tools.
    """
    raw = entry.get(HISTORY_KEY) if isinstance(entry, dict) else None
    if not isinstance(raw, list):
        return ()
    out: List[CommitPoint] = []
    for p in raw[-COMMIT_HISTORY:]:
        if not (isinstance(p, list) and len(p) == 3 and valid_commit_time(p[0])
                and all(isinstance(v, int) and not isinstance(v, bool) and -1 <= v < MAX_BATCH_IDX for v in p[1:])
                and p[1] >= 0):
            return ()
        out.append(CommitPoint(float(p[0]), int(p[1]), int(p[2])))
    return tuple(out)


class RemoteConsumer:
    """A consumer of a job's stream, with the API and results of
    :class:`~persistent_delta.DeltaConsumer`. Not thread-safe; one active process per name.

    Args:
        server: ``nats://HOST:PORT`` (or several / a list: a cluster); None with ``transport``.
        job: the job's name on the stream.
        name: the consumer name (as for local consumers).
        channel: ``"lookups"`` (default) or ``"snapshots"``.
        reset: None (out-of-range raises :class:`OffsetOutOfRangeError`), ``"earliest"`` or
            ``"latest"``; also where a new consumer starts (default: the first range still on
            the stream; ``"latest"``: the end).
        tables: only these table fqns.
        wait: seconds to wait for the server, for the job's table metadata (a shipper that has
            not started yet), and for the name's claim (a killed holder's claim expires).
        connect: authentication/TLS.
        stream: unused (a remote consumer never creates the job's stream or buckets: the
            shipper side does, with its own :class:`StreamOptions`); kept for callers.
        max_buffer_bytes: complete ranges buffered per rank at most, before a poll.
        retry_s: how long ``commit``, ``committed`` and ``end_offsets`` retry while the server
            is unreachable (a restart, a leader election) before raising ``TransportError``.
        read_threads: torch intra-op threads of its polls, ``merged()`` and ``apply_poll``
            (``LogOptions.read_threads``: default 1, or ``PERSISTENT_DELTA_READ_THREADS``;
            0: the process's setting).
        transport: read through this transport instead of a connection to ``server`` (the
            consumer closes it on :meth:`close`).
        key: the job's stream key(s) (a :class:`~persistent_delta.fleet.auth.StreamKey`, a key
            file, or several: during a rotation, the old and the new); default
            ``PERSISTENT_DELTA_STREAM_KEY_FILE``. Every message, metadata value and base is
            verified with it; what does not authenticate is skipped and reported in
            :attr:`rejected`.
        insecure: read unauthenticated data when no key is found (an explicit opt-out).
        format: the row format of the snapshot rows to read, as a local consumer's (see
            :class:`~persistent_delta.read.consumer.DeltaReader`): shippers carry every format
            the publishes wrote, and this consumer keeps its own (``DeltaPoll.passed_over``
            counts the other parts). Nothing on the stream registers it with the trainer: the
            trainer's ``publish(..., formats=[...])`` (or a local snapshots consumer of the
            format) makes the publishes write it.

    Raises:
        StreamKeyError: no key, and not ``insecure``.
        TransportError: the server cannot be reached within ``wait``.
        JobNotFoundError: the job's stream does not exist on the server within ``wait``.
        NotALogError: no shipper has stored the job's table metadata within ``wait``.
        LogLockedError: another process uses the name.
    """

    def __init__(
        self,
        server: Optional[ServerSpec],
        job: str,
        name: str,
        channel: str = LOOKUPS,
        reset: Optional[str] = None,
        tables: Optional[Sequence[str]] = None,
        wait: float = 0.0,
        connect: Optional[ConnectOptions] = None,
        stream: Optional[StreamOptions] = None,
        max_buffer_bytes: int = 256 << 20,
        retry_s: float = 30.0,
        read_threads: Optional[int] = None,
        transport: Optional[Transport] = None,
        key: KeySpec = None,
        insecure: bool = False,
        format: str = codec.NATIVE,
    ) -> None:
        self._closed = True
        self.rejected: Deque[PersistentDeltaError] = deque(maxlen=100)  # the last messages skipped, and why
        self._read_threads = LogOptions.resolve(read_threads=read_threads).read_threads
        self.job = subjects.check_job(job)
        self._ring: Keyring = resolve_keyring(key, insecure, f"remote consumer of job {self.job!r}")
        self._scans: Dict[int, MarkerScan] = {}
        self.name = check_consumer_name(name)
        self.channel = check_channel(channel)
        self.format = check_read_format(format, self.channel)
        if self.format == codec.ANY_FORMAT:
            raise InvalidInputError(f"a remote consumer reads one row format; the formats are {codec.ROW_FORMATS}")
        if reset is not None and reset not in position_rules.RESET_POLICIES:
            raise InvalidInputError(f"reset must be None, 'earliest' or 'latest', got {reset!r}")
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or wait < 0:
            raise InvalidInputError(f"wait must be a non-negative number of seconds, got {wait!r}")
        if server is None and transport is None:
            raise InvalidInputError("a remote consumer needs a server URL or a transport")
        check_table_filter(tables, None)
        self.reset = reset
        self._tables_filter = list(tables) if tables is not None else None
        if isinstance(max_buffer_bytes, bool) or not isinstance(max_buffer_bytes, int) or max_buffer_bytes < 1:
            raise InvalidInputError(f"max_buffer_bytes must be a positive integer, got {max_buffer_bytes!r}")
        self._max_buffer = int(max_buffer_bytes)
        self._retry_s = float(retry_s)
        self._lost = False
        self.last_error = ""  # the last transport failure a poll retried over ("" when the last poll reached the server)
        self.last_shipped: Dict[int, float] = {}  # rank -> wall-clock time the last delivered range was shipped
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._told_behind: Set[int] = set()  # ranks a warning said are behind on the snapshots channel
        self._ranks: Dict[int, _RankState] = {}
        self._meta: Dict[int, RankTables] = {}
        self._logs: Dict[int, LogIdentity] = {}  # rank -> the newest identity of its log seen authenticated
        self._expected: Optional[Set[int]] = None
        self._layout = Layout(self.job)  # the job's streams (read from its meta bucket at open)
        self._stream_ids: Dict[str, str] = {}  # stream name -> its identity when last looked (Transport.stream_id)
        self._stream_checked = 0.0  # when (monotonic) they were last looked at
        if transport is None:
            assert server is not None  # checked above
            transport = open_transport(server, connect, wait=wait)
        self.conn: Transport = transport
        self.server = ",".join(self.conn.servers)
        try:
            deadline = time.monotonic() + wait
            self._await_job(deadline)  # a consumer never creates the job's stream or buckets: the shipper side does
            if self._layout.single:
                self._stream_ids[self._layout.stream(0)] = self.conn.stream_id(self.job)
            self._claim(deadline)
            self._closed = False
            self._load_meta(deadline)
            if self._tables_filter is not None:
                check_table_filter(self._tables_filter, self._job_tables())
            self._load_positions()
            self.conn.watch(subjects.ends_filter(self.job, self.channel), self._wake)
        except BaseException:
            self.close()
            raise
        logger.info("remote consumer %r (%s) of job %s on %s: positions %s", self.name, self.channel, self.job,
                    self.server, self.position())

    def _await_job(self, deadline: float) -> None:
        """Wait until the job's stream and buckets exist (created by its shipper), within the deadline.

        Raises:
            JobNotFoundError: they do not exist at the deadline.
            TransportError: the server cannot be reached at the deadline.
        """
        while True:
            try:
                if self.conn.job_exists(self.job, streams=()):  # the buckets: then the layout, and its streams
                    layout = recorded_layout(self.conn, self.job, self._ring)
                    if layout is not None:
                        self._layout = layout  # a rank's group stream exists before its table metadata
                        return
                    if self.conn.job_exists(self.job):
                        return
            except TransportError:
                if time.monotonic() >= deadline:
                    raise
            else:
                if time.monotonic() >= deadline:
                    raise JobNotFoundError(
                        f"job {self.job!r} has no stream on {self.server}: no shipper of it has run there yet, or the "
                        "stream was deleted (a remote consumer never creates it: only the shipper side does). Start "
                        "`persistent-delta ship ROOT --server ... --job ...`, or pass wait=")
            time.sleep(0.2)

    # ------------------------------------------------------------------ the claim
    def _claim(self, deadline: float) -> None:
        value = codec.pack({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
        key = lock_key(self.name)
        while True:
            try:
                rev = self.conn.kv_create(self.job, subjects.LOCKS, key, value)
                break
            except KeyConflictError:
                pass  # held by another process: wait for it to go, within the deadline
            except TransportError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)
                continue
            if time.monotonic() >= deadline:
                held = self.conn.kv_get(self.job, subjects.LOCKS, key)
                who = codec.unpack(held.value, "lock") if held else {}
                raise LogLockedError(
                    f"consumer {self.name!r} of job {self.job!r} is in use by pid {who.get('pid') if isinstance(who, dict) else '?'} "
                    f"on {who.get('host') if isinstance(who, dict) else '?'}; close it, or wait for its claim to expire "
                    "(a killed holder's claim expires after the locks bucket's TTL)"
                )
            time.sleep(0.2)
        self._lock_rev, self._lock_value = rev, value
        self._heartbeat = threading.Thread(target=self._beat, name="pd-remote-claim", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        key = lock_key(self.name)
        period = 1.0
        while not self._stop.wait(period):
            conn = self.conn
            if conn is None:
                return
            try:
                try:
                    rev = conn.kv_update(self.job, subjects.LOCKS, key, self._lock_value, self._lock_rev)
                except KeyConflictError:  # expired meanwhile (server down longer than the TTL): take it again
                    rev = conn.kv_create(self.job, subjects.LOCKS, key, self._lock_value)
                self._lock_rev = rev
            except KeyConflictError:
                self._lost = True
                logger.error("remote consumer %r of job %s lost its claim to another process", self.name, self.job)
                return
            except (TransportError, AttributeError):
                continue

    # ------------------------------------------------------------------ metadata
    def _load_meta(self, deadline: float) -> None:
        while True:
            try:
                self._refresh_meta()
            except TransportError:  # a leader election (a node died), a restart: retried within wait
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)
                continue
            if self._meta and not self.missing_ranks():
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if not self._meta:
            raise NotALogError(f"job {self.job!r} on {self.server}: no shipper has stored table metadata yet; start "
                               "`persistent-delta ship ROOT --server ... --job ...` on the trainer hosts, or pass wait=")

    def _refresh_meta(self) -> None:
        for key, (value, _) in self.conn.kv_entries(self.job, subjects.META, subjects.TABLES_KEYS).items():
            try:
                rt = RankTables.decode(open_value(self._ring, self.job, subjects.META, key, value), f"job {self.job} {key}")
                if key != subjects.tables_key(rt.rank) or (self._expected is not None and rt.rank not in self._expected):
                    raise StreamDataError(f"job {self.job} {key}: holds the table metadata of rank {rt.rank}",
                                          subject=key)
                self._newest(rt.rank, rt.identity, f"the table metadata {key}", key)
            except (RejectedMessageError, CorruptRecordError) as exc:  # not authentic, not this job's, malformed
                self._reject(exc)
                continue
            self._meta[rt.rank] = rt
            if rt.world_size is not None and self._expected is None:
                self._expected = set(range(rt.world_size))
        for rank in sorted(self._meta) if self._expected is None else sorted(self._expected & set(self._meta)):
            if rank not in self._ranks:
                stream = self._layout.stream(rank)
                if stream not in self._stream_ids:
                    self._stream_ids[stream] = self.conn.stream_id(self.job, stream=stream)
                self._ranks[rank] = self._new_state(rank)

    def _newest(self, rank: int, ident: Optional[LogIdentity], what: str, subject: str = "", seq: int = 0) -> None:
        """Adopt ``ident`` as rank ``rank``'s log when it is newer than the newest seen (a
        consumer never goes back to an older one).

        Raises:
            OlderLogError: ``ident`` is of an older log of the rank (``what`` names the message).
        """
        if ident is None:
            return
        cur = self._logs.get(rank)
        if ident.older_than(cur):
            assert cur is not None
            raise OlderLogError(f"{self._where(rank)}: {what} is of {ident.describe()}, older than the rank's "
                                f"{cur.describe()}: the previous run's data (before a start afresh), replayed or left "
                                "on the stream; skipped", subject=subject, seq=seq)
        if cur is None or cur.older_than(ident):
            self._logs[rank] = ident
            self._scans.setdefault(rank, MarkerScan()).adopt(ident)

    def _reject(self, exc: PersistentDeltaError) -> None:
        """Report a message, value or range that is skipped (never applied)."""
        self.rejected.append(exc)
        self.last_error = str(exc)[:500]
        logger.warning("remote consumer %r of job %s: skipped: %s", getattr(self, "name", "?"), self.job, exc)

    def _job_tables(self) -> List[str]:
        return sorted({fqn for rt in self._meta.values() for fqn in rt.entries})

    def missing_ranks(self) -> List[int]:
        """Ranks of the job whose shipper has not stored its table metadata yet."""
        return sorted((self._expected or set()) - set(self._meta))

    @property
    def ranks(self) -> List[int]:
        return sorted(self._ranks)

    # ------------------------------------------------------------------ positions
    def _new_state(self, rank: int) -> _RankState:
        return _RankState(rank, None, 1, None, RangeAssembler(self.job, self.channel, rank, self._max_buffer))

    def _load_positions(self) -> None:
        got = self._retrying(lambda: self.conn.kv_get(self.job, subjects.OFFSETS, offsets_key(self.name, self.channel)))
        stored: Dict[str, Any] = {}
        was: Optional[Dict[Any, Any]] = None  # stream name -> its identity at the commit
        if got is not None:
            d = codec.unpack(got.value, "remote offsets")
            stored = d.get("ranks", {}) if isinstance(d, dict) else {}
            if not isinstance(stored, dict):
                stored = {"": stored}  # reported below as malformed
            if isinstance(d, dict) and isinstance(d.get("streams"), dict):
                was = d["streams"]
            elif isinstance(d, dict) and isinstance(d.get("stream"), str):
                was = {subjects.stream_name(self.job): d["stream"]}
        for rank, st in self._ranks.items():
            entry = stored.get(str(rank))
            if entry is not None:
                pos, seq, epoch = self._stored_position(entry, rank)
                st.pos, st.seq, st.epoch = pos, seq, epoch  # pos None: reset to earliest
                st.history = stored_history(entry)
                stream = self._layout.stream(rank)
                if was is not None and was.get(stream) != self._stream_ids.get(stream):
                    st.seq = 1  # committed on a stream since deleted and created again: read the new one from its start
                st.resume_seq = st.seq
                self._stored_log(st, entry)
            elif self.reset == "latest":
                self._to_latest(st)
            else:
                self._to_earliest(st)

    def _stored_log(self, st: _RankState, entry: Dict[str, Any]) -> None:
        """The identity stored with rank ``st``'s position: adopted when it is the newest seen;
        when the rank's table metadata is of a newer log (the job was started afresh since the
        commit), the position counts batches of a log that is gone: reset by the reset policy,
        or (``reset=None``) the next poll raises :class:`OffsetOutOfRangeError`. A position
        stored before identities has none (nothing to compare)."""
        try:
            st.log = LogIdentity.from_value(entry)
        except ValueError as exc:
            raise StreamDataError(f"the stored position of remote consumer {self.name!r} ({self.channel}) for "
                                  f"{self._where(st.rank)} is malformed ({exc}); reset it with `persistent-delta offsets "
                                  "--server ... --reset`") from exc
        newest = self._logs.get(st.rank)
        if st.log is None or not st.log.older_than(newest):
            try:
                self._newest(st.rank, st.log, "the stored position")
            except OlderLogError:  # not reached: checked above
                pass
            return
        assert newest is not None
        st.stale = (f"remote consumer {self.name!r} committed batch {st.pos} of {st.log.describe()}, and "
                    f"{self._where(st.rank)} is now {newest.describe()} (the job was started afresh): that position "
                    "counts batches of a log that is gone")
        if self.reset is None:
            return
        logger.warning("%s; reset to %s", st.stale, self.reset)
        st.stale = ""
        if self.reset == "latest":
            self._to_latest(st)
        else:
            self._to_earliest(st)

    def _stored_position(self, entry: object, rank: int) -> "tuple[Optional[int], int, Optional[str]]":
        """(pos, seq, epoch) of a stored position entry, checked.

        Raises:
            StreamDataError: malformed (reset it with ``offsets --server`` or ``seek``).
        """
        try:
            if not isinstance(entry, dict):
                raise ValueError("not a map")
            pos, seq, epoch = entry.get("pos"), entry["seq"], entry.get("epoch")
            for v, lo in ((pos, 0), (seq, 1)):
                if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v < MAX_BATCH_IDX):
                    raise ValueError(f"{str(v)[:40]} is not a position")
            if epoch is not None and not isinstance(epoch, str):
                raise ValueError("epoch is not a string")
            return pos, int(seq), epoch
        except (KeyError, ValueError) as exc:
            raise StreamDataError(f"the stored position of remote consumer {self.name!r} ({self.channel}) for "
                                  f"{self._where(rank)} is malformed ({exc}); seek() and commit(), or reset it: "
                                  f"persistent-delta offsets --server {self.server} --job {self.job} --reset {self.name} "
                                  "--to-earliest --execute") from exc

    def _scan(self, rank: int) -> MarkerScan:
        """Rank ``rank``'s latest genuine range, read forward (the last message may be a replay)."""
        scan = self._scans.setdefault(rank, MarkerScan())
        scan.adopt(self._logs.get(rank))
        return self._retrying(lambda: scan_markers(self.conn, self._ring, self.job, self.channel, rank, scan,
                                                   self._reject, stream=self._layout.stream(rank)))

    def _to_latest(self, st: _RankState) -> None:
        m = self._scan(st.rank).latest
        self._clear(st)
        st.log = self._logs.get(st.rank)
        if m is None:
            st.pos, st.seq, st.epoch = None, 1, None
            return
        st.pos, st.seq, st.epoch = m.end, m.seq + 1, m.epoch
        st.resume_seq = st.seq

    def _to_earliest(self, st: _RankState) -> None:
        self._clear(st)
        st.pos, st.seq, st.epoch, st.resume_seq = None, 1, None, 1
        st.log = self._logs.get(st.rank)

    def _clear(self, st: _RankState) -> None:
        st.stale = ""  # the position is set anew
        st.ranges.clear()
        st.buffered = 0
        st.gap = None
        st.reported = None
        st.assembler = RangeAssembler(self.job, self.channel, st.rank, self._max_buffer)

    def position(self) -> Dict[int, int]:
        """rank -> the next batch_idx ``poll`` reads (0 for a rank with nothing shipped yet)."""
        self._check()
        return {r: (st.pos if st.pos is not None else 0) for r, st in sorted(self._ranks.items())}

    def seek(self, batch_idx: int, rank: Optional[int] = None) -> None:
        """Move the position (every rank's, or one rank's) to ``batch_idx``, in memory; the
        next poll reads the stream from its start to find it (a range holding ``batch_idx``
        is delivered whole, and reports its start)."""
        self._check()
        check_batch_idx(batch_idx)
        if rank is not None and rank not in self._ranks:
            raise InvalidInputError(f"rank {rank} is not a rank of job {self.job!r} (ranks: {self.ranks})")
        for st in [self._ranks[rank]] if rank is not None else list(self._ranks.values()):
            self._clear(st)
            st.pos, st.seq, st.epoch, st.resume_seq = batch_idx, 1, None, 1
            st.log = self._logs.get(st.rank)  # a batch of the rank's newest log

    def bootstrap(self, progress: Optional[Callable[[int, int], None]] = None,
                  wait: float = 0.0) -> BaseTables:
        """A full base state from the stream, for a replica that joins late or after its
        position expired: the full tables (fqn -> ``(global_rows, global_cols)``) assembled
        from every rank's base (:func:`persistent_delta.fleet.ship.upload_base`), and
        every rank's position moved just past the base's publish (in memory; ``commit`` stores
        it). Apply the polls that follow to the returned tables: a
        :class:`~persistent_delta.read.base.BaseTables` continuing from just past the base's
        publish, so ``apply_poll`` refuses a poll that does not follow it
        (:class:`~persistent_delta.errors.StaleBaseError`).

        Args:
            progress: called with (ranks fetched, ranks) before the first rank's base and
                after each (e.g. a tqdm bar's ``total``/``n``).
            wait: seconds to wait for every rank's base, for a replica started alongside its
                trainer (which uploads the bases at its start). 0 (the default) reads what
                is there now; other refusals are raised at once.

        Raises:
            NotALogError: a rank of the job has no base on the stream (or no table metadata),
                after ``wait``.
            InvalidInputError: the ranks' bases were taken at different publishes.
            AuthenticationError: a base does not authenticate with the job's key.
            OlderLogError: a rank's base is of an older log than the newest this consumer has seen
                for it (the previous run's base, put back), after ``wait``.
            StreamDataError: a base does not match the job's table metadata (a table missing or
                unknown, another shape or dtype, a stamp out of bounds). Nothing moves.
        """
        self._check()
        if wait < 0:
            raise InvalidInputError(f"wait must be >= 0 seconds, got {wait}")
        deadline = time.monotonic() + wait
        while True:
            try:
                return self._bootstrap(progress)
            except (NotALogError, OlderLogError):  # no base of the rank's newest log yet
                if time.monotonic() >= deadline:
                    raise
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
                try:
                    self._refresh_meta()  # a rank's table metadata may come with its base
                except TransportError:  # retried within wait, as at open
                    pass

    def _bootstrap(self, progress: Optional[Callable[[int, int], None]]) -> BaseTables:
        stamps: Dict[int, int] = {}
        full: Dict[str, torch.Tensor] = {}
        bases: Dict[int, Dict[str, torch.Tensor]] = {}
        logs: Dict[int, Optional[LogIdentity]] = {}
        try:
            self._refresh_meta()  # the ranks' newest logs, as their shippers stored them
        except TransportError:
            pass
        ranks = sorted(self._expected or self._meta)
        for done, rank in enumerate(ranks):
            if progress is not None:
                progress(done, len(ranks))
            name = subjects.base_name(rank)
            buf = self._retrying(lambda: self.conn.object_get(self.job, name))
            if buf is None or rank not in self._meta:
                raise NotALogError(f"job {self.job!r}: rank {rank} has no base (or no table metadata) on {self.server}; "
                                   "upload one with persistent_delta.fleet.ship.upload_base on every rank")
            body = open_value(self._ring, self.job, subjects.BASE, name, buf)
            stamps[rank], bases[rank], logs[rank] = wire.decode_base(body, self._where(rank))
            self._newest(rank, logs[rank], f"the base (batch {stamps[rank]})", subject=name)
            if logs[rank] is None:
                logger.warning("%s: the base carries no log identity (uploaded without one): it cannot be checked "
                               "against the rank's newest log", self._where(rank))
            self._check_base(rank, stamps[rank], bases[rank])
        for rank, tables in bases.items():
            meta = self._meta[rank]
            for fqn, values in tables.items():
                shard = ShardInfo.from_entry(TableEntry.from_bytes(fqn, meta.entries[fqn]))
                rows = shard.global_rows if shard is not None and shard.global_rows is not None else values.shape[0]
                cols = shard.global_cols if shard is not None and shard.global_cols is not None else values.shape[1]
                t = full.setdefault(fqn, torch.zeros(rows, cols, dtype=values.dtype))
                r0, c0 = (shard.row_offset, shard.col_offset) if shard is not None else (0, 0)
                if t.dtype != values.dtype or r0 + values.shape[0] > t.shape[0] or c0 + values.shape[1] > t.shape[1]:
                    raise StreamDataError(f"{self._where(rank)}: the base of {fqn!r} does not fit the full table "
                                          f"{tuple(t.shape)} {t.dtype} at ({r0}, {c0})")
                t[r0:r0 + values.shape[0], c0:c0 + values.shape[1]] = values
        if progress is not None:
            progress(len(ranks), len(ranks))
        if len(set(stamps.values())) > 1:
            raise InvalidInputError(f"job {self.job!r}: the ranks' bases were taken at different publishes "
                                    f"{stamps}; upload them at the same step on every rank")
        for rank, stamp in stamps.items():
            st = self._ranks[rank]
            self._clear(st)
            st.pos, st.seq, st.epoch, st.resume_seq = stamp + 1, 1, None, 1
            st.log = logs.get(rank) or self._logs.get(rank)
        return BaseTables(full, positions={rank: stamp + 1 for rank, stamp in stamps.items()}, batches=stamps,
                          source=f"the base of job {self.job!r} (bootstrap)")

    def _check_base(self, rank: int, stamp: int, tables: Dict[str, torch.Tensor]) -> None:
        """A rank's base against its table metadata: every table, 2-D floats, the shard's shape,
        the table's value dtype where known (the stamp's bounds are :func:`wire.decode_base`'s).

        Raises:
            StreamDataError: it does not match.
        """
        where = f"{self._where(rank)}: base"
        entries = self._meta[rank].entries
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

    def end_offsets(self) -> Dict[int, int]:
        """rank -> one past the last batch shipped to the stream."""
        self._check()
        out = {}
        for rank in self._ranks:
            m = self._scan(rank).latest
            out[rank] = 0 if m is None else m.end
        return out

    def _retrying(self, fn: Callable[[], _T]) -> _T:
        deadline = time.monotonic() + self._retry_s
        while True:
            try:
                return fn()
            except TransportError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def commit(self) -> Dict[int, int]:
        """Store the current positions in the job's ``offsets`` bucket (replicated with the
        stream). Returns them.

        Raises:
            LogLockedError: the claim on the name was lost (another process took it).
            TransportError: the server stayed unreachable for ``retry_s`` (nothing is stored).
        """
        self._check()
        if self._lost:
            raise LogLockedError(f"consumer {self.name!r} of job {self.job!r} lost its claim; nothing committed")
        positions = {r: st.pos for r, st in self._ranks.items() if st.pos is not None}
        now = time.time()
        # each rank's commit joins its history, with the stream's end as far as this consumer has
        # read it (its buffered ranges' end): what the health rule judges the lag at each commit by
        histories = {r: (*self._ranks[r].history, CommitPoint(now, pos, self._seen_end(self._ranks[r], pos))
                         )[-COMMIT_HISTORY:] for r, pos in positions.items()}
        ranks = {str(r): {"pos": pos, "seq": self._ranks[r].resume_seq, "epoch": self._ranks[r].epoch,
                          HISTORY_KEY: [[p.time, p.offset, p.end] for p in histories[r]],
                          **(self._ranks[r].log.to_value() if self._ranks[r].log is not None else {})}
                 for r, pos in positions.items()}
        streams: Dict[str, Any] = ({"stream": self._stream_ids.get(subjects.stream_name(self.job), "")}
                                   if self._layout.single else {"streams": dict(self._stream_ids)})
        value = codec.pack({"name": self.name, "channel": self.channel, "ranks": ranks, "time": now, **streams})
        self._retrying(lambda: self.conn.kv_put(self.job, subjects.OFFSETS, offsets_key(self.name, self.channel), value))
        for r, h in histories.items():
            self._ranks[r].history = h
        return dict(positions)

    @staticmethod
    def _seen_end(st: _RankState, pos: int) -> int:
        """The stream's end as far as rank ``st`` has read it (no request): its last buffered
        range's end, or the first range past a gap, or its position when it holds nothing."""
        if st.gap is not None:
            return max(pos, st.gap.marker.end)
        return max(pos, st.ranges[-1].marker.end) if st.ranges else pos

    def committed(self) -> Dict[int, int]:
        """rank -> the position stored in the ``offsets`` bucket now.

        Raises:
            UnknownConsumerError: nothing stored for this name and channel.
        """
        self._check()
        got = self._retrying(lambda: self.conn.kv_get(self.job, subjects.OFFSETS, offsets_key(self.name, self.channel)))
        if got is None:
            raise UnknownConsumerError(f"remote consumer {self.name!r} ({self.channel}) of job {self.job!r} has no "
                                       "committed position")
        d = codec.unpack(got.value, "remote offsets")
        ranks = d.get("ranks") if isinstance(d, dict) else None
        out: Dict[int, int] = {}
        for r, v in (ranks.items() if isinstance(ranks, dict) else []):
            if str(r).isdigit() and int(r) in self._ranks:
                pos = self._stored_position(v, int(r))[0]
                if pos is not None:
                    out[int(r)] = pos
        return out

    # ------------------------------------------------------------------ reading
    def _where(self, rank: int) -> str:
        return f"rank {rank} of job {self.job} ({self.channel}) on {self.server}"

    def _fill(self, st: _RankState) -> None:
        """Read rank ``st``'s stream messages into complete buffered ranges (bounded)."""
        subject = subjects.rank_filter(self.job, self.channel, st.rank)
        end_subject = subjects.end_subject(self.job, self.channel, st.rank)
        stream = self._layout.stream(st.rank)
        while st.gap is None and st.buffered < self._max_buffer:
            msgs, more = self.conn.get_batch(self.job, subject, st.seq, _GET_BATCH,
                                              min(_GET_BYTES, max(1 << 20, self._max_buffer - st.buffered)),
                                              stream=stream)
            if not msgs:
                if time.monotonic() - self._stream_checked >= _STREAM_CHECK_S and self._recreated(st.rank):
                    continue  # caught up on a stream since created again below this sequence
                return
            for seq, subj, headers, data in msgs:
                try:  # anything that does not authenticate is skipped (and reported): never applied
                    verify_message(self._ring, self.job, subj, headers, data, seq)
                except AuthenticationError as exc:
                    st.seq = seq + 1
                    self._reject(exc)
                    continue
                if self._ring.insecure and wire.FORMAT_HEADER not in headers:
                    st.seq = seq + 1  # unauthenticated and not ours: foreign
                    self._reject(StreamDataError(f"{self._where(st.rank)}: message {seq} on {subj[:200]!r} is not "
                                                 "a persistent_delta message", subject=subj, seq=seq))
                    continue
                wire.check_format(headers, self._where(st.rank))  # authenticated: refused again by the next poll
                st.seq = seq + 1
                try:
                    if subj != end_subject:
                        st.assembler.add_part(headers, data, seq, subj)
                        continue
                    m = Marker.decode(data, seq, self._where(st.rank), headers)
                except StreamDataError as exc:
                    self._reject(exc)
                    continue
                if m.side is None and self._managed(st.rank):
                    st.seq = seq  # refused again by the next poll, never skipped
                    raise FormatMismatchError(
                        f"{self._where(st.rank)}: range [{m.start}, {m.end}) was shipped without the side records of "
                        "its managed-collision tables (an older shipper): a raw-id map built from it would be wrong; "
                        "upgrade the shipper, and seek() this consumer past that range or to a base")
                self._on_marker(st, m)
                if st.gap is not None or st.buffered >= self._max_buffer:
                    return
            if not more:
                return  # caught up: a new marker wakes the next poll (no request that would come back empty)

    def _recreated(self, rank: int) -> bool:
        """Whether the stream of ``rank`` was deleted and created again since this consumer last
        looked (its sequence numbers started again at 1). Every stream read is looked at: the
        ranks of each one created again are read again from its start -- ranges at or below a
        position are re-sends, a range above it is the gap it is."""
        self._stream_checked = time.monotonic()
        changed = set()
        for name, was in list(self._stream_ids.items()):
            now = self.conn.stream_id(self.job, stream=name)
            if now != was:
                changed.add(name)
                self._stream_ids[name] = now
        if not changed:
            return False
        logger.warning("remote consumer %r of job %s: stream(s) %s were deleted and created again; reading them from "
                       "their start", self.name, self.job, sorted(changed))
        for st in self._ranks.values():
            if self._layout.stream(st.rank) in changed:
                st.seq = st.resume_seq = 1
                st.gap, st.gap_complete = None, False
                self._scans.pop(st.rank, None)
        return self._layout.stream(rank) in changed

    def _managed(self, rank: int) -> bool:
        """Whether the lookups channel of ``rank`` has managed-collision tables (their side
        records travel with every range)."""
        meta = self._meta.get(rank)
        return self.channel == LOOKUPS and meta is not None and any(
            is_managed(TableEntry.from_bytes(fqn, b)) for fqn, b in meta.entries.items())

    def _on_marker(self, st: _RankState, m: Marker) -> None:
        try:  # a range of an older log of the rank than the newest seen: the previous run's, replayed
            self._newest(st.rank, m.log, f"range marker {m.seq} [{m.start}, {m.end})", seq=m.seq)
        except OlderLogError as exc:
            self._reject(exc)
            return  # its parts stay pending until the next marker takes its own (and drops the others)
        if st.epoch is not None and m.epoch != st.epoch and (m.epoch in st.left or (m.prev is not None and any(
                r.marker.epoch == m.epoch for r in st.ranges))):
            return  # a replay of an epoch an explicit epoch start replaced
        if m.end == m.start and not m.listing:
            self._on_progress(st, m)
            return
        try:
            if m.digests is None and not self._ring.insecure:
                raise StreamDataError(f"{self._where(st.rank)}: range marker {m.seq} does not list its parts' digests",
                                      seq=m.seq)
            got = st.assembler.complete(m)
            if got is not None:
                got = self._keep_format(m, got)
                self._validate(st.rank, m, got)
        except (RejectedMessageError, CorruptRecordError) as exc:
            self._reject(exc)
            return  # as if never sent: never applied, and no position moves past it
        tables, side, stamps = (None, {}, {}) if got is None else (got.tables, got.side, got.stamps)
        expected = st.ranges[-1].marker.end if st.ranges else st.pos
        restarted = expected is not None and (
            (st.epoch is not None and m.epoch != st.epoch and int(m.info.get("log_end", m.end)) < expected)
            or (st.log is not None and st.log.older_than(m.log)))  # a newer log of the rank: batches count anew
        if expected is None:  # a new consumer at "earliest": the first range on the stream
            if tables is None:
                return
            st.pos = expected = m.start
            st.log = m.log
        nbytes = 0 if tables is None else sum(
            int(u.ids.nbytes) + (0 if u.states is None else int(u.states.nbytes)) for u in tables.values()) + sum(
            int(ids.nbytes) + int(states.nbytes) for recs in side.values() for _, ids, states in recs)
        if restarted or (m.end > expected and (m.start > expected or tables is None)):
            # batches missing at the position: the log was started afresh (its batch numbers
            # restarted below us), or the stream lacks [expected, m.start) or this range's parts
            st.gap, st.gap_complete = _Range(m, tables or {}, nbytes, side, stamps), tables is not None
            return
        if m.end <= expected:
            return  # a re-send (or a range already delivered): never applied twice
        assert tables is not None
        st.ranges.append(_Range(m, tables, nbytes, side, stamps))
        st.reported = (m.end, m.batches_ended)
        st.buffered += nbytes
        if m.log is not None:
            st.log = m.log
        if st.epoch is not None and m.epoch != st.epoch and m.prev is None:
            st.left.add(st.epoch)  # an explicit epoch start: the old epoch's markers are replays from now on
        st.epoch = m.epoch

    def _on_progress(self, st: _RankState, m: Marker) -> None:
        """A progress marker (:mod:`~persistent_delta.fleet.wire`: no rows, the rank's batches
        ended): kept when it continues what the rank buffered, of the same log (never a
        position, a gap or an epoch change: the ranges' markers decide those)."""
        expected = st.ranges[-1].marker.end if st.ranges else st.pos
        if (expected is None or m.end == expected) and (m.log is None or st.log is None or m.log == st.log):
            was = st.reported[1] if st.reported is not None and st.reported[0] == m.end else m.end
            st.reported = (m.end, max(was, m.batches_ended))

    def _behind(self) -> Dict[int, int]:
        """The job's ranks behind on the snapshots channel, by the local readers' rule over what
        each rank's markers said (:func:`~persistent_delta.read.polling.tell_behind`); a rank
        whose markers said nothing yet is left out."""
        if self.channel != SNAPSHOTS or self._expected is None or self.missing_ranks():
            return {}
        ends = {r: st.reported for r, st in self._ranks.items() if st.reported is not None}
        return tell_behind(f"job {self.job} on {self.server}", ends, self._told_behind, stacklevel=4)

    def _keep_format(self, m: Marker, got: RangeContent) -> RangeContent:
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
        for f, rows in got.formats.items():
            if f != self.format:
                passed += len(rows)
                continue
            tables.update(rows)
            stamps.update(got.format_stamps.get(f, {}))
        m.info["passed_over"] = passed
        return RangeContent(tables, got.side, stamps)

    def _validate(self, rank: int, m: Marker, got: RangeContent) -> None:
        """Check a complete range against the rank's table metadata before anything of it is kept.

        Raises:
            StreamDataError: a table not in the metadata, ids not int64 / 1-D / within the rank's
                shard, states of another dtype or row shape, stamps out of bounds.
        """
        meta = self._meta.get(rank)
        where = f"{self._where(rank)}: range [{m.start}, {m.end}) (marker {m.seq})"
        if meta is None:
            raise StreamDataError(f"{where}: the rank has no table metadata", seq=m.seq)
        if any(fqn not in meta.entries for fqn in list(got.tables) + list(got.side)):
            self._refresh_meta()  # a table new since the metadata was read: its shipper stored it again
            meta = self._meta[rank]
        for fqn, u in got.tables.items():
            if fqn not in meta.entries:
                raise StreamDataError(f"{where}: table {fqn[:200]!r} is not in the rank's metadata", seq=m.seq)
            entry = TableEntry.from_bytes(fqn, meta.entries[fqn])
            _check_ids(u.ids, ShardInfo.from_entry(entry), f"{where} table {fqn!r}", m.seq)
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

    def _resolve_gap(self, st: _RankState) -> None:
        """A gap at the position: raise, or apply the reset policy."""
        assert st.gap is not None
        if self._recreated(st.rank):
            return  # read again from the new stream's start (the caller fills)
        gap, m = st.gap, st.gap.marker
        if self.reset is None:
            afresh = st.log is not None and st.log.older_than(m.log)
            why = (f"batches [{st.pos}, {m.start}) are not on the stream: dropped by its limits, or never shipped "
                   "because the shipper fell past the trainer's retention bound"
                   if (st.pos is None or m.start > st.pos) and not afresh
                   else f"the log was started afresh: a new shipper epoch, its batch numbers restarted at {m.start}")
            raise OffsetOutOfRangeError(
                f"remote consumer {self.name!r} is at batch {st.pos} of {self._where(st.rank)}, but the stream's next "
                f"range is [{m.start}, {m.end}) ({why}). Pass reset='earliest' or 'latest', or seek()"
            )
        logger.warning("remote consumer %r: %s: position %s out of range (next range [%d, %d)); reset to %s", self.name,
                       self._where(st.rank), st.pos, m.start, m.end, self.reset)
        if self.reset == "latest":
            self._to_latest(st)
            return
        # "earliest": the first complete range on the stream from here on
        seq = st.seq
        self._clear(st)
        st.seq, st.epoch, st.log = seq, m.epoch, m.log
        if st.gap_complete:
            st.pos = m.start
            st.ranges.append(gap)
            st.buffered = gap.nbytes
        else:
            st.pos = None

    def poll(self, max_batches: Optional[int] = None, timeout: Optional[float] = None,
             max_bytes: Optional[int] = None) -> DeltaPoll:
        """Per rank, the complete ranges from the position up to the end every rank of the job
        has shipped (at most about ``max_batches``; a range is never split), merged per table;
        moves the position past them. See :meth:`DeltaConsumer.poll`.

        ``max_bytes``: cut the poll at this byte budget by
        :func:`~persistent_delta.read.polling.byte_cut` (the same rule as a local reader's): a
        piece is a buffered range, sized by its rows summed over ranks; the poll ends at the
        end of the last range that fits (the same on every rank, so publishes stay whole), and
        reads at least one. A replica catching up uses it to bound each poll's result (what the
        consumer buffers from the stream is bounded by ``max_buffer_bytes``).

        While the server cannot be reached the poll delivers what it buffered and retries
        until its timeout (``last_error`` says why); ``commit`` retries up to ``retry_s``.

        Raises:
            OffsetOutOfRangeError: batches at the position are missing from the stream, or the
                stored position counts batches of an older log of a rank than its newest (the job
                was started afresh since the commit), and no reset policy was chosen.
        """
        self._check()
        check_poll_args(max_batches, timeout, max_bytes)
        self._check_stale()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._wake.clear()
            try:
                if self.missing_ranks() or not self._ranks:
                    self._refresh_meta()
                    for st in self._ranks.values():
                        if st.pos is None and st.seq == 1 and self.reset == "latest":
                            self._to_latest(st)
                for st in self._ranks.values():
                    self._fill(st)
                self.last_error = ""
            except TransportError as exc:
                # the server is unreachable (restarting, a leader election): like Kafka's
                # consumer, the poll delivers what it has and retries until its timeout
                if self.last_error != str(exc):
                    logger.warning("remote consumer %r: %s (retrying)", self.name, exc)
                self.last_error = str(exc)
            with intra_op_threads(self._read_threads):
                result = self._poll_once(max_batches, max_bytes)
            if not result.empty or deadline is None or time.monotonic() >= deadline:
                return result
            self._wake.wait(min(max(0.0, deadline - time.monotonic()), _RECHECK_S))

    def _check_stale(self) -> None:
        """Raise for a stored position of an older log than the rank's newest (see :meth:`_stored_log`)."""
        for st in self._ranks.values():
            if st.stale:
                raise OffsetOutOfRangeError(f"{st.stale}. Pass reset='earliest' or 'latest', or seek(); or reset it: "
                                            f"persistent-delta offsets --server {self.server} --job {self.job} --reset "
                                            f"{self.name} --to-earliest --execute")

    def _poll_once(self, max_batches: Optional[int], max_bytes: Optional[int] = None) -> DeltaPoll:
        for st in self._ranks.values():
            if st.gap is not None and not st.ranges:
                self._resolve_gap(st)
                self._fill(st)
        behind = self._behind()
        known = {r: st for r, st in self._ranks.items() if st.pos is not None}
        positions = {r: int(st.pos) for r, st in known.items()}  # type: ignore[arg-type]
        ends = {r: (st.ranges[-1].marker.end if st.ranges else int(st.pos)) for r, st in known.items()}  # type: ignore[arg-type]
        hard = position_rules.poll_stops(positions, ends, self._expected, None)
        if max_bytes is not None:
            pieces: Dict[int, int] = {}  # range end -> its rows' bytes, summed over ranks
            for rank, st in known.items():
                for r in st.ranges:
                    if r.marker.end <= hard[rank]:
                        pieces[r.marker.end] = pieces.get(r.marker.end, 0) + r.nbytes
            hard = clip_stops(positions, hard, byte_cut(pieces, max_bytes, max(hard.values(), default=0)))
        soft = {r: min(s, hard[r]) for r, s in position_rules.poll_stops(positions, ends, self._expected, max_batches).items()}
        common = self._common_stop(known, positions, hard, soft)
        out: Dict[int, RankDelta] = {}
        for rank, st in sorted(self._ranks.items()):
            taken: List[_Range] = []
            if rank in known:
                while st.ranges and st.ranges[0].marker.end <= hard[rank] and (
                        common is None or st.ranges[0].marker.end <= common) and (
                        common is not None or not taken or st.ranges[0].marker.end <= soft[rank]):
                    taken.append(st.ranges.popleft())
            out[rank] = self._deliver(st, taken)
        if self.format == codec.INT8:
            join_int8(out)  # column-wise tables: halves joined and quantized, as a local poll's
        return DeltaPoll(channel=self.channel, ranks=out,
                         world_size=None if self._expected is None else len(self._expected),
                         read_threads=self._read_threads, format=self.format, behind=behind)

    def _common_stop(self, known: Dict[int, _RankState], positions: Dict[int, int], hard: Dict[int, int],
                     soft: Dict[int, int]) -> Optional[int]:
        """Where every rank stops when they all sit at the same position: the largest range end
        that every rank has buffered (within the poll's stops), so that each rank reads the same
        range (a complete poll: every publish's column halves and row shards together). Shippers
        cut ranges at the same multiples, so the ranks' range ends meet there at the latest.
        None when the positions differ (a rank was seeked alone) or the job is not known."""
        if self._expected is None or set(known) != self._expected or len(set(positions.values())) != 1:
            return None
        ends = None
        for rank, st in known.items():
            mine = {r.marker.end for r in st.ranges if r.marker.end <= hard[rank]}
            ends = mine if ends is None else ends & mine
        if not ends:
            return next(iter(positions.values()))  # nothing common yet: deliver nothing
        limit = min(soft.values())
        within = [e for e in ends if e <= limit]
        return max(within) if within else min(ends)

    def _deliver(self, st: _RankState, taken: List[_Range]) -> RankDelta:
        pos = st.pos if st.pos is not None else 0
        start = min([pos] + [r.marker.start for r in taken])
        end = taken[-1].marker.end if taken else pos
        meta = self._meta.get(st.rank)
        rd = RankDelta(rank=st.rank, path=f"{self.server}/{self._layout.stream(st.rank)}/{self.channel}/rank-{st.rank}",
                       start_idx=start, end_idx=end)
        for r in taken:
            for stamp, t in r.marker.info.get("publishes", []):
                rd.publishes[int(stamp)] = min(float(t), rd.publishes.get(int(stamp), float(t)))
            rd.passed_over += int(r.marker.info.get("passed_over", 0))
            if r.marker.info.get("deferred") is not None:  # the newest range's count (as its shipper read the log)
                rd.deferred = st.deferred = int(r.marker.info["deferred"])
        if rd.deferred is None:  # nothing new: still what the last range delivered said
            rd.deferred = st.deferred
        if meta is None:
            return rd
        mode = UpdateMode(meta.modes.get(self.channel, "none"))
        for fqn, entry_bytes in sorted(meta.entries.items()):
            if self._tables_filter is not None and fqn not in self._tables_filter:
                continue
            entry = TableEntry.from_bytes(fqn, entry_bytes)
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
                rows = empty_rows(entry, mode, self.channel, self.format)
            shard = ShardInfo.from_entry(entry)
            zch = None
            # the same rule as a local read (zch_records); snapshots: the publishes' slot reassignments
            if is_managed(entry) and (self.channel == LOOKUPS or any(fqn in r.side for r in taken)):
                zch = side_delta(fqn, start, end, [rec for r in taken for rec in r.side.get(fqn, [])],
                                 shard.row_offset if shard is not None else 0, f"{self._where(st.rank)} {fqn!r}")
            rd.tables[fqn] = table_delta(fqn, st.rank, start, end, rows, shard, stamps, zch, self.format)
        for r in taken:
            st.buffered -= r.nbytes
        if taken:
            st.pos = end
            st.resume_seq = taken[-1].marker.seq + 1
            self.last_shipped[st.rank] = taken[-1].marker.shipped
        return rd


    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release the name and close the connection (positions not committed are dropped).
        Idempotent."""
        self._closed = True
        self._stop.set()
        conn = getattr(self, "conn", None)
        if conn is None:
            return
        self.conn = None  # type: ignore[assignment]
        if getattr(self, "_lock_rev", None) is not None and not self._lost:
            try:
                conn.kv_delete(self.job, subjects.LOCKS, lock_key(self.name))
            except TransportError:
                pass  # it expires by itself
        conn.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check(self) -> None:
        if self._closed:
            raise LogClosedError(f"{self!r} is closed")

    def __del__(self) -> None:
        warn_unclosed(self, repr(self))

    def __enter__(self) -> "RemoteConsumer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteConsumer(job={getattr(self, 'job', '?')!r}, {getattr(self, 'name', '?')!r}, channel={getattr(self, 'channel', '?')!r})"
