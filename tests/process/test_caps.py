"""What a publish carries.

Caps (``tracker.publish(consumer, max_rows=..., max_bytes=...)``): what does not fit is deferred
to the next publish, durably, never lost nor carried with an older value; the poll and
``tracker.stats()`` say how many rows are still deferred; a float replica fed by the publishes
equals the trainer's tables once none is deferred.

Evictions: a publish carries every slot a managed-collision eviction re-initialised since the
last publish (its new values) and the slot reassignments (its raw-id changes), so a replica that
reads only the snapshots channel holds the trainer's rows and (raw id -> slot) map after every
publish, and the evicted raw ids come as tombstones."""

import os
import signal

import pytest
import torch

from caps_cases import ROW_BYTES, publish_cases, restart_after_kill_case
from harness import run_spawn
from procs import REPO, SUPPORT, run_python


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("publish"))
    (r,) = run_spawn(publish_cases, 1, root)
    r["root"] = root
    return r


@pytest.fixture
def capped(published):
    return published["caps"]


def test_a_snapshot_replica_follows_evictions_after_every_publish(published):
    r = published["evictions"]
    assert r["evicted"] > 0, r  # the model evicted: the case is not vacuous
    assert r["rows_differ"] == [0] * len(r["rows_differ"]), r
    assert r["map_differs"] == [0] * len(r["map_differs"]), r
    assert r["tombstones_held"] == 0, r  # an evicted raw id holds no slot after its publish
    # an int8 TorchRec inference replica of the MC model, fed by the same polls, holds TorchRec's
    # quantization of the trainer's tables after every publish
    assert r["int8_rows_differ"] == [0] * len(r["int8_rows_differ"]), r


def test_a_quantized_mc_models_forward_follows_the_trainers_after_every_publish(published):
    """The int8 replica's managed-collision modules get the publishes' slot reassignments with
    the rows: its forward on every raw id of the hash space (admitted, evicted, never seen)
    equals TorchRec's quantization of the trainer's model (tables and MCH buffers) after every
    publish."""
    r = published["evictions"]
    assert r["evicted"] > 0 and r["served_admitted"] > 0, r
    assert r["forward_differs"] == [0] * len(r["forward_differs"]), r


def test_the_publishes_slot_reassignments_travel_through_the_stream(published):
    """The snapshots channel shipped (in-process transport): a remote poll's rows and ``zch()``
    equal a local reader's over the same publishes."""
    from persistent_delta.fleet.memory import MemoryBroker
    from persistent_delta.fleet.remote import RemoteConsumer
    from persistent_delta.fleet.ship import Shipper
    from persistent_delta.read.consumer import DeltaReader

    root, broker = os.path.join(published["root"], "mc"), MemoryBroker()
    with Shipper(root, None, "job-mc", channels=["snapshots"], max_batches=3, transport=broker.connect()) as s:
        s.run(idle_exit_s=0.2)
    with RemoteConsumer(None, "job-mc", "remote", channel="snapshots", transport=broker.connect()) as remote, \
            DeltaReader(root, channel="snapshots") as local:
        got, want = remote.poll(), local.poll()
        assert got.ranges == want.ranges
        gz, wz = got.zch(), want.zch()
        assert set(gz) == set(wz) and wz and all(z.slots.numel() for z in wz.values())
        for fqn, z in wz.items():
            for f in ("slots", "taken", "given", "evicted_raw_ids"):
                assert torch.equal(getattr(gz[fqn], f), getattr(z, f)), (fqn, f)
        for fqn, m in want.merged().items():
            assert torch.equal(got.merged()[fqn].states, m.states), fqn


def test_caps_bound_every_publish_and_the_replica_converges(capped):
    pubs = capped["publishes"]
    for p in pubs:
        if p["caps"].get("max_rows"):
            assert p["carried"] <= p["caps"]["max_rows"], p
        if p["caps"].get("max_bytes"):
            assert p["carried"] * ROW_BYTES <= p["caps"]["max_bytes"], p
    assert any(p["pending"] > 0 for p in pubs)  # the caps did defer rows
    assert capped["equal_after_rows_cap"] == capped["equal_after_bytes_cap"] == capped["equal_after_uncapped"] == {}


def test_pending_counts_agree_and_every_row_carries_its_newest_value(capped):
    for p in capped["publishes"]:
        stored = sum(len(ids) for ids in p["deferred"].values())
        assert p["pending"] == p["poll_pending"] == stored, p
        assert p["stale"] == 0, p  # no row carried with a value older than its publish's call
    # the case covers a row deferred and changed again before a publish carried it
    assert capped["deferred_then_changed"] > 0
    assert capped["publishes"][-1]["pending"] == 0


def test_deferred_rows_outlive_their_deleted_lookups_records(capped):
    # delete_on_read: the lookups behind the consumer's position are gone while rows are deferred
    waiting = [p for p in capped["publishes"] if p["pending"] and p["log_start"] >= p["offset"]]
    assert waiting, [(p["pending"], p["log_start"], p["offset"]) for p in capped["publishes"]]


def test_bad_caps_are_refused_with_a_typed_error(capped):
    refused = capped["refused"]
    assert "published" not in refused, refused
    assert all("max_rows" in m for m in refused[:5]), refused
    assert "max_bytes" in refused[5] and "smaller than one row" in refused[6], refused
    assert "order" in refused[7], refused


@pytest.mark.slow
def test_deferred_rows_survive_a_sigkill_after_the_publish(tmp_path):
    root = str(tmp_path / "log")
    proc = run_python(f"import sys; sys.path.insert(0, {SUPPORT!r}); import caps_cases; "
                      f"caps_cases.killed_after_capped_publish({root!r})", check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pending = int(proc.stdout.split("PENDING")[1].split()[0])
    assert pending > 0
    (r,) = run_spawn(restart_after_kill_case, 1, root)
    assert r["pending_before"] == r["poll_pending_before"] == pending
    assert r["killed_rows"] == 3
    assert sum(len(v) for v in r["deferred"].values()) == pending
    assert {f: sorted(v) for f, v in r["rows"].items()} == {f: sorted(v) for f, v in r["deferred"].items()}
    assert r["values_ok"] and r["poll_pending_after"] == 0 and r["stats_after"] == 0
