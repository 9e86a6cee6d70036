"""A replica's base from the trainer's checkpoints, and the replica loop that needs no bookkeeping.

Owns: :func:`load_checkpoint_base` (the full tables of the newest complete base with its
increments' rows applied in order, as a :class:`~persistent_delta.read.base.BaseTables` that
knows, per rank, the log position it continues from) and :class:`Follower` (start, restart
and fall-behind recovery of a float-tables replica in one loop).

The tables are :func:`persistent_delta.checkpoint.tables.read_tables`' (its module note says
what is read and which position the tables continue from: the batch after the chain's last
increment). :class:`~persistent_delta.read.base.Continuation` checks every poll against that
position and against the log identities the base recorded (another job's log, or one started
afresh, is refused). A rank that published several times in one batch with ``flush()`` between
takes stamps past its batch; a read from ``b + 1`` then applies those publishes again
(at-least-once, same values).

A replica restarting, or added late, positions its consumer at the tables' position
(``seek``): behind it would apply older publishes again, past it would miss some. When the
log no longer holds that position (``delete_on_read`` freed it, or the consumer was expired),
no read can continue these tables: the :class:`Follower` waits for the trainer's next
increment (every ``every`` steps) and starts from it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from persistent_delta.checkpoint import chain as chains
from persistent_delta.checkpoint.tables import read_tables
from persistent_delta.errors import (IncompleteBaseError, InvalidInputError, NotALogError, OffsetOutOfRangeError,
                                    OlderLogError, StaleBaseError)
from persistent_delta.read.base import BaseTables
from persistent_delta.read.results import DeltaPoll
from persistent_delta.serve.apply import Applied, apply_poll

logger = logging.getLogger(__name__)



def load_checkpoint_base(root: str) -> BaseTables:
    """A replica's starting tables from the trainer's checkpoints: every table whole, in global
    row ids, from the newest complete base under ``root`` (its DCP files, read offline; the
    weights only) with its complete increments' rows applied in order (see the module note).
    Any thread of any process may call it, while the trainer writes more increments.

    Returns:
        fqn -> the full table ``(global_rows, global_cols)``: a
        :class:`~persistent_delta.read.base.BaseTables` whose ``batches`` say, per rank, the
        tracker's batch at the chain's last increment (or the base), ``positions`` where a poll
        applied onto it must start at the latest (that batch + 1), and ``logs`` the ranks' log
        identities the base recorded (a poll of another log is refused).

    Raises:
        IncompleteBaseError: no complete base under ``root`` (take one with
            ``Checkpoints.save_base``), or it holds no weights of a table it records.
        IncrementChainError: its increments are not one chain, or a part is damaged.
        FormatMismatchError: written with another format version.
    """
    read = read_tables(root)
    return BaseTables(read.tables, positions={r: b + 1 for r, b in read.batches.items()}, batches=read.batches,
                      logs=read.logs, source=read.source)


@dataclass
class _Loaded:
    """What a :class:`Follower` loaded from checkpoints: the chain's base and how many increments."""

    base: str
    increments: int


