"""Readers of a trainer's delta log in any process: ``DeltaReader`` (unregistered, no side
effects) and ``DeltaConsumer`` (registered, durable position), Kafka-consumer style.

Owns: a reader's in-memory positions, which ranks a job has, and the poll/commit cycle. What a
position means (bounds, read start, range checks, reset) is :mod:`persistent_delta.log.position_rules`'s;
reading a range of the logs is :mod:`persistent_delta.read.fetch`'s; a poll's arguments, its byte
cut and the :class:`~persistent_delta.read.polling.Consumer` protocol these readers implement are
:mod:`persistent_delta.read.polling`'s; the result types are :mod:`persistent_delta.read.results`'.

Design note
-----------
A log root holds one log per rank (``<root>/rank-<r>``). The job's ranks come from the world
size each tracker records at attach, never from which directories happen to exist: a rank that
does not exist yet is waited for (``wait=``) or picked up by a later poll; directories of ranks
at or above the world size (left from a run with more ranks) are ignored, with a warning.

``poll`` reads, per rank, one read transaction: the unique rows of ``[read_start(position),
end)`` per table, with shard-local ids mapped to global row ids. For a tracker's job ``end`` is
the same on every rank: the smallest channel end over the job's ranks, so a poll holds only
batches that every rank has completed (no merged table misses a column half; a missing rank
holds every poll at its start). A restart or restore of a multi-rank job changes each rank's log
in its own transaction; while the ranks' restart generations differ
(:func:`~persistent_delta.log.position_rules.settled`) a poll reads nothing, so it never holds a
batch one rank already dropped and another still holds. ``poll(timeout=)`` waits for a commit
that completes a batch.

* :class:`DeltaReader` keeps its positions in memory only: it holds back no retention and has
  no effect on the trainer; data deleted under it gives :class:`OffsetOutOfRangeError` (or its
  reset policy). Replay and one-off looks use it.
* :class:`DeltaConsumer` registers its name in every rank's log (``Delivery.POLL_COMMIT``):
  it holds back ``delete_on_read`` retention like a durable subscription, and while it reads
  the lookups channel the trainer writes every batch whole and never compacts across it.
  ``commit`` makes the positions durable (one write transaction per rank, no writer lock
  needed); a crash between ``poll`` and ``commit`` re-delivers (at-least-once). One active user
  per name: a second one is refused with the holder's pid.

A waiting poll does not cut the writer's group commit short: small steps are committed after
at most ``linger_s`` (see :class:`~persistent_delta.config.WriterOptions`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Dict, List, Optional, Sequence, Set, Tuple, TypeVar, Union

from persistent_delta.log import codec, position_rules
from persistent_delta.log.alloc import ResultBuffers
from persistent_delta.config import LogOptions
from persistent_delta.errors import (
    ConfigMismatchError,
    InvalidInputError,
    LogClosedError,
    NotALogError,
    OffsetOutOfRangeError,
    UnknownConsumerError,
)
from persistent_delta.log.layout import (
    DATA_FILE,
    EMPTY_RANK_GRACE_S,
    FileState,
    PathLike,
    file_state,
    rank_dir,
    rank_paths,
)
from persistent_delta.lifecycle import warn_unclosed
from persistent_delta.log.lmdbenv import ConsumerClaims
from persistent_delta.log.deltalog import DeltaLog, ReadTxn, WriteTxn
from persistent_delta.read import fetch
from persistent_delta.read.polling import byte_cut, check_poll_args, clip_stops, poll_loop, tell_behind
from persistent_delta.read.results import DeltaPoll
from persistent_delta.log.watch import FileWatch
from persistent_delta.log.schema import (
    LOOKUPS,
    META_TRACKER,
    SNAPSHOTS,
    ConsumerEntry,
    Delivery,
    TrackerMeta,
    check_batch_idx,
    check_table_filter,
    check_channel,
    check_consumer_name,
    check_read_format,
)

logger = logging.getLogger(__name__)

RESET_POLICIES = position_rules.RESET_POLICIES
Start = Union[str, int]
_R = TypeVar("_R", bound="DeltaReader")
_RECHECK_S = 0.05  # a waiting poll re-reads the logs at least this often, events or not
_PUBLISH_S = 0.0002
_RETENTION_RACES = 3  # reads of one poll that retention may pass between its bounds and its records
# what a poll reads first of a log: the channel's (start, end), where it is served from, the
# restart generation and the batches ended (position_rules)
_Bounds = Tuple[int, int, int, int, int]


class _RetentionPassed(Exception):
    """A poll's read found a position deleted after its bounds were checked: read them again."""


