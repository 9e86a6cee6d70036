"""A job started afresh (``fresh=True``: the same job name and stream key, the log emptied in
place) never takes the previous run's data back: a client of the server that re-publishes the
old run's genuine (authenticated) part and marker, or puts its base back, is refused, because
every shipped range, table metadata and base carries the identity of the log it came from and
a reader never moves back to an older one."""

from __future__ import annotations

import os
import time
from typing import Dict, List, Tuple

import pytest
import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta import DeltaReader, errors
from persistent_delta.fleet import subjects
from persistent_delta.fleet.nats import Connection
from persistent_delta.fleet.remote import RemoteConsumer
from persistent_delta.fleet.subjects import offsets_key
from persistent_delta.fleet.ship import Shipper, upload_base
from persistent_delta.fleet.wire import Message
from persistent_delta.log import codec
from persistent_delta.log.deltalog import DeltaLog
from persistent_delta.log.schema import META_CURR_BATCH, META_LOG_ID, META_TRACKER, TrackerMeta
from persistent_delta.trainer.restore import open_tracker_log
from logs import fill_store

DIM = 4
OLD = 1000.0  # the old run's row values are OLD + batch; the new run's are the batch


def _records(offset: float):
    def records(b: int):
        n = 5 + b % 3
        ids = (torch.arange(n) * 7 + b) % 60
        return [("t", ids, torch.full((n, DIM), offset + b))]
    return records


def _write(root: str, start: int, batches: int, offset: float) -> None:
    path = os.path.join(root, "rank-0")
    fill_store(path, _records(offset), batches=batches, mode=UpdateMode.LAST, start=start)
    with DeltaLog(path) as log:  # a tracker's log: complete below the batch being recorded
        log.write(lambda w: w.set_meta(META_CURR_BATCH, start + batches) if w.meta(META_TRACKER) else None)


def _ship(root: str, url: str, job: str) -> None:
    with Shipper(root, url, job, channels=["lookups"], max_batches=10) as s:
        s.run(idle_exit_s=0.3)


def _log_id(root: str) -> str:
    with DeltaLog(os.path.join(root, "rank-0"), readonly=True, writer_lock=False) as log:
        return str(log.read(lambda r: r.meta(META_LOG_ID)))


def _start_afresh(root: str) -> None:
    """What ``PersistentTrackerConfig(fresh=True)`` does to a rank's log when the job starts again."""
    want = TrackerMeta("embedding", UpdateMode.LAST.value, ["t"], rank=0, world_size=1)
    with DeltaLog(os.path.join(root, "rank-0")) as log:
        log.write(lambda w: open_tracker_log(w, want, {}, [], fresh=True))


def _range_messages(conn: Connection, job: str, rng: str) -> List[Message]:
    """The genuine messages (parts and marker) of range ``rng`` of rank 0 now on the stream."""
    msgs, _ = conn.get_batch(job, subjects.rank_filter(job, "lookups", 0), 1, 1000, 1 << 24)
    return [Message(m.subject, m.data, {k: v for k, v in m.headers.items() if k.startswith("PD-")}, "")
            for m in msgs if m.headers.get("PD-Range") == rng]


def _replay(conn: Connection, msgs: List[Message], tag: str) -> None:
    """Publish ``msgs`` again under new message ids (what any client of the server can do)."""
    again = [Message(m.subject, m.payload, dict(m.headers), f"{tag}-{i}") for i, m in enumerate(msgs)]
    assert conn.send_all(again) == []


def _delete_stream(conn: Connection, job: str) -> None:
    async def delete() -> None:
        await conn.js.delete_stream(subjects.stream_name(job))

    conn.call("delete the stream", delete)


def _old_run_then_fresh(root: str, url: str, job: str, recreate: bool = True) -> List[Message]:
    """The old run ships [0, 30); the job starts afresh (the stream deleted and created again
    with ``recreate``, else kept); the new run ships [0, 20). Returns the old run's genuine
    messages of [20, 30), as a client of the server captured them."""
    _write(root, 0, 30, OLD)
    _ship(root, url, job)
    conn = Connection(url)
    try:
        old = _range_messages(conn, job, "20-30")
        assert len(old) == 2  # one part, its marker
        _start_afresh(root)
        if recreate:
            _delete_stream(conn, job)
    finally:
        conn.close()
    _write(root, 0, 20, 0.0)
    _ship(root, url, job)
    return old


