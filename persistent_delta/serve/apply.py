"""Applying polled rows to a replica's full tables: the one definition of "applied".

Owns: how a poll of the snapshots channel lands in a replica's tables. A replica (a serving
process, an evaluation job) holds each table whole, as one ``(global_rows, global_cols)``
tensor, and keeps it equal to the trainer's by applying every poll in order:

* each rank's rows go to their global row ids (``TableDelta.global_ids``), and a column-wise
  shard's values to its columns ``[col_offset, col_offset + width)`` -- the column halves of a
  publish land side by side, with no intermediate merge or copy;
* within a poll each rank's rows already hold the newest publish's values (snapshots merge
  LAST); across polls the later poll is newer, so applying polls in order is newest-wins;
* a row present on several ranks (a data-parallel, replicated table: each rank publishes the
  rows it looked up) takes the value of the newest publish that holds it, the lowest rank's
  among equals, as :meth:`DeltaPoll.merged` does.

A tracker job's poll stops at the end every rank completed, so it never holds part of a
publish; ``complete_only=True`` also refuses a poll whose ranks were read up to different
ends, or that misses a rank of the job (see :attr:`DeltaPoll.complete`). Nothing is applied
when a check fails.

A replica's starting tables (its *base*) come from the trainer's shard files
(:func:`load_base`) or from a base uploaded to the stream
(:meth:`persistent_delta.fleet.remote.RemoteConsumer.bootstrap`), as a
:class:`~persistent_delta.read.base.BaseTables` that knows, per rank, where it continues from:
a poll applied onto it that starts later raises :class:`~persistent_delta.errors.StaleBaseError` (the publishes in
between are in neither: :mod:`persistent_delta.read.base`).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import Dict, List, Mapping, Optional, Protocol, Tuple, Union, runtime_checkable

import torch
from torchrec.distributed.model_tracker.types import UniqueRows

from persistent_delta.errors import IncompletePollError, InvalidInputError, NotALogError, RanksBehindError
from persistent_delta.log import position_rules
from persistent_delta.log.layout import PathLike
from persistent_delta.log.rows import scatter_rows
from persistent_delta.log.schema import ShardInfo
from persistent_delta.log.shard_files import load_shards, shard_batches, shard_identities, shard_positions, whole_tables
from persistent_delta.read.base import BaseTables
from persistent_delta.read.results import DeltaPoll, TableDelta, merge_table
from persistent_delta.log.schema import SNAPSHOTS
from persistent_delta.threads import intra_op_threads


logger = logging.getLogger(__name__)


def load_base(shard_dir: PathLike, wait: float = 0.0) -> BaseTables:
    """A replica's starting tables from the trainer's shard files: every table whole, in
    global row ids, assembled from the ``rank-<r>.safetensors`` files that
    :func:`persistent_delta.trainer.save_shards.save_local_shards` wrote on every rank into
    ``shard_dir`` (row-wise shards stacked, column-wise halves side by side). Apply the
    snapshots published after the files were taken to these tables (:func:`apply_poll`), with
    a consumer whose position is at or before the base's batch on every rank (registered before
    the save, or before the publish that followed it): the first poll applied is checked for it
    (:mod:`persistent_delta.read.base`). Reads every file whole: it needs memory for the full
    tables plus one rank's shards.

    Args:
        shard_dir: the directory every rank passed to ``save_local_shards``.
        wait: seconds to wait for the files to appear, for a replica started alongside its
            trainer: until ``shard_dir`` holds shard files and they cover every table they
            name whole (the ranks write their files one by one, each atomically). 0 (the
            default) reads what is there now.

    Returns:
        fqn -> the full table, shape ``(global_rows, global_cols)``, the shards' dtype: a
        :class:`~persistent_delta.read.base.BaseTables` (a ``dict``) whose ``batches`` say which
        batch each rank's file holds, ``positions`` where a poll applied onto it must start
        at the latest, and ``logs`` which log each rank's file was taken from (a poll read from
        another log, e.g. after a start afresh, is refused).

    Raises:
        NotALogError: ``shard_dir`` holds no shard files (after ``wait``).
        InvalidInputError: a malformed file, a table size the files' values cannot fill
            (checked before it is allocated), or a row or column no rank file holds (a rank's
            file is missing, after ``wait``).
    """
    if wait < 0:
        raise InvalidInputError(f"wait must be >= 0 seconds, got {wait}")
    deadline = time.monotonic() + wait
    while True:
        try:
            # before the weights: a file saved again meanwhile gives an older position (stricter)
            positions, batches = shard_positions(shard_dir), shard_batches(shard_dir)
            logs = shard_identities(shard_dir)
            found = load_shards(shard_dir)
            if time.monotonic() >= deadline or all(_covers_whole(s) for s in found.values()):
                break
        except NotALogError:
            if time.monotonic() >= deadline:
                raise
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    tables = whole_tables(shard_dir, found)
    unknown = sorted(r for r, p in positions.items() if p is None)
    if unknown:
        logger.warning("%s: the shard files of ranks %s record no batch (written by an older version): a poll applied "
                       "onto them cannot be checked to continue them on those ranks", shard_dir, unknown)
    return BaseTables(tables, positions={r: p for r, p in positions.items() if p is not None},
                      batches={r: b for r, b in batches.items() if b is not None},
                      logs={r: ident for r, ident in logs.items() if ident is not None},
                      source=f"the base in {os.fspath(shard_dir)!r}")


def _covers_whole(shards: List[Tuple[ShardInfo, torch.Tensor]]) -> bool:
    """Whether a table's shards hold as many cells as the table (a readiness test for
    :func:`load_base`'s wait; overlapping copies of a replicated table count once each, and
    :func:`full_rows` checks the cover itself)."""
    info0 = shards[0][0]
    if info0.global_rows is None or info0.global_cols is None:
        return True  # full_rows says what is missing
    held = sum(int(w.shape[0]) * int(w.shape[1]) for _, w in shards)
    return held >= int(info0.global_rows) * int(info0.global_cols)


@dataclass
class Applied:
    """What :func:`apply_poll` applied.

    Attributes:
        ranges: rank -> ``(start_idx, end_idx)`` the poll read (what the tables now reflect).
        rows: rows written, summed over ranks and tables (a column-split row counts per shard).
        nbytes: value bytes written.
        publishes: stamp -> publish time of the publishes applied.
        applied_at: wall-clock time (``time.time()``) when the last row was written.
    """

    ranges: Dict[int, Tuple[int, int]] = field(default_factory=dict)
    rows: int = 0
    nbytes: int = 0
    publishes: Dict[int, float] = field(default_factory=dict)
    applied_at: float = 0.0

    def lag_s(self) -> Optional[float]:
        """Seconds from the oldest publish applied to ``applied_at`` (its freshness), or None."""
        return self.applied_at - min(self.publishes.values()) if self.publishes else None


@runtime_checkable
class PollTarget(Protocol):
    """A replica that applies polls itself, by the same rules (e.g.
    :class:`persistent_delta.serve.inference.InferenceReplica`): :func:`apply_poll` hands it
    the poll."""

    def apply_poll(self, poll: DeltaPoll, *, complete_only: bool = False, strict: bool = True) -> "Applied":
        """Apply ``poll`` in place (see :func:`apply_poll`)."""
        ...


def apply_poll(
    tables: Union[Mapping[str, torch.Tensor], PollTarget], poll: DeltaPoll, *, complete_only: bool = False, strict: bool = True
) -> Applied:
    """Apply the rows of a snapshots poll to ``tables`` (fqn -> full table), in place.

    Args:
        tables: fqn -> the replica's whole table, ``(global_rows, global_cols)``, of the
            trainer's dtype; or a :class:`PollTarget` (a TorchRec inference model's replica,
            :class:`persistent_delta.serve.inference.InferenceReplica`), which applies the poll
            itself. Tables from :func:`load_base` (a
            :class:`~persistent_delta.read.base.BaseTables`) check that the poll continues
            them (see Raises) and move on to its end.
        poll: a poll of the ``snapshots`` channel.
        complete_only: refuse a poll that is not :attr:`~DeltaPoll.complete`.
        strict: a polled table missing from ``tables`` is an error (``False``: skipped).

    Runs with the poll's ``read_threads`` torch intra-op threads (default 1: see
    :mod:`persistent_delta.threads`).

    Raises:
        InvalidInputError: not a snapshots poll; int8 rows (for a quantized inference model:
            :mod:`persistent_delta.serve.inference`); a table is missing (``strict``), not 2-D,
            smaller than the shard says, or of another dtype.
        IncompletePollError: ``complete_only`` and the poll is not complete.
        StaleBaseError: ``tables`` is a :class:`~persistent_delta.read.base.BaseTables` and the
            poll starts, on some rank, after the position they continue from (the base's batch,
            then the end of the poll applied before): the publishes in between are in neither;
            or it was read, on some rank, from another log than the base's (another job's, or
            the log before a start afresh). Start from a fresh base (its message says how).
    """
    if isinstance(tables, PollTarget):
        return tables.apply_poll(poll, complete_only=complete_only, strict=strict)
    check_poll(poll, complete_only)
    follows = tables.continuation if isinstance(tables, BaseTables) else None
    if follows is not None:
        follows.check(poll)
    if any(part.format == "int8" for part in poll):
        raise InvalidInputError(
            "this poll holds int8 rows (FBGEMM's row-wise int8: uint8 [n, dim + 4]); apply_poll writes float tables. "
            "Apply them into a TorchRec quantized inference model (persistent_delta.serve.inference.InferenceReplica), "
            "or read a float format (DeltaConsumer(..., format='native'))")
    with torch.no_grad(), intra_op_threads(poll.read_threads):
        plan: List[Tuple[torch.Tensor, TableDelta]] = []
        for fqn, parts in poll.tables().items():
            table = tables.get(fqn)
            if table is None:
                if strict:
                    raise InvalidInputError(f"the replica has no table {fqn!r} (it has {sorted(tables)})")
                continue
            if len(parts) > 1 and any(p.shard is not None and p.shard.replicated for p in parts):
                parts = [_replicated(fqn, parts)]
            for part in parts:
                if part.ids.numel() and part.states is not None:
                    plan.append((_target(fqn, table, part), part))
        out = Applied(ranges=poll.ranges, publishes=poll.publishes)
        for target, part in plan:
            states = part.states
            assert states is not None
            scatter_rows(target, part.global_ids, states.reshape(states.shape[0], -1))
            out.rows += int(part.ids.numel())
            out.nbytes += states.numel() * states.element_size()
    if follows is not None:
        follows.advance(poll)
    out.applied_at = time.time()
    return out


def check_poll(poll: DeltaPoll, complete_only: bool) -> None:
    """The checks every apply makes before it writes anything.

    Raises:
        InvalidInputError: not a snapshots poll.
        RanksBehindError: ``complete_only`` and a rank of the job is behind
            (:attr:`~persistent_delta.read.results.DeltaPoll.behind`).
        IncompletePollError: ``complete_only`` and the poll is not complete.
    """
    if poll.channel != SNAPSHOTS:
        raise InvalidInputError(
            f"apply_poll applies snapshots (current row values); this poll read the {poll.channel!r} channel")
    if complete_only and poll.behind:
        raise RanksBehindError(f"{position_rules.behind_note(poll.behind)}; nothing was applied", poll.behind)
    if complete_only and not poll.complete:
        raise IncompletePollError(
            f"the poll read ranks {sorted(poll.ranks)} (world size {poll.world_size}) over ranges {poll.ranges}: "
            "some rank's part of these publishes is not in it; nothing was applied")


def _replicated(fqn: str, parts: List[TableDelta]) -> TableDelta:
    """A replicated table's parts as one part, by :func:`merge_table`'s rule (newest publish
    wins, then the lowest rank)."""
    merged = merge_table(fqn, parts)
    rows = UniqueRows(ids=merged.global_ids, states=merged.states)
    return TableDelta(fqn, min(p.rank for p in parts), min(p.start_idx for p in parts), max(p.end_idx for p in parts),
                      rows, merged.global_ids, replace(parts[0].shard, row_offset=0) if parts[0].shard else None)


def _target(fqn: str, table: torch.Tensor, part: TableDelta) -> torch.Tensor:
    """The view of ``table`` that ``part``'s rows are copied into (checked)."""
    states = part.states
    assert states is not None
    width = int(states[0].numel()) if states.shape[0] else 0
    if table.dim() != 2:
        raise InvalidInputError(f"replica table {fqn!r} must be 2-D (rows, columns), got shape {tuple(table.shape)}")
    if table.dtype != states.dtype:
        raise InvalidInputError(f"replica table {fqn!r} is {table.dtype}; the log holds {states.dtype} values")
    c0 = part.col_offset
    if c0 + width > table.shape[1]:
        raise InvalidInputError(
            f"replica table {fqn!r} has {table.shape[1]} columns; rank {part.rank}'s shard holds columns "
            f"[{c0}, {c0 + width})")
    top = int(part.global_ids.max()) if part.global_ids.numel() else -1
    if top >= table.shape[0] or (part.global_ids.numel() and int(part.global_ids.min()) < 0):
        raise InvalidInputError(
            f"replica table {fqn!r} has {table.shape[0]} rows; rank {part.rank}'s rows reach global id {top}")
    return table if (c0 == 0 and width == table.shape[1]) else table[:, c0:c0 + width]


__all__ = ["Applied", "PollTarget", "apply_poll", "check_poll"]
