"""The consumer read path: the fast paths of ``rows`` (ordered runs, direct
address, chunked gather), ``records.read_unique`` and ``results`` (row-wise shards concatenated,
column slices assembled, replicated tables) against straightforward references on random
logs, and every record's checksum still checked on the way."""

from __future__ import annotations

import os
import random
from typing import Dict, List, Optional, Tuple

import pytest
import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta import DeltaReader
from persistent_delta.log import codec, rows
from persistent_delta.errors import CorruptRecordError
from persistent_delta.log.layout import rank_dir
from persistent_delta.log.deltalog import DeltaLog, WriteTxn
from persistent_delta.log.records import AppendRecord, encode_records, write_records
from persistent_delta.read.results import TableDelta, merge_table
from persistent_delta.log.rows import compute_unique_rows, gather_rows
from persistent_delta.log.schema import (
    DB_OF_CHANNEL,
    LOOKUPS,
    META_CURR_BATCH,
    META_SNAPSHOT_END,
    META_TRACKER,
    SNAPSHOTS,
    ShardInfo,
    TrackerMeta,
)
from torchrec.distributed.model_tracker.types import UniqueRows

Rows = Dict[int, torch.Tensor]  # id -> row (None-free: NONE mode keeps rows as empty tensors)


# ----------------------------------------------------------------------------- references


def ref_rule(ids: List[torch.Tensor], states: Optional[List[torch.Tensor]], mode: UpdateMode) -> Rows:
    """The FIRST/LAST/NONE rule, one row at a time, in log order."""
    out: Rows = {}
    for k, rec in enumerate(ids):
        for i, x in enumerate(rec.tolist()):
            row = torch.empty(0) if states is None or mode == UpdateMode.NONE else states[k][i]
            if mode == UpdateMode.LAST or x not in out:
                out[x] = row
    return out


def check_rows(got: UniqueRows, want: Rows, mode: UpdateMode) -> None:
    keys = sorted(want)
    assert got.ids.tolist() == keys
    if mode == UpdateMode.NONE:
        assert got.states is None
    else:
        assert torch.equal(got.states, torch.stack([want[k] for k in keys]) if keys else got.states[:0])


def random_ids(g: random.Random, kind: str, n: int, high: int) -> torch.Tensor:
    """``sorted``: ascending unique (what the writer stores); ``dups``: unsorted with repeats
    (a plain store's appends); ``sparse``: ascending unique over a huge range (the sort path)."""
    if kind == "dups":
        return torch.tensor([g.randrange(high) for _ in range(n)], dtype=torch.int64)
    if kind == "sparse":
        return torch.tensor(sorted(g.sample(range(10**12), n)), dtype=torch.int64)
    return torch.tensor(sorted(g.sample(range(high), min(n, high))), dtype=torch.int64)


# ----------------------------------------------------------------------------- rows


@pytest.mark.parametrize("mode", list(UpdateMode))
@pytest.mark.parametrize("layout", ["ordered", "disjoint_unordered", "overlapping", "sparse", "sparse_shuffled", "dups",
                                    "one_unsorted"])
@pytest.mark.parametrize("rows_per_record", [7, 3000])
@pytest.mark.parametrize("concat_bytes", [rows._CONCAT_BYTES, 0])  # concatenate, or the chunked gather
def test_compute_unique_rows_matches_the_rule(monkeypatch, mode, layout, rows_per_record, concat_bytes):
    monkeypatch.setattr(rows, "_CONCAT_BYTES", concat_bytes)
    g = random.Random(hash((mode.value, layout, rows_per_record)) % 1000)
    k, dim = 6, 48
    if layout == "ordered":
        ids = [torch.arange(i * rows_per_record, (i + 1) * rows_per_record) for i in range(k)]
        ids.insert(2, torch.empty(0, dtype=torch.int64))
    elif layout == "disjoint_unordered":
        pool = torch.randperm(k * rows_per_record * 3)[: k * rows_per_record]
        ids = list(pool.split(rows_per_record))
    elif layout == "one_unsorted":
        ids = [torch.randperm(rows_per_record * 2)[:rows_per_record]]
    elif layout == "sparse_shuffled":  # many descents: torch's sort, not the merge of runs
        pool = random_ids(g, "sparse", rows_per_record * 2, 0)
        ids = [pool[torch.randperm(pool.numel())[:rows_per_record]] for _ in range(k)]
    else:
        ids = [random_ids(g, layout if layout != "overlapping" else "sorted", rows_per_record, 2 * rows_per_record)
               for _ in range(k)]
    states = [torch.randn(i.numel(), dim) for i in ids]
    got = compute_unique_rows(ids, None if mode == UpdateMode.NONE else states, mode)
    check_rows(got, ref_rule(ids, states, mode), mode)
    # results own their memory
    for t in [got.ids] + ([got.states] if got.states is not None else []):
        assert all(t.data_ptr() != x.data_ptr() for x in ids + states)


@pytest.mark.parametrize("dtype", sorted(codec.INTEGER_ID_DTYPES, key=str))
@pytest.mark.parametrize("mode", list(UpdateMode))
@pytest.mark.parametrize("sparse", [False, True])
def test_every_id_dtype(dtype, mode, sparse):
    g = torch.Generator().manual_seed(3)
    high = min(10**6, torch.iinfo(dtype).max) if sparse else 120  # sparse: the sort (32/64-bit ids)
    ids = [torch.randint(0, high, (n,), generator=g).to(dtype) for n in (9, 0, 14, 5)]
    ids[2] = ids[2].sort().values
    states = [torch.randn(i.numel(), 3, generator=g) for i in ids]
    got = compute_unique_rows(ids, None if mode == UpdateMode.NONE else states, mode)
    assert got.ids.dtype == dtype
    check_rows(got, ref_rule(ids, states, mode), mode)