def _world_size_of(found: Dict[int, str], options: LogOptions) -> Optional[int]:
    """The world size the lowest rank's tracker recorded, or None (a plain store, an old log)."""
    for rank, path in sorted(found.items()):
        try:
            with DeltaLog(path, readonly=True, options=options) as log:
                meta = log.read(lambda r: TrackerMeta.from_value(r.meta(META_TRACKER)))
        except NotALogError:
            continue  # not a log yet: ask the next rank
        return None if meta is None else meta.world_size
    return None


class DeltaReader:
    """An unregistered reader of a log root: positions in memory only, no retention hold, no
    effect on the trainer, never writes. Not thread-safe; open it in the process that uses it.
    A :class:`~persistent_delta.read.polling.Consumer` (no ``commit``: nothing to make durable).

    Args:
        root: the log root (``<root>/rank-<r>``), or a plain store's log directory (rank 0);
            a job's rank directory (``rank-<r>``) is refused at once.
        channel: ``"lookups"`` (default) or ``"snapshots"``.
        start: where to start: ``"earliest"`` (default, the channel start), ``"latest"`` (its
            end) or a batch index.
        reset: when a position cannot be served (below the start, past the end): None raises
            :class:`OffsetOutOfRangeError`, ``"earliest"``/``"latest"`` move it there.
        tables: only these table fqns (default: all).
        wait: seconds to wait for the root and every rank of the job to exist (default 0:
            the root must exist; a rank that appears later is picked up by a later poll).
        options: :class:`LogOptions` (default :meth:`LogOptions.resolve`).
        check: walk each log file's whole structure before opening it (linear in the file;
            every open makes constant-time checks anyway: file size against LMDB's meta pages,
            their transaction ids -- see :func:`persistent_delta.log.lmdbenv.check_file`).
        ranks: read only these ranks of the job (a shipper reads its own host's ranks); the
            complete-batch rule then holds over these ranks only. Default: every rank.
        format: the row format of the snapshot rows to read (``"native"``, default;
            ``"float32"``, ``"float16"``, ``"bfloat16"``, ``"int8"``: see
            :data:`persistent_delta.log.codec.ROW_FORMATS`). A poll holds only records of this
            format (:attr:`DeltaPoll.passed_over` counts the others); int8 rows are always
            whole rows, a column-wise table's joined from its ranks' halves and quantized by
            the poll. Publishes write a format only when asked for: register a
            :class:`DeltaConsumer` with it, or pass it to ``tracker.publish(formats=...)``.

    Raises:
        NotALogError: no log under ``root`` (after ``wait``), or ranks still missing after a
            positive ``wait`` (named in the message).
        DamagedLogError: a log file fails those checks (it is not opened).
        RankDirectoryError: ``root`` is a rank's log directory (the message names the root).
        InvalidInputError: a bad channel, start, reset policy, wait or format (a format other
            than native on the lookups channel).
    """

    _readonly = True

    def __init__(
        self,
        root: PathLike,
        channel: str = LOOKUPS,
        start: Start = "earliest",
        reset: Optional[str] = None,
        tables: Optional[Sequence[str]] = None,
        wait: float = 0.0,
        options: Optional[LogOptions] = None,
        check: bool = False,
        ranks: Optional[Sequence[int]] = None,
        format: str = codec.NATIVE,
    ) -> None:
        self._closed = True
        self._full_check = check
        self._only: Optional[Set[int]] = None if ranks is None else {int(r) for r in ranks}
        self.channel = check_channel(channel)
        self.format = check_read_format(format, self.channel)
        if reset is not None and reset not in RESET_POLICIES:
            raise InvalidInputError(f"reset must be None, 'earliest' or 'latest', got {reset!r}")
        if not (start in RESET_POLICIES or (isinstance(start, int) and not isinstance(start, bool))):
            raise InvalidInputError(f"start must be 'earliest', 'latest' or a batch index, got {start!r}")
        if isinstance(start, int):
            check_batch_idx(start, "start")
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or wait < 0:
            raise InvalidInputError(f"wait must be a non-negative number of seconds, got {wait!r}")
        self.reset = reset
        self.root = os.fspath(root)
        self._start = start
        self._tables = list(tables) if tables is not None else None
        self._options = options or LogOptions.resolve()
        self._logs: Dict[int, DeltaLog] = {}
        self._positions: Dict[int, int] = {}
        self._expected: Optional[Set[int]] = None  # the job's ranks, once a tracker said so
        self._told_behind: Set[int] = set()  # ranks a warning said are behind on the snapshots channel
        self._seen: Tuple[int, ...] = ()  # the logs' visible transactions when the last poll began
        self._bounds_read: Dict[int, _Bounds] = {}  # what the last read found of each log (_poll_wait compares)
        self._watcher: Optional[FileWatch] = None
        self._watched: List[str] = []
        self._buffers = ResultBuffers()  # polls' row buffers, reused once the caller drops a poll
        check_table_filter(tables, None)
        self._closed = False
        try:
            self._discover(wait)
            if not self.missing_ranks():
                check_table_filter(tables, self._job_tables())
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ ranks
    def _discover(self, wait: float) -> None:
        deadline = time.monotonic() + wait
        while True:
            try:
                self._open_ranks()
            except NotALogError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)
                continue
            missing = self.missing_ranks()
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        missing = self.missing_ranks()
        if missing and wait > 0:
            raise NotALogError(
                f"{self.root}: ranks {missing} of the job (world size {len(self._expected or ())}) have no log after "
                f"waiting {wait} s; start them, or wait longer"
            )
        if missing:
            logger.info("%s: ranks %s have no log yet; polls hold at their start until they appear", self.root, missing)

    def _open_ranks(self) -> None:
        """Open the logs of the job's ranks that exist now.

        Raises:
            NotALogError: none is open (nothing under the root yet, or not ours).
        """
        if self._expected is None:
            found = rank_paths(self.root, EMPTY_RANK_GRACE_S)  # a rank being created: a later poll looks again
            size = _world_size_of(found, self._options)
            if size is None:  # a plain store, or logs written before world sizes were recorded
                candidates = {r: p for r, p in found.items() if self._only is None or r in self._only}
            else:
                self._expected = set(range(size)) if self._only is None else set(range(size)) & self._only
                for rank in sorted(set(found) - set(range(size))):
                    logger.warning("%s: ignoring rank-%d, left from a run with more ranks (world size %d)",
                                   self.root, rank, size)
                candidates = {r: rank_dir(self.root, r) for r in self._expected}
        else:
            candidates = {r: rank_dir(self.root, r) for r in self._expected}
        for rank, path in sorted(candidates.items()):
            if rank in self._logs or file_state(path) is not FileState.PRESENT:
                continue
            try:
                self._open(rank, path)
            except NotALogError:
                if self._expected is None:
                    raise
                # not a log yet: a later poll looks again
        if not self._logs:
            raise NotALogError(f"{self.root}: no rank of the job has a log yet")

    def _open(self, rank: int, path: str) -> None:
        log = DeltaLog(path, readonly=self._readonly, writer_lock=False, options=self._options, check=self._full_check)
        try:
            self._positions[rank] = self._first_position(rank, log)
        except BaseException:
            log.close()
            raise
        self._logs[rank] = log

    def _first_position(self, rank: int, log: DeltaLog) -> int:
        if isinstance(self._start, int):
            return self._start
        return log.read(lambda r: position_rules.registration_offset(r, self.channel, latest=self._start == "latest"))

    def _job_tables(self) -> List[str]:
        """The job's table set: what each rank's tracker recorded at attach (a table-wise table
        lives on one rank only), or the tables of a plain store."""
        def tables(r: ReadTxn) -> List[str]:
            meta = TrackerMeta.from_value(r.meta(META_TRACKER))
            return list(meta.tables) if meta is not None else list(r.tables())
        return sorted({fqn for log in self._logs.values() for fqn in log.read(tables)})

    def missing_ranks(self) -> List[int]:
        """Ranks of the job that have no log (yet)."""
        return sorted((self._expected or set()) - set(self._logs))

    @property
    def ranks(self) -> List[int]:
        """The ranks read now (a rank that appears later joins at the next poll)."""
        return sorted(self._logs)

    # ------------------------------------------------------------------ reading
    def poll(
        self, max_batches: Optional[int] = None, timeout: Optional[float] = None, max_bytes: Optional[int] = None
    ) -> DeltaPoll:
        """Read, per rank, the batches from the position up to the end every rank of the job
        has completed (at most ``max_batches`` of them), and move the position past them.

        Args:
            max_batches: read at most this many batches per rank (default: all available).
            timeout: wait up to this many seconds for at least one new batch (default: do not
                wait). A poll that times out is empty and still reports its ranges.
            max_bytes: cut the poll at this byte budget by
                :func:`~persistent_delta.read.polling.byte_cut` (the same rule as a remote
                consumer's): a piece is a batch with records, sized by the value bytes stored
                under it summed over ranks; the poll ends after the last batch that fits (the
                same batch on every rank, so publishes stay whole), and reads at least one. A
                replica catching up uses it to bound each poll's memory. Counted from the
                position: a read that must start earlier (compacted or window-filtered
                lookups) reads more.

        Returns:
            A :class:`DeltaPoll` reporting, per rank, the range it actually read.

        Raises:
            OffsetOutOfRangeError: a position is below the channel start (its batches were
                deleted) or past its end, and no reset policy was chosen.
            InvalidInputError: a bad argument (:func:`~persistent_delta.read.polling.check_poll_args`).
            LogClosedError: it is closed.
        """
        self._check()
        check_poll_args(max_batches, timeout, max_bytes)
        return poll_loop(self, max_batches, timeout, max_bytes, self._options.read_threads)

    def _poll_begin(self) -> None:
        self._seen = self._txnids()  # what _poll_wait waits to change

    def _poll_wait(self, deadline: float) -> None:
        """Wait until a commit may have made something readable. A commit that moved nothing
        a read at the positions depends on (:meth:`_readable_moved`: a publish whose stamp is
        still open; on the snapshots channel, a step that closes none; retention below the
        positions) is waited past without a read: the read would be empty again."""
        watch = self._watch()
        while time.monotonic() < deadline:
            now = self._txnids()
            if now != self._seen:
                if self._readable_moved():
                    return
                self._seen = now  # (read before the bounds: a later commit is looked at again)
                continue
            if self._written() != self._seen:
                # committed to the meta page, not yet published to new readers (LMDB
                # updates its lock file just after, with no file event): a moment
                time.sleep(_PUBLISH_S)
                continue
            watch.wait(min(deadline - time.monotonic(), _RECHECK_S))
            if self.missing_ranks():
                return  # a rank may have appeared: poll again

    def _read_bounds(self) -> Dict[int, _Bounds]:
        """rank -> what a poll reads first of its log (``_Bounds``), one read transaction each."""
        return {rank: log.read(lambda r: (*position_rules.bounds(r, self.channel), position_rules.served_from(r, self.channel),
                                          position_rules.restart_generation(r), position_rules.batches_ended(r)))
                for rank, log in self._logs.items()}

    def _readable_moved(self) -> bool:
        """Whether a read at the positions now could differ from the last one, which was empty:
        on some rank the channel's end or the restart generation moved, or the position can
        no longer be served (retention deleted up to it: the read raises or resets), or the
        ranks read changed. The batches ended are left out: they change what a poll reports
        of the ranks behind, not what it reads, and the poll that returns reads them anew."""
        now = self._read_bounds()
        if now.keys() != self._bounds_read.keys():
            return True
        for rank, (_, end, floor, generation, _) in now.items():
            _, end0, _, generation0, _ = self._bounds_read[rank]
            if end != end0 or generation != generation0 or self._positions[rank] < floor:
                return True
        return False

    def _watch(self) -> FileWatch:
        """The reader's file watch, kept open between polls (closing an inotify descriptor
        waits for an RCU grace period: ~10 ms), renewed when the set of open ranks changed."""
        paths = [os.path.join(log.path, DATA_FILE) for _, log in sorted(self._logs.items())]
        if self._watcher is None or self._watched != paths:
            if self._watcher is not None:
                self._watcher.close()
            self._watcher, self._watched = FileWatch(paths), paths
        return self._watcher

    def _txnids(self) -> Tuple[int, ...]:
        return tuple(log.visible_txnid() for _, log in sorted(self._logs.items()))

    def _written(self) -> Tuple[int, ...]:
        return tuple(log.last_txnid() for _, log in sorted(self._logs.items()))

    def _poll_once(self, max_batches: Optional[int], max_bytes: Optional[int] = None) -> DeltaPoll:
        """One read at the positions. The bounds are checked in one transaction per rank and
        the records read in the next: when retention passed a position in between, the read
        raises (:func:`~persistent_delta.log.position_rules.check_served`) and runs again from
        the bounds, where the position is out of range (an error, or the reset policy)."""
        for attempt in range(_RETENTION_RACES):
            try:
                return self._read_once(max_batches, max_bytes, last=attempt + 1 == _RETENTION_RACES)
            except _RetentionPassed:
                continue
        raise AssertionError("unreachable: the last attempt raises")

    def _read_once(self, max_batches: Optional[int], max_bytes: Optional[int], last: bool) -> DeltaPoll:
        if self.missing_ranks():
            self._open_ranks()
        where = {rank: f"rank {rank} ({log.path})" for rank, log in self._logs.items()}
        bounds = self._bounds_read = self._read_bounds()
        generations = {rank: b[3] for rank, b in bounds.items()}
        # a restart or restore half-way leaves the ranks' ends apart until every rank committed it
        behind = self._behind({rank: (b[1], b[4]) for rank, b in bounds.items()}) if position_rules.settled(
            generations) else {}
        positions = {rank: position_rules.serve_position(self._positions[rank], a, b, self.channel, self.reset,
                                                   self._label(), where[rank], floor, self._registered_root())
                     for rank, (a, b, floor, _, _) in bounds.items()}
        stops = position_rules.poll_stops(positions, {rank: b[1] for rank, b in bounds.items()}, self._expected, max_batches)
        if not position_rules.settled(generations):  # a restart or restore is half-way: wait for it
            stops = dict(positions)
        if max_bytes is not None:
            pieces = fetch.stored_bytes(self._logs, positions, stops, self.channel)
            stops = clip_stops(positions, stops, byte_cut(pieces, max_bytes, max(stops.values(), default=0)))
        try:
            ranks = fetch.fetch_ranks(self._logs, positions, stops, self.channel, self._tables, self._buffers.take,
                                      self.format)
            if stops != positions and {rank: log.read(position_rules.restart_generation)
                                       for rank, log in self._logs.items()} != generations:
                # a restart or restore began on some rank meanwhile: this read may mix its sides
                ranks = fetch.fetch_ranks(self._logs, positions, dict(positions), self.channel, self._tables,
                                          self._buffers.take, self.format)
        except OffsetOutOfRangeError:
            if last:
                raise
            raise _RetentionPassed() from None
        for rank, delta in ranks.items():
            self._positions[rank] = delta.end_idx
        return DeltaPoll(channel=self.channel, ranks=ranks,
                         world_size=None if self._expected is None else len(self._expected),
                         read_threads=self._options.read_threads, format=self.format, behind=behind)

    def _behind(self, ends: Dict[int, Tuple[int, int]]) -> Dict[int, int]:
        """The job's ranks behind on the snapshots channel (rank -> (snapshots end, batches ended)
        of the ranks read; :func:`~persistent_delta.log.position_rules.snapshots_behind`), told
        once per rank as it falls behind: a log warning and a :class:`RanksBehindWarning`."""
        if self.channel != SNAPSHOTS or self._expected is None or self.missing_ranks():
            return {}
        return tell_behind(str(self.root), ends, self._told_behind, stacklevel=4)

    def _label(self) -> str:
        return "(unregistered reader)"

    def _registered_root(self) -> Optional[str]:
        """The log root where this reader's name is registered (None: it has no name)."""
        return None

    # ------------------------------------------------------------------ positions
    def position(self) -> Dict[int, int]:
        """rank -> the next batch_idx ``poll`` reads."""
        self._check()
        return dict(self._positions)

    def end_offsets(self) -> Dict[int, int]:
        """rank -> the channel's end now (one past the last complete batch)."""
        self._check()
        return {rank: log.read(lambda r: position_rules.bounds(r, self.channel)[1]) for rank, log in self._logs.items()}

    def seek(self, batch_idx: int, rank: Optional[int] = None) -> None:
        """Move the position (every rank's, or one rank's) to ``batch_idx``, in memory. The
        range is checked by the next ``poll``.

        Raises:
            InvalidInputError: a negative, too large or non-int ``batch_idx``, or an unknown rank.
        """
        self._check()
        check_batch_idx(batch_idx)
        if rank is not None and rank not in self._positions:
            raise InvalidInputError(f"rank {rank} has no log under {self.root} (ranks: {sorted(self._positions)})")
        for r in [rank] if rank is not None else list(self._positions):
            self._positions[r] = batch_idx

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close every log handle. Idempotent."""
        self._closed = True
        for log in self._logs.values():
            log.close()
        buffers = getattr(self, "_buffers", None)
        if buffers is not None:
            buffers.clear()
        watcher = getattr(self, "_watcher", None)
        if watcher is not None:
            watcher.close()
            self._watcher = None

    @property
    def closed(self) -> bool:
        return self._closed

    def _check(self) -> None:
        if self._closed:
            raise LogClosedError(f"{self!r} is closed")

    def __del__(self) -> None:
        warn_unclosed(self, repr(self))

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({getattr(self, 'root', '?')!r}, channel={getattr(self, 'channel', '?')!r})"


class DeltaConsumer(DeltaReader):
    """A registered consumer of a log root, in any process (the trainer's included): its
    position is durable (``commit``) and it holds back retention. See the module docs. A
    :class:`~persistent_delta.read.polling.CommittingConsumer`.

    Args:
        root: the log root (``<root>/rank-<r>``), or a single log directory (rank 0).
        name: the consumer name (letters, digits, ``._:@/-``); one active user per name.
        channel: ``"lookups"`` (default) or ``"snapshots"``.
        reset: see :class:`DeltaReader`; also where a new registration starts (default: the
            channel start; ``"latest"``: its end).
        register: register the name in every rank's log where it is missing (durably: it holds
            back retention from now on). With False a missing name raises.
        tables: see :class:`DeltaReader`.
        wait: see :class:`DeltaReader`.
        options: see :class:`DeltaReader`.
        check: see :class:`DeltaReader`.
        ranks: see :class:`DeltaReader`.
        format: the row format this snapshots consumer stores (see :class:`DeltaReader`),
            recorded in its entry at registration: from then on every publish writes its
            rows in this format too (converted on the trainer's writer thread). A
            registered name keeps its format; to change it, delete the name and register
            it again.

    Raises:
        NotALogError: ``root`` holds no log (after ``wait``).
        UnknownConsumerError: ``register=False`` and the name is missing on a rank.
        ConfigMismatchError: the name is registered for the other channel, or with another
            format.
        LogLockedError: another process (the trainer, another consumer, the offsets tool) uses
            the name now.
        InvalidInputError: bad name, channel or reset policy.
    """

    _readonly = False

    def __init__(
        self,
        root: PathLike,
        name: str,
        channel: str = LOOKUPS,
        reset: Optional[str] = None,
        register: bool = True,
        tables: Optional[Sequence[str]] = None,
        wait: float = 0.0,
        options: Optional[LogOptions] = None,
        check: bool = False,
        ranks: Optional[Sequence[int]] = None,
        format: str = codec.NATIVE,
    ) -> None:
        self._closed = True
        self.name = check_consumer_name(name)
        self._register = register
        self._claims: Dict[int, ConsumerClaims] = {}
        self._committed: Dict[int, int] = {}
        start: Start = "latest" if reset == "latest" else "earliest"
        super().__init__(root, channel=channel, start=start, reset=reset, tables=tables, wait=wait, options=options,
                         check=check, ranks=ranks, format=format)
        logger.info("consumer %r (%s) on %s: positions %s", self.name, self.channel, self.root, self._positions)

    def _label(self) -> str:
        return self.name

    def _registered_root(self) -> Optional[str]:
        return self.root

    # ------------------------------------------------------------------ registration
    def _first_position(self, rank: int, log: DeltaLog) -> int:
        found = log.read(lambda r: r.consumer(self.name))
        if found is not None:  # a name of the other channel: say so before anyone's claim on it
            self._check_entry(rank, found)
        claims = ConsumerClaims(log.path)
        claims.claim(self.name, "consume with it")
        try:
            offset = self._load(rank, log)
        except BaseException:
            claims.release_all()
            raise
        self._claims[rank] = claims
        self._committed[rank] = offset
        return offset

    def _check_entry(self, rank: int, entry: ConsumerEntry) -> int:
        if entry.channel == self.channel and entry.format != self.format:
            raise ConfigMismatchError(
                f"consumer {self.name!r} is registered for {entry.format!r} rows on rank {rank}, not {self.format!r}: a "
                f"replica keeps the format it stores. Pass format={entry.format!r}, use another name, or, if nothing uses "
                f"it any more, delete it: persistent-delta offsets {self.root} --delete {self.name} --execute"
            )
        if entry.channel == self.channel:
            return entry.offset
        other = f"{self.name}.{self.channel}"
        if entry.channel == LOOKUPS and entry.delivery == Delivery.IN_TRANSACTION and self.channel == SNAPSHOTS:
            # One name, one consumer: the trainer's consumer reads lookups; its publishes are
            # read back by another consumer, of the snapshots channel.
            raise ConfigMismatchError(
                f"consumer {self.name!r} is the trainer's (lookups) consumer on rank {rank}: "
                f"tracker.publish({self.name!r}) writes snapshots of the rows it changed, and a replica reads "
                f"them under a name of its own, e.g. DeltaConsumer({self.root!r}, {other!r}, channel='snapshots')"
            )
        raise ConfigMismatchError(
            f"consumer {self.name!r} is registered for channel {entry.channel!r} on rank {rank}, not "
            f"{self.channel!r}; use another name (e.g. {other!r}), or, if nothing uses it any more, delete it: "
            f"persistent-delta offsets {self.root} --delete {self.name} --execute"
        )

    def _load(self, rank: int, log: DeltaLog) -> int:
        entry = log.read(lambda r: r.consumer(self.name))
        if entry is not None:
            return self._check_entry(rank, entry)
        if not self._register:
            raise UnknownConsumerError(
                f"consumer {self.name!r} is not registered in {log.path}; pass register=True or register it with "
                f"`persistent-delta offsets {self.root} --register {self.name} --execute`"
            )

        def add(w: WriteTxn) -> int:
            found = w.consumer(self.name)
            if found is not None:  # registered meanwhile by another process
                return self._check_entry(rank, found)
            offset = position_rules.registration_offset(w, self.channel, latest=self.reset == "latest")
            position_rules.register(w, self.name, offset, self.channel, Delivery.POLL_COMMIT, self.format)
            logger.info("registered consumer %r in %s at batch %d", self.name, log.path, offset)
            return offset

        return log.write(add)

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
                w.set_consumer(self.name, entry.committed(pos, position_rules.bounds(w, entry.channel)[1]))

            log.write(write)
            self._committed[rank] = pos
        return dict(self._committed)

    def committed(self) -> Dict[int, int]:
        """rank -> the durably committed offset, as stored in the log now."""
        self._check()
        out = {}
        for rank, log in self._logs.items():
            entry = log.read(lambda r: r.consumer(self.name))
            if entry is None:
                raise UnknownConsumerError(f"consumer {self.name!r} is no longer registered in {log.path}")
            out[rank] = entry.offset
        return out

    def close(self) -> None:
        """Close every log handle and release the name (positions not committed are dropped:
        never an implicit commit). Idempotent."""
        super().close()
        for claims in getattr(self, "_claims", {}).values():
            claims.release_all()

    def __repr__(self) -> str:
        return (f"DeltaConsumer({getattr(self, 'root', '?')!r}, {getattr(self, 'name', '?')!r}, "
                f"channel={getattr(self, 'channel', '?')!r})")
