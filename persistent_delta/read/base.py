"""A replica's base, and the rule that every poll applied onto it continues it.

Owns: :class:`BaseTables` (a base's full tables with, per rank, the snapshots position they
continue from) and :class:`Continuation`, the check an apply makes before it writes anything.
:func:`persistent_delta.serve.apply.load_base` and
:meth:`persistent_delta.fleet.remote.RemoteConsumer.bootstrap` return a :class:`BaseTables`;
:func:`persistent_delta.serve.apply.apply_poll` and
:class:`persistent_delta.serve.inference.InferenceReplica` check each poll against it.

Design note
-----------
A base taken at batch ``b`` (the tracker's ``curr_batch_idx`` when ``save_local_shards`` ran)
holds the trainer's values as of the save. The next publish may be stamped ``b`` -- the save
may have run between the batch's forward and its backward, so that publish may hold values the
base lacks -- or later, when stamp ``b`` takes no more publishes (``tracker.next_stamp`` says
which). That first stamp is the base's **position** on the rank (the shard file's
``next_stamp``; its ``batch_idx`` for files written before it was recorded; a base on the
stream, taken at publish ``s``: ``s + 1``). A snapshots read that starts at or before it misses
nothing the base lacks; one that starts after it misses the publishes in between, and their
rows would stay stale with nothing to say so: a replica restarted with an old base and its
consumer's committed position, or a replica registered late, at the earliest snapshot still
stored, after another consumer's ``delete_on_read`` freed the publishes that followed its base.

The reader guarantees the other half: a read at a position holds every publish from it on, or
raises (:class:`~persistent_delta.errors.OffsetOutOfRangeError`: the publishes there were
deleted). So one comparison per rank decides: the poll's start (:attr:`DeltaPoll.ranges`) must
be at or before the position -- or, for a local read, how far back it misses nothing
(``RankDelta.covers_from``: one past the newest publish stored below its start, never below
where retention deleted up to), so that a consumer registered after the first publishes of a
job that published nothing between its base and them continues it. After a poll the tables
continue from its end: the next poll starts there (a consumer's does), and one that starts
later -- a consumer moved forward by a reset policy or a seek, another consumer's poll -- is
refused the same way. A rank the base does not know (a file that records no batch) is not
checked. Starting earlier than the position is allowed: older publishes are applied again, and
the newer ones that follow in order bring every row back to the newest value (the
at-least-once rule of every apply).

A position counts the batches of one log: the rank's log the base was taken from (the shard
files' ``log_id``/``log_stamp``, :class:`~persistent_delta.log.schema.LogIdentity`). A poll
read from another log -- another job's, or the same path started afresh (``fresh=True``: a new
identity, batches from 0 again) -- would pass the comparison with positions that mean nothing
for the base, so a rank whose poll says which log it read (:attr:`RankDelta.log`, a local read)
is refused first when the base names another one. A base or a poll that does not say (files
written before identities were recorded, a remote read) is not checked for it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch

from persistent_delta.errors import StaleBaseError
from persistent_delta.log.schema import LogIdentity
from persistent_delta.read.results import DeltaPoll


class Continuation:
    """Per rank, the snapshots position a replica's tables continue from (see the module note):
    checked against each poll before it is applied, and moved to the poll's end after.

    Not thread-safe: the replica's one applying thread uses it.

    Args:
        positions: rank -> the position the tables continue from.
        source: what the tables came from, for the error message (a shard-files directory).
        logs: rank -> the identity of the log the positions count batches of (a rank without
            one is not checked for it).
    """

    def __init__(self, positions: Mapping[int, int], source: str = "the base",
                 logs: Optional[Mapping[int, LogIdentity]] = None) -> None:
        self.positions: Dict[int, int] = {int(r): int(p) for r, p in positions.items()}
        self.source = source
        self.logs: Dict[int, LogIdentity] = {int(r): ident for r, ident in (logs or {}).items()}
        self._applied: Dict[int, int] = {}  # rank -> end of the last poll applied

    def check(self, poll: DeltaPoll) -> None:
        """Raise unless ``poll`` continues the tables on every rank it read (it is not applied).

        Raises:
            StaleBaseError: a rank's read starts after the position the tables continue from,
                or was read from another log than the one the tables were taken from.
        """
        for rank, delta in sorted(poll.ranks.items()):
            self._check_log(rank, delta.log, delta.start_idx)
            position, start = self.positions.get(rank), delta.start_idx
            covers = start if delta.covers_from is None else min(start, delta.covers_from)
            if position is None or covers <= position:
                continue
            held = f" (it holds every publish from batch {covers} on)" if covers < start else ""
            if rank in self._applied:
                why = (f"the poll applied before ended at batch {position}: the publishes stamped in "
                       f"[{position}, {covers}) are in neither (was the consumer moved forward, by a reset policy or a seek, "
                       "or is this another consumer's poll?)")
            else:
                why = (f"{self.source} continues from batch {position}: the publishes stamped in "
                       f"[{position}, {covers}) are in neither (a replica restarted with an old base and its consumer's "
                       "committed position, or registered after the publishes that followed its base were deleted)")
            raise StaleBaseError(
                f"rank {rank}: this snapshots poll starts at batch {start}{held}, but {why}; applied, their rows "
                "would stay stale. Nothing was applied. Start from a fresh base: save_local_shards(tracker, shard_dir) "
                "on every rank of the trainer, then load_base(shard_dir) (across hosts: RemoteConsumer.bootstrap()), "
                "with the consumer at or before its batch; or from the trainer's checkpoints, "
                "persistent_delta.serve.Follower(consumer, root), which positions the consumer",
                rank=rank, start=start, position=position)

    def _check_log(self, rank: int, read: Optional[LogIdentity], start: int) -> None:
        """Raise when the poll's rank ``rank`` was read from another log than the tables'."""
        mine = self.logs.get(rank)
        if mine is None or read is None or read.log_id == mine.log_id:
            return
        when = "an older" if mine.older_than(read) else "another"
        raise StaleBaseError(
            f"rank {rank}: this snapshots poll was read from {read.describe()}, but {self.source} was taken from "
            f"{when} log, {mine.describe()} (another job's log, or this path's log before a start afresh with "
            "fresh=True): its batch positions count that log's batches, so nothing tells which of this log's "
            "publishes it holds; applied, rows would be wrong or stale. Nothing was applied. Start from a fresh "
            "base of this log: save_local_shards(tracker, shard_dir) on every rank of the trainer that writes it, "
            "then load_base(shard_dir) (across hosts: RemoteConsumer.bootstrap()), with the consumer at or before "
            "its batch; or from the trainer's checkpoints, persistent_delta.serve.Follower(consumer, root)",
            rank=rank, start=start, position=self.positions.get(rank, 0))

    def advance(self, poll: DeltaPoll) -> None:
        """``poll`` was applied: the tables continue from its end on every rank it read."""
        for rank, delta in poll.ranks.items():
            if rank in self.positions:
                self.positions[rank] = self._applied[rank] = int(delta.end_idx)


class BaseTables(Dict[str, torch.Tensor]):
    """A replica's base: fqn -> the full table ``(global_rows, global_cols)``, a ``dict`` as
    :func:`~persistent_delta.serve.apply.load_base` always returned, that also knows where it
    continues from. :func:`~persistent_delta.serve.apply.apply_poll` onto it checks every poll
    first (:class:`Continuation`) and raises
    :class:`~persistent_delta.errors.StaleBaseError` for one that does not continue it.
    ``dict(base)`` (or a copy of its tables) is a plain dict again, unchecked. Pickled (by
    ``torch.save`` too), it is an ``OrderedDict`` of its tables, unchecked.

    Attributes:
        batches: rank -> the batch the base was taken at (as its files record it).
        continuation: per rank, where the tables continue from; moved by each applied poll.
        source: what the tables came from (the shard-files directory, the job's stream).
        logs: rank -> the identity of the rank's log the base was taken from (as its files
            record it): a poll read from another log is refused.
    """

    def __init__(self, tables: Union[Mapping[str, torch.Tensor], Iterable[Tuple[str, torch.Tensor]]] = (),
                 positions: Optional[Mapping[int, int]] = None, batches: Optional[Mapping[int, int]] = None,
                 source: str = "the base", logs: Optional[Mapping[int, LogIdentity]] = None) -> None:
        super().__init__(tables)
        self.batches: Dict[int, int] = dict(batches or {})
        self.source = source
        self.continuation = Continuation(positions or {}, source, logs)

    @property
    def logs(self) -> Dict[int, LogIdentity]:
        """rank -> the identity of the log the base was taken from (ranks that record one)."""
        return dict(self.continuation.logs)

    @property
    def positions(self) -> Dict[int, int]:
        """rank -> the snapshots position the tables continue from now: a poll applied onto
        them must start at or before it."""
        return dict(self.continuation.positions)

    def __reduce__(self) -> Tuple[type, Tuple[List[Tuple[str, torch.Tensor]]]]:
        # as an OrderedDict, what a state dict is: torch.load(weights_only=True) reads it back
        return OrderedDict, (list(self.items()),)


def continuation_of(base: Optional[Mapping[str, torch.Tensor]]) -> Optional[Continuation]:
    """A fresh :class:`Continuation` at ``base``'s positions, for a replica that copies the base
    into tables of its own (an inference model); None for a plain mapping (nothing to check)."""
    if not isinstance(base, BaseTables):
        return None
    return Continuation(base.continuation.positions, base.source, base.continuation.logs)


__all__ = ["BaseTables", "Continuation", "continuation_of"]
