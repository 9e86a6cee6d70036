"""The read path at real sizes on both sides of every size threshold that switches a code path
in ``log/rows`` (nothing monkeypatched), with empty records, empty tables and empty ranks among
the parts, against references: ``torch.cat(parts)[picked]`` for the gather, TorchRec's in-memory
``DeltaStoreTrec`` for the store and for each rank of a poll.

A new threshold in ``log/rows`` must be added to ``THRESHOLDS`` (and so to the sizes below):
``test_every_threshold_is_crossed`` fails until it is."""

from __future__ import annotations

import random
from typing import Dict, List, Optional, Sequence

import pytest
import torch
from torchrec.distributed.model_tracker.delta_store import DeltaStoreTrec
from torchrec.distributed.model_tracker.types import UniqueRows, UpdateMode

from persistent_delta import DeltaReader, LmdbDeltaStore
from persistent_delta.log import rows
from persistent_delta.log.deltalog import DeltaLog, WriteTxn
from persistent_delta.log.layout import rank_dir
from persistent_delta.log.records import AppendRecord, encode_records, write_records
from persistent_delta.log.rows import gather_rows
from persistent_delta.log.schema import META_CURR_BATCH, META_TRACKER, TrackerMeta

# Every module-level constant of log/rows that switches a code path, and how the sizes below
# cross it.
THRESHOLDS = {
    "_CONCAT_BYTES": "parts of 8 MiB - one row, 8 MiB and 8 MiB + one row together, and 2.5x",
    "_CHUNK_BYTES": "rows picked from a part of one chunk - 1, one chunk, one chunk + 1; rows as wide as a chunk and wider",
    "_DENSE_FACTOR": "dense ids (direct address) and ids spread over 10**12 (the sort)",
    "_FEW_RUNS": "sparse ids in 63 and 65 ascending runs",
    # the one limit no real size here reaches (2**31 ids): its int64 side is crossed by lowering it
    "_INT32_POSITIONS": "int32 positions at every size here; int64 in tests/unit/test_merge.py::test_matches_torchrec",
}

DIM = 128  # fp32: 512-byte rows, 16384 rows = 8 MiB, a 512 KiB chunk = 1024 rows
ROW_BYTES = DIM * 4
CONCAT_ROWS = rows._CONCAT_BYTES // ROW_BYTES
CHUNK_ROWS = rows._CHUNK_BYTES // ROW_BYTES


def test_every_threshold_is_crossed():
    consts = {name for name, v in vars(rows).items()
              if name.lstrip("_").isupper() and isinstance(v, int) and not isinstance(v, bool)}
    assert consts == set(THRESHOLDS), "a size threshold of log/rows is not crossed by this module's sizes"
    assert (CONCAT_ROWS, CHUNK_ROWS) == (16384, 1024)  # the sizes below are computed for these


# ----------------------------------------------------------------------------- gather_rows


def _parts(sizes: Sequence[int], dim: int = DIM) -> List[torch.Tensor]:
    return [torch.randn(n, dim) for n in sizes]


def _check_gather(parts: List[torch.Tensor], picked: torch.Tensor) -> None:
    want = torch.cat(parts)[picked]
    assert torch.equal(gather_rows(parts, picked), want)
    # into a column slice of a wider buffer, as a poll's buffer takes it
    wide = torch.full((picked.numel(), parts[0].shape[1] + 3), -1.0)
    gather_rows(parts, picked, wide[:, 1:1 + parts[0].shape[1]])
    assert torch.equal(wide[:, 1:1 + parts[0].shape[1]], want)
    assert bool((wide[:, 0] == -1).all()) and bool((wide[:, -2:] == -1).all())


