"""LmdbDeltaStore: TorchRec's DeltaStore semantics, durability across reopen, misuse."""

import os

import pytest
import torch
from torchrec.distributed.model_tracker.delta_store import DeltaStoreTrec
from torchrec.distributed.model_tracker.types import IndexedLookup, UpdateMode

from persistent_delta.errors import (
    ConfigMismatchError,
    FormatMismatchError,
    InvalidInputError,
    LogClosedError,
    NotALogError,
    ReadOnlyLogError,
)
from persistent_delta import LmdbDeltaStore
from persistent_delta.log.deltalog import DeltaLog


def L(b, ids, states=None):
    return IndexedLookup(batch_idx=b, ids=torch.tensor(ids), states=None if states is None else torch.tensor(states))


def fill(store, table_to_lookups):
    for fqn, lookups in table_to_lookups.items():
        for lk in lookups:
            store.append(batch_idx=lk.batch_idx, fqn=fqn, ids=lk.ids, states=lk.states)


# --- TorchRec's append/delete cases: per_fqn_lookups must compare equal to DeltaStoreTrec's ----

APPEND_DELETE = [
    ({}, None, {}),
    ({"t1": [L(1, [1], [1]), L(2, [2], [2])]}, None, {}),
    ({"t1": [L(b, [b], [b]) for b in (1, 2, 3, 4)]}, 3, {"t1": [L(3, [3], [3]), L(4, [4], [4])]}),
    ({"t1": [L(8, [8], [8]), L(10, [10], [10]), L(13, [13], [13])]}, 13, {"t1": [L(13, [13], [13])]}),
    ({"t1": [L(9, [9], [9])], "t2": [L(9, [9], [9]), L(10, [10], [10])]}, 10, {"t1": [], "t2": [L(10, [10], [10])]}),
]


@pytest.mark.parametrize("before,up_to,after", APPEND_DELETE)
def test_append_and_delete_like_torchrec(log_dir, before, up_to, after):
    ref = DeltaStoreTrec()
    with LmdbDeltaStore(log_dir) as store:
        fill(store, before)
        fill(ref, before)
        assert dict(store.per_fqn_lookups) == before == ref.per_fqn_lookups
        store.delete(up_to)
        ref.delete(up_to)
        assert dict(store.per_fqn_lookups) == after == ref.per_fqn_lookups
    with LmdbDeltaStore(log_dir) as store:  # and the same after a reopen
        assert dict(store.per_fqn_lookups) == after


# --- TorchRec's compaction cases, checked through get_unique --------------------------------

COMPACT = [
    (UpdateMode.NONE, {}, 1, 5, {}),
    (UpdateMode.NONE, {"t1": [L(3, [1, 2, 3])]}, 1, 5, {"t1": ([1, 2, 3], None)}),
    (UpdateMode.NONE, {"t1": [L(1, [1, 2, 3]), L(2, [4, 5, 6]), L(3, [7, 8, 9])]}, 1, 3, {"t1": (list(range(1, 10)), None)}),
    (UpdateMode.NONE, {"t1": [L(1, [1, 2, 3]), L(2, [3, 4, 5]), L(3, [5, 6, 7]), L(4, [7, 8, 9])]}, 1, 4, {"t1": (list(range(1, 10)), None)}),
    (
        UpdateMode.FIRST,
        {"t1": [L(1, [1, 2, 3], [[10.0], [20.0], [30.0]]), L(2, [3, 4, 5], [[35.0], [40.0], [50.0]]),
                L(3, [5, 6, 7], [[55.0], [60.0], [70.0]]), L(4, [7, 8, 9], [[75.0], [80.0], [90.0]])]},
        1, 4,
        {"t1": (list(range(1, 10)), [[10.0], [20.0], [30.0], [40.0], [50.0], [60.0], [70.0], [80.0], [90.0]])},
    ),
    (
        UpdateMode.LAST,
        {"t1": [L(1, [1, 2, 3], [[10.0], [20.0], [30.0]]), L(2, [3, 4, 5], [[35.0], [40.0], [50.0]]),
                L(3, [5, 6, 7], [[55.0], [60.0], [70.0]]), L(4, [7, 8, 9], [[75.0], [80.0], [90.0]])]},
        1, 4,
        {"t1": (list(range(1, 10)), [[10.0], [20.0], [35.0], [40.0], [55.0], [60.0], [75.0], [80.0], [90.0]])},
    ),
    (
        UpdateMode.LAST,
        {"t1": [L(1, [1, 2, 3], [[10.0], [20.0], [30.0]]), L(2, [3, 4, 5], [[35.0], [40.0], [50.0]])],
         "t2": [L(1, [10, 20, 30], [[100.0], [200.0], [300.0]]), L(2, [30, 40, 50], [[350.0], [400.0], [500.0]])]},
        1, 3,
        {"t1": ([1, 2, 3, 4, 5], [[10.0], [20.0], [35.0], [40.0], [50.0]]),
         "t2": ([10, 20, 30, 40, 50], [[100.0], [200.0], [350.0], [400.0], [500.0]])},
    ),
]


