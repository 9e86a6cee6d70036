"""Bases on the stream from the trainer's checkpoints, kept current by the shipper.

Owns: :class:`CheckpointBases`: when the trainer's newest complete checkpoint chain moves (a new
base, or a new increment), every local rank's shards as of the chain's last increment
(:func:`persistent_delta.checkpoint.tables.read_tables`) are uploaded as the rank's base to the
job's object store, stamped with the rank's tracker batch there and carrying the log identity
the base recorded, so that :meth:`RemoteConsumer.bootstrap
<persistent_delta.fleet.remote.RemoteConsumer.bootstrap>` returns tables no older than the
newest increment, and a replica started with no state of its own continues from it
(``Shipper(..., checkpoints=)``, ``persistent-delta ship --checkpoints``).

Design note. The tables continue from the tracker's batch ``b`` + 1 (see
:mod:`persistent_delta.checkpoint.tables`), which is what a base stamped ``b`` means on the
stream (:func:`persistent_delta.fleet.bootstrap.bootstrap` moves each rank's position to the
stamp + 1). A rank's base is uploaded only once its table metadata is on the stream (its feed
synced): ``bootstrap`` checks the base against it. Every rank of the chain is uploaded from the
same chain, and a chain is uploaded whole before it counts as done: a crash or a lost server
in between uploads it again. The chain is read whole (every table of these ranks, in this
process's memory once), at most every ``check_every`` seconds, and only when it moved.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional, Sequence, Tuple

from persistent_delta.checkpoint import chain as chains
from persistent_delta.checkpoint.tables import read_tables
from persistent_delta.errors import CheckpointError, IncompleteBaseError, InvalidInputError
from persistent_delta.fleet import subjects, wire
from persistent_delta.fleet.auth import Keyring, seal_value
from persistent_delta.fleet.transport import Transport

logger = logging.getLogger(__name__)

CHECK_EVERY_S = 1.0  # how often the shipper looks for a newer chain


class CheckpointBases:
    """Uploads each local rank's base from the newest checkpoint chain under ``root`` whenever
    that chain moves (see the module docs).

    Args:
        root: the trainer's checkpoint root (``Checkpoints(..., root=)``).
        job: the job's name on the stream.
        ring: the job's key ring (signs each base).
        replicas: replicas of the object store, where the first upload creates it.
        check_every: seconds between looks at the chain.

    Raises:
        InvalidInputError: ``root`` is not a directory path, or ``check_every`` < 0.
    """

    def __init__(self, root: str, job: str, ring: Keyring, replicas: int = 1,
                 check_every: float = CHECK_EVERY_S) -> None:
        if not isinstance(root, (str, os.PathLike)) or not str(root):
            raise InvalidInputError(f"checkpoints must be a directory path, got {root!r}")
        if check_every < 0:
            raise InvalidInputError(f"check_every must be >= 0 seconds, got {check_every}")
        self.root, self.job, self._ring = os.fspath(root), job, ring
        self._replicas, self._every = replicas, check_every
        self._checked = float("-inf")
        self._refused: Optional[Tuple[str, int]] = None  # a chain that could not be read (said once)
        self.uploaded: Optional[Tuple[str, int]] = None  # (base directory, increments) on the stream
        self._ranks: Tuple[int, ...] = ()  # the ranks it was uploaded for
        self.uploads = 0

    def update(self, conn: Transport, ranks: Sequence[int]) -> bool:
        """Upload the bases of ``ranks`` (those whose table metadata is on the stream) when the
        chain moved since the last upload or a rank was added. Returns whether it uploaded.

        Raises:
            TransportError: the server is unreachable (nothing counts as uploaded: retried).
        """
        now = time.monotonic()
        ranks = tuple(sorted(ranks))
        if not ranks or now - self._checked < self._every:
            return False
        self._checked = now
        try:
            chain = chains.latest_chain(self.root)
        except IncompleteBaseError:
            return False  # no complete base yet
        except CheckpointError as exc:
            self._refuse(("?", -1), exc)
            return False
        tip = (chain.base, len(chain.increments))
        if tip == self.uploaded and ranks == self._ranks:
            return False
        try:
            read = read_tables(self.root)
        except IncompleteBaseError:
            return False  # removed meanwhile (retention): the next look finds the newer one
        except CheckpointError as exc:
            self._refuse(tip, exc)
            return False
        tip = (read.base, read.increments)  # it may have read a chain newer than the look's
        for rank in ranks:
            if rank not in read.layouts:
                continue  # a rank the checkpoints do not know (another job's layout): bootstrap says so
            name = subjects.base_name(rank)
            body = wire.encode_base(read.batches[rank], read.shard(rank), read.logs[rank])
            conn.object_put(self.job, name, seal_value(self._ring, self.job, subjects.BASE, name, body),
                            replicas=self._replicas)
        self.uploaded, self._ranks = tip, ranks
        self.uploads += 1
        logger.info("shipper %s: bases of ranks %s from %s", self.job, list(ranks), read.source)
        return True

    def _refuse(self, tip: Tuple[str, int], exc: CheckpointError) -> None:
        if tip != self._refused:
            self._refused = tip
            logger.error("shipper %s: the checkpoints under %s give no base for replicas: %s", self.job, self.root, exc)


__all__ = ["CheckpointBases", "CHECK_EVERY_S"]