def _read_to_end(c: RemoteConsumer, timeout: float = 15.0) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Poll until the position reaches ``end_offsets()`` (bounded); returns the (ids, states)
    read, in order."""
    rows = []
    deadline = time.monotonic() + timeout
    while c.position() != c.end_offsets() and time.monotonic() < deadline:
        got = c.poll(timeout=0.5)
        rows += [(t.ids, t.states) for d in got.ranks.values() for t in d.tables.values() if t.ids.numel()]
    return rows


def _latest(rows: List[Tuple[torch.Tensor, torch.Tensor]]) -> Dict[int, float]:
    """id -> its latest value (the rows in order, the LAST rule)."""
    out: Dict[int, float] = {}
    for ids, states in rows:
        out.update(zip(ids.tolist(), states[:, 0].tolist()))
    return out


def _local_latest(root: str, end: int) -> Dict[int, float]:
    """What a local reader of the new run reads over [0, end)."""
    with DeltaReader(root, start=0) as r:
        got = r.poll(max_batches=end)
        assert got.ranges == {0: (0, end)}
        return _latest([(t.ids, t.states) for d in got.ranks.values() for t in d.tables.values()])


def test_a_fresh_start_gives_the_log_a_new_identity(tmp_path, nats_server):
    """``fresh=True`` empties the log and gives it a new log id and a later creation stamp; what
    the shipper stores for the new run (table metadata, markers) carries the new identity."""
    root, job = str(tmp_path / "log"), "fresh-id"
    _write(root, 0, 5, OLD)
    with DeltaLog(os.path.join(root, "rank-0"), readonly=True, writer_lock=False) as log:
        before = log.read(lambda r: r.identity())
    _start_afresh(root)
    with DeltaLog(os.path.join(root, "rank-0"), readonly=True, writer_lock=False) as log:
        after = log.read(lambda r: r.identity())
    assert _log_id(root) == after.log_id != before.log_id
    assert before.older_than(after) and not after.older_than(before)
    _write(root, 0, 5, 0.0)
    _ship(root, nats_server.url, job)
    with RemoteConsumer(nats_server.url, job, "replica", reset="earliest", wait=10) as c:
        _read_to_end(c)
        assert c.position() == {0: 5}
        c.commit()
    conn = Connection(nats_server.url)
    try:
        stored = codec.unpack(conn.kv_get(job, subjects.OFFSETS, offsets_key("replica", "lookups")).value)
        assert (stored["ranks"]["0"]["log_id"], stored["ranks"]["0"]["log_stamp"]) == (after.log_id, after.stamp)
    finally:
        conn.close()


def test_the_old_runs_replayed_range_is_refused_and_the_new_one_applied(tmp_path, nats_server):
    """After a fresh start, a client re-publishes the old run's genuine part and marker of
    [20, 30) while a consumer sits at batch 20 of the new run: the consumer rejects them
    (``rejected`` lists them) and then applies the new run's own [20, 30)."""
    root, job = str(tmp_path / "log"), "fresh-replay"
    old = _old_run_then_fresh(root, nats_server.url, job)
    with RemoteConsumer(nats_server.url, job, "replica", reset="earliest", wait=10) as c:
        rows = _read_to_end(c)
        assert c.position() == {0: 20}
        conn = Connection(nats_server.url)
        try:
            _replay(conn, old, "replay")
        finally:
            conn.close()
        got = c.poll(timeout=1.0)
        assert got.empty and c.position() == {0: 20}, got.ranges
        refused = [e for e in c.rejected if isinstance(e, errors.OlderLogError)]
        assert refused and "20, 30" in str(refused[0]), list(c.rejected)
        _write(root, 20, 10, 0.0)
        _ship(root, nats_server.url, job)
        rows += _read_to_end(c)
        assert c.position() == {0: 30}
        assert max(v for _, s in rows for v in s.reshape(-1).tolist()) < OLD  # no row of the old run
        assert _latest(rows) == _local_latest(root, 30)


