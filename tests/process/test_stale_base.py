"""A replica's base and its consumer's position are checked against each other: a snapshots
poll applied onto a base must start at or before the base's position on every rank
(``persistent_delta.read.base``), else ``StaleBaseError`` and nothing is applied.

One real two-rank job (row-wise TorchRec model, ``delete_on_read``) runs the serving guide's
loop: shard files saved before training, a replica registered before the first publish that
applies and commits every publish but the last, and shard files saved right after the last
publish. This process then plays the replicas that start afterwards."""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Tuple

import pytest

from harness import run_spawn
from inference_cases import quantized
from persistent_delta import DeltaConsumer, apply_poll, load_base
from persistent_delta.errors import OrderError, StaleBaseError
from persistent_delta.fleet.memory import MemoryBroker
from persistent_delta.fleet.remote import RemoteConsumer
from persistent_delta.fleet.ship import Shipper, upload_base
from persistent_delta.serve.inference import InferenceReplica
from stale_base_cases import fresh_start_case, full, retention_mid_poll_case, serving_job_case, tables_diff

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Tuple[str, str, str, List[Dict[str, Any]]]:
    d = tmp_path_factory.mktemp("stale-base")
    root, base0, fresh = str(d / "log"), str(d / "base0"), str(d / "fresh")
    return root, base0, fresh, run_spawn(serving_job_case, 2, root, base0, fresh, timeout=240)


@pytest.fixture(scope="module")
def restarted(tmp_path_factory) -> Tuple[str, str, str, List[Dict[str, Any]]]:
    d = tmp_path_factory.mktemp("fresh-start")
    root, old, new = str(d / "log"), str(d / "old-base"), str(d / "new-base")
    return root, old, new, run_spawn(fresh_start_case, 2, root, old, new, timeout=240)



def test_a_restarted_replica_with_its_old_base_is_refused_at_its_first_apply(job):
    """The replica restarts as the guide's loop would: it loads the shard files of batch 0 again
    and continues at its committed position, past the publishes its base lacks."""
    root, base0, _, ranks = job
    base = load_base(base0)
    assert base.batches == {0: 0, 1: 0} and base.positions == {0: 1, 1: 1}
    untouched = {k: v.clone() for k, v in base.items()}
    with DeltaConsumer(root, "serving.snapshots", channel="snapshots") as consumer:
        assert consumer.committed() == {0: 7, 1: 7}
        poll = consumer.poll()
    assert poll.ranges == {0: (7, 9), 1: (7, 9)} and poll.num_rows > 0
    with pytest.raises(StaleBaseError, match="starts at batch 7.*continues from batch 1.*save_local_shards") as err:
        apply_poll(base, poll, complete_only=True)
    assert isinstance(err.value, OrderError) and (err.value.rank, err.value.start, err.value.position) == (0, 7, 1)
    assert not (d := tables_diff(base, untouched)), d  # nothing applied, nothing moved
    assert base.positions == {0: 1, 1: 1}
    # what it refused: applied anyway (a plain dict is not checked), the tables are stale
    stale = dict(base)
    apply_poll(stale, poll, complete_only=True)
    assert tables_diff(stale, full(ranks, "final_shards"))
    # a TorchRec inference model built on that base refuses it the same way
    replica = InferenceReplica(quantized("ec", base, "int8"), base=base)
    before = replica.all_weights()
    with pytest.raises(StaleBaseError):
        apply_poll(replica, poll, complete_only=True)
    assert not (d := tables_diff(replica.all_weights(), before)), d


def test_a_late_replica_registered_after_delete_on_read_is_refused(job):
    """A replica added later registers at the earliest snapshot still stored: the publishes
    between its base and there were deleted once the first replica had read them."""
    root, base0, _, _ = job
    base = load_base(base0)
    with DeltaConsumer(root, "late", channel="snapshots") as consumer:
        assert consumer.position() == {0: 8, 1: 8}  # 2..6 deleted: the first replica committed 7
        poll = consumer.poll()
    with pytest.raises(StaleBaseError, match="rank 0: this snapshots poll starts at batch 8"):
        apply_poll(base, poll)
    replica = InferenceReplica(quantized("ec", base, "int8"), base=base)
    with pytest.raises(StaleBaseError):
        apply_poll(replica, poll)


def test_the_documented_path_stays_quiet_and_bit_exact(job):
    """The guide's loop applied every publish onto its base exactly; restarted, a replica that
    loads shard files saved at or after its committed position (here right after a publish:
    the next publish takes the next stamp) continues quietly, twice over, to the trainer's
    tables bit for bit."""
    root, _, fresh, ranks = job
    first = ranks[0]
    assert first["base_positions"] == {0: 1, 1: 1}
    assert first["ranges"] == [{0: (0, 3), 1: (0, 3)}, {0: (3, 5), 1: (3, 5)}, {0: (5, 7), 1: (5, 7)}]
    assert first["replica_positions"] == {0: 7, 1: 7}  # moved to each applied poll's end
    assert not (d := tables_diff(first["replica"], full(ranks, "applied_shards"))), d
    assert (first["curr_batch_idx"], first["next_stamp"]) == (8, 9)
    want = full(ranks, "final_shards")
    for _ in range(2):  # the second restart sits right at the base's position
        base = load_base(fresh)
        assert base.batches == {0: 8, 1: 8} and base.positions == {0: 9, 1: 9}
        replica = InferenceReplica(quantized("ec", base, "int8"), base=base)
        with DeltaConsumer(root, "serving.snapshots", channel="snapshots") as consumer:
            poll = consumer.poll()
            apply_poll(base, poll, complete_only=True)
            apply_poll(replica, poll, complete_only=True)
            consumer.commit()
        assert not (d := tables_diff(base, want)), d
        assert base.positions == {0: 9, 1: 9}
    # a consumer moved ahead over batches where nothing was published skips nothing: still quiet
    with DeltaConsumer(root, "serving.snapshots", channel="snapshots") as consumer:
        consumer.seek(10)
        apply_poll(base, consumer.poll(), complete_only=True)
    assert base.positions == {0: 10, 1: 10}


