"""What every consumer's poll shares: the :class:`Consumer` protocol, a poll's arguments, the
poll loop, the byte cut and the ranks-behind warning.

Owns: the surface that :class:`~persistent_delta.read.consumer.DeltaReader`,
:class:`~persistent_delta.read.consumer.DeltaConsumer` and
:class:`~persistent_delta.fleet.remote.RemoteConsumer` implement alike, the one check of a
poll's arguments (:func:`check_poll_args`; a shipper's batch bound too:
:func:`check_max_batches`), the poll loop written once (:func:`poll_loop` over each
consumer's :class:`PollCycle`), the one rule that cuts a poll at a byte budget
(:func:`byte_cut`, :func:`clip_stops`), and how a snapshots poll tells the ranks behind
(:func:`tell_behind`). Which batches a poll may read at all, and which ranks are behind, is
:mod:`persistent_delta.log.position_rules`'.

The byte cut
------------
A poll is made of **pieces** it cannot split: a batch for a local reader, a shipped range for a
remote consumer. Each piece is known by its end (exclusive) and its bytes summed over the
poll's ranks; a reader sizes them its own way (a local reader: the value bytes stored under
each batch, before reading it; a remote consumer: the rows of each range it buffered). The cut
walks the pieces that hold bytes in the order of their ends: the first one is always taken (a
poll makes progress however small the budget), each next one while the bytes taken stay within
``max_bytes``; the walk stops at the first piece that does not fit, and the poll ends at the end
of the last piece taken. Pieces without bytes never decide a cut: when every piece fits, the
poll keeps its own stops (empty batches after the last piece included). The cut is the same
batch index on every rank, so a publish's column halves and row shards stay in one poll.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Dict, List, Mapping, Optional, Protocol, Set, Tuple, TypeVar, runtime_checkable

from persistent_delta.errors import InvalidInputError, RanksBehindWarning
from persistent_delta.log import position_rules
from persistent_delta.read.results import DeltaPoll
from persistent_delta.threads import intra_op_threads

logger = logging.getLogger(__name__)

_C = TypeVar("_C", bound="Consumer")


@runtime_checkable
class Consumer(Protocol):
    """A reader of a job's deltas, rank by rank, Kafka-consumer style.

    Contract, for every implementation:

    * Not thread-safe: one thread uses it. Open it in the process that uses it (a local
      reader's LMDB handles and a remote consumer's connection are never shared over a fork).
    * Ranges are half-open ``[start_idx, end_idx)`` in batch indices; a position is the next
      ``batch_idx`` a poll reads. Each poll reports, per rank, the range it actually read; a
      poll starts where the previous one ended (a read may start earlier than the position:
      a range or window that holds it is delivered whole, and its start is reported).
    * ``poll`` delivers only batches every rank of the job has completed, cut at
      ``max_batches`` and at the byte budget by :func:`byte_cut`; bad arguments raise
      :class:`~persistent_delta.errors.InvalidInputError` (:func:`check_poll_args`).
    * ``close`` is idempotent; any other call after it raises
      :class:`~persistent_delta.errors.LogClosedError`. It is a context manager that closes
      on exit.

    Whether positions can be made durable is :class:`CommittingConsumer`'s (a
    :class:`~persistent_delta.read.consumer.DeltaReader` keeps them in memory only and has no
    ``commit``).
    """

    channel: str

    @property
    def ranks(self) -> List[int]:
        """The ranks read now (a rank that appears later joins at a later poll)."""
        ...

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        ...

    def missing_ranks(self) -> List[int]:
        """Ranks of the job not readable yet."""
        ...

    def poll(
        self, max_batches: Optional[int] = None, timeout: Optional[float] = None, max_bytes: Optional[int] = None
    ) -> DeltaPoll:
        """Read per rank from the position on, and move the position past what was read.

        Args:
            max_batches: at most about this many batches per rank (default: all available).
            timeout: wait up to this many seconds for something new (default: do not wait).
            max_bytes: cut the poll at this byte budget (:func:`byte_cut`).

        Returns:
            The :class:`~persistent_delta.read.results.DeltaPoll` with the ranges read.

        Raises:
            InvalidInputError: a bad argument (:func:`check_poll_args`).
            OffsetOutOfRangeError: the batches at a position are gone and no reset policy
                was chosen.
            LogClosedError: it is closed.
        """
        ...

    def position(self) -> Dict[int, int]:
        """rank -> the next ``batch_idx`` a poll reads."""
        ...

    def end_offsets(self) -> Dict[int, int]:
        """rank -> the end of what can be read now (one past the last batch)."""
        ...

    def seek(self, batch_idx: int, rank: Optional[int] = None) -> None:
        """Move the position (every rank's, or one rank's) to ``batch_idx``, in memory."""
        ...

    def close(self) -> None:
        """Release what it holds; positions not committed are dropped. Idempotent."""
        ...

    def __enter__(self: _C) -> _C:
        ...

    def __exit__(self, *exc: object) -> None:
        ...


@runtime_checkable
class CommittingConsumer(Consumer, Protocol):
    """A :class:`Consumer` with a durable position under a name (a registered
    :class:`~persistent_delta.read.consumer.DeltaConsumer`, a
    :class:`~persistent_delta.fleet.remote.RemoteConsumer`): at-least-once, a crash between
    ``poll`` and ``commit`` re-delivers."""

    def commit(self) -> Dict[int, int]:
        """Make the current positions durable; returns them (rank -> position).

        Raises:
            LogClosedError: it is closed.
        """
        ...

    def committed(self) -> Dict[int, int]:
        """rank -> the position stored now."""
        ...


def _positive_int(name: str, value: object, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "a positive int or None" if optional else "a positive int"
        raise InvalidInputError(f"{name} must be {allowed}, got {value!r}")


def check_poll_args(max_batches: Optional[int], timeout: Optional[float], max_bytes: Optional[int]) -> None:
    """Check the arguments of a :meth:`Consumer.poll`.

    Args:
        max_batches: None, or a positive int.
        timeout: None, or a non-negative number of seconds.
        max_bytes: None, or a positive int.

    Raises:
        InvalidInputError: an argument is out of its domain (bools are not numbers here).
    """
    _positive_int("max_batches", max_batches, optional=True)
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0):
        raise InvalidInputError(f"timeout must be a non-negative number of seconds or None, got {timeout!r}")
    _positive_int("max_bytes", max_bytes, optional=True)


def check_max_batches(max_batches: int) -> int:
    """Check a required batch bound (a shipper's batches per range).

    Args:
        max_batches: a positive int.

    Returns:
        ``max_batches``.

    Raises:
        InvalidInputError: it is not a positive int.
    """
    _positive_int("max_batches", max_batches, optional=False)
    return max_batches


def byte_cut(pieces: Mapping[int, int], max_bytes: int, stop: int) -> int:
    """Where a poll ends under ``max_bytes`` (the rule is the module's: see "The byte cut").

    Args:
        pieces: end (exclusive batch index) -> bytes of the pieces ending there, summed over
            the poll's ranks, for the pieces the poll may read.
        max_bytes: the budget.
        stop: where the poll would end without a budget (the largest of its stops).

    Returns:
        The end of the last piece taken, or ``stop`` when every piece fits.
    """
    taken: Optional[int] = None
    total = 0
    for end, nbytes in sorted(pieces.items()):
        if nbytes <= 0:
            continue
        if taken is not None and total + nbytes > max_bytes:
            return taken
        taken, total = end, total + nbytes
    return stop


def clip_stops(positions: Mapping[int, int], stops: Mapping[int, int], cut: int) -> Dict[int, int]:
    """Each rank's stop moved down to ``cut``, never below its position.

    Args:
        positions: rank -> its position.
        stops: rank -> where its read would end (exclusive).
        cut: the common end from :func:`byte_cut`.

    Returns:
        rank -> its new stop.
    """
    return {rank: max(positions[rank], min(stop, cut)) for rank, stop in stops.items()}


class PollCycle(Protocol):
    """The three steps a consumer's poll repeats (:func:`poll_loop`), each consumer its own way:
    a local reader reads its LMDB logs and waits on their files, a remote consumer fetches
    from the stream and waits for a marker's wake-up."""

    def _poll_begin(self) -> None:
        """Before each read: take in what is new (open ranks, fetch messages) and note what
        :meth:`_poll_wait` compares with."""

    def _poll_once(self, max_batches: Optional[int], max_bytes: Optional[int]) -> DeltaPoll:
        """One read at the positions, moving them past what it delivers."""

    def _poll_wait(self, deadline: float) -> None:
        """Wait (at most until ``deadline``, monotonic) until something new may be readable."""


def poll_loop(cycle: PollCycle, max_batches: Optional[int], timeout: Optional[float], max_bytes: Optional[int],
              read_threads: int) -> DeltaPoll:
    """The poll of every consumer, written once: begin, read (on ``read_threads`` torch
    intra-op threads), and, while the result is empty and ``timeout`` (seconds; None: no
    wait) has not passed, wait and read again. The arguments are checked by the caller
    (:func:`check_poll_args`)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        cycle._poll_begin()
        with intra_op_threads(read_threads):
            result = cycle._poll_once(max_batches, max_bytes)
        if not result.empty or deadline is None or time.monotonic() >= deadline:
            return result
        cycle._poll_wait(deadline)


def tell_behind(where: str, ends: Mapping[int, Tuple[int, int]], told: Set[int], stacklevel: int = 2,
                proven: Optional[Mapping[int, int]] = None) -> Dict[int, int]:
    """The ranks behind on the snapshots channel (:func:`~persistent_delta.log.position_rules.snapshots_behind`
    over ``ends``: rank -> ``(snapshots end, batches ended)`` of every rank of the job), told
    once per rank as it falls behind -- a log warning and a :class:`RanksBehindWarning` --
    by every snapshots consumer alike, local or remote. ``told`` (the ranks told so far) is
    updated in place: a rank that catches up and falls behind again is told again.

    Args:
        where: what the message names (the log root, the job on its server).
        ends: each rank's pair.
        told: the ranks already told (updated).
        stacklevel: ``warnings.warn``'s, counted from the caller.
        proven: rank -> one past the newest publish stamp known of it, where below its end
            (a remote consumer's: :meth:`~persistent_delta.fleet.wire.Marker.proven_end`).

    Returns:
        rank -> the newest publish stamp it lacks (``DeltaPoll.behind``).
    """
    behind = position_rules.snapshots_behind(dict(ends), None if proven is None else dict(proven))
    new = {r: b for r, b in behind.items() if r not in told}
    told.clear()
    told.update(behind)
    if new:
        msg = (f"{where}: {position_rules.behind_note(behind)} [each rank's snapshots end and batch end: "
               f"{dict(sorted(ends.items()))}]")
        logger.warning("%s", msg)
        warnings.warn(msg, RanksBehindWarning, stacklevel=stacklevel + 1)
    return behind
