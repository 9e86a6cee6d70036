"""The shipper: each local rank log of a job, shipped to the job's stream.

Owns: moving complete batches from the local logs to the stream, and when the local position
may advance. One shipper per host, beside the trainer (its own process: ``persistent-delta
ship ROOT --server nats://HOST:PORT --job NAME``, or a thread of the trainer:
:meth:`Shipper.start`); a rank's base (:func:`upload_base`). What goes on the stream is
:mod:`persistent_delta.fleet.wire`'s, under :mod:`persistent_delta.fleet.subjects`' names; it
is sent through a :class:`~persistent_delta.fleet.transport.Transport` (NATS JetStream for a
server URL).

Design note
-----------
For each local rank log and channel the shipper is a registered consumer
(:class:`~persistent_delta.DeltaConsumer` named ``ship-<job>-<channel>``, reading that rank
only: it never waits for other hosts' ranks). A round polls at most ``max_batches`` batches
(cut at multiples of ``max_batches``, so ranks shipped at different paces still cut their
ranges at the same batches), sends the range's parts (on the lookups channel with the
side records of managed-collision tables over the same range, read from the log in a
transaction of their own: :func:`persistent_delta.log.zch_records.shipped_side`), then its marker,
and commits the local position **only after the stream acknowledged all of them** (at most
every 0.1 s while busy, at once when idle: an fsync per range would delay the next one). A crash at any instant
therefore re-sends at most the range in flight, under the same message ids (the server
drops them within its duplicate window; remote consumers drop a range ending at or below
their position after it). On start the shipper reads its last marker on the stream: when it
is ahead of the local position (acknowledged, not yet committed locally) the local position
catches up first, so nothing is shipped twice as a different range.

**The trainer is never held by the network.** The shipper only reads the logs; while the
stream is unreachable it retries and its local position holds retention back like any
registered consumer, within the trainer's :class:`~persistent_delta.config.RetentionBound`.
Past the bound the trainer expires the shipper; its next poll starts at the log start
(``reset="earliest"``) and remote consumers find the gap (a range starting above their
position) and get :class:`~persistent_delta.errors.OffsetOutOfRangeError` or their reset
policy. While a shipper is registered on the lookups channel the trainer writes every batch
whole (as for any out-of-process lookups consumer); ship ``--channels snapshots`` only to
keep the trainer's window filter.

**Streams.** By default every rank ships into the job's one stream. With ``ranks_per_stream``
(``--ranks-per-stream``) ranks ship into a stream per group of that many ranks, so that no one
stream leader takes every write of a large job; the layout is recorded in the job's ``meta``
bucket by its first shipper and is fixed for the job's life (:mod:`persistent_delta.fleet.streams`:
another layout is refused with :class:`~persistent_delta.errors.StreamLayoutError`). A rank's
group stream is created before its table metadata is stored.

Statistics (per rank and channel: position, log end, lag, bytes, retries) are in
:meth:`Shipper.stats` and stored every second in the job's ``meta`` bucket
(``persistent-delta offsets --server``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from persistent_delta.log import codec, position_rules, zch_records
from persistent_delta.fleet import subjects, wire
from persistent_delta.fleet.checkpoint_bases import CheckpointBases
from persistent_delta.fleet.auth import KeySpec, Keyring, open_value, resolve_keyring, seal_value
from persistent_delta.fleet.ranges import MarkerScan, scan_markers
from persistent_delta.fleet.streams import Layout, check_ranks_per_stream, settle_layout
from persistent_delta.config import LogOptions
from persistent_delta.read.consumer import DeltaConsumer
from persistent_delta.read.polling import check_max_batches
from persistent_delta.errors import (
    ConfigMismatchError,
    CorruptRecordError,
    DamagedLogError,
    FormatMismatchError,
    InvalidInputError,
    KeyConflictError,
    NotALogError,
    PersistentDeltaError,
    RejectedMessageError,
    TransportError,
    UnknownConsumerError,
)
from persistent_delta.log.layout import DATA_FILE, EMPTY_RANK_GRACE_S, PathLike, check_root, rank_paths
from persistent_delta.log.deltalog import DeltaLog
from persistent_delta.log.schema import CHANNELS, LOOKUPS, META_TRACKER, SNAPSHOTS, LogIdentity, TrackerMeta, check_channel
from persistent_delta.threads import intra_op_threads
from persistent_delta.fleet.connect import open_transport
from persistent_delta.fleet.transport import ConnectOptions, ServerSpec, StreamOptions, Transport
from persistent_delta.fleet.wire import RankTables
from persistent_delta.log.watch import FileWatch

logger = logging.getLogger(__name__)

_STATS_EVERY_S = 1.0
_RESCAN_EVERY_S = 0.5
_IDLE_WAIT_S = 0.05
_COMMIT_EVERY_S = 0.1
_PROGRESS_EVERY_S = 0.5  # a rank that ends batches without publishing: its progress markers at most this often


def upload_base(
    server: Optional[ServerSpec], job: str, rank: int, stamp: int, tables: Dict[str, torch.Tensor],
    connect: Optional[ConnectOptions] = None, replicas: int = 1, transport: Optional[Transport] = None,
    key: KeySpec = None, insecure: bool = False, log: Optional[str] = None,
) -> None:
    """Upload a rank's **base** (its full tables) to the job's object store, so that a replica
    joining late (or after its position expired) can start from a full state without the
    trainer's disk (:meth:`RemoteConsumer.bootstrap <persistent_delta.fleet.remote.RemoteConsumer.bootstrap>`).

    Call it on every rank at the same step, right after ``tracker.publish(...)``, with
    ``stamp = tracker.curr_batch_idx`` (the stamp that publish used) and ``tables = {fqn:
    table.weights() for fqn, table in tracker.local_tables.items()}``: the base then holds every
    value up to that publish, and a replica continues with the publishes after it. It replaces
    the rank's previous base. Blocks until the server stored it (the trainer's step waits:
    call it on demand or every few thousand steps, not every step).

    Args:
        server: ``nats://HOST:PORT`` (or several / a list: a cluster); None with ``transport``.
        job: the job's name on the stream.
        rank: this rank.
        stamp: the publish the tables are as of.
        tables: fqn -> this rank's full local shard.
        connect: authentication/TLS for ``server``.
        replicas: replicas of the object store, where this call creates it.
        transport: send through this transport instead of a connection to ``server`` (it is
            left open).
        key: the job's stream key (a :class:`~persistent_delta.fleet.auth.StreamKey`, a key
            file, or several: the first signs); default ``PERSISTENT_DELTA_STREAM_KEY_FILE``.
        insecure: upload unsigned when no key is found (consumers with a key refuse it).
        log: the rank's log directory (``tracker.path``): the base carries its identity
            (:class:`~persistent_delta.log.schema.LogIdentity`), and ``bootstrap()`` never
            returns a base of an older log than the newest it has seen for the rank (the
            previous run's base, put back). Default: the identity in the rank's table metadata
            its shipper stored (authenticated with ``key``); a base with neither carries none.

    Raises:
        TransportError: the server is unreachable.
        InvalidInputError: neither ``server`` nor ``transport`` given.
        StreamKeyError: no key, and not ``insecure``.
    """
    ring = resolve_keyring(key, insecure, f"upload_base of job {job!r}")
    name = subjects.base_name(rank)
    job = subjects.check_job(job)
    if transport is None and server is None:
        raise InvalidInputError("upload_base needs a server URL or a transport")
    conn = transport if transport is not None else open_transport(server, connect)
    try:
        data = seal_value(ring, job, subjects.BASE, name, wire.encode_base(stamp, tables, _base_identity(conn, ring, job, rank, log)))
        conn.object_put(job, name, data, replicas=replicas)
    finally:
        if transport is None:
            conn.close()


def _base_identity(conn: Transport, ring: Keyring, job: str, rank: int, log: Optional[str]) -> Optional[LogIdentity]:
    """The identity a rank's base carries: its log's (``log``: the rank's log directory), else
    the one in the rank's table metadata on the stream when it authenticates, else None."""
    if log is not None:
        with DeltaLog(log, readonly=True, writer_lock=False) as opened:
            return opened.read(lambda r: r.identity())
    try:
        got = conn.kv_get(job, subjects.META, subjects.tables_key(rank))
    except TransportError:  # the job's buckets do not exist yet: no shipper has stored anything
        return None
    if got is None:
        return None
    try:
        rt = RankTables.decode(open_value(ring, job, subjects.META, subjects.tables_key(rank), got.value), job)
    except (RejectedMessageError, CorruptRecordError, FormatMismatchError):  # not authentic, or unreadable
        return None
    return rt.identity if rt.rank == rank else None


def shipper_name(job: str, channel: str) -> str:
    """The consumer name a shipper registers in each rank log."""
    return f"ship-{subjects.check_job(job)}-{channel}"


@dataclass
class FeedStats:
    """One rank and channel of a shipper."""

    rank: int
    channel: str
    epoch: str = ""
    position: int = 0
    log_end: int = 0
    lag_batches: int = 0
    ranges: int = 0
    batches: int = 0
    messages: int = 0
    row_bytes: int = 0
    payload_bytes: int = 0
    retries: int = 0
    rejected: int = 0  # messages on its subjects that did not authenticate or decode (skipped)
    recreated: int = 0  # times it found the job's stream deleted and created it again
    last_shipped: float = 0.0
    last_error: str = ""


@dataclass
class _Feed:
    rank: int
    channel: str
    path: str
    consumer: DeltaConsumer
    new_registration: bool
    stats: FeedStats
    epoch: str = ""
    synced: bool = False
    log_id: str = ""
    log_stamp: int = 0  # the log's creation stamp (with log_id, its LogIdentity)
    stats_sent: float = 0.0
    dirty: bool = False  # shipped and acknowledged, not yet committed locally
    committed_at: float = 0.0
    log: Optional[DeltaLog] = None  # read-only, for the side records of managed-collision tables
    prev: Optional[int] = None  # the end of the range last shipped in this epoch (None: none yet)
    table_fqns: Set[str] = field(default_factory=set)
    tables: bytes = b""  # the sealed table metadata it stored last (stored again when changed or tampered with)
    scan: MarkerScan = field(default_factory=MarkerScan)  # this rank's markers read so far
    ended_sent: int = -1  # snapshots: the batches ended its last marker carried (-1: none yet)
    progress_at: float = 0.0  # when (monotonic) it last shipped a progress marker


class Shipper:
    """Ships every local rank log under ``root`` to the job's stream (see the module docs).

    Args:
        root: the log root on this host (``<root>/rank-<r>``: only the ranks this host has).
        server: ``nats://HOST:PORT`` (or several, comma-separated, or a list: a cluster); None
            with ``transport``.
        job: the job's name on the stream (``[A-Za-z0-9_-]{1,64}``).
        channels: which channels to ship (default both).
        ranks: only these local ranks (default: every rank directory of the job here).
        connect: authentication/TLS (:class:`~persistent_delta.fleet.transport.ConnectOptions`).
        stream: the stream's replicas and limits when this shipper creates it.
        max_batches: batches per shipped range at most (ranges are cut at its multiples).
        options: :class:`LogOptions` for opening the logs.
        transport: ship through this transport instead of a connection to ``server`` (the
            shipper closes it on :meth:`close`).
        key: the job's stream key, which signs every message and bucket value it writes (a
            :class:`~persistent_delta.fleet.auth.StreamKey`, a key file from ``persistent-delta
            keygen``, or several: the first signs); default ``PERSISTENT_DELTA_STREAM_KEY_FILE``.
        insecure: ship unsigned when no key is found (consumers holding a key refuse it).
        ranks_per_stream: ship ranks ``[g * G, (g + 1) * G)`` into the job's stream of group
            ``g`` (``PDG_<job>_<g>``) instead of one stream for the job. None (default): the
            job's recorded layout, one stream for a new job. A job's layout is fixed by its
            first shipper: another one makes :meth:`run_once` raise
            :class:`~persistent_delta.errors.StreamLayoutError` before anything is shipped.
        checkpoints: the trainer's checkpoint root (``Checkpoints(..., root=)``): whenever its
            newest chain moves, each local rank's base from it goes to the job's object store
            (:mod:`~persistent_delta.fleet.checkpoint_bases`), so ``RemoteConsumer.bootstrap()``
            returns the tables as of the newest increment. None (default): bases only from
            :func:`upload_base`.

    Raises:
        InvalidInputError: a bad argument, or neither ``server`` nor ``transport`` given.
        RankDirectoryError: ``root`` is a rank's log directory, not the job's root.
        StreamKeyError: no key, and not ``insecure``.

    Not thread-safe: use it from one thread (``run``), or let :meth:`start` run it in one.
    """

    def __init__(
        self,
        root: PathLike,
        server: Optional[ServerSpec],
        job: str,
        channels: Sequence[str] = CHANNELS,
        ranks: Optional[Sequence[int]] = None,
        connect: Optional[ConnectOptions] = None,
        stream: Optional[StreamOptions] = None,
        max_batches: int = 16,
        options: Optional[LogOptions] = None,
        transport: Optional[Transport] = None,
        key: KeySpec = None,
        insecure: bool = False,
        ranks_per_stream: Optional[int] = None,
        checkpoints: Optional[PathLike] = None,
    ) -> None:
        self.root = check_root(root)
        self._ranks_per_stream = check_ranks_per_stream(ranks_per_stream)
        self.layout: Optional[Layout] = None  # the job's, once connected
        self._ensured: Set[str] = set()  # group streams this shipper made sure exist
        self.job = subjects.check_job(job)
        self._ring: Keyring = resolve_keyring(key, insecure, f"shipper of job {self.job!r}")
        if server is None and transport is None:
            raise InvalidInputError("a shipper needs a server URL or a transport")
        self.server = server
        self.channels = [check_channel(c) for c in channels]
        if not self.channels:
            raise InvalidInputError("channels must name at least one channel")
        self.max_batches = check_max_batches(max_batches)
        self._only = None if ranks is None else {int(r) for r in ranks}
        self._connect = connect or ConnectOptions()
        self._stream = stream or StreamOptions()
        self._options = options
        self._read_threads = (options or LogOptions.resolve()).read_threads
        self._feeds: Dict[Tuple[int, str], _Feed] = {}
        self._conn: Optional[Transport] = transport
        self._ready = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._watch: Optional[FileWatch] = None
        self._watched: List[str] = []
        self._scanned = 0.0
        self._closed = False
        self.connect_failures = 0
        self.bases = None if checkpoints is None else CheckpointBases(
            os.fspath(checkpoints), self.job, self._ring, replicas=self._stream.replicas)

    # ------------------------------------------------------------------ feeds
    def _scan(self) -> None:
        now = time.monotonic()
        if now - self._scanned < _RESCAN_EVERY_S and self._feeds:
            return
        self._scanned = now
        try:
            found = rank_paths(self.root, EMPTY_RANK_GRACE_S)  # a rank being created: the next scan looks again
        except NotALogError:
            return
        except DamagedLogError as exc:  # a rank's file wiped: the ranks already open keep shipping
            logger.error("shipper %s: %s", self.job, exc)
            return
        for rank, path in found.items():
            if self._only is not None and rank not in self._only:
                continue
            for channel in self.channels:
                if (rank, channel) in self._feeds:
                    continue
                try:
                    self._feeds[(rank, channel)] = self._open_feed(rank, channel, path)
                except NotALogError:
                    continue  # not a log yet: the next scan looks again

    def _open_feed(self, rank: int, channel: str, path: str) -> _Feed:
        name = shipper_name(self.job, channel)
        new = False
        # snapshots: every row format, as the records are (a remote consumer keeps its own)
        fmt = codec.ANY_FORMAT if channel == SNAPSHOTS else codec.NATIVE
        try:
            consumer = DeltaConsumer(self.root, name, channel=channel, reset="earliest", register=False, ranks=[rank],
                                     options=self._options, format=fmt)
        except UnknownConsumerError:
            consumer = DeltaConsumer(self.root, name, channel=channel, reset="earliest", register=True, ranks=[rank],
                                     options=self._options, format=fmt)
            new = True
        except ConfigMismatchError:  # registered before formats (native): it ships native rows only
            logger.warning("shipper %s: %s was registered before row formats: it ships native snapshot rows only; "
                           "delete it (persistent-delta offsets --delete) to carry every format", self.job, name)
            consumer = DeltaConsumer(self.root, name, channel=channel, reset="earliest", register=False, ranks=[rank],
                                     options=self._options)
        if rank not in consumer.ranks:
            consumer.close()
            raise NotALogError(f"{path}: rank {rank} is not (yet) a log of the job")
        with DeltaLog(path, readonly=True, writer_lock=False, options=self._options) as log:
            ident = log.read(lambda r: r.identity())
        logger.info("shipper %s: rank %d %s from batch %d%s", self.job, rank, channel, consumer.position()[rank],
                    " (new registration)" if new else "")
        return _Feed(rank, channel, path, consumer, new, FeedStats(rank, channel), log_id=ident.log_id,
                     log_stamp=ident.stamp)

    # ------------------------------------------------------------------ the stream
    def _connected(self) -> bool:
        if self._conn is not None and self._ready:
            return True
        try:
            if self._conn is None:
                assert self.server is not None  # checked by __init__ when no transport is given
                self._conn = open_transport(self.server, self._connect)
            if self.layout is None:  # StreamLayoutError (another layout) is not retried: it propagates
                self.layout = settle_layout(self._conn, self.job, self._stream, self._ranks_per_stream, self._ring)
                logger.info("shipper %s: layout %s", self.job, self.layout.describe())
            self._ready = True
            return True
        except TransportError as exc:
            self.connect_failures += 1
            if self.connect_failures == 1 or self.connect_failures % 50 == 0:
                logger.warning("shipper %s: stream not reachable (%s); the trainer is not held, retrying", self.job, exc)
            return False

    def _sync(self, feed: _Feed) -> None:
        """After (re)connecting: the feed's epoch, its table metadata, and the local position
        caught up with what the stream already acknowledged."""
        assert self._conn is not None and self.layout is not None
        conn, rank = self._conn, feed.rank
        stream = self.layout.stream(rank)
        if not self.layout.single and stream not in self._ensured:  # before the rank's table metadata
            conn.ensure_job(self.job, self._stream, streams=self.layout.spec(rank))
            self._ensured.add(stream)
        prev = conn.kv_get(self.job, subjects.META, subjects.shipper_key(rank, feed.channel))
        epoch = ""
        if prev is not None and not feed.new_registration:
            epoch = self._stored_epoch(feed, prev.value)
        if not epoch:
            epoch = subjects.new_epoch(feed.log_id)
        if epoch != feed.epoch:
            feed.prev = None
        feed.epoch = feed.stats.epoch = epoch
        conn.kv_put(self.job, subjects.META, subjects.shipper_key(rank, feed.channel), self._state(feed))
        self._store_tables(feed)
        # the latest genuine range of this rank, read forward (the last message may be forged or
        # a replay): catch the local position up with what the stream acknowledged
        scan_markers(conn, self._ring, self.job, feed.channel, rank, feed.scan, self._rejected(feed), stream=stream)
        pos = feed.consumer.position()[rank]
        m = feed.scan.latest
        if m is not None and m.epoch == epoch:
            feed.prev = m.end if m.end > m.start else m.prev  # a progress marker carries the last range's end
            feed.ended_sent = m.batches_ended
            if m.end > pos:
                logger.info("shipper %s: rank %d %s: the stream has up to batch %d already; local position %d -> %d",
                            self.job, rank, feed.channel, m.end, pos, m.end)
                feed.consumer.seek(m.end, rank)
                feed.consumer.commit()
        feed.new_registration = False
        feed.synced = True

    def _stored_epoch(self, feed: _Feed, value: bytes) -> str:
        """The epoch of this shipper's stored state, when it authenticates and is of this log."""
        try:
            state = codec.unpack(value, "shipper state")
        except PersistentDeltaError:
            return ""
        if not isinstance(state, dict) or state.get("log_id") != feed.log_id or not isinstance(state.get("epoch"), str):
            return ""
        tag = state.get("epoch_auth")
        why = self._ring.check(tag if isinstance(tag, str) else None, self._epoch_fields(feed, state["epoch"]))
        if why is not None:
            logger.warning("shipper %s: rank %d %s: the stored epoch is not this shipper's (%s); registering a new epoch",
                           self.job, feed.rank, feed.channel, why)
            return ""
        return str(state["epoch"])

    def _epoch_fields(self, feed: _Feed, epoch: str) -> List[str]:
        return ["epoch", self.job, str(feed.rank), feed.channel, feed.log_id, epoch]

    def _rejected(self, feed: _Feed) -> Any:
        def report(exc: PersistentDeltaError) -> None:
            feed.stats.rejected += 1
            feed.stats.last_error = str(exc)[:500]
            logger.warning("shipper %s: rank %d %s: skipped a message: %s", self.job, feed.rank, feed.channel, exc)
        return report

    def _store_tables(self, feed: _Feed) -> None:
        assert self._conn is not None
        with DeltaLog(feed.path, readonly=True, writer_lock=False, options=self._options) as log:
            def read(r: Any) -> RankTables:
                meta = TrackerMeta.from_value(r.meta(META_TRACKER))
                ident = r.identity()
                return RankTables(
                    rank=feed.rank, log_id=ident.log_id, world_size=None if meta is None else meta.world_size,
                    tracker=None if meta is None else meta.to_value(),
                    modes={c: position_rules.update_mode(r, c).value for c in CHANNELS},
                    entries={fqn: e.to_bytes() for fqn, e in r.tables().items()}, log_stamp=ident.stamp)
            tables = log.read(read)
        key = subjects.tables_key(feed.rank)
        feed.table_fqns = set(tables.entries)
        feed.tables = seal_value(self._ring, self.job, subjects.META, key, tables.encode())
        self._conn.kv_put(self.job, subjects.META, key, feed.tables)

    def _state(self, feed: _Feed) -> bytes:
        return codec.pack({"epoch": feed.epoch, "log_id": feed.log_id, "host": socket.gethostname(), "pid": os.getpid(),
                           "time": time.time(), "stats": asdict(feed.stats),
                           "epoch_auth": self._ring.sign(self._epoch_fields(feed, feed.epoch))})

    # ------------------------------------------------------------------ shipping
    def _send(self, feed: _Feed, msgs: List[wire.Message]) -> bool:
        """Send until every message is acknowledged (True), or the shipper is stopped."""
        assert self._conn is not None
        pending = msgs
        pause = 0.05
        while pending:
            failed = self._conn.send_all(pending)
            if not failed:
                return True
            feed.stats.retries += len(failed)
            feed.stats.last_error = f"{len(failed)} of {len(pending)} messages not acknowledged"
            if self._conn.connected:  # the server answers, yet the messages were refused
                self._recreate_if_deleted(feed)
                self._send_stats(feed)  # stuck: the stored statistics say so (lag, retries, why)
            if self._stop.wait(pause):
                return False
            pause = min(pause * 2, 1.0)
            pending = failed
        return True

    def _recreate_if_deleted(self, feed: _Feed) -> None:
        """After a send failed: when the job's stream (or a bucket) no longer exists -- deleted
        under the running shipper -- create it again, so shipping resumes. What the deleted
        stream held is gone: remote consumers behind this shipper's position find the gap
        (:class:`~persistent_delta.errors.OffsetOutOfRangeError` or their reset policy)."""
        assert self._conn is not None and self.layout is not None
        layout = self.layout
        try:
            if self._conn.job_exists(self.job, streams=[layout.stream(feed.rank)]):
                return
            self._conn.ensure_job(self.job, self._stream, streams=None if layout.single else layout.spec(feed.rank))
            if not layout.single:  # a deleted meta bucket lost the layout: record it again
                try:
                    self._conn.kv_create(self.job, subjects.META, subjects.LAYOUT_KEY, seal_value(
                        self._ring, self.job, subjects.META, subjects.LAYOUT_KEY, layout.encode()))
                except KeyConflictError:
                    pass
        except TransportError:
            return  # unreachable: the send is retried, and this asked again
        feed.stats.recreated += 1
        feed.stats.last_error = (f"the stream {layout.stream(feed.rank)} of job {self.job} was deleted under the shipper and was created again; "
                                 f"batches shipped before it (below {feed.stats.position}) are gone from the stream")
        logger.error("shipper %s: %s", self.job, feed.stats.last_error)
        for f in self._feeds.values():
            f.scan = MarkerScan()  # the new stream numbers its messages from 1 again
            f.stats_sent = 0.0  # stored again at once (with the table metadata, when a deleted bucket lost it)

    def _ship(self, feed: _Feed) -> int:
        """Ship one range of ``feed``; returns the batches shipped."""
        assert self._conn is not None
        try:
            feed.consumer.committed()  # a read: is the registration still there?
        except UnknownConsumerError:
            self._registration_lost(feed)
            return 0
        if not feed.synced:
            self._sync(feed)
        rank = feed.rank
        pos = feed.consumer.position()[rank]
        poll = feed.consumer.poll(max_batches=self.max_batches - pos % self.max_batches)
        d = poll.ranks.get(rank)
        end = feed.consumer.end_offsets().get(rank, pos)
        st = feed.stats
        st.log_end, st.position, st.lag_batches = end, pos, max(0, end - pos)
        # a position moved up by the reset policy (the trainer expired the shipper past its
        # retention bound): the range is shipped even when empty, so remote consumers see the gap
        jumped = d is not None and d.start_idx > pos
        ended = self._batches_ended(feed, pos if d is None else d.end_idx)
        if d is None or (d.end_idx <= d.start_idx and not jumped):
            st.position, st.lag_batches = pos, max(0, end - pos)
            if ended is not None:
                self._progress(feed, pos, end, ended)
            return 0
        if jumped:
            logger.warning("shipper %s: rank %d %s: batches [%d, %d) were deleted before they were shipped (the trainer "
                           "expired the shipper); remote consumers get OffsetOutOfRangeError or their reset policy",
                           self.job, rank, feed.channel, pos, d.start_idx)
        if not feed.tables or any(fqn not in feed.table_fqns for fqn in d.tables):
            self._store_tables(feed)  # a table new since the last store: consumers validate against it
        rows = {fqn: t.rows for fqn, t in d.tables.items()}
        chunk = wire.chunk_size(self._conn.max_payload)
        info: Dict[str, Any] = {"log_id": feed.log_id, "log_stamp": feed.log_stamp, "log_end": end,
                                "publishes": [[int(b), float(t)] for b, t in sorted(d.publishes.items())]}
        if d.deferred is not None:  # snapshots: rows capped publishes left pending, as the log stood at this read
            info["deferred"] = int(d.deferred)
        if ended is not None:
            info["batches_ended"] = ended
        if d.covers_from is not None:  # snapshots: no publish stored nor deleted in [covers_from, start)
            info["covers_from"] = int(d.covers_from)
        # replicated tables: per row, the publish its value comes from (parts of their own)
        stamps = {fqn: t.stamps for fqn, t in d.tables.items() if t.stamps is not None}
        side = self._side(feed, d.start_idx, d.end_idx, [fqn for fqn, t in d.tables.items() if t.zch is not None])
        formats = {f: {fqn: (t.rows, t.stamps) for fqn, t in by_fqn.items()} for f, by_fqn in d.formats.items()}
        parts, marker, row_bytes = wire.encode_range(self.job, feed.epoch, feed.channel, rank, d.start_idx,
                                                     d.end_idx, rows, chunk, info, side, stamps, self._ring, feed.prev,
                                                     formats)
        if not (self._send(feed, parts) and self._send(feed, [marker])):
            feed.consumer.seek(pos, rank)  # stopped: the range is shipped again next time
            return 0
        feed.dirty = True  # acknowledged: the local commit may follow (see _commit)
        feed.prev = d.end_idx
        feed.ended_sent = d.end_idx if ended is None else ended
        st.ranges += 1
        st.batches += d.end_idx - pos
        st.messages += len(parts) + 1
        st.row_bytes += row_bytes
        st.payload_bytes += sum(len(m.payload) for m in parts)
        st.position = d.end_idx
        st.lag_batches = max(0, end - d.end_idx)
        st.last_shipped = time.time()
        return max(1, d.end_idx - pos)

    def _batches_ended(self, feed: _Feed, end: int) -> Optional[int]:
        """Snapshots: the rank's batches ended, when its snapshots end is ``end`` (both read in
        one transaction, so the pair is one the log held: a stamp closes in the transaction
        that ends its batch); None on the lookups channel, or when the snapshots end is past
        ``end`` (a range cut by ``max_batches``, or a publish closed since the poll): the
        marker then claims nothing past its end."""
        if feed.channel != SNAPSHOTS:
            return None
        if feed.log is None:
            feed.log = DeltaLog(feed.path, readonly=True, writer_lock=False, options=self._options)
        snap, ended = feed.log.read(lambda r: (position_rules.bounds(r, SNAPSHOTS)[1], position_rules.batches_ended(r)))
        return max(ended, end) if snap == end else None

    def _progress(self, feed: _Feed, pos: int, end: int, ended: int) -> None:
        """Ship a progress marker: an empty range ``[pos, pos)`` carrying the rank's batches
        ended (:mod:`~persistent_delta.fleet.wire`), when they moved since its last marker and
        it publishes nothing, at most every ``_PROGRESS_EVERY_S``: so a remote consumer learns
        a rank that ends batches without publishing is behind
        (:func:`~persistent_delta.log.position_rules.snapshots_behind`)."""
        assert self._conn is not None
        now = time.monotonic()
        if ended <= feed.ended_sent or (feed.ended_sent >= 0 and now - feed.progress_at < _PROGRESS_EVERY_S):
            return
        info: Dict[str, Any] = {"log_id": feed.log_id, "log_stamp": feed.log_stamp, "log_end": end,
                                "batches_ended": ended}
        _, marker, _ = wire.encode_range(self.job, feed.epoch, feed.channel, feed.rank, pos, pos, {},
                                         wire.chunk_size(self._conn.max_payload), info, None, None, self._ring,
                                         feed.prev)
        if self._send(feed, [marker]):
            feed.ended_sent, feed.progress_at = ended, now

    def _side(self, feed: _Feed, start_idx: int, end_idx: int, managed: List[str]) -> Dict[str, List[wire.SideRecord]]:
        """The side records of the managed-collision tables over the range just polled
        (:func:`zch_records.shipped_side`: at most two records per table). They are read in a
        transaction of their own: the range is below the log end and at or above this
        shipper's position, so retention and compaction leave it as the poll read it."""
        if not managed:
            return {}
        if feed.log is None:
            feed.log = DeltaLog(feed.path, readonly=True, writer_lock=False, options=self._options)

        def read(r: Any) -> Dict[str, List[wire.SideRecord]]:
            entries = r.tables()
            return {fqn: zch_records.shipped_side(r, entries[fqn], start_idx, end_idx, feed.channel) for fqn in managed}

        return feed.log.read(read)

    def _registration_lost(self, feed: _Feed) -> None:
        # the log was started afresh (fresh=True deletes every registration), or the entry was
        # deleted (offsets --delete): register anew, under a new epoch
        logger.warning("shipper %s: rank %d %s: registration deleted (log started afresh?); registering again",
                       self.job, feed.rank, feed.channel)
        feed.consumer.close()
        if feed.log is not None:
            feed.log.close()
        self._feeds.pop((feed.rank, feed.channel), None)

    def _commit(self, feed: _Feed, force: bool) -> None:
        """Commit the local position of what the stream acknowledged: at once when idle or
        ``force``, else at most every ``_COMMIT_EVERY_S`` (an fsync per range would delay the
        next one; a crash before the commit ships nothing twice: :meth:`_sync` catches the
        position up from the stream's last marker)."""
        now = time.monotonic()
        if not feed.dirty or (not force and now - feed.committed_at < _COMMIT_EVERY_S):
            return
        try:
            feed.consumer.commit()
        except UnknownConsumerError:
            self._registration_lost(feed)
            return
        feed.dirty, feed.committed_at = False, now

    def run_once(self) -> int:
        """One round over every local rank and channel: ship what is complete (at most one
        range each). Returns the batches shipped (0 also while the stream is unreachable)."""
        self._check()
        self._scan()
        if not self._feeds or not self._connected():
            return 0
        shipped = 0
        for feed in list(self._feeds.values()):
            try:
                with intra_op_threads(self._read_threads):  # its polls and encoding: see threads
                    n = self._ship(feed)
                shipped += n
                self._commit(feed, force=n == 0)
            except TransportError as exc:
                feed.stats.last_error = str(exc)
                feed.synced = False
                logger.info("shipper %s: rank %d %s: %s (retrying)", self.job, feed.rank, feed.channel, exc)
            self._send_stats(feed)
        if self.bases is not None:
            try:
                self.bases.update(self._conn, [f.rank for f in self._feeds.values() if f.synced])
            except TransportError as exc:
                logger.info("shipper %s: bases from the checkpoints: %s (retrying)", self.job, exc)
        return shipped

    def _send_stats(self, feed: _Feed) -> None:
        now = time.monotonic()
        if self._conn is None or not feed.synced or now - feed.stats_sent < _STATS_EVERY_S:
            return
        feed.stats_sent = now
        try:
            self._conn.kv_put(self.job, subjects.META, subjects.shipper_key(feed.rank, feed.channel), self._state(feed))
            stored = self._conn.kv_get(self.job, subjects.META, subjects.tables_key(feed.rank))
            if feed.tables and (stored is None or stored.value != feed.tables):  # deleted or overwritten by another client
                self._store_tables(feed)
        except TransportError:
            pass

    def run(self, until: Optional[threading.Event] = None, idle_exit_s: Optional[float] = None) -> None:
        """Ship until ``stop()`` (or ``until`` is set); with ``idle_exit_s``, also return once
        nothing was shipped for that long (tests, one-off catch-up)."""
        if until is not None:
            self._stop = until  # every wait and retry of this shipper watches it
        idle_since = time.monotonic()
        while not self._stop.is_set():
            n = self.run_once()
            if n:
                idle_since = time.monotonic()
                continue
            if idle_exit_s is not None and time.monotonic() - idle_since >= idle_exit_s:
                return
            self._wait()

    def _wait(self) -> None:
        paths = sorted({os.path.join(f.path, DATA_FILE) for f in self._feeds.values()})
        if self._watch is None or paths != self._watched:
            if self._watch is not None:
                self._watch.close()
            self._watch, self._watched = FileWatch(paths), paths
        self._watch.wait(_IDLE_WAIT_S if self._ready else 0.2)

    def start(self) -> "Shipper":
        """Run the shipper in a daemon thread of this process (a trainer's, say)."""
        self._check()
        self._thread = threading.Thread(target=self.run, name=f"pd-ship-{self.job}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the loop (the range in flight is shipped again by the next shipper)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(30)
            self._thread = None

    # ------------------------------------------------------------------ stats, lifecycle
    def stats(self) -> List[Dict[str, Any]]:
        """Per rank and channel: position, log end, lag in batches, ranges, batches, messages,
        row and payload bytes, send retries, last ship time, last error."""
        return [asdict(f.stats) for _, f in sorted(self._feeds.items())]

    def close(self) -> None:
        """Stop, close every log handle and the transport. Idempotent."""
        if self._closed:
            return
        self.stop()
        self._closed = True
        for f in list(self._feeds.values()):
            try:
                self._commit(f, force=True)
            except Exception as exc:  # noqa: BLE001 - closing: the next shipper catches up from the stream
                logger.warning("shipper %s: final commit of rank %d %s failed: %s", self.job, f.rank, f.channel, exc)
            f.consumer.close()
            if f.log is not None:
                f.log.close()
        if self._watch is not None:
            self._watch.close()
        if self._conn is not None:
            self._conn.close()

    def _check(self) -> None:
        if self._closed:
            from persistent_delta.errors import LogClosedError

            raise LogClosedError(f"{self!r} is closed")

    def __enter__(self) -> "Shipper":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Shipper({self.root!r}, job={self.job!r})"
