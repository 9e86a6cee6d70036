"""Read results and their assembly over ranks: what a poll, a replay window or a table row holds.

Owns: the result types every reader returns (:class:`TableDelta`, :class:`RankDelta`,
:class:`MergedDelta`, :class:`DeltaPoll`), the mapping of shard-local ids to global row ids
(:func:`table_delta`), and the merge of one table's shards over ranks (row-wise shards
concatenated, column-wise shards put side by side), joined as views where the poll laid them
out so (:func:`persistent_delta.read.fetch.finish_ranks`), else copied. Each result carries the
half-open range it actually read. Reading the log into these types is
:mod:`persistent_delta.read.fetch`'s.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torchrec.distributed.model_tracker.types import UniqueRows, UpdateMode

from persistent_delta.config import LogOptions
from persistent_delta.errors import InvalidInputError
from persistent_delta.log import codec
from persistent_delta.log.rows import compute_unique_rows, is_ascending, ordered_runs, unique_ids
from persistent_delta.log.schema import LogIdentity, ShardInfo
from persistent_delta.threads import intra_op_threads
from persistent_delta.log.zch_records import ZchDelta, merge_side


# ----------------------------------------------------------------------------- poll results


@dataclass
class TableDelta:
    """One rank's delta of one table over ``[start_idx, end_idx)`` (half-open).

    ``rows`` holds shard-local ids (ascending, unique) and the states per the update mode
    (snapshots: the current row values of the shard's columns); ``global_ids`` are the same rows
    as int64 global row ids.

    In a :class:`DeltaPoll` the tensors share memory: every rank's and table's states are
    views of one buffer (a column-wise shard's states a column slice of the full rows, so not
    contiguous), and column-wise shards with the same ids hold one ids tensor. Treat them as
    read-only, or clone what you change or keep apart from the rest: a kept view keeps the
    whole poll's buffer alive.

    ``format``: the row format of ``states`` (:data:`persistent_delta.log.codec.ROW_FORMATS`,
    the reader's choice): ``"int8"`` states are uint8 ``[n, dim + 4]`` (FBGEMM's row-wise int8:
    values, fp16 scale, fp16 bias), always whole rows -- a column-wise table's int8 rows are
    joined from its ranks' halves and quantized by the poll (:func:`join_int8`), and handed
    out as one part of the lowest rank, spanning every column.
    """

    fqn: str
    rank: int
    start_idx: int
    end_idx: int
    rows: UniqueRows
    global_ids: torch.Tensor
    shard: Optional[ShardInfo] = None
    stamps: Optional[torch.Tensor] = None  # snapshots of a replicated table: per row, its publish's stamp
    zch: Optional[ZchDelta] = None  # a managed-collision table's raw ids (lookups channel)
    format: str = codec.NATIVE  # the row format of the states

    @property
    def ids(self) -> torch.Tensor:
        """Shard-local ids (``rows.ids``)."""
        ids: torch.Tensor = self.rows.ids
        return ids

    @property
    def states(self) -> Optional[torch.Tensor]:
        """States (``rows.states``), None when the log tracks ids only."""
        states: Optional[torch.Tensor] = self.rows.states
        return states

    @property
    def col_offset(self) -> int:
        """First column of the full table that this shard's state columns hold."""
        return self.shard.col_offset if self.shard is not None else 0


@dataclass
class RankDelta:
    """What one poll read from one rank: ``[start_idx, end_idx)`` and the per-table deltas.

    Batch indices start at 1 (``DMP.forward`` steps the tracker before the first lookups), and a
    range may hold indices with no records: after a restart the ranks continue at the largest
    index any of them persisted and drop what not every rank completed, and a restore stamps
    its re-delivery after the lost batches; indices are never reused, so those batches read
    as empty."""

    rank: int
    path: str
    start_idx: int
    end_idx: int
    tables: Dict[str, TableDelta] = field(default_factory=dict)
    publishes: Dict[int, float] = field(default_factory=dict)  # snapshots: stamp -> publish time
    passed_over: int = 0  # snapshots: records of other row formats the read passed over
    unjoined: int = 0  # int8: rows of a column-wise table left out, some column half missing (see join_int8)
    # a reader of every format (a shipper): format -> fqn -> rows of the other formats
    formats: Dict[str, Dict[str, TableDelta]] = field(default_factory=dict)
    # snapshots: rows capped publishes of this rank deferred and none has carried yet, as the
    # log stood at this read (persistent_delta.log.deferred; remote: at the shipper's read of the
    # newest range); None when not known
    deferred: Optional[int] = None
    # snapshots: the read holds every publish stamped from this batch on (its start, or earlier
    # where nothing was published nor deleted: position_rules.snapshots_covered_from); None: not
    # known (a remote read); what a replica's base is checked against (persistent_delta.read.base)
    covers_from: Optional[int] = None
    # snapshots: the identity of the rank's log the read came from (None: not known, a remote
    # read); a replica's base of another log is refused by it (persistent_delta.read.base)
    log: Optional[LogIdentity] = None


@dataclass
class MergedDelta:
    """One table's delta over every rank, in global row ids.

    Attributes:
        global_ids: ascending unique global row ids touched on any rank.
        states: rows aligned with ``global_ids``; for a column-split table, the column shards
            concatenated to full rows when every shard holds the same ids and full-width state
            slices (embeddings, snapshots); otherwise None (see ``column_parts``).
        column_parts: col_offset -> UniqueRows (global ids, that column slice's states).
        column_split: whether shards hold different column ranges.

    Where one shard holds all of a table's rows (one rank, or one column slice), these tensors
    are that shard's :class:`TableDelta` tensors, not copies: the poll already copied them out
    of the log once. Where a poll laid its shards' rows out side by side (row-wise shards one
    after another, column slices as full rows: see
    :func:`persistent_delta.read.fetch.finish_ranks`), ``states`` is a view
    over them, not a copy either. Copy them before changing them in place if the poll's
    per-rank deltas must stay as read.
    """

    fqn: str
    global_ids: torch.Tensor
    states: Optional[torch.Tensor]
    column_parts: Dict[int, UniqueRows]
    column_split: bool
    global_rows: Optional[int] = None
    global_cols: Optional[int] = None
    ranks: List[int] = field(default_factory=list)


def _cat_rows(parts: Sequence[UniqueRows], stamps: Optional[Sequence[Optional[torch.Tensor]]] = None) -> UniqueRows:
    """Unite row sets, in ascending ids. An id in several parts (replicated tables) keeps the
    row with the highest stamp when every part has ``stamps`` (snapshots: the newest publish),
    and among equal stamps -- or without stamps -- the first part's row (``UpdateMode.FIRST``
    over the parts in order).

    No sort when it is not needed: one part with ascending ids is returned as it is (no
    copy); parts with ascending ids over disjoint id ranges (row-wise shards) are concatenated
    in range order, each row copied once (:func:`~persistent_delta.log.rows.compute_unique_rows`).
    """
    keep = [i for i, p in enumerate(parts) if p.ids.numel()]
    if not keep:
        return parts[0]
    nonempty = [parts[i] for i in keep]
    if len(nonempty) == 1 and is_ascending(nonempty[0].ids):
        return nonempty[0]
    if all(p.states is not None for p in nonempty):
        if stamps is not None and all(stamps[i] is not None for i in keep):
            return _newest_rows(nonempty, [stamps[i] for i in keep])  # type: ignore[misc]
        runs = ordered_runs([p.ids for p in nonempty])
        if runs:
            joined = _joined([nonempty[i].states for i in runs], 0)  # type: ignore[misc]
            if joined is not None:  # laid out one after another by fetch.finish_ranks: a view
                return UniqueRows(ids=torch.cat([nonempty[i].ids for i in runs]), states=joined)
        return compute_unique_rows([p.ids for p in nonempty], [p.states for p in nonempty], UpdateMode.FIRST)
    return compute_unique_rows([p.ids for p in nonempty], None, UpdateMode.NONE)


def _newest_rows(parts: Sequence[UniqueRows], stamps: Sequence[torch.Tensor]) -> UniqueRows:
    """Per id, the row with the highest stamp; ties: the first part's."""
    ids = torch.cat([p.ids.to(torch.int64) for p in parts])
    st = torch.cat([s.to(torch.int64) for s in stamps])
    pos = torch.arange(ids.numel())
    order = torch.from_numpy(np.lexsort((pos.numpy(), -st.numpy(), ids.numpy())))
    sorted_ids = ids[order]
    first = torch.ones(sorted_ids.numel(), dtype=torch.bool)
    first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    picked = order[first]
    states = torch.cat([p.states for p in parts])  # type: ignore[misc]
    return UniqueRows(ids=torch.cat([p.ids for p in parts])[picked], states=states[picked])


def _union_ids(column_parts: Dict[int, UniqueRows]) -> Tuple[torch.Tensor, bool]:
    """Ascending unique ids over the column groups, and whether every group holds exactly
    them (then they are the first group's ids: the usual case)."""
    groups: List[torch.Tensor] = [c.ids for c in column_parts.values()]
    first = groups[0]
    if all(g is first or torch.equal(first, g) for g in groups[1:]):
        return first, True
    return unique_ids(torch.cat(groups)), False


def merge_table(fqn: str, parts: Sequence[TableDelta]) -> MergedDelta:
    """Merge one table's per-rank deltas into global row ids (see :class:`MergedDelta`).

    Raises:
        InvalidInputError: ``parts`` is empty.
    """
    if not parts:
        raise InvalidInputError(f"{fqn}: nothing to merge")
    groups: Dict[int, List[TableDelta]] = {}
    for p in parts:
        groups.setdefault(p.col_offset, []).append(p)
    column_parts = {
        off: _cat_rows([UniqueRows(ids=p.global_ids, states=p.states) for p in ps], [p.stamps for p in ps])
        for off, ps in sorted(groups.items())
    }
    shard = next((p.shard for p in parts if p.shard is not None), None)
    global_cols = shard.global_cols if shard is not None else None
    split = len(column_parts) > 1
    if not split:
        only = next(iter(column_parts.values()))
        ids, states = only.ids, only.states
    else:
        ids, same = _union_ids(column_parts)
        widths = {off: ps[0].shard.local_cols if ps[0].shard is not None else None for off, ps in groups.items()}
        states = _assemble_columns(column_parts, widths, global_cols) if same else None
    return MergedDelta(
        fqn=fqn,
        global_ids=ids,
        states=states,
        column_parts=column_parts,
        column_split=split,
        global_rows=shard.global_rows if shard is not None else None,
        global_cols=global_cols,
        ranks=sorted(p.rank for p in parts),
    )


def _assemble_columns(
    column_parts: Dict[int, UniqueRows], widths: Dict[int, Optional[int]], global_cols: Optional[int]
) -> Optional[torch.Tensor]:
    """Full rows from column slices that hold the same ids, or None unless the slices tile
    ``[0, global_cols)`` with 2-D states of their widths."""
    for off, part in column_parts.items():
        width, st = widths.get(off), part.states
        if width is None or st is None or st.dim() != 2 or st.shape[1] != width:
            return None
    if not tiles_the_row([(off, widths[off]) for off in column_parts], global_cols):  # type: ignore[misc]
        return None
    slices: List[torch.Tensor] = [p.states for p in column_parts.values()]  # type: ignore[misc]
    joined = _joined(slices, 1)  # laid out side by side by fetch.finish_ranks: a view
    return joined if joined is not None else torch.cat(slices, dim=1)


def tiles_the_row(slices: Sequence[Tuple[int, int]], global_cols: Optional[int]) -> bool:
    """Whether column slices tile a table's full row exactly (the merge and the poll's buffer
    layout ask the same question).

    Args:
        slices: ``(col_offset, width)`` per column-wise shard, each covering the half-open
            columns ``[col_offset, col_offset + width)``.
        global_cols: the table's full width (None: unknown, never tiled).

    Returns:
        True when the slices cover ``[0, global_cols)`` without gap or overlap.
    """
    pos = 0
    for off, width in sorted(slices):
        if off != pos:
            return False
        pos += width
    return global_cols is not None and pos == global_cols


def _joined(parts: Sequence[torch.Tensor], dim: int) -> Optional[torch.Tensor]:
    """``torch.cat(parts, dim)`` as a view, when the parts already lie next to each other
    along ``dim`` in one block of memory (as
    :func:`persistent_delta.read.fetch.finish_ranks` places them); else None.
    Only 2-D parts (or 1-D along dim 0) of one dtype and strides are joined."""
    first = parts[0]
    if first.dim() not in (1, 2) or dim >= first.dim():
        return None
    base = first.untyped_storage().data_ptr()
    step = first.stride(dim) * first.element_size()
    size = list(first.shape)
    for prev, p in zip(parts, parts[1:]):
        if p.dtype != first.dtype or p.stride() != first.stride() or p.untyped_storage().data_ptr() != base:
            return None
        if p.dim() != first.dim() or any(p.shape[d] != first.shape[d] for d in range(first.dim()) if d != dim):
            return None
        if p.data_ptr() != prev.data_ptr() + prev.shape[dim] * step:
            return None
        size[dim] += p.shape[dim]
    return first.as_strided(size, first.stride())


class Ranges(Dict[int, Tuple[int, int]]):
    """:attr:`DeltaPoll.ranges`: rank -> ``(start_idx, end_idx)`` read (half-open). Calling it
    (the method it was) returns itself, with a ``DeprecationWarning``."""

    def __call__(self) -> "Ranges":
        warnings.warn("DeltaPoll.ranges is a property: use poll.ranges, not poll.ranges()", DeprecationWarning,
                      stacklevel=2)
        return self


@dataclass
class DeltaPoll:
    """The result of :meth:`DeltaConsumer.poll`: per rank, the range read and per-table deltas.

    ``world_size`` is the job's number of ranks when the reader knows it (a tracker's job);
    ``read_threads``: the torch intra-op threads :meth:`merged` and ``apply_poll`` use (the
    reader's ``LogOptions.read_threads``; see :mod:`persistent_delta.threads`).
    """

    channel: str
    ranks: Dict[int, RankDelta]
    world_size: Optional[int] = None
    read_threads: int = field(default_factory=lambda: LogOptions.resolve().read_threads)
    format: str = codec.NATIVE  # the row format the reader asked for (every TableDelta's)
    # snapshots: rank -> the newest publish stamp other ranks hold that this rank completed the
    # batch of without publishing in it (position_rules.snapshots_behind): ranks behind for good
    behind: Dict[int, int] = field(default_factory=dict)

    @property
    def passed_over(self) -> int:
        """Snapshot records of other row formats than :attr:`format` that this poll passed
        over, summed over ranks (the publishes wrote them for other consumers): a poll that
        moved but holds no rows, with this above zero, read only other formats' records --
        was the format asked for at registration, or passed to ``publish(formats=...)``?"""
        return sum(d.passed_over for d in self.ranks.values())

    @property
    def unjoined(self) -> int:
        """int8 polls: rows of column-wise tables left out because the poll held only some of
        their column halves (:func:`join_int8`), summed over ranks; 0 otherwise."""
        return sum(d.unjoined for d in self.ranks.values())

    @property
    def complete(self) -> bool:
        """Whether every rank of the job was read up to the same end, so that no batch (or
        publish) in this poll is missing some rank's part: all of a publish's column halves and
        row shards are here, or none. A tracker job's poll stops at the end every rank
        completed, so it is complete unless the reader's ranks were moved apart (per-rank
        ``seek`` with ``max_batches``) or a rank of the job is missing. Starts may differ: a
        rank with no records over a stretch starts later, and nothing of it is missing.

        A snapshots poll with a rank :attr:`behind` is not complete either: that rank's part of
        the other ranks' newest publishes will never come."""
        if not self.ranks or self.behind:
            return False
        if self.world_size is not None and set(self.ranks) != set(range(self.world_size)):
            return False
        return len({d.end_idx for d in self.ranks.values()}) == 1

    @property
    def publishes(self) -> Dict[int, float]:
        """Snapshots: stamp -> wall-clock time (seconds since the epoch) of each publish this
        poll holds records of (the earliest over ranks: the ranks' ``publish()`` calls of one
        step); empty for lookups."""
        out: Dict[int, float] = {}
        for d in self.ranks.values():
            for stamp, t in d.publishes.items():
                out[stamp] = min(t, out.get(stamp, t))
        return dict(sorted(out.items()))

    @property
    def deferred(self) -> Optional[int]:
        """Snapshots: rows that capped publishes deferred and no publish has carried yet, summed
        over the ranks read, as their logs stood at this poll (``tracker.publish(...,
        max_rows=...)``). A replica that applied every publish up to the log's end equals the
        trainer's tables as of the newest publish once this is 0. A remote poll reports each
        rank's count as its shipper read the log when it shipped the newest range of that rank
        the consumer delivered (a poll with nothing new repeats it). None when no rank's count
        is known (lookups; a remote consumer before its first range; ranges shipped by a
        shipper older than the count)."""
        known = [d.deferred for d in self.ranks.values() if d.deferred is not None]
        return int(sum(known)) if known else None

    @property
    def nbytes(self) -> int:
        """Bytes of ids and states delivered, summed over ranks and tables."""
        total = 0
        for d in self.ranks.values():
            for t in d.tables.values():
                total += t.ids.numel() * t.ids.element_size()
                if t.states is not None:
                    total += t.states.numel() * t.states.element_size()
        return int(total)

    def tables(self) -> Dict[str, List[TableDelta]]:
        """fqn -> that table's per-rank deltas (rank order). Row-wise shards hold disjoint
        global ids; column-wise shards the same ids with different ``col_offset``."""
        out: Dict[str, List[TableDelta]] = {}
        for rank in sorted(self.ranks):
            for fqn, delta in self.ranks[rank].tables.items():
                out.setdefault(fqn, []).append(delta)
        return out

    def merged(self) -> Dict[str, MergedDelta]:
        """fqn -> the table's delta merged over ranks, in global row ids."""
        with intra_op_threads(self.read_threads):
            return {fqn: merge_table(fqn, parts) for fqn, parts in self.tables().items()}

    def zch(self) -> Dict[str, ZchDelta]:
        """fqn -> a managed-collision table's raw ids, slot reassignments and evictions over
        the poll's ranges, merged over ranks (:mod:`persistent_delta.log.zch_records`); ``states`` holds
        the poll's rows of the admitted raw ids' slots when every one of them is in the poll.
        Local and remote polls alike (a :class:`~persistent_delta.fleet.remote.RemoteConsumer` reads
        the side records shipped with each lookups range)."""
        out: Dict[str, ZchDelta] = {}
        merged: Optional[Dict[str, MergedDelta]] = None
        for fqn, parts in self.tables().items():
            sides = [(p.rank, p.zch) for p in parts if p.zch is not None]
            if not sides:
                continue
            z = out[fqn] = merge_side(fqn, sides)
            if merged is None:
                merged = self.merged()
            m = merged[fqn]
            if m.states is not None and z.slot_ids.numel() and m.global_ids.numel():
                pos = torch.searchsorted(m.global_ids, z.slot_ids).clamp_(max=m.global_ids.numel() - 1)
                if bool((m.global_ids[pos] == z.slot_ids).all()):
                    z.states = m.states.index_select(0, pos)
        return out

    @property
    def ranges(self) -> "Ranges":
        """rank -> ``(start_idx, end_idx)`` read (half-open). A property, like
        :attr:`complete` and :attr:`publishes` (``poll.ranges()`` still works, with a
        ``DeprecationWarning``)."""
        return Ranges({r: (d.start_idx, d.end_idx) for r, d in self.ranks.items()})

    @property
    def num_rows(self) -> int:
        """Rows delivered, summed over ranks and tables."""
        return sum(int(t.ids.numel()) for d in self.ranks.values() for t in d.tables.values())

    @property
    def empty(self) -> bool:
        """Whether no rank read any batch (the position did not move)."""
        return all(d.end_idx <= d.start_idx for d in self.ranks.values())

    def __iter__(self) -> Iterator[TableDelta]:
        for parts in self.tables().values():
            yield from parts


def table_delta(
    fqn: str, rank: int, start_idx: int, end_idx: int, rows: UniqueRows, shard: Optional[ShardInfo],
    stamps: Optional[torch.Tensor] = None, zch: Optional[ZchDelta] = None, fmt: str = codec.NATIVE,
) -> TableDelta:
    """One rank's :class:`TableDelta` of ``[start_idx, end_idx)``: ``rows`` in shard-local ids,
    and the same rows in global row ids (local id + the shard's row offset); ``stamps``,
    ``zch`` and ``fmt`` (its ``format``): see :class:`TableDelta`."""
    gids = rows.ids.to(torch.int64)
    if shard is not None and shard.row_offset:
        gids = gids + shard.row_offset
    return TableDelta(fqn, rank, start_idx, end_idx, rows, gids, shard, stamps, zch, fmt)


def _column_split(shard: Optional[ShardInfo]) -> bool:
    return shard is not None and shard.local_cols is not None and shard.global_cols is not None and \
        shard.local_cols != shard.global_cols


def join_int8(ranks: Dict[int, RankDelta]) -> Dict[int, RankDelta]:
    """An int8 poll's column-wise tables as whole quantized rows, in place (returns ``ranks``):
    the ranks' float32 column halves of each row (written flagged ``"int8"``: no rank can
    quantize a half, whose scale is the whole row's) are joined and quantized
    (:func:`persistent_delta.log.codec.quantize_int8`), and handed out as one
    :class:`TableDelta` of the lowest rank, in global ids, spanning every column; the other
    ranks' parts of the table are dropped. A row of which the poll holds some halves only (a
    rank re-sent it alone, e.g. after a restart) cannot be quantized: it is left out and
    counted in the lowest rank's :attr:`RankDelta.unjoined`. Local and remote polls both
    finish through it.

    Raises:
        InvalidInputError: a table's halves do not tile its row.
    """
    by_table: Dict[str, List[TableDelta]] = {}
    for rank in sorted(ranks):
        for fqn, t in ranks[rank].tables.items():
            if _column_split(t.shard):
                by_table.setdefault(fqn, []).append(t)
    for fqn, parts in by_table.items():
        shard = parts[0].shard
        assert shard is not None and shard.global_cols is not None
        groups: Dict[int, List[TableDelta]] = {}
        for p in parts:
            groups.setdefault(p.col_offset, []).append(p)
        widths = {off: int(ps[0].shard.local_cols or 0) for off, ps in groups.items()}  # type: ignore[union-attr]
        if not tiles_the_row(list(widths.items()), shard.global_cols):
            raise InvalidInputError(f"int8 poll: the column halves of table {fqn!r} ({sorted(widths.items())}) do not "
                                    f"tile its {shard.global_cols} columns")
        cols = {off: _cat_rows([UniqueRows(ids=p.global_ids, states=p.states) for p in ps if p.ids.numel()] or
                               [UniqueRows(ids=ps[0].global_ids, states=ps[0].states)])
                for off, ps in sorted(groups.items())}
        every = unique_ids(torch.cat([c.ids for c in cols.values()]))
        common = every
        for c in cols.values():
            common = common[torch.isin(common, c.ids)]
        halves = []
        for off, c in cols.items():
            pos = torch.searchsorted(c.ids, common)
            assert c.states is not None
            halves.append(c.states.index_select(0, pos).to(torch.float32).reshape(common.numel(), widths[off]))
        ids = common.to(torch.int64)
        states = codec.quantize_int8(torch.cat(halves, dim=1)) if ids.numel() else \
            torch.empty((0, shard.global_cols + codec.INT8_TAIL), dtype=torch.uint8)
        whole = replace(shard, row_offset=0, col_offset=0, local_cols=shard.global_cols, local_rows=shard.global_rows)
        first = parts[0]
        for p in parts:
            del ranks[p.rank].tables[fqn]
        ranks[first.rank].tables[fqn] = TableDelta(
            fqn, first.rank, min(p.start_idx for p in parts), max(p.end_idx for p in parts),
            UniqueRows(ids=ids, states=states), ids, whole, None, None, codec.INT8)
        ranks[first.rank].unjoined += int(every.numel() - common.numel())
    return ranks