@pytest.mark.parametrize("n_parts,rows_per_part,dim", [(1, 50, 4), (5, 10, 3), (10, 2000, 64), (3, 5000, 1)])
@pytest.mark.parametrize("concat_bytes", [rows._CONCAT_BYTES, 0])
def test_gather_rows_is_cat_then_index(monkeypatch, n_parts, rows_per_part, dim, concat_bytes):
    monkeypatch.setattr(rows, "_CONCAT_BYTES", concat_bytes)
    parts = [torch.randn(rows_per_part + i, dim) for i in range(n_parts)]
    total = sum(p.shape[0] for p in parts)
    picked = torch.randperm(total)[: total // 2]
    assert torch.equal(gather_rows(parts, picked), torch.cat(parts)[picked])
    assert torch.equal(gather_rows(parts, picked.sort().values), torch.cat(parts)[picked.sort().values])
    # other dtypes and row shapes are copied as bytes
    b = [p.to(torch.bfloat16).reshape(p.shape[0], dim, 1) for p in parts]
    assert torch.equal(gather_rows(b, picked), torch.cat(b)[picked])
    # into a destination whose rows lie at a stride (a column slice of a wider buffer), in place
    wide = torch.zeros(picked.numel(), dim + 5)
    got = gather_rows(parts, picked, wide[:, 2:2 + dim])
    assert got.data_ptr() == wide[:, 2:].data_ptr()
    assert torch.equal(wide[:, 2:2 + dim], torch.cat(parts)[picked])
    assert not wide[:, :2].any() and not wide[:, 2 + dim:].any()  # nothing beside the slice written
    # parts picked whole (a filtered window's records: each id once), in any order, beside a part picked in part
    starts = [0]
    for p in parts:
        starts.append(starts[-1] + p.shape[0])
    whole = [torch.arange(starts[i], starts[i + 1]) for i in range(0, n_parts, 2)]
    some = [torch.arange(starts[i], starts[i + 1])[::2] for i in range(1, n_parts, 2)]
    mixed = torch.cat(whole + some)
    mixed = mixed[torch.randperm(mixed.numel())]
    assert torch.equal(gather_rows(parts, mixed), torch.cat(parts)[mixed])
    assert torch.equal(gather_rows(b, mixed), torch.cat(b)[mixed])
    every = torch.randperm(total)
    assert torch.equal(gather_rows(parts, every, wide.new_zeros(total, dim + 5)[:, 1:1 + dim]), torch.cat(parts)[every])


def test_ordered_runs():
    a, b, e = torch.tensor([1, 2, 5]), torch.tensor([6, 9]), torch.empty(0, dtype=torch.int64)
    assert rows.ordered_runs([b, e, a]) == [2, 0]
    assert rows.ordered_runs([a, torch.tensor([5, 7])]) is None  # ranges touch
    assert rows.ordered_runs([torch.tensor([3, 1]), torch.tensor([7])]) is None  # not ascending
    assert rows.ordered_runs([torch.tensor([1, 1])]) is None  # a repeat
    assert rows.ordered_runs([e]) == []
    # overlapping the first record (the early exit) and overlapping a later one only
    assert rows.ordered_runs([torch.tensor([10, 12]), torch.tensor([1, 3]), torch.tensor([4, 11])]) is None
    assert rows.ordered_runs([torch.tensor([10, 12]), torch.tensor([1, 3]), torch.tensor([2, 4])]) is None
    assert rows.ordered_runs([torch.tensor([10, 12]), torch.tensor([1, 3]), torch.tensor([4, 9])]) == [1, 2, 0]


# ----------------------------------------------------------------------------- logs


def _job(root: str, world: int, layout: str, mode: UpdateMode, seed: int, global_rows: int = 4000,
         dim: int = 8) -> Dict[Tuple[int, str], Dict[str, list]]:
    """Random records on ``world`` rank logs of tables "a" (records) and "e" (no records in
    range); returns (rank, channel) -> fqn -> list of (local ids, local rows) in log order."""
    g = random.Random(seed)
    written: Dict[Tuple[int, str], Dict[str, list]] = {}
    for rank in range(world):
        if layout == "col_same":  # column-wise as a real job looks: every rank the same ids (its own columns)
            g = random.Random(seed)
        if layout == "row":
            lo, hi, c0, c1, stype = rank * global_rows // world, (rank + 1) * global_rows // world, 0, dim, "row_wise"
        elif layout in ("col", "col_same"):
            lo, hi, c0, c1, stype = 0, global_rows, rank * dim // world, (rank + 1) * dim // world, "column_wise"
        else:  # replicated: every rank all rows and columns, ids overlapping
            lo, hi, c0, c1, stype = 0, global_rows, 0, dim, "data_parallel"
        local = hi - lo
        lookups = []
        for b in range(6):
            for _ in range(g.choice([1, 1, 2])):  # sometimes two records in one batch (seq 0, 1)
                kind = g.choice(["sorted", "sorted", "dups"])
                ids = random_ids(g, kind, g.randrange(0, 300), local)
                st = None if mode == UpdateMode.NONE else torch.randn(ids.numel(), c1 - c0)
                lookups.append(AppendRecord(b, "a", ids, st))
        snaps = []
        for stamp in (6, 7, 9):  # three publishes, overlapping ids: the newest wins
            ids = random_ids(g, g.choice(["sorted", "sorted", "dups"]), g.randrange(1, 400), local)
            snaps.append((stamp, ids, torch.randn(ids.numel(), c1 - c0)))
        written[(rank, LOOKUPS)] = {"a": [(r.ids, r.states) for r in lookups]}
        written[(rank, SNAPSHOTS)] = {"a": [(i, v) for _, i, v in snaps]}
        # per id, the stamp of the last publish holding it (replicated snapshots: newest wins)
        written[(rank, "stamps")] = {"a": {int(x): stamp for stamp, i, _ in snaps for x in i.tolist()}}

        def build(w: WriteTxn, rank: int = rank, lookups: list = lookups, snaps: list = snaps, lo: int = lo,
                  hi: int = hi, c0: int = c0, c1: int = c1, stype: str = stype) -> None:
            w.set_meta(META_TRACKER, TrackerMeta("embedding", mode.value, ["a", "e"], rank, world).to_value())
            for fqn in ("a", "e"):
                entry = w.ensure_table(fqn)
                entry.meta["shard"] = dict(table_name=fqn, sharding_type=stype, row_offset=lo, col_offset=c0,
                                           local_rows=hi - lo, local_cols=c1 - c0, global_rows=global_rows,
                                           global_cols=dim)
                entry.values_dtype, entry.values_tail = "float32", [c1 - c0]
                if mode != UpdateMode.NONE:
                    entry.states_dtype, entry.states_tail = "float32", [c1 - c0]
                w.stage_table(entry)
            write_records(w, encode_records(lookups, mode))
            for stamp, ids, vals in snaps:
                w.put_record(w.tables()["a"].table_id, stamp, codec.encode_record(ids, vals, codec.KIND_SNAPSHOT),
                             channel=SNAPSHOTS)
            w.set_meta(META_CURR_BATCH, 6)
            w.set_meta(META_SNAPSHOT_END, 10)

        with DeltaLog(rank_dir(root, rank), update_mode=mode.value) as log:
            log.write(build)
    return written


def _ref_merged(per_rank: Dict[int, Rows], shards: Dict[int, ShardInfo],
                stamps: Optional[Dict[int, Dict[int, int]]] = None) -> Tuple[List[int], Optional[torch.Tensor]]:
    """Merged over ranks: global ids; an id on several ranks of one column slice keeps the
    row of the highest stamp when ``stamps`` (rank -> id -> stamp) are given, else (and among
    equal stamps) the lowest rank's row; column slices side by side."""
    by_col: Dict[int, Dict[int, torch.Tensor]] = {}
    best: Dict[Tuple[int, int], int] = {}
    for rank in sorted(per_rank):
        sh = shards[rank]
        group = by_col.setdefault(sh.col_offset, {})
        for x, row in per_rank[rank].items():
            key, stamp = x + sh.row_offset, (stamps[rank][x] if stamps else 0)
            if key not in group or stamp > best[(sh.col_offset, key)]:
                group[key], best[(sh.col_offset, key)] = row, stamp
    keys = sorted(set().union(*[set(g) for g in by_col.values()]))
    if any(sorted(g) != keys for g in by_col.values()) or not keys:
        return keys, None
    return keys, torch.cat([torch.stack([g[k] for k in keys]) for _, g in sorted(by_col.items())], dim=1)


@pytest.mark.parametrize("mode,channel", [(m, LOOKUPS) for m in UpdateMode] + [(UpdateMode.FIRST, SNAPSHOTS)])
@pytest.mark.parametrize("world,layout", [(1, "row"), (3, "row"), (2, "col"), (4, "col"), (2, "col_same"), (4, "col_same"),
                                          (2, "replicated")])
@pytest.mark.parametrize("concat_bytes", [rows._CONCAT_BYTES, 0])
def test_poll_and_merged_match_the_reference(monkeypatch, tmp_path, mode, world, layout, channel, concat_bytes):
    """Snapshots merge LAST whatever the lookups mode (one lookups mode suffices for them).
    ``col_same``: every rank the same ids, so a poll's id work is done once and reused
    (rows.IdMemo)."""
    monkeypatch.setattr(rows, "_CONCAT_BYTES", concat_bytes)
    root = str(tmp_path)
    written = _job(root, world, layout, mode, seed=world * 31 + len(layout) + len(mode.value))
    rule = UpdateMode.LAST if channel == SNAPSHOTS else mode
    with DeltaReader(root, channel=channel) as reader:
        poll = reader.poll()
    per_rank: Dict[int, Rows] = {}
    shards: Dict[int, ShardInfo] = {}
    for rank in range(world):
        recs = written[(rank, channel)]["a"]
        want = ref_rule([i for i, _ in recs], None if rule == UpdateMode.NONE else [s for _, s in recs], rule)
        delta = poll.ranks[rank].tables["a"]
        check_rows(delta.rows, want, rule)
        assert delta.shard is not None
        assert delta.global_ids.tolist() == [x + delta.shard.row_offset for x in sorted(want)]
        per_rank[rank], shards[rank] = want, delta.shard
        empty = poll.ranks[rank].tables["e"]
        assert empty.ids.numel() == 0
        if rule != UpdateMode.NONE:  # an empty table keeps (0, *row_shape)
            assert empty.states.shape == (0, delta.shard.local_cols) and empty.states.dtype == torch.float32
    merged = poll.merged()
    replicated = channel == SNAPSHOTS and layout == "replicated"
    keys, states = _ref_merged(per_rank, shards, {r: written[(r, "stamps")]["a"] for r in range(world)} if replicated
                               else None)
    assert merged["a"].global_ids.tolist() == keys
    assert merged["e"].global_ids.numel() == 0
    if rule == UpdateMode.NONE:
        assert merged["a"].states is None
    elif states is None:
        assert merged["a"].states is None and layout == "col"
    else:
        assert torch.equal(merged["a"].states, states)
    if states is not None and world > 1 and layout in ("row", "col_same") and rule != UpdateMode.NONE:
        # one buffer for the poll, laid out as merged() joins it: merged states are a view of
        # the ranks' states, not a copy (fetch.finish_ranks, results._joined)
        assert merged["a"].states.untyped_storage().data_ptr() == \
            poll.ranks[0].tables["a"].states.untyped_storage().data_ptr()
        assert merged["a"].states.is_contiguous()


@pytest.mark.parametrize("world,layout", [(1, "row"), (3, "row"), (2, "col"), (4, "col_same"), (2, "replicated")])
@pytest.mark.parametrize("table", ["plain", "requires_grad", "transposed", "wider"])
def test_apply_poll_writes_the_merged_rows_into_every_kind_of_table(tmp_path, world, layout, table):
    """``apply_poll`` leaves each table equal to its base with every rank's rows written into
    their rows and columns (a replicated table: ``merged()``'s rows), untouched elsewhere: into a plain table, one that requires grad, one whose rows are not
    contiguous (a transposed tensor: ``index_copy_``), and the first columns of a wider one
    (rows contiguous at a larger stride)."""
    from persistent_delta.serve.apply import apply_poll

    root = str(tmp_path)
    _job(root, world, layout, UpdateMode.FIRST, seed=world * 7 + len(layout))
    with DeltaReader(root, channel=SNAPSHOTS) as reader:
        poll = reader.poll()
    base = {fqn: torch.randn(4000, 8) for fqn in ("a", "e")}
    want = {fqn: t.clone() for fqn, t in base.items()}
    if layout == "replicated":  # newest publish wins across ranks: merged()'s rule
        for fqn, m in poll.merged().items():
            want[fqn][m.global_ids] = m.states
    else:  # each rank's rows into its columns
        for fqn, parts in poll.tables().items():
            for p in parts:
                want[fqn][p.global_ids, p.col_offset:p.col_offset + p.states.shape[1]] = p.states
    assert not torch.equal(want["a"], base["a"])
    if table == "plain":
        tables = {fqn: t.clone() for fqn, t in base.items()}
    elif table == "requires_grad":
        tables = {fqn: t.clone().requires_grad_() for fqn, t in base.items()}
    elif table == "transposed":
        tables = {fqn: t.t().contiguous().t() for fqn, t in base.items()}
        assert tables["a"].stride(1) != 1
    else:
        wide = {fqn: torch.cat([t, torch.full((4000, 3), 7.0)], dim=1) for fqn, t in base.items()}
        tables = {fqn: w[:, :8] for fqn, w in wide.items()}
    applied = apply_poll(tables, poll, complete_only=True)
    assert applied.rows == (sum(int(m.global_ids.numel()) for m in poll.merged().values()) if layout == "replicated"
                            else poll.num_rows)
    for fqn in ("a", "e"):
        assert torch.equal(tables[fqn].detach(), want[fqn])
    if table == "wider":
        assert all(bool((w[:, 8:] == 7.0).all()) for w in wide.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8])
