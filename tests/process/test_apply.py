"""A replica fed by ``publish()`` through ``apply_poll``: the one definition of "applied".

Real 2-rank sharded models write the log; the replica is this process, with a
``DeltaConsumer`` on the snapshots channel. Checked: bit-exact tables of the last
``publish()`` call (not of later training), row-wise shards with a replicated table and
column halves, publish times, complete publishes, ``max_bytes`` catch-up, and the refusals.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
import torch

from harness import global_table_weights, run_spawn
from persistent_delta import DeltaConsumer, apply_poll
from persistent_delta.errors import IncompletePollError, InvalidInputError
from tracker_cases import publish_apply_case

pytestmark = pytest.mark.dist

NUM_TABLES, ROWS, DIM = 2, 100, 8


def _expected(results: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    """The trainer's whole tables at the last publish, assembled from the ranks' shards."""
    out: Dict[str, torch.Tensor] = {}
    for res in results:
        for fqn, (w, info) in res["shards"].items():
            table = out.setdefault(fqn, torch.full((info["global_rows"], info["global_cols"]), float("nan")))
            r0, c0 = info["row_offset"], info["col_offset"]
            table[r0:r0 + w.shape[0], c0:c0 + w.shape[1]] = w
    for fqn, table in out.items():
        assert not table.isnan().any(), f"{fqn}: the shards do not cover the table"
    return out


def _initial(full: Dict[str, torch.Tensor], fqn: str) -> torch.Tensor:
    """The initial weight of table ``fqn`` (``global_table_weights`` keys by table name)."""
    return full[fqn.rsplit(".", 1)[-1]]


@pytest.fixture(scope="module", params=[("row_wise", (1,)), ("column_wise", ())], ids=["row_wise+dp", "column_wise"])
def job(request, tmp_path_factory) -> Tuple[str, List[Dict[str, Any]]]:
    sharding, dp = request.param
    root = str(tmp_path_factory.mktemp(f"apply-{sharding}"))
    return root, run_spawn(publish_apply_case, 2, root, sharding, dp)


def _replica(results: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
    full = global_table_weights(NUM_TABLES, ROWS, DIM, seed=0)
    return {fqn: _initial(full, fqn).clone() for fqn in results[0]["shards"]}


def test_a_replica_holds_the_tables_of_the_last_publish_call(job):
    root, results = job
    want = _expected(results)
    # training went on after the last publish (else "values of the call" proves nothing)
    assert any(changed for res in results for changed in res["changed_after"].values())
    replica = _replica(results)
    with DeltaConsumer(root, "replica", channel="snapshots") as consumer:
        poll = consumer.poll()
        assert poll.complete and poll.world_size == 2
        applied = apply_poll(replica, poll, complete_only=True)
        consumer.commit()
    assert applied.rows > 0 and applied.ranges == poll.ranges
    for fqn in want:
        assert torch.equal(replica[fqn], want[fqn]), fqn
    # each publish carries the time of its publish() call (the earliest over ranks)
    stamps = sorted(results[0]["windows"])
    assert sorted(applied.publishes) == stamps
    for stamp, t in applied.publishes.items():
        lo = min(res["windows"][stamp][0] for res in results)
        hi = max(res["windows"][stamp][1] for res in results)
        assert lo <= t <= hi, (stamp, t, lo, hi)
    assert applied.lag_s() is not None and applied.lag_s() >= 0


def test_every_stored_publish_holds_the_values_of_its_own_call(job):
    """Read each rank's log record by record: a publish's rows carry the shard's values at that
    publish() call, even though the next publish reuses its record buffers before it is read."""
    from persistent_delta.log.layout import rank_dir
    from persistent_delta.log.deltalog import DeltaLog
    from persistent_delta.log.schema import SNAPSHOTS

    root, results = job
    for rank, res in enumerate(results):
        checked = set()
        log = DeltaLog(rank_dir(root, rank), readonly=True)
        try:
            def look(r):
                for fqn, entry in r.tables().items():
                    for rec in r.iter_records(entry.table_id, channel=SNAPSHOTS):
                        want = res["at_publish"][rec.batch_idx][fqn][rec.ids.long()]
                        assert torch.equal(rec.states, want), (rank, fqn, rec.batch_idx)
                        checked.add(rec.batch_idx)
            log.read(look)
        finally:
            log.close()
        # every publish is there (each one changed rows), and the values moved between them
        assert checked == set(res["at_publish"]), (rank, checked)
        stamps = sorted(res["at_publish"])
        assert any(not torch.equal(res["at_publish"][a][f], res["at_publish"][b][f])
                   for a, b in zip(stamps, stamps[1:]) for f in res["at_publish"][a])


def test_max_bytes_catches_up_in_whole_publishes(job):
    root, results = job
    want = _expected(results)
    with DeltaConsumer(root, "whole", channel="snapshots") as consumer:
        everything = consumer.poll()
    one_publish = everything.nbytes // len(results[0]["windows"])
    replica = _replica(results)
    ranges: List[Dict[int, Tuple[int, int]]] = []
    with DeltaConsumer(root, "catchup", channel="snapshots") as consumer:
        while True:
            poll = consumer.poll(max_bytes=one_publish)
            if poll.empty:
                break
            assert poll.complete  # the cut is common to all ranks: never half a publish
            assert len(poll.publishes) >= 1
            apply_poll(replica, poll, complete_only=True)
            consumer.commit()
            ranges.append(poll.ranges)
    assert len(ranges) > 1, "max_bytes did not split the catch-up"
    for prev, nxt in zip(ranges, ranges[1:]):
        assert all(prev[r][1] == nxt[r][0] for r in prev), (prev, nxt)  # contiguous, nothing skipped
    for fqn in want:
        assert torch.equal(replica[fqn], want[fqn]), fqn


def test_refusals_apply_nothing(job):
    root, results = job
    replica = _replica(results)
    before = {k: v.clone() for k, v in replica.items()}
    with DeltaConsumer(root, "refused", channel="snapshots") as consumer:
        # the ranks' positions moved apart, and a bounded poll ends at different batches: rank 0's
        # part of the last publish it read is in the poll, rank 1's is not
        stamps = sorted(results[0]["windows"])
        consumer.seek(stamps[1], rank=1)
        poll = consumer.poll(max_batches=stamps[1] - stamps[0])
        assert poll.ranges[0][1] != poll.ranges[1][1] and not poll.complete
        with pytest.raises(IncompletePollError):
            apply_poll(replica, poll, complete_only=True)
        wrong_dtype = {k: v.double() for k, v in replica.items()}
        with pytest.raises(InvalidInputError, match="float64"):
            apply_poll(wrong_dtype, poll)
        missing = dict(replica)
        missing.pop(sorted(missing)[-1])
        with pytest.raises(InvalidInputError, match="has no table"):
            apply_poll(missing, poll)
        small = {k: v[: ROWS // 4].clone() for k, v in replica.items()}
        with pytest.raises(InvalidInputError, match="rows"):
            apply_poll(small, poll)
    for k in replica:
        assert torch.equal(replica[k], before[k]), k
    with DeltaConsumer(root, "lookups-reader") as consumer:
        with pytest.raises(InvalidInputError, match="snapshots"):
            apply_poll(replica, consumer.poll())


def test_offsets_shows_the_lag_in_seconds_of_the_oldest_unread_publish(job):
    import time

    from persistent_delta.cli.offsets import describe, register_consumer

    root, results = job
    register_consumer(root, "late", channel="snapshots", execute=True)  # at the earliest publish
    with DeltaConsumer(root, "caught-up", channel="snapshots") as consumer:
        consumer.poll()
        consumer.commit()
    before = time.time()
    rows = {(r.rank, c.name): c for r in describe(root) for c in r.consumers}
    after = time.time()
    oldest = min(min(res["windows"][s][0] for s in res["windows"]) for res in results)
    newest = max(max(res["windows"][s][1] for s in res["windows"]) for res in results)
    for rank in range(2):
        late, done = rows[(rank, "late")], rows[(rank, "caught-up")]
        assert late.lag_s is not None and before - newest <= late.lag_s <= after - oldest + 1e-3, late
        assert done.lag_s == 0.0
        assert rows[(rank, "serving")].lag_s is None  # a lookups consumer: no publish times
