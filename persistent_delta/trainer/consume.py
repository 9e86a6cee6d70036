"""TorchRec's consume rule on the trainer: ``get_unique(consumer)`` and the reads built from it.

Owns: the trainer's consume operations -- read a lookups consumer's rows from its position,
commit its new position, compact behind the read and enforce retention, in one write
transaction (:func:`consume`) or in two (:func:`consume_read_ids` then :func:`consume_commit`,
as a publish does), and the exact read of side records (:func:`consume_exact`). What a position
means, where a read starts, which compactions are safe and what retention deletes are
:mod:`persistent_delta.log.position_rules`'s; this module only asks it.

A consumer either reads (:func:`consume`, :func:`consume_exact`) or publishes (the read
:func:`consume_read_ids` and the commit :func:`consume_commit`): both move its one position,
so a publish after a read would carry nothing of what the read took. Its first commit records
the role in its entry (:attr:`~persistent_delta.log.schema.ConsumerEntry.role`), durably, and
the other use raises :class:`~persistent_delta.errors.ConsumerRoleError` from then on.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch
from torchrec.distributed.model_tracker.types import UniqueRows, UpdateMode

from persistent_delta.config import RetentionBound
from persistent_delta.errors import ConsumerConflictError, ConsumerRoleError, UnknownConsumerError
from persistent_delta.log import codec, position_rules
from persistent_delta.log.deltalog import ReadTxn, WriteTxn
from persistent_delta.log.records import AppendRecord, log_start, read_unique
from persistent_delta.log.rows import unique_ids
from persistent_delta.log.schema import LOOKUPS, ROLE_PUBLISHES, ROLE_READS, ConsumerEntry
from persistent_delta.trainer.unread import UnreadIds, UnreadSince

logger = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["consume", "consume_commit", "consume_exact", "consume_read_ids"]


def consume(
    w: WriteTxn,
    name: str,
    end: int,
    mode: UpdateMode,
    *,
    compact: bool,
    delete_on_read: bool,
    bound: Optional[RetentionBound] = None,
    alloc: Optional[Callable[[int], torch.Tensor]] = None,
) -> Dict[str, UniqueRows]:
    """TorchRec's ``get_unique(consumer)`` inside one write transaction: compact
    ``[largest position, end)`` (when ``compact``), read the consumer's rows from its position,
    commit ``end`` as its position, enforce retention (when ``delete_on_read``).

    An in-transaction consumer below the log start (cleared, or expired) reads from the log
    start: its reset policy is "earliest" (TorchRec has no out-of-range error); expiry is
    logged. ``alloc``: where the rows' memory comes from (:func:`~persistent_delta.log.records.read_unique`).

    The same rule in two transactions (a read now, the commit later, as ``publish()`` does):
    :func:`consume_read_ids` then :func:`consume_commit`.

    Raises:
        UnknownConsumerError: ``name`` is not a lookups consumer of this log.
        ConsumerRoleError: ``name`` publishes (see the module docs).
    """
    entry = _lookups_consumer(w, name, role=ROLE_READS)
    if compact:
        _compact_for_read(w, mode, end)
    rows = read_unique(w, mode, from_idx=position_rules.read_start(w, entry.offset), alloc=alloc)
    _commit_read(w, name, entry, end, delete_on_read, bound, ROLE_READS)
    return rows


def consume_read_ids(
    r: ReadTxn, name: str, pending: Sequence[AppendRecord] = (),
    taken: Optional[UnreadSince] = None, unread_ids: Optional[UnreadIds] = None,
    consumers: Optional[Dict[str, ConsumerEntry]] = None,
) -> Tuple[ConsumerEntry, Dict[str, torch.Tensor]]:
    """The read half of :func:`consume`, ids only (ascending, unique, per table; no states
    read), in ``r``, nothing written: for a reader that takes the rows' current values instead
    (a publish). Commit it with :func:`consume_commit` and the entry returned.

    ``pending``: lookups records handed to the writer but not committed yet, read by the same
    rule as the log's (from :func:`read_start`; side records are not read). The writer must
    commit them before this read's :func:`consume_commit` (in the same transaction or an
    earlier one), so that the read need not wait for them. A pending record may also be in the
    log already (a commit in flight): its ids count once.

    ``taken`` (a consumer's unread set taken from ``unread_ids``, :mod:`persistent_delta.trainer.unread`): the
    ids the writer committed since the consumer's previous publish. They answer instead of the log's
    records when they equal them: the unread set started at the consumer's position, the
    consumer is not expired, nothing at or after that position was deleted, and a read there
    starts there (no filtered window or compacted record reaches back before it). Otherwise the
    log is read. Tables with no unread id may then be left out (the log's read lists them
    empty). ``consumers``: ``r.consumers()``, when the caller read them already.

    Raises:
        UnknownConsumerError: ``name`` is not a lookups consumer of this log.
        ConsumerRoleError: ``name`` reads (``get_unique``; see the module docs).
    """
    entry = _lookups_consumer(r, name, consumers=consumers, role=ROLE_PUBLISHES)
    start = position_rules.read_start(r, entry.offset)
    if (taken is not None and unread_ids is not None and taken.start == entry.offset == start
            and not entry.expired and log_start(r) <= start):
        return entry, unread_ids.unread(taken, pending)
    if unread_ids is not None:
        unread_ids.log_reads += 1
    extra: Dict[str, List[torch.Tensor]] = {}
    for rec in pending:
        if rec.kind not in codec.SIDE_KINDS and rec.batch_idx >= start and rec.ids.numel():
            extra.setdefault(rec.fqn, []).append(rec.ids)
    rows = read_unique(r, UpdateMode.NONE, from_idx=start, extra_ids=extra)
    out = {fqn: u.ids for fqn, u in rows.items()}
    for fqn, parts in extra.items():  # tables the pending records create, or list again
        if fqn not in out:
            out[fqn] = unique_ids(parts[0] if len(parts) == 1 else torch.cat(parts))
    return entry, out


def consume_commit(
    w: WriteTxn,
    name: str,
    read: ConsumerEntry,
    end: int,
    mode: UpdateMode,
    *,
    compact: bool,
    delete_on_read: bool,
    bound: Optional[RetentionBound] = None,
) -> None:
    """The write half of :func:`consume`: commit ``end`` as ``name``'s position after a
    :func:`consume_read_ids` that returned ``read``, compacting and enforcing retention as
    :func:`consume` does, and record that the consumer publishes.

    Raises:
        UnknownConsumerError: the consumer was unregistered since.
        ConsumerConflictError: its position moved since the read (what was read is stale).
        ConsumerRoleError: it reads (see the module docs).
    """
    entry = _lookups_consumer(w, name, warn=False, role=ROLE_PUBLISHES)
    if entry.offset != read.offset or entry.expired != read.expired:
        raise ConsumerConflictError(
            f"consumer {name!r} of {w.path} moved from {read.offset} to {entry.offset} between its read and its "
            "commit; the rows read are not committed"
        )
    if compact:
        _compact_for_read(w, mode, end)
    _commit_read(w, name, entry, end, delete_on_read, bound, ROLE_PUBLISHES)


def consume_exact(
    w: WriteTxn,
    name: str,
    end: int,
    read: Callable[[int], T],
    empty: T,
    *,
    delete_on_read: bool,
    bound: Optional[RetentionBound] = None,
) -> T:
    """The consume rule for readers of records the window filter never touches (a table's
    side records: raw ids, slot reassignments): ``read(start)`` over ``[start, end)`` from the
    consumer's position exactly (or the log start, when its batches were deleted), then commit
    ``end`` and enforce retention as :func:`consume` does. Nothing to read gives ``empty`` and
    leaves the position.

    Raises:
        UnknownConsumerError: ``name`` is not a lookups consumer of this log.
        ConsumerRoleError: ``name`` publishes (see the module docs).
    """
    entry = _lookups_consumer(w, name, role=ROLE_READS)
    start = max(entry.offset, log_start(w))
    out = empty
    if start < end:
        out = read(start)
        w.set_consumer(name, entry.committed(end, end, ROLE_READS))
    if delete_on_read:
        position_rules.enforce_retention(w, LOOKUPS, bound)
    return out


def _lookups_consumer(r: ReadTxn, name: str, warn: bool = True,
                      consumers: Optional[Dict[str, ConsumerEntry]] = None, role: str = "") -> ConsumerEntry:
    consumers = position_rules.lookups_consumers(r.consumers() if consumers is None else consumers)
    entry = consumers.get(name)
    if entry is None:
        raise UnknownConsumerError(
            f"consumer {name} not present in {sorted(consumers)}: it is not registered in {r.path}; add it with "
            "add_consumer()"
        )
    if role and entry.role and entry.role != role:
        raise ConsumerRoleError(_role_message(name, r.path, entry.role))
    if warn and entry.expired:
        logger.warning("consumer %r of %s was expired by the retention bound; it reads from the log start %d",
                       name, r.path, log_start(r))
    return entry


def _role_message(name: str, path: str, role: str) -> str:
    if role == ROLE_PUBLISHES:
        what = (f"consumer {name!r} of {path} publishes (tracker.publish): get_unique on it would move the position its "
                "next publish starts from, and that publish would carry nothing of the rows read")
    else:
        what = (f"consumer {name!r} of {path} reads (tracker.get_unique): a publish of it would carry only the rows "
                "changed since its last get_unique, not those since its last publish")
    return (f"{what}. A consumer either reads or publishes: use two consumer names, one per use "
            "(PersistentTrackerConfig(consumers=[...]) or tracker.add_consumer(name)); to change this one's use, "
            "tracker.remove_consumer(name) and add it again")


def _compact_for_read(w: WriteTxn, mode: UpdateMode, end: int) -> None:
    # TorchRec compacts [largest offset, end). It never changes an answer; it only makes
    # later reads of that range cheaper.
    offsets = [v.offset for v in position_rules.lookups_consumers(w.consumers()).values()]
    position_rules.safe_compact(w, mode, max(0, max(offsets, default=0)), end)


def _commit_read(
    w: WriteTxn, name: str, entry: ConsumerEntry, end: int, delete_on_read: bool, bound: Optional[RetentionBound],
    role: str,
) -> None:
    w.set_consumer(name, entry.committed(end, end, role))
    if delete_on_read:
        position_rules.enforce_retention(w, LOOKUPS, bound)