def test_apply_writes_rows_of_every_dtype_bit_for_bit(dtype):
    """The row copy of ``apply_poll`` moves each row's bytes whatever the dtype (bfloat16 has
    no numpy type), into a column slice of a wider table, rows from a column slice too."""
    from persistent_delta.log.rows import scatter_rows

    g = torch.Generator().manual_seed(3)
    wide = torch.randint(0, 250, (50, 12), generator=g).to(dtype)
    target = wide[:, 4:9]
    src = torch.randint(0, 250, (6, 10), generator=g).to(dtype)[:, 2:7]
    ids = torch.tensor([0, 7, 8, 21, 30, 49])
    want = wide.clone()
    want[:, 4:9][ids] = src
    scatter_rows(target, ids, src)
    assert torch.equal(wide.view(torch.uint8) if dtype != torch.uint8 else wide,
                       want.view(torch.uint8) if dtype != torch.uint8 else want)


@pytest.mark.parametrize("n", [0, 1, 5])
def test_scatter_rows_on_each_of_its_paths_equals_indexing(n):
    """``log.rows.scatter_rows``, shared by the replica's apply and a checkpoint chain's rows: no
    rows, one, several; 2-D rows and 1-D ones (a row-wise optimizer state), int32 ids, a
    non-contiguous 1-D target and rows of another dtype (both by ``index_copy_``)."""
    from persistent_delta.log.rows import scatter_rows

    g = torch.Generator().manual_seed(n)
    ids = torch.randperm(40, generator=g)[:n]
    cases = [
        (torch.randn(40, 6, generator=g), torch.randn(n, 6, generator=g), ids),
        (torch.randn(40, generator=g), torch.randn(n, generator=g), ids.to(torch.int32)),
        (torch.randn(80, generator=g)[::2], torch.randn(n, generator=g), ids),
        (torch.randn(40, 6, generator=g, dtype=torch.float64), torch.randn(n, 6, generator=g, dtype=torch.float64), ids),
    ]
    for target, rows, at in cases:
        want = target.clone()
        want[at.long()] = rows
        scatter_rows(target, at.long() if at.dtype != torch.int32 else at, rows)
        assert torch.equal(target, want), (target.shape, rows.shape, at.dtype)