class Follower:
    """A replica's float tables kept equal to the trainer's, from its checkpoints and its
    publishes, with no bookkeeping by the user: built, it loads the newest base and increments
    and moves ``consumer`` to their position; :meth:`step` polls, applies and commits. When the
    consumer's position is gone -- its publishes deleted, the consumer expired or the stream's
    retention passed it (``OffsetOutOfRangeError``), or a poll does not continue the tables
    (``StaleBaseError``: moved by a reset policy, another log) -- it loads the newest base
    again, once the trainer has written a newer one, and goes on from there. A replica that
    crashed starts the same way: a new :class:`Follower`, the same consumer name.

    Two sources of the base, one loop:

    - ``checkpoints`` given: the trainer's checkpoint root, read here
      (:func:`load_checkpoint_base`); ``consumer`` is a snapshots ``DeltaConsumer`` of the
      trainer's log root.
    - ``checkpoints`` None: ``consumer`` is a snapshots ``RemoteConsumer`` and the base is its
      ``bootstrap()``: the bases the job's shipper uploads from the same checkpoints
      (``Shipper(..., checkpoints=)``, ``persistent-delta ship --checkpoints``), as of the
      newest increment. While it waits for a newer one it asks the stream at most every
      ``rebase_every`` seconds (each ask downloads every rank's base).

    Not thread-safe: one thread calls :meth:`step`; read :attr:`tables` between steps.

    Args:
        consumer: a snapshots consumer (native rows): a ``DeltaConsumer`` with
            ``checkpoints``, or anything with ``bootstrap()`` (a ``RemoteConsumer``) without.
        checkpoints: the trainer's checkpoint root (``Checkpoints(..., root=)``), or None.
        wait: seconds to wait for a complete base to appear (a replica started with its trainer).
        rebase_every: seconds between asks for a newer base on the stream while waiting.

    Raises:
        InvalidInputError: no ``checkpoints`` and a consumer without ``bootstrap()``.
        IncompleteBaseError: no complete base after ``wait`` (checkpoints).
        NotALogError, OlderLogError, StreamDataError: as ``RemoteConsumer.bootstrap`` (stream).
        IncrementChainError, FormatMismatchError: as :func:`load_checkpoint_base`.
    """

    def __init__(self, consumer: Any, checkpoints: Optional[str] = None, wait: float = 0.0,
                 rebase_every: float = 5.0) -> None:
        if checkpoints is None and not callable(getattr(consumer, "bootstrap", None)):
            raise InvalidInputError(
                f"Follower({consumer!r}) without checkpoints needs a consumer with bootstrap() (a RemoteConsumer "
                "whose job's shipper uploads bases from the checkpoints); a local consumer reads them: pass "
                "checkpoints=<the trainer's checkpoint root>")
        if wait < 0 or rebase_every < 0:
            raise InvalidInputError(f"wait and rebase_every must be >= 0 seconds, got {wait} and {rebase_every}")
        self.consumer, self.root = consumer, checkpoints
        self.reloads = 0
        self._rebase_every = rebase_every
        self._asked = time.monotonic()
        if checkpoints is None:
            self._adopt(consumer.bootstrap(wait=wait))
            return
        deadline = time.monotonic() + wait
        while True:
            try:
                self._reload()
                break
            except IncompleteBaseError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def _latest(self) -> _Loaded:
        assert self.root is not None
        chain = chains.latest_chain(self.root)
        return _Loaded(chain.base, len(chain.increments))

    def _reload(self) -> None:
        """Load the newest chain and move the consumer to its position on every rank."""
        assert self.root is not None
        self.loaded = self._latest()  # first: a newer chain written meanwhile is loaded at the next recovery
        self._adopt(load_checkpoint_base(self.root))

    def _adopt(self, tables: BaseTables) -> None:
        self.tables = tables
        for rank, position in self.tables.positions.items():
            self.consumer.seek(position, rank=rank)
        self.reloads += 1
        self._waiting = False
        logger.info("replica tables from %s; consumer %s at %s", self.tables.source, self.consumer.name,
                    self.tables.positions)

    def step(self, timeout: float = 1.0, max_bytes: Optional[int] = None) -> Optional[Applied]:
        """Poll, apply the poll onto :attr:`tables` (``complete_only``) and commit. Returns what
        was applied, or None when the tables were loaded again (or wait for the trainer's next
        increment: the consumer's position is gone and no newer base exists yet).

        Raises:
            RanksBehindError, IncompletePollError: as ``apply_poll(complete_only=True)``.
            CheckpointError: the newest chain cannot be read (checkpoints).
        """
        try:
            poll: DeltaPoll = self.consumer.poll(timeout=timeout, max_bytes=max_bytes)
            applied = apply_poll(self.tables, poll, complete_only=True)
        except (OffsetOutOfRangeError, StaleBaseError) as exc:
            return self._recover(exc, timeout)
        self.consumer.commit()
        return applied

    def _newer_on_stream(self) -> Optional[BaseTables]:
        """The stream's bases when newer than the loaded tables (a later batch), or None."""
        if time.monotonic() - self._asked < self._rebase_every:
            return None
        self._asked = time.monotonic()
        try:
            tables = self.consumer.bootstrap()
        except (NotALogError, OlderLogError) as exc:  # the bases are being replaced: ask again later
            logger.info("replica %s: no base on the stream now (%s)", self.consumer.name, exc)
            return None
        newest = max(self.tables.batches.values(), default=-1)
        return tables if max(tables.batches.values(), default=-1) > newest else None

    def _recover(self, exc: BaseException, timeout: float) -> None:
        if self.root is not None:
            if self._latest() != self.loaded:
                logger.warning("replica %s loads the newest checkpoint again: %s", self.consumer.name, exc)
                self._reload()
                return None
        else:
            newer = self._newer_on_stream()
            if newer is not None:
                logger.warning("replica %s loads the newest base from the stream again: %s", self.consumer.name, exc)
                self._adopt(newer)
                return None
        log = logger.debug if self._waiting else logger.warning
        self._waiting = True
        log("replica %s cannot continue its tables (%s): waiting for the trainer's next increment",
            self.consumer.name, exc)
        for rank, position in self.tables.positions.items():
            self.consumer.seek(position, rank=rank)
        time.sleep(timeout)
        return None

    def positions(self) -> Tuple[Dict[int, int], Dict[int, int]]:
        """(where the tables continue from, the channel's end now), per rank."""
        return self.tables.positions, self.consumer.end_offsets()


__all__ = ["Follower", "load_checkpoint_base"]