@pytest.mark.parametrize("total", [CONCAT_ROWS - 1, CONCAT_ROWS, CONCAT_ROWS + 1, CONCAT_ROWS * 5 // 2])
@pytest.mark.parametrize("empty_at", ["none", "first", "middle", "last", "all_but_one"])
@pytest.mark.parametrize("pick", ["all", "all_shuffled", "half", "one"])
def test_gather_across_the_concat_threshold(total, empty_at, pick):
    g = torch.Generator().manual_seed(total + len(empty_at) * 7 + len(pick))
    sizes = [total // 3, total // 3, total - 2 * (total // 3)]
    if empty_at == "all_but_one":
        sizes = [0, total, 0]
    elif empty_at != "none":
        sizes.insert({"first": 0, "middle": 2, "last": 3}[empty_at], 0)
    parts = _parts(sizes)
    if pick == "all":
        picked = torch.arange(total)
    elif pick == "all_shuffled":
        picked = torch.randperm(total, generator=g)
    elif pick == "half":
        picked = torch.randperm(total, generator=g)[: total // 2]
    else:
        picked = torch.tensor([total - 1])
    _check_gather(parts, picked)


@pytest.mark.parametrize("from_part", [CHUNK_ROWS - 1, CHUNK_ROWS, CHUNK_ROWS + 1])
def test_gather_across_the_chunk_threshold(from_part):
    """A part with some rows picked goes through the chunk buffer: one chunk less one row, one
    chunk, one chunk and one row; beside an empty part and a part picked whole."""
    parts = _parts([CONCAT_ROWS, 0, 3 * CHUNK_ROWS])
    whole = torch.arange(CONCAT_ROWS)  # part 0 picked whole
    some = CONCAT_ROWS + torch.randperm(3 * CHUNK_ROWS, generator=torch.Generator().manual_seed(from_part))[:from_part]
    picked = torch.cat([some, whole])[torch.randperm(CONCAT_ROWS + from_part, generator=torch.Generator().manual_seed(1))]
    _check_gather(parts, picked)


@pytest.mark.parametrize("dim", [rows._CHUNK_BYTES // 4, rows._CHUNK_BYTES // 4 + 16])
def test_gather_of_rows_as_wide_as_a_chunk_or_wider(dim):
    """A row of one chunk or more: the chunk holds one row."""
    n = rows._CONCAT_BYTES // (dim * 4) + 2  # past the concat threshold
    parts = _parts([n // 2, 0, n - n // 2], dim)
    picked = torch.randperm(n, generator=torch.Generator().manual_seed(dim))[: n - 3]
    _check_gather(parts, picked)


def test_gather_of_zero_width_rows_and_no_rows():
    assert gather_rows(_parts([CONCAT_ROWS + 5, 0], 0), torch.arange(7)).shape == (7, 0)
    assert gather_rows(_parts([CONCAT_ROWS + 5, 0]), torch.empty(0, dtype=torch.int64)).shape == (0, DIM)


# ----------------------------------------------------------------------------- the store


def _ids(g: random.Random, pattern: str, n: int, k: int) -> torch.Tensor:
    """Record ``k``'s ids: ``dense`` (repeats, within a small range), ``ordered`` (ascending,
    disjoint from the other records), ``sparse63``/``sparse65`` (ascending over 10**12, the
    record holding that many runs)."""
    if n == 0:
        return torch.empty(0, dtype=torch.int64)
    if pattern == "dense":
        return torch.tensor([g.randrange(3 * n) for _ in range(n)], dtype=torch.int64)
    if pattern == "ordered":
        return torch.arange(k * n, (k + 1) * n, dtype=torch.int64)
    runs = int(pattern[len("sparse"):])
    pieces = [sorted(g.sample(range(10 ** 12), n // runs + 1)) for _ in range(runs)]
    return torch.tensor([x for p in pieces for x in p][:n], dtype=torch.int64)


def _records(pattern: str, total: int, seed: int) -> List[AppendRecord]:
    """Records of table "a" totalling ``total`` rows, with empty records among them, and a table
    "e" that has only empty records."""
    g = random.Random(seed)
    sizes = [0, total // 2, 0, total - total // 2, 0]
    out = []
    for k, n in enumerate(sizes):
        out.append(AppendRecord(k, "a", _ids(g, pattern, n, k), torch.randn(n, DIM)))
        out.append(AppendRecord(k, "e", torch.empty(0, dtype=torch.int64), torch.empty(0, DIM)))
    return out


def _reference(records: Sequence[AppendRecord], mode: UpdateMode, from_idx: int = 0) -> Dict[str, UniqueRows]:
    ref = DeltaStoreTrec(mode)
    for r in records:
        ref.append(r.batch_idx, r.fqn, r.ids, None if mode == UpdateMode.NONE else r.states)
    return ref.get_unique(from_idx)


def _check_same(got: UniqueRows, want: UniqueRows, mode: UpdateMode) -> None:
    order = torch.argsort(want.ids)
    assert torch.equal(got.ids, want.ids[order])
    if mode == UpdateMode.NONE:
        assert got.states is None
    else:
        assert got.states is not None and want.states is not None
        assert torch.equal(got.states, want.states[order])


@pytest.mark.parametrize("mode", [UpdateMode.FIRST, UpdateMode.LAST, UpdateMode.NONE])
@pytest.mark.parametrize("pattern", ["dense", "ordered", "sparse63", "sparse65"])
@pytest.mark.parametrize("total", [CONCAT_ROWS - 1, CONCAT_ROWS + 1, CONCAT_ROWS * 5 // 2])
def test_store_get_unique_matches_torchrec_across_thresholds(tmp_path, mode, pattern, total):
    records = _records(pattern, total, seed=total + len(pattern))
    with LmdbDeltaStore(str(tmp_path / "s"), mode) as store:
        store.append_many(records)
        got = store.get_unique()
        later = store.get_unique(from_idx=3)  # a read that starts past the first records
    want, want_later = _reference(records, mode), _reference(records, mode, 3)
    assert set(got) == {"a", "e"}
    for fqn in ("a", "e"):
        _check_same(got[fqn], want[fqn], mode)
        _check_same(later[fqn], want_later[fqn], mode)


# ----------------------------------------------------------------------------- a poll across ranks


def _write_rank(root: str, rank: int, world: int, mode: UpdateMode, records: List[AppendRecord]) -> None:
    def build(w: WriteTxn) -> None:
        w.set_meta(META_TRACKER, TrackerMeta("embedding", mode.value, ["a", "e"], rank, world).to_value())
        for fqn in ("a", "e"):
            entry = w.ensure_table(fqn)
            entry.values_dtype, entry.values_tail = "float32", [DIM]
            if mode != UpdateMode.NONE:
                entry.states_dtype, entry.states_tail = "float32", [DIM]
            w.stage_table(entry)
        encoded = encode_records(records, mode)
        if encoded:
            write_records(w, encoded)
        w.set_meta(META_CURR_BATCH, 5)

    with DeltaLog(rank_dir(root, rank), update_mode=mode.value) as log:
        log.write(build)


@pytest.mark.parametrize("mode", [UpdateMode.FIRST, UpdateMode.LAST, UpdateMode.NONE])
@pytest.mark.parametrize("pattern", ["dense", "ordered", "sparse65"])
def test_a_poll_over_ranks_matches_torchrec_past_the_thresholds(tmp_path, mode, pattern):
    """Three ranks: rank 0 reads past 8 MiB with empty records among its records, rank 1 has
    no record at all (an empty rank), rank 2 only empty records; table "e" is empty on every
    rank. Every rank of the poll, and a reader that starts from the latest batches only."""
    root = str(tmp_path)
    per_rank = {
        0: _records(pattern, CONCAT_ROWS * 5 // 4, seed=len(pattern)),
        1: [],
        2: [AppendRecord(k, fqn, torch.empty(0, dtype=torch.int64), torch.empty(0, DIM))
            for k in range(3) for fqn in ("a", "e")],
    }
    for rank, records in per_rank.items():
        _write_rank(root, rank, 3, mode, records)
    with DeltaReader(root) as reader:
        poll = reader.poll()
    for rank, records in per_rank.items():
        want = _reference(records, mode) if records else {}
        for fqn in ("a", "e"):
            got = poll.ranks[rank].tables[fqn].rows
            if fqn in want:
                _check_same(got, want[fqn], mode)
            else:
                assert got.ids.numel() == 0
                assert got.states is None if mode == UpdateMode.NONE else got.states.shape == (0, DIM)