def _part(rank: int, ids: List[int], col: int = 0, width: int = 2, row_offset: int = 0,
          states: bool = True) -> TableDelta:
    local = torch.tensor(ids, dtype=torch.int64)
    st = torch.randn(len(ids), width) if states else None
    shard = ShardInfo(row_offset=row_offset, col_offset=col, local_cols=width, global_rows=100, global_cols=width)
    return TableDelta("t", rank, 0, 1, UniqueRows(local, st), local + row_offset, shard)


def test_merge_table_fast_paths_keep_the_old_rule():
    # one shard: its tensors as they are (the poll copied them out of the log already)
    p = _part(0, [1, 4, 7])
    m = merge_table("t", [p, _part(1, [], row_offset=50)])
    assert m.global_ids is p.global_ids and m.states is p.states
    # row-wise shards in any rank order: concatenated by id range, no sort
    a, b, c = _part(2, [0, 3], row_offset=20), _part(0, [2, 5]), _part(1, [1], row_offset=10)
    m = merge_table("t", [a, b, c])
    assert m.global_ids.tolist() == [2, 5, 11, 20, 23]
    assert torch.equal(m.states, torch.cat([b.states, c.states, a.states]))
    # overlapping (replicated) shards: the first part's row wins, as before
    a, b = _part(0, [1, 5, 9]), _part(1, [0, 5, 6, 9])
    m = merge_table("t", [a, b])
    assert m.global_ids.tolist() == [0, 1, 5, 6, 9]
    assert torch.equal(m.states, torch.stack([b.states[0], a.states[0], a.states[1], b.states[2], a.states[2]]))
    # a part without states: ids only
    m = merge_table("t", [_part(0, [1, 2]), _part(1, [3], row_offset=0, states=False)])
    assert m.global_ids.tolist() == [1, 2, 3] and m.states is None