@pytest.mark.parametrize("mode,lookups,start,end,expected", COMPACT)
def test_compact_like_torchrec(log_dir, mode, lookups, start, end, expected):
    with LmdbDeltaStore(log_dir, mode) as store:
        fill(store, lookups)
        store.compact(start_idx=start, end_idx=end)
        for fqn, lks in store.per_fqn_lookups.items():
            in_range = [lk for lk in lookups[fqn] if start <= lk.batch_idx < end]
            assert sum(1 for lk in lks if start <= lk.batch_idx < end) == min(len(in_range), 1)
        got = store.get_unique()
    assert set(got) == set(expected)
    for fqn, (ids, states) in expected.items():
        assert got[fqn].ids.tolist() == ids
        if states is None:
            assert got[fqn].states is None
        else:
            assert got[fqn].states.tolist() == states


def test_compact_bad_range_raises_assertion_error_and_changes_nothing(log_dir):
    with LmdbDeltaStore(log_dir) as store:
        store.append(1, "t1", torch.tensor([1, 2, 3]))
        store.append(2, "t1", torch.tensor([4]))
        for start, end in [(5, 3), (2, 2)]:
            with pytest.raises(AssertionError):
                store.compact(start, end)
        assert [lk.batch_idx for lk in store.per_fqn_lookups["t1"]] == [1, 2]


def test_compacted_record_is_stamped_start_idx(log_dir):
    with LmdbDeltaStore(log_dir, UpdateMode.FIRST) as store:
        for b in range(5):
            store.append(b, "t", torch.tensor([b, b + 1]), torch.full((2, 3), float(b)))
        store.compact(1, 4)
        assert [lk.batch_idx for lk in store.per_fqn_lookups["t"]] == [0, 1, 4]
        # from_idx=2 no longer sees the merged range, as in TorchRec
        assert store.get_unique(2)["t"].ids.tolist() == [4, 5]
        assert store.get_unique(1)["t"].ids.tolist() == [1, 2, 3, 4, 5]
        assert store.get_unique(1)["t"].states[:, 0].tolist() == [1.0, 1.0, 2.0, 3.0, 4.0]


def test_several_records_share_a_batch_and_keep_call_order(log_dir):
    with LmdbDeltaStore(log_dir, UpdateMode.LAST) as store:
        store.append(3, "t", torch.tensor([1, 2]), torch.tensor([[1.0], [2.0]]))
        store.append(3, "t", torch.tensor([2, 5]), torch.tensor([[20.0], [5.0]]))
        store.append(3, "u", torch.tensor([7]), torch.tensor([[7.0]]))
        store.append(3, "t", torch.tensor([1]), torch.tensor([[100.0]]))
    with LmdbDeltaStore(log_dir, UpdateMode.LAST) as store:
        lks = store.per_fqn_lookups["t"]
        assert [lk.ids.tolist() for lk in lks] == [[1, 2], [2, 5], [1]]
        got = store.get_unique()["t"]
        assert got.ids.tolist() == [1, 2, 5] and got.states[:, 0].tolist() == [100.0, 20.0, 5.0]


