"""A publish's unread ids, marked by the writer (persistent_delta.trainer.unread), against a plain union."""

import numpy as np
import torch

from persistent_delta.log.codec import KIND_RAW_IDS
from persistent_delta.log.records import AppendRecord
from persistent_delta.trainer.unread import DENSE_ROWS, UnreadIds

SMALL, BIG = 1000, DENSE_ROWS * 4  # a bitmap table, and one that keeps id lists (merged as they grow)


def _union(records, base):
    out = {}
    for r in records:
        if r.batch_idx >= base and r.kind != KIND_RAW_IDS and r.ids.numel():
            out.setdefault(r.fqn, set()).update(r.ids.tolist())
    return {f: sorted(v) for f, v in out.items()}


def test_each_publish_gets_the_union_of_what_was_committed_and_pending_since_its_base():
    rng = np.random.default_rng(3)
    unread = UnreadIds({"small": SMALL, "big": BIG})
    assert unread.take("a", 5) is None  # no unread set before a consumer's first publish
    committed, base = [], 5
    for publish in range(4):
        batches = range(base - 1, base + 6)  # one batch below the base: not this publish's
        records = []
        for b in batches:
            records.append(AppendRecord(b, "small", torch.from_numpy(rng.integers(0, SMALL, 300))))
            # ids beyond the bitmap and a negative one are kept as they are (the gather refuses them)
            records.append(AppendRecord(b, "small", torch.tensor([SMALL + 7, -2 if b == base + 3 else 0])))
            records.append(AppendRecord(b, "big", torch.from_numpy(rng.integers(0, BIG, 40_000))))
            records.append(AppendRecord(b, "big", torch.tensor([5, 5]), kind=KIND_RAW_IDS))  # a side record
        pending = records[-8:]  # the last two batches are still queued for the writer
        unread.add(records[:-8])
        committed = records
        acc = unread.take("a", base + 6)
        got = unread.unread(acc, pending)
        want = _union(committed, base)
        assert {f: t.tolist() for f, t in got.items()} == want, publish
        assert all(t.dtype == torch.int64 for t in got.values())
        base += 6
    # the bitmaps came back clean: a publish with nothing committed since gets nothing
    assert unread.unread(unread.take("a", base), []) == {}


def test_a_dropped_unread_set_answers_nothing_and_others_go_on():
    unread = UnreadIds({"t": SMALL})
    unread.take("a", 0)
    unread.take("b", 0)
    unread.add([AppendRecord(0, "t", torch.tensor([3, 1, 3], dtype=torch.int32))])
    unread.drop("a")
    assert unread.take("a", 1) is None
    got = unread.unread(unread.take("b", 1))
    assert got["t"].tolist() == [1, 3] and got["t"].dtype == torch.int32