def test_merge_joins_parts_that_lie_side_by_side_without_a_copy():
    """Parts that already lie next to each other in one buffer (as a poll lays them out) are
    joined as a view; anything else (a gap, another buffer, rows in another order, a column
    slice that does not tile the row) is copied as before, to the same values."""
    buf = torch.randn(10, 4)
    a, b = _part(0, [0, 1, 2]), _part(1, [0, 1], row_offset=50)
    a.rows.states, b.rows.states = buf[0:3], buf[3:5]
    m = merge_table("t", [b, a])
    assert m.states.data_ptr() == buf.data_ptr() and torch.equal(m.states, buf[:5])
    a.rows.states, b.rows.states = buf[0:3], buf[4:6]  # a gap
    m = merge_table("t", [a, b])
    assert m.states.data_ptr() != buf.data_ptr() and torch.equal(m.states, torch.cat([buf[0:3], buf[4:6]]))
    a.rows.states, b.rows.states = buf[2:5], buf[0:2]  # adjacent, but the rows' order is the other one
    m = merge_table("t", [a, b])
    assert m.states.data_ptr() != buf.data_ptr() and torch.equal(m.states, torch.cat([buf[2:5], buf[0:2]]))
    a.rows.states, b.rows.states = buf[0:3], torch.randn(2, 4)  # another buffer
    m = merge_table("t", [a, b])
    assert torch.equal(m.states, torch.cat([a.states, b.states]))
    # column slices of one buffer's rows, tiling the row: the full rows as a view
    rows = torch.randn(3, 6)
    left, right = _part(0, [1, 2, 3], col=0, width=2), _part(1, [1, 2, 3], col=2, width=4)
    for p in (left, right):
        p.shard = ShardInfo(col_offset=p.shard.col_offset, local_cols=p.shard.local_cols, global_rows=100,
                            global_cols=6)
    left.rows.states, right.rows.states = rows[:, 0:2], rows[:, 2:6]
    m = merge_table("t", [right, left])
    assert m.states.data_ptr() == rows.data_ptr() and torch.equal(m.states, rows)
    left.rows.states, right.rows.states = rows[:, 0:2].clone(), rows[:, 2:6]  # another buffer: a copy
    m = merge_table("t", [left, right])
    assert m.states.data_ptr() != rows.data_ptr() and torch.equal(m.states, rows)


# ----------------------------------------------------------------------------- checksums


def _corrupt(path: str, channel: str, table_id: int, batch_idx: int) -> None:
    """Flip the last byte (a state value) of record (table_id, batch_idx, 0), keeping its key."""
    with DeltaLog(path) as log:
        def flip(w: WriteTxn) -> None:
            db = w._dbs[DB_OF_CHANNEL[channel]]
            key = codec.record_key(table_id, batch_idx, 0)
            value = bytearray(w.txn.get(key, db=db))
            value[-1] ^= 0x01
            assert w.txn.put(key, bytes(value), db=db)

        log.write(flip)


@pytest.mark.parametrize("channel,batch_idx", [(LOOKUPS, 0), (LOOKUPS, 5), (SNAPSHOTS, 9)])
def test_a_flipped_byte_is_caught_on_the_read_path(tmp_path, channel, batch_idx):
    root = str(tmp_path)
    _job(root, 2, "row", UpdateMode.FIRST, seed=5)
    with DeltaReader(root, channel=channel) as reader:
        reader.poll()  # intact
    path = rank_dir(root, 1)
    with DeltaLog(path, readonly=True) as log:
        table_id = log.read(lambda r: r.tables()["a"].table_id)
    _corrupt(path, channel, table_id, batch_idx)
    with DeltaReader(root, channel=channel) as reader:
        with pytest.raises(CorruptRecordError):
            reader.poll()


def test_a_flipped_byte_in_a_data_file_copy_is_caught(tmp_path):
    """The same through the file: a byte of a stored snapshot value flipped in a copy of
    ``data.mdb`` (the single-record snapshot path copies the rows in one piece)."""
    root = str(tmp_path / "job")
    vals = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16) + 0.5
    with DeltaLog(rank_dir(root, 0), update_mode="first") as log:
        def build(w: WriteTxn) -> None:
            w.set_meta(META_TRACKER, TrackerMeta("embedding", "first", ["a"], 0, 1).to_value())
            entry = w.ensure_table("a")
            w.stage_table(entry)
            w.put_record(entry.table_id, 3, codec.encode_record(torch.arange(64), vals, codec.KIND_SNAPSHOT),
                         channel=SNAPSHOTS)
            w.set_meta(META_SNAPSHOT_END, 4)

        log.write(build)
    data = os.path.join(rank_dir(root, 0), "data.mdb")
    raw = bytearray(open(data, "rb").read())
    pattern = vals[20].numpy().tobytes()
    at = raw.find(pattern)
    assert at > 0
    while at >= 0:  # (a page may also hold an older copy: flip the byte in every copy)
        raw[at + 5] ^= 0x10
        at = raw.find(pattern, at + 1)
    copy = str(tmp_path / "copy")
    os.makedirs(rank_dir(copy, 0))
    with open(os.path.join(rank_dir(copy, 0), "data.mdb"), "wb") as f:
        f.write(raw)
    with DeltaReader(root, channel=SNAPSHOTS) as reader:
        assert torch.equal(reader.poll().merged()["a"].states, vals)
    with DeltaReader(copy, channel=SNAPSHOTS) as reader:
        with pytest.raises(CorruptRecordError):
            reader.poll()