def test_get_unique_ascending_empty_tables_and_dtypes(log_dir):
    with LmdbDeltaStore(log_dir, UpdateMode.FIRST) as store:
        ids = torch.tensor([9, 3, 9, 1], dtype=torch.int32)
        states = torch.randn(4, 2, 3).to(torch.bfloat16)
        store.append(0, "a", ids, states)
        store.append(5, "b", torch.tensor([4]), torch.zeros(1, 2, 3, dtype=torch.bfloat16))
        got = store.get_unique()
        assert got["a"].ids.dtype == torch.int32 and got["a"].ids.tolist() == [1, 3, 9]
        assert got["a"].states.dtype == torch.bfloat16 and got["a"].states.shape == (3, 2, 3)
        assert torch.equal(got["a"].states, states[[3, 1, 0]])
        later = store.get_unique(1)
        assert later["a"].ids.numel() == 0 and later["a"].ids.dtype == torch.int32
        assert later["a"].states.shape == (0, 2, 3) and later["a"].states.dtype == torch.bfloat16
        assert later["b"].ids.tolist() == [4]


def test_reopen_gives_back_exactly_what_was_there(log_dir):
    torch.manual_seed(0)
    with LmdbDeltaStore(log_dir, UpdateMode.LAST) as store:
        for b in range(20):
            for fqn in ("x", "y"):
                n = int(torch.randint(0, 30, ()))
                store.append(b, fqn, torch.randint(0, 50, (n,)), torch.randn(n, 4))
        store.compact(3, 11)
        store.delete(2)
        before = {k: [(lk.batch_idx, lk.ids, lk.states) for lk in v] for k, v in store.per_fqn_lookups.items()}
        uniq = store.get_unique(0)
    with LmdbDeltaStore(log_dir, UpdateMode.LAST) as store:
        after = {k: [(lk.batch_idx, lk.ids, lk.states) for lk in v] for k, v in store.per_fqn_lookups.items()}
        assert before.keys() == after.keys()
        for k in before:
            assert len(before[k]) == len(after[k])
            for (b1, i1, s1), (b2, i2, s2) in zip(before[k], after[k]):
                assert b1 == b2 and torch.equal(i1, i2) and torch.equal(s1, s2)
        again = store.get_unique(0)
        for k in uniq:
            assert torch.equal(uniq[k].ids, again[k].ids) and torch.equal(uniq[k].states, again[k].states)


def test_results_do_not_alias_the_map(log_dir):
    with LmdbDeltaStore(log_dir, UpdateMode.FIRST) as store:
        store.append(0, "t", torch.tensor([1, 2]), torch.tensor([[1.0], [2.0]]))
        got = store.get_unique()["t"]
        lks = store.get_indexed_lookups(0, 1)["t"]
        store.delete()
        for b in range(1, 50):
            store.append(b, "t", torch.tensor([7, 8]), torch.tensor([[9.0], [9.0]]))
        assert got.ids.tolist() == [1, 2] and got.states[:, 0].tolist() == [1.0, 2.0]
        assert lks[0].ids.tolist() == [1, 2]
        got.states += 1  # writable, owned memory


def test_get_indexed_lookups_half_open(log_dir):
    with LmdbDeltaStore(log_dir) as store:
        for b in range(6):
            store.append(b, "t", torch.tensor([b]))
        assert [lk.batch_idx for lk in store.get_indexed_lookups(2, 5)["t"]] == [2, 3, 4]
        assert store.get_indexed_lookups(7, 9)["t"] == []


def test_per_fqn_lookups_is_read_only(log_dir):
    with LmdbDeltaStore(log_dir) as store:
        store.append(0, "t", torch.tensor([1]))
        view = store.per_fqn_lookups
        with pytest.raises(TypeError):
            view["u"] = []  # type: ignore[index]


