"""A remote consumer's health: each commit stores a bounded history of (time, position, stream end
seen) with the rank's position in the job's offsets bucket, and ``describe_remote`` judges it by
the local consumers' rule (:mod:`persistent_delta.ops.health`). Real logs shipped by a real
``Shipper`` through the in-process memory transport; a forged offsets entry reads as no history."""

from __future__ import annotations

import os
import time

import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta import LmdbDeltaStore
from persistent_delta.fleet import subjects
from persistent_delta.fleet.memory import MemoryBroker
from persistent_delta.fleet.positions import stored_history
from persistent_delta.fleet.remote import RemoteConsumer
from persistent_delta.fleet.subjects import offsets_key
from persistent_delta.fleet.ship import Shipper
from persistent_delta.log import codec
from persistent_delta.log.schema import COMMIT_HISTORY
from persistent_delta.ops.remote_positions import StreamEnds, describe_stream, remote_offsets, stream_ends_of

JOB = "job-health"
STALL = 0.2  # the health rule's least silence, small to keep the test fast


def _ends() -> StreamEnds:
    return stream_ends_of(None, False, "the test")  # the session's key (PERSISTENT_DELTA_STREAM_KEY_FILE)


def _write(root: str, batches: range) -> None:
    with LmdbDeltaStore(os.path.join(root, "rank-0"), updateMode=UpdateMode.LAST) as store:
        for b in batches:
            ids = torch.arange(b, b + 20)
            store.append(b, "t", ids, torch.randn(20, 4, generator=torch.Generator().manual_seed(b)))


def _ship(root: str, broker: MemoryBroker) -> None:
    with Shipper(root, None, JOB, channels=["lookups"], max_batches=3, transport=broker.connect("shipper")) as s:
        s.run(idle_exit_s=0.2)
        assert all(not st["last_error"] for st in s.stats()), s.stats()


def _row(broker: MemoryBroker, name: str):
    rows = [c for c in describe_stream(broker.connect("ops"), JOB, _ends(), STALL)["consumers"] if c.consumer == name]
    assert len(rows) == 1, rows
    return rows[0]


def test_a_remote_consumer_is_ok_while_it_catches_up_and_stalled_when_it_stops_as_the_stream_moves(tmp_path):
    root = str(tmp_path / "log")
    broker = MemoryBroker()
    _write(root, range(0, 10))
    _ship(root, broker)
    with RemoteConsumer(None, JOB, "replica", wait=5, transport=broker.connect("replica")) as c:
        for _ in range(2):
            c.poll(max_batches=3)
            c.commit()
    row = _row(broker, "replica")
    assert (row.offset, row.stream_end, row.lag, row.health) == (6, 10, 4, "ok")
    # behind and silent, but nothing arrived since its last commit (the end it had seen then is
    # the end now): still ok. Without the stored history this reads as stalled.
    time.sleep(STALL * 2)
    assert _row(broker, "replica").health == "ok"
    # the trainer goes on, the consumer does not: stalled
    _write(root, range(10, 13))
    _ship(root, broker)
    row = _row(broker, "replica")
    assert (row.stream_end, row.health) == (13, "stalled")
    # it comes back (its history is read back and goes on) and commits: ok again
    with RemoteConsumer(None, JOB, "replica", wait=5, transport=broker.connect("replica")) as c:
        c.poll(max_batches=3)
        c.commit()
    assert _row(broker, "replica").health == "ok"
    (stored,) = [d for d in remote_offsets(broker.connect("ops"), JOB) if d["name"] == "replica"]
    assert [p[1:] for p in stored["ranks"]["0"]["hist"]] == [[3, 10], [6, 10], [9, 13]]


def test_a_forged_history_reads_as_none_and_the_history_is_bounded(tmp_path):
    root = str(tmp_path / "log")
    broker = MemoryBroker()
    _write(root, range(0, 6))
    _ship(root, broker)
    conn = broker.connect("forger")
    forged = {"0": {"pos": 2, "seq": 1, "epoch": None, "hist": [[time.time(), 2, 6]] * 50_000}}
    garbage = ["not a list", {"a": 1}, [["t", 1, 2]], [[1.0, True, 2]], [[float("nan"), 1, 2]], [[1.0, -5, 2]],
               [[1.0, 1, 2, 3]], [None]]
    for i, h in enumerate(garbage):
        forged[str(i + 1)] = {"pos": 1, "seq": 1, "hist": h}
    forged["x"] = {"pos": 1}
    forged["9"] = "not a map"
    conn.kv_put(JOB, subjects.OFFSETS, offsets_key("forged", "lookups"),
                codec.pack({"name": "forged", "channel": "lookups", "ranks": forged, "time": time.time()}))
    # a commit time that is not one: the entry shows as malformed, its commit time unset
    conn.kv_put(JOB, subjects.OFFSETS, offsets_key("dated", "lookups"),
                codec.pack({"name": "dated", "channel": "lookups", "ranks": {"0": {"pos": 1, "seq": 1}},
                            "time": "yesterday"}))
    found = describe_stream(broker.connect("ops"), JOB, _ends(), STALL)["consumers"]
    rows = [c for c in found if c.consumer == "forged"]
    assert sorted(r.rank for r in rows) == list(range(0, 9))
    assert all(r.health in ("ok", "stalled") for r in rows)
    assert [(c.health, c.commit_time) for c in found if c.consumer == "dated"] == [("malformed", None)]
    assert len(stored_history(forged["0"])) == COMMIT_HISTORY
    assert all(stored_history(forged[str(i + 1)]) == () for i in range(len(garbage)))
    # a consumer taking that name over reads its rank-0 position, and its commit keeps a bounded history
    with RemoteConsumer(None, JOB, "forged", wait=5, transport=broker.connect("replica")) as c:
        assert c.committed() == {0: 2}
        c.poll()
        c.commit()
    (stored,) = [d for d in remote_offsets(broker.connect("ops"), JOB) if d["name"] == "forged"]
    assert len(stored["ranks"]["0"]["hist"]) == COMMIT_HISTORY
    assert stored["ranks"]["0"]["hist"][-1][1:] == [6, 6]
