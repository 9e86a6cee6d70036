"""Remote consumers: a job's deltas read from its stream, on any host.

Owns: the remote consumer's front -- :class:`RemoteConsumer`, with the API and results of a
local :class:`~persistent_delta.DeltaConsumer` (the same :class:`DeltaPoll`: ``merged()``,
``zch()`` and ``apply`` work unchanged) -- and its poll/commit cycle. Its parts, each a module
of its own (as kafka-python's consumer is split into a subscription state, a fetcher and a
coordinator):

* the one-process claim on the name and its heartbeat: :mod:`persistent_delta.fleet.claim`;
* the positions per rank, stored in the job's ``offsets`` bucket with their commit history:
  :mod:`persistent_delta.fleet.positions` (what they are) and
  :mod:`persistent_delta.fleet.coordinator` (loaded at open, stored by ``commit``);
* fetching each rank's ranges from the stream, assembled, authenticated and validated, and
  the gaps: :mod:`persistent_delta.fleet.fetcher` (the design note of the reading is there);
* what a poll delivers of them: :mod:`persistent_delta.fleet.delivery`; a base from the
  stream: :mod:`persistent_delta.fleet.bootstrap`.

Which batches a poll may deliver is :func:`persistent_delta.log.position_rules.poll_stops`
(complete batches only: every rank of the job); the message format is
:mod:`persistent_delta.fleet.wire`'s, read through a
:class:`~persistent_delta.fleet.transport.Transport` (NATS JetStream for a server URL).

Design note
-----------
A poll delivers, per rank, the buffered ranges up to the smallest end over the job's ranks,
merged per table by the channel's update mode (what a local consumer reading the same batches
gets), and moves the position past them; ``commit`` stores each rank's position and the stream
sequence after its last marker, so a restart resumes exactly there (at-least-once: a crash
between ``poll`` and ``commit`` re-delivers). A stored position counts batches of one log of
the rank: when the rank's log is newer (the job was started afresh since the commit) the
position is reset by the reset policy, or the next poll raises :class:`OffsetOutOfRangeError`.
On the snapshots channel a poll says which ranks of the job are behind (as a local reader
does, :func:`persistent_delta.read.polling.tell_behind`), from what each rank's markers
report.

One active process per consumer name (:class:`~persistent_delta.fleet.claim.NameClaim`): a
second user is refused with :class:`LogLockedError` naming the holder.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Sequence, Set

from persistent_delta.config import LogOptions
from persistent_delta.errors import (
    InvalidInputError,
    JobNotFoundError,
    LogClosedError,
    LogLockedError,
    NotALogError,
    OffsetOutOfRangeError,
    OlderLogError,
    PersistentDeltaError,
    TransportError,
)
from persistent_delta.fleet import subjects
from persistent_delta.fleet.auth import KeySpec, Keyring, resolve_keyring
from persistent_delta.fleet.bootstrap import bootstrap
from persistent_delta.fleet.claim import NameClaim
from persistent_delta.fleet.coordinator import Coordinator
from persistent_delta.fleet.delivery import deliver, take_ranges
from persistent_delta.fleet.fetcher import Fetcher
from persistent_delta.fleet.streams import recorded_layout
from persistent_delta.fleet.connect import open_transport
from persistent_delta.fleet.transport import ConnectOptions, ServerSpec, StreamOptions, Transport
from persistent_delta.lifecycle import warn_unclosed
from persistent_delta.log import codec, position_rules
from persistent_delta.log.schema import (
    LOOKUPS,
    SNAPSHOTS,
    check_batch_idx,
    check_channel,
    check_consumer_name,
    check_read_format,
    check_table_filter,
)
from persistent_delta.read.base import BaseTables
from persistent_delta.read.polling import check_poll_args, poll_loop, tell_behind
from persistent_delta.read.results import DeltaPoll, RankDelta, join_int8

logger = logging.getLogger(__name__)

_RECHECK_S = 0.05


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
        self.last_error = ""  # the last transport failure a poll retried over ("" when the last poll reached the server)
        self.last_shipped: Dict[int, float] = {}  # rank -> wall-clock time the last delivered range was shipped
        self._wake = threading.Event()
        self._told_behind: Set[int] = set()  # ranks a warning said are behind on the snapshots channel
        self._claim: Optional[NameClaim] = None
        if transport is None:
            assert server is not None  # checked above
            transport = open_transport(server, connect, wait=wait)
        self.conn: Optional[Transport] = transport
        self.server = ",".join(transport.servers)
        self._fetch = Fetcher(transport, self._ring, self.job, self.channel, self.format, self.server,
                              int(max_buffer_bytes), float(retry_s), self._reject)
        self._coord = Coordinator(self._fetch, self.name, reset)
        try:
            deadline = time.monotonic() + wait
            self._await_job(deadline)  # a consumer never creates the job's stream or buckets: the shipper side does
            if self._fetch.layout.single:
                self._fetch.stream_ids[self._fetch.layout.stream(0)] = transport.stream_id(self.job)
            self._claim = NameClaim(transport, self.job, self.name)
            self._claim.acquire(deadline)
            self._closed = False
            self._load_meta(deadline)
            if self._tables_filter is not None:
                check_table_filter(self._tables_filter, self._fetch.job_tables())
            self._coord.load()
            transport.watch(subjects.ends_filter(self.job, self.channel), self._wake)
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
        conn = self._fetch.conn
        while True:
            try:
                if conn.job_exists(self.job, streams=()):  # the buckets: then the layout, and its streams
                    layout = recorded_layout(conn, self.job, self._ring)
                    if layout is not None:
                        self._fetch.layout = layout  # a rank's group stream exists before its table metadata
                        return
                    if conn.job_exists(self.job):
                        return
            except TransportError as exc:
                if not exc.retriable or time.monotonic() >= deadline:
                    raise
            else:
                if time.monotonic() >= deadline:
                    raise JobNotFoundError(
                        f"job {self.job!r} has no stream on {self.server}: no shipper of it has run there yet, or the "
                        "stream was deleted (a remote consumer never creates it: only the shipper side does). Start "
                        "`persistent-delta ship ROOT --server ... --job ...`, or pass wait=")
            time.sleep(0.2)

    # ------------------------------------------------------------------ metadata
    def _load_meta(self, deadline: float) -> None:
        while True:
            try:
                self._fetch.refresh_meta()
            except TransportError as exc:  # a leader election (a node died), a restart: retried within wait
                if not exc.retriable or time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)
                continue
            if self._fetch.meta and not self.missing_ranks():
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if not self._fetch.meta:
            raise NotALogError(f"job {self.job!r} on {self.server}: no shipper has stored table metadata yet; start "
                               "`persistent-delta ship ROOT --server ... --job ...` on the trainer hosts, or pass wait=")

    def _reject(self, exc: PersistentDeltaError) -> None:
        """Report a message, value or range that is skipped (never applied)."""
        self.rejected.append(exc)
        self.last_error = str(exc)[:500]
        logger.warning("remote consumer %r of job %s: skipped: %s", getattr(self, "name", "?"), self.job, exc)

    def missing_ranks(self) -> List[int]:
        """Ranks of the job whose shipper has not stored its table metadata yet."""
        return self._fetch.missing_ranks()

    @property
    def ranks(self) -> List[int]:
        return sorted(self._fetch.fetches)

    # ------------------------------------------------------------------ positions
    def position(self) -> Dict[int, int]:
        """rank -> the next batch_idx ``poll`` reads (0 for a rank with nothing shipped yet)."""
        self._check()
        return {r: (p.pos if p.pos is not None else 0) for r, p in sorted(self._fetch.positions.items())}

    def seek(self, batch_idx: int, rank: Optional[int] = None) -> None:
        """Move the position (every rank's, or one rank's) to ``batch_idx``, in memory; the
        next poll reads the stream from its start to find it (a range holding ``batch_idx``
        is delivered whole, and reports its start)."""
        self._check()
        check_batch_idx(batch_idx)
        fetch = self._fetch
        if rank is not None and rank not in fetch.fetches:
            raise InvalidInputError(f"rank {rank} is not a rank of job {self.job!r} (ranks: {self.ranks})")
        for r in [rank] if rank is not None else list(fetch.fetches):
            f, p = fetch.fetches[r], fetch.positions[r]
            fetch.clear(f, p)
            p.pos, f.seq, p.epoch, p.resume_seq = batch_idx, 1, None, 1
            p.log = fetch.logs.get(r)  # a batch of the rank's newest log

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
                return bootstrap(self._fetch, progress)
            except (NotALogError, OlderLogError):  # no base of the rank's newest log yet
                if time.monotonic() >= deadline:
                    raise
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
                try:
                    self._fetch.refresh_meta()  # a rank's table metadata may come with its base
                except TransportError:  # retried within wait, as at open
                    pass

    def end_offsets(self) -> Dict[int, int]:
        """rank -> one past the last batch shipped to the stream."""
        self._check()
        out = {}
        for rank in self._fetch.fetches:
            m = self._fetch.scan(rank).latest
            out[rank] = 0 if m is None else m.end
        return out

    def commit(self) -> Dict[int, int]:
        """Store the current positions in the job's ``offsets`` bucket (replicated with the
        stream). Returns them.

        Raises:
            LogLockedError: the claim on the name was lost (another process took it).
            TransportError: the server stayed unreachable for ``retry_s`` (nothing is stored).
        """
        self._check()
        if self._claim is not None and self._claim.lost:
            raise LogLockedError(f"consumer {self.name!r} of job {self.job!r} lost its claim; nothing committed")
        return self._coord.commit()

    def committed(self) -> Dict[int, int]:
        """rank -> the position stored in the ``offsets`` bucket now.

        Raises:
            UnknownConsumerError: nothing stored for this name and channel.
        """
        self._check()
        return self._coord.committed()

    # ------------------------------------------------------------------ reading
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
        return poll_loop(self, max_batches, timeout, max_bytes, self._read_threads)

    def _poll_begin(self) -> None:
        self._wake.clear()
        try:
            fetch = self._fetch
            if self.missing_ranks() or not fetch.fetches:
                fetch.refresh_meta()
                for r, f in fetch.fetches.items():
                    if fetch.positions[r].pos is None and f.seq == 1 and self.reset == "latest":
                        fetch.to_latest(f, fetch.positions[r])
            for r, f in fetch.fetches.items():
                fetch.fill(f, fetch.positions[r])
            self.last_error = ""
        except TransportError as exc:
            # the server is unreachable (restarting, a leader election): like Kafka's
            # consumer, the poll delivers what it has and retries until its timeout
            if self.last_error != str(exc):
                logger.warning("remote consumer %r: %s (retrying)", self.name, exc)
            self.last_error = str(exc)

    def _poll_wait(self, deadline: float) -> None:
        self._wake.wait(min(max(0.0, deadline - time.monotonic()), _RECHECK_S))

    def _check_stale(self) -> None:
        """Raise for a stored position of an older log than the rank's newest (:class:`~persistent_delta.fleet.coordinator.Coordinator`)."""
        for p in self._fetch.positions.values():
            if p.stale:
                raise OffsetOutOfRangeError(f"{p.stale}. Pass reset='earliest' or 'latest', or seek(); or reset it: "
                                            f"persistent-delta offsets --server {self.server} --job {self.job} --reset "
                                            f"{self.name} --to-earliest --execute")

    def _poll_once(self, max_batches: Optional[int], max_bytes: Optional[int] = None) -> DeltaPoll:
        fetch = self._fetch
        for r, f in fetch.fetches.items():
            if f.gap is not None and not f.ranges:
                fetch.resolve_gap(f, fetch.positions[r], self.reset, self.name)
                fetch.fill(f, fetch.positions[r])
        behind = self._behind()
        taken = take_ranges(fetch.fetches, fetch.positions, fetch.expected, max_batches, max_bytes)
        out: Dict[int, RankDelta] = {}
        for rank, ranges in taken.items():
            meta = fetch.meta.get(rank)
            path = f"{self.server}/{fetch.layout.stream(rank)}/{self.channel}/rank-{rank}"
            out[rank] = deliver(fetch.fetches[rank], fetch.positions[rank], ranges, meta, self.channel, self.format,
                                self._tables_filter, path, fetch.where(rank))
            if ranges and meta is not None:
                self.last_shipped[rank] = ranges[-1].marker.shipped
        if self.format == codec.INT8:
            join_int8(out)  # column-wise tables: halves joined and quantized, as a local poll's
        return DeltaPoll(channel=self.channel, ranks=out,
                         world_size=None if fetch.expected is None else len(fetch.expected),
                         read_threads=self._read_threads, format=self.format, behind=behind)

    def _behind(self) -> Dict[int, int]:
        """The job's ranks behind on the snapshots channel, by the local readers' rule over what
        each rank's markers said (:func:`~persistent_delta.read.polling.tell_behind`); a rank
        whose markers said nothing yet is left out."""
        if self.channel != SNAPSHOTS or self._fetch.expected is None or self.missing_ranks():
            return {}
        known = {r: f for r, f in self._fetch.fetches.items() if f.reported is not None}
        return tell_behind(f"job {self.job} on {self.server}", {r: f.reported for r, f in known.items()},
                           self._told_behind, stacklevel=4, proven={r: f.proven for r, f in known.items()})

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release the name and close the connection (positions not committed are dropped).
        Idempotent."""
        self._closed = True
        conn = getattr(self, "conn", None)
        if conn is None:
            return
        self.conn = None
        claim = getattr(self, "_claim", None)
        if claim is not None:
            claim.release()
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