# --- misuse ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(batch_idx=0, fqn="t", ids=torch.tensor([1.0, 2.0])), "integer dtype"),
        (dict(batch_idx=0, fqn="t", ids=torch.tensor([1, -2])), "non-negative"),
        (dict(batch_idx=0, fqn="t", ids=torch.tensor([[1, 2]])), "1-D"),
        (dict(batch_idx=0, fqn="t", ids=[1, 2]), "torch.Tensor"),
        (dict(batch_idx=-1, fqn="t", ids=torch.tensor([1])), r"\[0, 2\*\*63\)"),
        (dict(batch_idx=1.0, fqn="t", ids=torch.tensor([1])), "must be an int"),
        (dict(batch_idx=0, fqn="", ids=torch.tensor([1])), "non-empty"),
        (dict(batch_idx=0, fqn="t", ids=torch.tensor([1, 2]), states=torch.ones(3, 2)), "one row per id"),
        (dict(batch_idx=0, fqn="t", ids=torch.tensor([1, 2]), states=torch.tensor(1.0)), "one row per id"),
        (dict(batch_idx=0, fqn="t", ids=torch.tensor([1]), raw_ids=torch.tensor([1])), "RawIdTracker"),
    ],
)
def test_bad_input_is_refused_and_changes_nothing(log_dir, kwargs, match):
    with LmdbDeltaStore(log_dir) as store:
        store.append(0, "keep", torch.tensor([5]))
        with pytest.raises(InvalidInputError, match=match):
            store.append(**kwargs)
        assert list(store.per_fqn_lookups) == ["keep"]


def test_missing_states_refused_when_mode_needs_them(log_dir):
    with LmdbDeltaStore(log_dir, UpdateMode.FIRST) as store:
        with pytest.raises(InvalidInputError, match="needs states"):
            store.append(0, "t", torch.tensor([1]))


def test_decreasing_batch_idx_is_refused(log_dir):
    with LmdbDeltaStore(log_dir) as store:
        store.append(5, "t", torch.tensor([1]))
        store.append(5, "t", torch.tensor([2]))  # same batch: fine
        store.append(1, "u", torch.tensor([2]))  # other table: its own order
        with pytest.raises(InvalidInputError, match="append-only"):
            store.append(4, "t", torch.tensor([3]))
        store.delete(100)
        with pytest.raises(InvalidInputError, match="append-only"):  # deletion does not rewind
            store.append(4, "t", torch.tensor([3]))
    with LmdbDeltaStore(log_dir) as store:  # nor does a reopen
        with pytest.raises(InvalidInputError, match="append-only"):
            store.append(4, "t", torch.tensor([3]))
        store.append(6, "t", torch.tensor([3]))


def test_bad_delete_index(log_dir):
    with LmdbDeltaStore(log_dir) as store:
        with pytest.raises(InvalidInputError):
            store.delete(-3)


def test_use_after_close_and_double_close(log_dir):
    store = LmdbDeltaStore(log_dir)
    store.append(0, "t", torch.tensor([1]))
    store.close()
    store.close()
    for call in (
        lambda: store.append(1, "t", torch.tensor([1])),
        lambda: store.get_unique(),
        lambda: store.delete(),
        lambda: store.compact(0, 2),
        lambda: store.per_fqn_lookups,
        lambda: store.flush(),
    ):
        with pytest.raises(LogClosedError):
            call()


def test_update_mode_mismatch_is_refused(log_dir):
    LmdbDeltaStore(log_dir, UpdateMode.FIRST).close()
    with pytest.raises(ConfigMismatchError, match="first"):
        LmdbDeltaStore(log_dir, UpdateMode.LAST)
    LmdbDeltaStore(log_dir, UpdateMode.FIRST).close()


def test_format_version_mismatch_is_refused(log_dir):
    LmdbDeltaStore(log_dir).close()
    with DeltaLog(log_dir) as log:
        log.write(lambda w: w.set_meta("format_version", 999))
    with pytest.raises(FormatMismatchError, match="999"):
        LmdbDeltaStore(log_dir)


def test_readonly_open_never_creates(tmp_path):
    missing = str(tmp_path / "nothing")
    with pytest.raises(NotALogError):
        LmdbDeltaStore(missing, readonly=True)
    assert not os.path.exists(missing)


def test_readonly_store_reads_but_refuses_writes(log_dir):
    with LmdbDeltaStore(log_dir) as store:
        store.append(0, "t", torch.tensor([3, 1]))
    with LmdbDeltaStore(log_dir, readonly=True) as ro:
        assert ro.get_unique()["t"].ids.tolist() == [1, 3]
        with pytest.raises(ReadOnlyLogError):
            ro.append(1, "t", torch.tensor([1]))


def test_not_a_log_directory(tmp_path):
    d = tmp_path / "junk"
    d.mkdir()
    (d / "data.mdb").write_bytes(b"not lmdb at all" * 1000)
    with pytest.raises(NotALogError):
        LmdbDeltaStore(str(d), readonly=True)
