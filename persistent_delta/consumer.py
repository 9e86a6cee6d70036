"""``DeltaConsumer``: read a trainer's delta log from another process, Kafka-consumer style.

Owns: one consumer's in-memory positions and its poll/commit cycle. What a position means
(bounds, read start, range checks, reset) is :mod:`persistent_delta.delivery`'s; the result
types are :mod:`persistent_delta.results`'.

Design note
-----------
A log root holds one log per rank (``<root>/rank-<r>``); each log keeps its own consumer
entries, so a consumer has one position per rank. ``poll`` reads, per rank, one read
transaction: the unique rows of ``[read_start(position), end)`` per table (the log's update
mode; ``LAST`` for snapshots), with shard-local ids mapped to global row ids, and moves the
in-memory position to ``end``. ``commit`` makes the positions durable (one write transaction
per rank, through a handle that needs no writer lock, so it works while the trainer runs).
Nothing advances durably before ``commit``: a crash between ``poll`` and ``commit``
re-delivers (at-least-once). The entry is registered as ``Delivery.POLL_COMMIT``: while it
reads the lookups channel the trainer writes every batch whole and never compacts across it.

A registered consumer holds back the trainer's ``delete_on_read`` retention like a durable
subscription (see :mod:`persistent_delta.delivery`).
"""

from __future__ import annotations

import logging
import os
from typing import Dict, List, Optional, Sequence

from persistent_delta import delivery
from persistent_delta.config import LogOptions
from persistent_delta.errors import (
    ConfigMismatchError,
    InvalidInputError,
    LogClosedError,
    UnknownConsumerError,
)
from persistent_delta.layout import PathLike, rank_paths
from persistent_delta.log import DeltaLog, ReadTxn, WriteTxn
from persistent_delta.results import DeltaPoll, RankDelta, read_range
from persistent_delta.schema import LOOKUPS, ConsumerEntry, Delivery, check_channel, check_consumer_name

logger = logging.getLogger(__name__)

RESET_POLICIES = delivery.RESET_POLICIES


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
        options: :class:`LogOptions` for opening the logs (default: :meth:`LogOptions.resolve`,
            i.e. the ``PERSISTENT_DELTA_*`` environment variables, then the defaults).

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
        self.channel = check_channel(channel)
        if reset is not None and reset not in RESET_POLICIES:
            raise InvalidInputError(f"reset must be None, 'earliest' or 'latest', got {reset!r}")
        self.reset = reset
        self.root = os.fspath(root)
        self._tables = list(tables) if tables is not None else None
        self._logs: Dict[int, DeltaLog] = {}
        self._closed = False
        try:
            for rank, path in rank_paths(self.root).items():
                self._logs[rank] = DeltaLog(path, writer_lock=False, options=options or LogOptions.resolve())
            self._committed = {rank: self._load(rank, log, register) for rank, log in self._logs.items()}
        except BaseException:
            self.close()
            raise
        self._positions = dict(self._committed)
        logger.info("consumer %r (%s) on %s: positions %s", self.name, self.channel, self.root, self._positions)

    # ------------------------------------------------------------------ registration
    def _check_entry(self, rank: int, entry: ConsumerEntry) -> int:
        if entry.channel != self.channel:
            raise ConfigMismatchError(
                f"consumer {self.name!r} is registered for channel {entry.channel!r} on rank {rank}, not "
                f"{self.channel!r}; use another name, or delete it (persistent-delta offsets ROOT --delete NAME --execute)"
            )
        return entry.offset

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
            offset = delivery.registration_offset(w, self.channel, latest=self.reset == "latest")
            w.set_consumer(self.name, ConsumerEntry.new(offset, self.channel, Delivery.POLL_COMMIT))
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
                start, end = delivery.bounds(r, self.channel)
                pos = delivery.serve_position(pos, start, end, self.channel, self.reset, self.name, f"rank {rank} ({log.path})")
                stop = end if max_batches is None else min(end, pos + max_batches)
                return read_range(r, rank, log.path, pos, stop, self.channel, self._tables)

            delta = log.read(read)
            ranks[rank] = delta
            self._positions[rank] = delta.end_idx
        return DeltaPoll(channel=self.channel, ranks=ranks)

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
                w.set_consumer(self.name, entry.committed(pos))

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
            out[rank] = entry.offset
        return out

    def end_offsets(self) -> Dict[int, int]:
        """rank -> the channel's end now (one past the last complete batch)."""
        self._check()
        return {rank: log.read(lambda r: delivery.bounds(r, self.channel)[1]) for rank, log in self._logs.items()}

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