def test_records_of_one_table_with_other_state_types_are_a_typed_error(tmp_path):
    """Two publishes of one table whose rows differ in dtype or width (a foreign or damaged
    log: a tracker keeps one row type per table) are refused by name, never mixed."""
    for second in (torch.ones(4, 16, dtype=torch.float64), torch.ones(4, 8)):
        root = str(tmp_path / f"job-{second.dtype}-{second.shape[1]}")
        with DeltaLog(rank_dir(root, 0), update_mode="first") as log:
            def build(w: WriteTxn) -> None:
                w.set_meta(META_TRACKER, TrackerMeta("embedding", "first", ["a"], 0, 1).to_value())
                entry = w.ensure_table("a")
                w.stage_table(entry)
                for stamp, vals in ((1, torch.ones(4, 16)), (2, second)):
                    w.put_record(entry.table_id, stamp, codec.encode_record(torch.arange(4), vals, codec.KIND_SNAPSHOT),
                                 channel=SNAPSHOTS)
                w.set_meta(META_SNAPSHOT_END, 3)

            log.write(build)
        with DeltaReader(root, channel=SNAPSHOTS) as reader:
            with pytest.raises(CorruptRecordError, match="table 'a': records of states"):
                reader.poll()


# ----------------------------------------------------------------------------- threads


@pytest.mark.skipif("OpenMP" not in torch.__config__.parallel_info(), reason="the count is per thread with OpenMP only")
@pytest.mark.parametrize("option,env,want", [(None, None, 1), (0, None, 2), (None, "3", 3), (1, "3", 1)])
def test_polls_merges_and_apply_run_at_the_read_threads(monkeypatch, tmp_path, option, env, want):
    """A reader's poll, ``merged()`` and ``apply_poll`` run at ``LogOptions.read_threads``
    torch threads (default 1; 0: the process's own), and give the caller's count back."""
    from persistent_delta.serve import apply as apply_mod
    from persistent_delta.read import fetch as fetch_mod
    from persistent_delta.read import results as results_mod
    from persistent_delta.config import LogOptions

    root = str(tmp_path)
    _job(root, 2, "row", UpdateMode.FIRST, seed=5)
    if env is not None:
        monkeypatch.setenv("PERSISTENT_DELTA_READ_THREADS", env)
    seen: Dict[str, List[int]] = {"poll": [], "merge": [], "apply": []}

    def spy(module, name, what):
        real = getattr(module, name)

        def wrapped(*a, **k):
            seen[what].append(torch.get_num_threads())
            return real(*a, **k)
        monkeypatch.setattr(module, name, wrapped)

    spy(fetch_mod, "plan_range", "poll")
    spy(results_mod, "merge_table", "merge")
    spy(apply_mod, "_target", "apply")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with DeltaReader(root, channel=SNAPSHOTS, options=LogOptions.resolve(read_threads=option)) as reader:
            poll = reader.poll()
            assert torch.get_num_threads() == 2
            poll.merged()
            assert torch.get_num_threads() == 2
            tables = {"a": torch.zeros(4000, 8), "e": torch.zeros(4000, 8)}
            assert apply_mod.apply_poll(tables, poll).rows > 0
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen["poll"] and seen["merge"] and seen["apply"]
    assert {k: set(v) for k, v in seen.items()} == {k: {want} for k in seen}


def test_a_waiting_poll_reads_again_only_after_a_commit_that_makes_a_publish_readable(monkeypatch, tmp_path):
    """A snapshots poll waiting for the next publish does not read the logs again for a commit
    after which a read would still be empty (the publish's records at a stamp not closed yet,
    with retention deleting below the poll's position in the same transaction), and returns
    the publish once the next commit closes its stamp: nothing is missed."""
    import threading
    import time

    from persistent_delta.log import position_rules
    from persistent_delta.log.schema import META_SNAPSHOT_START
    from persistent_delta.read import consumer as consumer_mod

    root = str(tmp_path)
    _job(root, 1, "row", UpdateMode.FIRST, seed=2)
    reads: List[bool] = []  # per read of the logs: whether it was empty
    read_once = threading.Event()
    real = consumer_mod.DeltaReader._poll_once

    def counted(self, *args, **kw):
        result = real(self, *args, **kw)
        reads.append(result.empty)
        read_once.set()
        return result

    ids, vals = torch.tensor([3, 5, 8]), torch.randn(3, 8)

    def publish(w: WriteTxn) -> None:
        table = w.tables()["a"].table_id
        w.put_record(table, 10, codec.encode_record(ids, vals, codec.KIND_SNAPSHOT), channel=SNAPSHOTS)
        position_rules.open_stamp(w, 10)
        w.delete_records(table, 0, 9, channel=SNAPSHOTS)  # retention below the reader's position (10)
        w.set_meta(META_SNAPSHOT_START, 9)

    def trainer() -> None:
        read_once.wait(30)
        log.write(publish)
        time.sleep(0.3)  # a poll that reads again for that commit has done so by now
        log.write(lambda w: position_rules.close_stamps(w, 11))  # the batch ended

    with DeltaLog(rank_dir(root, 0), update_mode=UpdateMode.FIRST.value) as log, \
            DeltaReader(root, channel=SNAPSHOTS) as reader:
        assert reader.poll().ranges == {0: (6, 10)}
        monkeypatch.setattr(consumer_mod.DeltaReader, "_poll_once", counted)
        thread = threading.Thread(target=trainer)
        thread.start()
        try:
            poll = reader.poll(timeout=30)
        finally:
            thread.join()
    assert poll.ranges == {0: (10, 11)}
    got = poll.ranks[0].tables["a"]
    assert got.global_ids.tolist() == [3, 5, 8] and torch.equal(got.states, vals)
    assert reads == [True, False]  # the read as the poll began, then the one after the stamp closed


def test_read_threads_must_be_a_count():
    from persistent_delta.config import LogOptions
    from persistent_delta.errors import InvalidInputError

    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidInputError, match="read_threads"):
            LogOptions(read_threads=bad)


# ----------------------------------------------------------------------------- one buffer a poll