def test_remote_replicas_are_checked_the_same_way(job):
    """Across hosts (the log shipped through the in-process memory transport): a remote replica
    registered late, on the shard files of batch 0, is refused; one that bootstraps from a base
    uploaded at an earlier publish catches up quietly, bit for bit, and is refused once moved
    past a publish its base lacks."""
    root, base0, _, ranks = job
    broker = MemoryBroker()
    with Shipper(root, None, "stale", channels=["snapshots"], transport=broker.connect("shipper")) as shipper:
        shipper.run(idle_exit_s=0.2)
    with RemoteConsumer(None, "stale", "late-remote", channel="snapshots", wait=5,
                        transport=broker.connect()) as consumer:
        poll = consumer.poll(timeout=5)
        assert poll.ranges == {0: (8, 9), 1: (8, 9)}  # the stream holds what the log still held
        with pytest.raises(StaleBaseError, match="rank 0: this snapshots poll starts at batch 8"):
            apply_poll(load_base(base0), poll)
    conn = broker.connect()
    for rank, res in enumerate(ranks):  # the ranks' tables as of batch 7 (publish 8 holds what changed since 6)
        upload_base(None, "stale", rank, 7, res["applied_shards"], transport=conn)
    conn.close()
    with RemoteConsumer(None, "stale", "booted", channel="snapshots", transport=broker.connect()) as consumer:
        tables = consumer.bootstrap()
        assert tables.batches == {0: 7, 1: 7} and tables.positions == {0: 8, 1: 8}
        apply_poll(tables, consumer.poll(timeout=1), complete_only=True)
        assert not (d := tables_diff(tables, full(ranks, "final_shards"))), d
        assert tables.positions == {0: 9, 1: 9}
        tables = consumer.bootstrap()
        consumer.seek(9)  # past publish 8, which the base lacks
        with pytest.raises(StaleBaseError, match=r"continues from batch 8: the publishes stamped in \[8, 9\)"):
            apply_poll(tables, consumer.poll(timeout=1))


def test_a_base_of_the_log_before_a_start_afresh_is_refused(restarted):
    """A job started afresh (``fresh=True``) writes a new log at the same path, its batches from
    0 again: the previous run's shard files would pass the position check (their position is
    past the new log's start), so the log identity they record is checked against the log each
    rank's poll was read from. The new run's base, saved before training, applies quietly."""
    root, old, new, ranks = restarted
    stale = load_base(old)
    assert set(stale.logs) == {0, 1} and stale.positions == {0: 5, 1: 5}
    untouched = {k: v.clone() for k, v in stale.items()}
    with DeltaConsumer(root, "serving.snapshots", channel="snapshots") as consumer:
        poll = consumer.poll()
    assert poll.ranges == {0: (2, 5), 1: (2, 5)} and poll.num_rows > 0  # at or before the old base's position
    assert all(d.log is not None and stale.logs[r].older_than(d.log) for r, d in poll.ranks.items())
    with pytest.raises(StaleBaseError, match=r"rank 0: this snapshots poll was read from log .* was taken from an "
                       r"older log.*start afresh.*save_local_shards.*load_base") as err:
        apply_poll(stale, poll, complete_only=True)
    assert isinstance(err.value, OrderError) and err.value.rank == 0
    assert not (d := tables_diff(stale, untouched)), d  # nothing applied, nothing moved
    assert stale.positions == {0: 5, 1: 5}
    replica = InferenceReplica(quantized("ec", stale, "int8"), base=stale)
    before = replica.all_weights()
    with pytest.raises(StaleBaseError, match="older log"):
        apply_poll(replica, poll, complete_only=True)
    assert not (d := tables_diff(replica.all_weights(), before)), d
    # the documented path: the new run's base, with the consumer the new log registered
    base = load_base(new)
    assert base.logs == {r: poll.ranks[r].log for r in (0, 1)} and base.positions == {0: 1, 1: 1}
    replica = InferenceReplica(quantized("ec", base, "int8"), base=base)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_poll(base, poll, complete_only=True)
        apply_poll(replica, poll, complete_only=True)
    assert not (d := tables_diff(base, full(ranks, "final_shards"))), d


def test_a_poll_that_retention_passes_mid_read_is_refused_not_applied_short(tmp_path):
    """A replica restarted at its base, behind its consumer's committed position: the trainer's
    next publish deletes the snapshots below that position after the poll checked its bounds
    and before it read the records. The poll raises ``OffsetOutOfRangeError`` (what
    ``serve.Follower`` recovers from with a newer base), rather than return the publish after
    the deleted ones as read from the base's position, which the base's check passes and
    leaves the deleted publishes' rows stale."""
    root, base_dir = str(tmp_path / "log"), str(tmp_path / "base")
    (out,) = run_spawn(retention_mid_poll_case, 1, root, base_dir, timeout=120)
    assert out["committed"] == {0: 5} and out["base_positions"] == {0: 2}, out
    assert "applied" not in out, (out["applied"], "applied onto the base with publishes 2-4 missing")
    assert "at batch 2, below the log start 5" in out["refused"], out["refused"]