@pytest.mark.parametrize("recreate", [True, False], ids=["stream-recreated", "stream-kept"])
def test_a_consumer_created_later_reads_only_the_new_run(tmp_path, nats_server, recreate):
    """The stream holds the new run's ranges and the old run's replayed [20, 30) between them
    (and, when kept across the restart, the whole old run before them): a consumer created
    afterwards reads only the new run's rows, and reaches ``end_offsets()``."""
    root, job = str(tmp_path / "log"), f"fresh-late-{int(recreate)}"
    old = _old_run_then_fresh(root, nats_server.url, job, recreate)
    conn = Connection(nats_server.url)
    try:
        _replay(conn, old, "replay")
    finally:
        conn.close()
    _write(root, 20, 10, 0.0)
    _ship(root, nats_server.url, job)
    with RemoteConsumer(nats_server.url, job, "late", reset="earliest", wait=10) as c:
        rows = _read_to_end(c)
        assert c.end_offsets() == {0: 30} and c.position() == {0: 30}
        assert max(v for _, s in rows for v in s.reshape(-1).tolist()) < OLD  # no row of the old run
        assert _latest(rows) == _local_latest(root, 30)
        assert any(isinstance(e, errors.OlderLogError) for e in c.rejected), list(c.rejected)
    with RemoteConsumer(nats_server.url, job, "at-end", reset="latest", wait=10) as c:
        assert c.position() == {0: 30}


def test_the_old_runs_base_put_back_is_not_returned_by_bootstrap(tmp_path, nats_server):
    """The old run's base, put back in the job's object store after the new run uploaded its
    own, is refused by ``bootstrap()`` (never returned); the new run's base is."""
    root, job = str(tmp_path / "log"), "fresh-base"
    url = nats_server.url
    _write(root, 0, 30, OLD)
    _ship(root, url, job)
    upload_base(url, job, 0, 29, {"t": torch.full((60, DIM), OLD)})
    conn = Connection(url)
    try:
        old_base = conn.object_get(job, subjects.base_name(0))
        assert old_base is not None
        _start_afresh(root)
        _write(root, 0, 20, 0.0)
        _ship(root, url, job)
        upload_base(url, job, 0, 19, {"t": torch.zeros(60, DIM)})
        conn.object_put(job, subjects.base_name(0), old_base)  # put back by a client of the server
        with RemoteConsumer(url, job, "replica", reset="earliest", wait=10) as c:
            with pytest.raises(errors.OlderLogError, match="older than the rank's"):
                c.bootstrap()
            upload_base(url, job, 0, 19, {"t": torch.zeros(60, DIM)})
            tables = c.bootstrap()
            assert float(tables["t"].abs().max()) == 0.0 and c.position() == {0: 20}
    finally:
        conn.close()


def test_a_position_committed_on_the_old_run_is_not_continued_silently(tmp_path, nats_server):
    """A consumer committed batch 30 of the old run; the job starts afresh and the new run ships
    [0, 40) before the consumer comes back (so no range reads as a restart by its batch
    numbers): without a reset policy its poll raises OffsetOutOfRangeError naming the start
    afresh (it never skips the new run's [0, 30) as re-sends); with ``reset="earliest"`` it
    reads the new run from its first batch."""
    root, job, url = str(tmp_path / "log"), "fresh-pos", nats_server.url
    _write(root, 0, 30, OLD)
    _ship(root, url, job)
    with RemoteConsumer(url, job, "replica", reset="earliest", wait=10) as c:
        _read_to_end(c)
        assert c.position() == {0: 30}
        c.commit()
    _start_afresh(root)
    _write(root, 0, 40, 0.0)
    _ship(root, url, job)
    with RemoteConsumer(url, job, "replica", wait=10) as c:
        with pytest.raises(errors.OffsetOutOfRangeError, match="started afresh"):
            c.poll(timeout=1.0)
        assert c.committed() == {0: 30}  # nothing stored moved
    with RemoteConsumer(url, job, "replica", reset="earliest", wait=10) as c:
        rows = _read_to_end(c)
        assert c.position() == {0: 40}
        assert max(v for _, s in rows for v in s.reshape(-1).tolist()) < OLD
        assert _latest(rows) == _local_latest(root, 40)
        c.commit()
    with RemoteConsumer(url, job, "replica", wait=10) as c:
        assert c.position() == {0: 40} and c.poll(timeout=0.5).empty