def _mixed_job(root: str, world: int, seed: int) -> None:
    """Rank logs of tables of every layout at once, with rows of several types and widths
    (odd fp16 widths, 1-D row-wise optimizer states), lookups and snapshots: row-wise "r",
    column-wise "c" (uneven slices), table-wise "t" (on rank 1 only), replicated "d", "h"
    (fp16, 3 columns, row-wise) and "m" (1-D states, row-wise)."""
    g = random.Random(seed)
    rows_of, dim = 600, 7
    for rank in range(world):
        tables = {}  # fqn -> (shard dict, states dtype, tail, ids factory)
        lo, hi = rank * rows_of // world, (rank + 1) * rows_of // world
        cuts = [0, 2, 3, 7][: world] + [dim] if world < 4 else [0, 2, 3, 5, 7]
        c0, c1 = cuts[rank], cuts[rank + 1]
        tables["r"] = (dict(sharding_type="row_wise", row_offset=lo, col_offset=0, local_rows=hi - lo, local_cols=dim),
                       torch.float32, [dim], hi - lo)
        tables["c"] = (dict(sharding_type="column_wise", row_offset=0, col_offset=c0, local_rows=rows_of,
                            local_cols=c1 - c0), torch.float32, [c1 - c0], rows_of)
        if rank == 1:
            tables["t"] = (dict(sharding_type="table_wise", row_offset=0, col_offset=0, local_rows=rows_of,
                                local_cols=dim), torch.float32, [dim], rows_of)
        tables["d"] = (dict(sharding_type="data_parallel", row_offset=0, col_offset=0, local_rows=rows_of,
                            local_cols=dim), torch.float32, [dim], rows_of)
        tables["h"] = (dict(sharding_type="row_wise", row_offset=lo, col_offset=0, local_rows=hi - lo, local_cols=3),
                       torch.float16, [3], hi - lo)
        tables["m"] = (dict(sharding_type="row_wise", row_offset=lo, col_offset=0, local_rows=hi - lo, local_cols=1),
                       torch.float32, [], hi - lo)
        lookups, snaps = [], []
        col_ids = random.Random(seed + 99)  # column-wise shards see the same ids on every rank
        for b in range(5):
            same = [random_ids(col_ids, "sorted", col_ids.randrange(1, 200), rows_of) for _ in range(2)]
            for fqn, (_, dtype, tail, local) in tables.items():
                ids = same[b % 2] if fqn == "c" else random_ids(g, "sorted", g.randrange(0, 150), local)
                lookups.append(AppendRecord(b, fqn, ids, torch.randn(ids.numel(), *tail).to(dtype)))
        for stamp in (5, 6):
            for fqn, (_, dtype, tail, local) in tables.items():
                ids = random_ids(g, "sorted", g.randrange(1, 200), local)
                snaps.append((stamp, fqn, ids, torch.randn(ids.numel(), *tail).to(dtype)))

        def build(w: WriteTxn, rank: int = rank, tables: dict = tables, lookups: list = lookups, snaps: list = snaps
                  ) -> None:
            w.set_meta(META_TRACKER, TrackerMeta("embedding", "first", sorted(tables), rank, world).to_value())
            for fqn, (shard, dtype, tail, _) in tables.items():
                entry = w.ensure_table(fqn)
                entry.meta["shard"] = dict(shard, table_name=fqn, global_rows=rows_of,
                                           global_cols=3 if fqn == "h" else 1 if fqn == "m" else dim)
                entry.values_dtype = entry.states_dtype = codec.dtype_name(dtype)
                entry.values_tail = entry.states_tail = list(tail)
                w.stage_table(entry)
            write_records(w, encode_records(lookups, UpdateMode.FIRST))
            for stamp, fqn, ids, vals in snaps:
                w.put_record(w.tables()[fqn].table_id, stamp, codec.encode_record(ids, vals, codec.KIND_SNAPSHOT),
                             channel=SNAPSHOTS)
            w.set_meta(META_CURR_BATCH, 5)
            w.set_meta(META_SNAPSHOT_END, 7)

        with DeltaLog(rank_dir(root, rank), update_mode="first") as log:
            log.write(build)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("channel", [LOOKUPS, SNAPSHOTS])
def test_a_poll_laid_out_in_one_buffer_equals_each_rank_read_on_its_own(tmp_path, world, channel):
    """Differential: a poll (every rank's rows copied into one buffer, fetch.finish_ranks)
    against each rank's log read on its own (fetch.read_range, memory of its own), and
    merged() against merge_table over those: the same ids, states, dtypes and shapes for
    every layout, dtype and width in one poll."""
    from persistent_delta.read.fetch import read_range

    root = str(tmp_path)
    _mixed_job(root, world, seed=world)
    start = 5 if channel == SNAPSHOTS else 0
    with DeltaReader(root, channel=channel, start=start) as reader:
        poll = reader.poll()
    alone = {}
    for rank in range(world):
        with DeltaLog(rank_dir(root, rank)) as log:
            end = poll.ranks[rank].end_idx
            alone[rank] = log.read(lambda r, rank=rank, end=end: read_range(r, rank, log.path, start, end, channel))
    buffers = set()
    for rank in range(world):
        got, want = poll.ranks[rank], alone[rank]
        assert (got.start_idx, got.end_idx) == (want.start_idx, want.end_idx)
        assert sorted(got.tables) == sorted(want.tables)
        for fqn, w in want.tables.items():
            d = got.tables[fqn]
            assert torch.equal(d.ids, w.ids) and torch.equal(d.global_ids, w.global_ids)
            assert d.states.dtype == w.states.dtype and d.states.shape == w.states.shape
            assert torch.equal(d.states, w.states), (rank, fqn)
            if d.states.numel():
                buffers.add(d.states.untyped_storage().data_ptr())
    assert len(buffers) == 1  # one allocation for the poll's rows
    merged = poll.merged()
    for fqn in merged:
        ref = merge_table(fqn, [alone[k].tables[fqn] for k in range(world) if fqn in alone[k].tables])
        m = merged[fqn]
        assert torch.equal(m.global_ids, ref.global_ids), fqn
        assert (m.states is None) == (ref.states is None), fqn
        if m.states is not None:
            assert torch.equal(m.states, ref.states), fqn
    # the layouts joined without a copy: row-wise shards and column slices tiling the row
    for fqn in ("r", "c", "h", "m"):
        if merged[fqn].states is not None and merged[fqn].states.numel():
            assert merged[fqn].states.untyped_storage().data_ptr() in buffers, fqn


