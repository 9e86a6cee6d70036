"""The offsets tool's data functions: describe consumers, reset, register and delete offsets.

Owns: the offsets tool's plans (reset, register, delete) and their dry-run/execute rule; the
describe computation lives in :mod:`persistent_delta.ops.positions` (shared with the exporter,
``top`` and the report) and is re-exported here.

Anchor: Kafka's ``kafka-consumer-groups`` (``--describe``, ``--reset-offsets`` with a dry run by
default). Every function here returns data (dataclasses); :mod:`persistent_delta.cli.main`
renders it. Bounds, statuses and pending counts come from :mod:`persistent_delta.log.position_rules`
(pending rows are counted from the same read start a consumer's poll would use).

``describe`` opens each rank's log read-only and never creates anything. The changing functions
plan per rank inside a read transaction (dry run, the default) or plan *and* apply inside one
write transaction per rank (``execute=True``) through a consumer-role handle, which needs no
writer lock: it works while the trainer runs, and the trainer sees the new offset at its next
read. A consumer process that is running keeps its in-memory position and overwrites a reset at
its next ``commit``: stop it first (as Kafka requires an inactive group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from persistent_delta.log import position_rules
from persistent_delta.errors import InvalidInputError, UnknownConsumerError
from persistent_delta.log.layout import PathLike, rank_paths
from persistent_delta.log.lmdbenv import ConsumerClaims
from persistent_delta.log.deltalog import DeltaLog, ReadTxn, WriteTxn
from persistent_delta.ops.positions import ConsumerOffsets, RankOffsets, TableStats, describe
from persistent_delta.log.schema import (
    LOOKUPS,
    ConsumerEntry,
    Delivery,
    check_channel,
    check_consumer_name,
)


# ------------------------------------------------------------------------------ changes


@dataclass(frozen=True)
class ResetTarget:
    """Where ``--reset`` moves an offset: ``earliest``, ``latest``, ``batch`` (``value``) or
    ``shift`` (by ``value``, negative to go back). Targets are clamped to ``[start, end]``."""

    kind: str
    value: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("earliest", "latest", "batch", "shift"):
            raise InvalidInputError(f"unknown reset target {self.kind!r}")
        if self.kind == "batch" and self.value < 0:
            raise InvalidInputError(f"--to-batch must be >= 0, got {self.value}")

    def resolve(self, offset: int, start: int, end: int) -> Tuple[int, str]:
        """The new offset and a note (set when the target was clamped into ``[start, end]``)."""
        want = {"earliest": start, "latest": end, "batch": self.value, "shift": offset + self.value}[self.kind]
        new = min(max(want, start), end)
        return new, "" if new == want else f"clamped from {want} to [{start}, {end}]"


@dataclass
class OffsetChange:
    """A planned (dry run) or applied change of one consumer on one rank."""

    rank: int
    path: str
    consumer: str
    action: str  # reset | register | delete | unchanged | exists | absent
    old: Optional[int]
    new: Optional[int]
    log_start: int
    log_end: int
    note: str = ""
    applied: bool = False


_Plan = Callable[[ReadTxn, int, str], Tuple[OffsetChange, Optional[Callable[[WriteTxn], None]]]]


def _run(root: PathLike, consumer: str, plan: _Plan, execute: bool) -> List[OffsetChange]:
    """Plan every rank (read-only), or plan and apply each rank in one write transaction while
    holding the consumer's name: a consumer in use (the trainer's, a running DeltaConsumer) is
    refused, as Kafka refuses to reset an active group."""
    paths = rank_paths(root)
    claims = [ConsumerClaims(path) for path in paths.values()]
    try:
        if execute:
            for c in claims:
                c.claim(consumer, "change its offsets (stop the process that uses it first)")
        return _plan_or_apply(paths, plan, execute)
    finally:
        for c in claims:
            c.release_all()


def _plan_or_apply(paths: Dict[int, str], plan: _Plan, execute: bool) -> List[OffsetChange]:
    changes = []
    for rank, path in paths.items():
        if execute:
            def apply(w: WriteTxn, rank: int = rank, path: str = path) -> OffsetChange:
                change, act = plan(w, rank, path)
                if act is not None:
                    act(w)
                    change.applied = True
                return change

            with DeltaLog(path, writer_lock=False) as log:
                changes.append(log.write(apply))
        else:
            def look(r: ReadTxn, rank: int = rank, path: str = path) -> OffsetChange:
                return plan(r, rank, path)[0]

            with DeltaLog(path, readonly=True) as log:
                changes.append(log.read(look))
    return changes


def _require_somewhere(changes: List[OffsetChange], consumer: str, root: PathLike) -> None:
    if all(c.action == "absent" for c in changes):
        raise UnknownConsumerError(
            f"consumer {consumer!r} is not registered in any rank of {root}; see `persistent-delta offsets {root}`"
        )


def reset_offsets(root: PathLike, consumer: str, target: ResetTarget, execute: bool = False) -> List[OffsetChange]:
    """Move ``consumer``'s committed offset on every rank where it is registered.

    Args:
        root: the log root.
        consumer: the consumer name.
        target: where to move it (clamped to the channel's ``[start, end]``).
        execute: apply (default: dry run, nothing written).

    Returns:
        One :class:`OffsetChange` per rank.

    Raises:
        UnknownConsumerError: the consumer is registered on no rank.
    """
    check_consumer_name(consumer)

    def plan(r: ReadTxn, rank: int, path: str) -> Tuple[OffsetChange, Optional[Callable[[WriteTxn], None]]]:
        entry = r.consumer(consumer)
        if entry is None:
            start, end = position_rules.bounds(r, LOOKUPS)
            return OffsetChange(rank, path, consumer, "absent", None, None, start, end), None
        start, end = position_rules.bounds(r, entry.channel)
        new, note = target.resolve(entry.offset, start, end)
        if new == entry.offset and not entry.expired:
            return OffsetChange(rank, path, consumer, "unchanged", entry.offset, new, start, end, note), None
        updated = entry.committed(new, end)
        return (OffsetChange(rank, path, consumer, "reset", entry.offset, new, start, end, note),
                lambda w: w.set_consumer(consumer, updated))

    changes = _run(root, consumer, plan, execute)
    _require_somewhere(changes, consumer, root)
    return changes


def register_consumer(
    root: PathLike,
    consumer: str,
    target: ResetTarget = ResetTarget("earliest"),
    channel: str = LOOKUPS,
    execute: bool = False,
) -> List[OffsetChange]:
    """Register ``consumer`` on every rank where it is missing (a ``POLL_COMMIT`` consumer, as
    :class:`~persistent_delta.DeltaConsumer` registers: it holds back retention of its channel
    from now on).

    Args:
        target: its first offset (default: the channel start); ``shift`` counts from the start.
        channel: ``"lookups"`` or ``"snapshots"``.
        execute: apply (default: dry run).

    Returns:
        One :class:`OffsetChange` per rank (``exists`` where it was registered already).
    """
    check_consumer_name(consumer)
    check_channel(channel)

    def plan(r: ReadTxn, rank: int, path: str) -> Tuple[OffsetChange, Optional[Callable[[WriteTxn], None]]]:
        start, end = position_rules.bounds(r, channel)
        entry = r.consumer(consumer)
        if entry is not None:
            return OffsetChange(rank, path, consumer, "exists", entry.offset, entry.offset, start, end), None
        new, note = target.resolve(start, start, end)
        fresh = ConsumerEntry.new(new, channel, Delivery.POLL_COMMIT)
        return (OffsetChange(rank, path, consumer, "register", None, new, start, end, note),
                lambda w: w.set_consumer(consumer, fresh))

    return _run(root, consumer, plan, execute)


def delete_consumer(root: PathLike, consumer: str, execute: bool = False) -> List[OffsetChange]:
    """Unregister ``consumer`` on every rank (it stops holding back retention).

    Raises:
        UnknownConsumerError: the consumer is registered on no rank.
    """
    check_consumer_name(consumer)

    def plan(r: ReadTxn, rank: int, path: str) -> Tuple[OffsetChange, Optional[Callable[[WriteTxn], None]]]:
        entry = r.consumer(consumer)
        start, end = position_rules.bounds(r, LOOKUPS if entry is None else entry.channel)
        if entry is None:
            return OffsetChange(rank, path, consumer, "absent", None, None, start, end), None
        old = entry.offset
        note = ""
        if entry.delivery == Delivery.IN_TRANSACTION:
            note = "declared by the trainer: its get_unique() fails until add_consumer()"

        def drop(w: WriteTxn) -> None:
            w.delete_consumer(consumer)

        return OffsetChange(rank, path, consumer, "delete", old, None, start, end, note), drop

    changes = _run(root, consumer, plan, execute)
    _require_somewhere(changes, consumer, root)
    return changes


__all__ = [
    "ConsumerOffsets", "OffsetChange", "RankOffsets", "ResetTarget", "TableStats",
    "delete_consumer", "describe", "register_consumer", "reset_offsets",
]