def test_a_poll_holds_every_rank_transaction_without_nesting_calls(tmp_path):
    """A poll opens every rank's read transaction at once (log.read_all); it must not take a
    stack frame per rank, or a job of a few hundred ranks would hit Python's recursion limit.
    Here: 24 ranks under a limit a few dozen frames above the caller's depth."""
    import inspect
    import sys

    root = str(tmp_path)
    written = _job(root, 24, "row", UpdateMode.FIRST, seed=3)
    with DeltaReader(root, channel=LOOKUPS) as reader:
        reader.poll(timeout=0)  # opens every log (outside the limit below)
        reader.seek(0)
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(len(inspect.stack()) + 60)
        try:
            poll = reader.poll()
        finally:
            sys.setrecursionlimit(limit)
    assert sorted(poll.ranks) == list(range(24))
    for rank in range(24):
        recs = written[(rank, LOOKUPS)]["a"]
        check_rows(poll.ranks[rank].tables["a"].rows, ref_rule([i for i, _ in recs], [s for _, s in recs],
                                                                UpdateMode.FIRST), UpdateMode.FIRST)


def _snapshot(poll) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    return {fqn: (m.global_ids.clone(), m.states.clone()) for fqn, m in poll.merged().items() if m.states is not None}


def _poll_ptr(poll) -> int:
    return next(d.states.untyped_storage().data_ptr() for r in poll.ranks.values() for d in r.tables.values()
                if d.states is not None and d.states.numel())


def test_a_poll_buffer_is_reused_only_after_every_view_of_it_is_gone(tmp_path):
    """A consumer hands a poll's row buffer out again (alloc.ResultBuffers) once the caller has
    dropped the poll, and never while a view of it lives: a kept poll's rows stay as they
    were read while later polls of other rows run, and a reused buffer holds the new poll's
    rows exactly (no bytes of the earlier poll)."""
    root = str(tmp_path)
    _mixed_job(root, 2, seed=5)
    with DeltaReader(root, channel=LOOKUPS) as reader:
        reader.seek(3)
        first = reader.poll()  # batches [3, 5)
        kept = first.merged()  # views of the first poll's buffer, kept past the poll
        want_first = _snapshot(first)
        p_first = _poll_ptr(first)
        del first
        reader.seek(0)
        second = reader.poll(max_batches=3)  # [0, 3), more rows: the first buffer is viewed, and too small
        want_second = _snapshot(second)
        p_second = _poll_ptr(second)
        assert p_second != p_first
        assert want_first.keys() == want_second.keys()
        assert sum(v[1].numel() for v in want_second.values()) > sum(v[1].numel() for v in want_first.values())
        del second
        reader.seek(3)
        third = reader.poll()  # [3, 5) again, into the second poll's buffer (free now; other rows in it)
        assert _poll_ptr(third) == p_second
        for fqn, (ids, states) in _snapshot(third).items():
            assert torch.equal(ids, want_first[fqn][0]) and torch.equal(states, want_first[fqn][1]), fqn
        for fqn, (ids, states) in want_first.items():  # the kept views survived the later polls
            assert torch.equal(kept[fqn].global_ids, ids) and torch.equal(kept[fqn].states, states), fqn
        reader.seek(0)
        fourth = reader.poll(max_batches=3)  # the kept views and the third poll hold both buffers
        assert _poll_ptr(fourth) not in (p_first, p_second)
        for fqn, (ids, states) in want_first.items():
            assert torch.equal(kept[fqn].global_ids, ids) and torch.equal(kept[fqn].states, states), fqn
        for fqn, (ids, states) in _snapshot(fourth).items():
            assert torch.equal(ids, want_second[fqn][0]) and torch.equal(states, want_second[fqn][1]), fqn
        for fqn, (ids, states) in _snapshot(third).items():  # the third poll, still held, as it was read
            assert torch.equal(ids, want_first[fqn][0]) and torch.equal(states, want_first[fqn][1]), fqn
    assert reader._buffers.held_bytes() == 0  # a closed reader keeps no buffers (the polls held keep theirs)
    for fqn, (ids, states) in want_first.items():
        assert torch.equal(kept[fqn].global_ids, ids) and torch.equal(kept[fqn].states, states), fqn


def test_result_buffers_keep_a_bounded_number_of_blocks():
    """At most ``keep`` blocks stay referenced; a free block far larger than the request (a
    catch-up poll's) is released rather than handed out for small polls or kept idle; a free
    block that fits is reused."""
    from persistent_delta.log.alloc import ResultBuffers

    pool = ResultBuffers(keep=2)
    big = pool.take(8 << 20)
    del big
    small = pool.take(1 << 20)  # the free 10 MiB block is more than 4x the request: released, a new block
    assert (pool.allocated, pool.reused) == (2, 0)
    assert pool.held_bytes() == pool._size(1 << 20)
    del small
    again = pool.take(1 << 20)  # the free 1.25 MiB block fits
    assert (pool.allocated, pool.reused) == (2, 1)
    held = [again] + [pool.take(1 << 20) for _ in range(5)]  # all held: new blocks, only two referenced here
    assert pool.allocated == 7 and pool.held_bytes() <= 2 * pool._size(1 << 20)
    assert len({t.data_ptr() for t in held}) == len(held)
    from persistent_delta.errors import InvalidInputError

    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(InvalidInputError):
            ResultBuffers(keep=bad)
