"""The transport seam holds for an engine other than NATS: a ``Shipper`` ships real local logs
through the in-process ``MemoryTransport`` and a ``RemoteConsumer`` reads them back bit-exact,
with nothing of either changed (no server, no subprocess)."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta import DeltaReader, LmdbDeltaStore
from persistent_delta.errors import InvalidInputError, LogLockedError, TransportError
from persistent_delta.fleet import subjects
from persistent_delta.fleet.memory import MemoryBroker
from persistent_delta.fleet.remote import RemoteConsumer
from persistent_delta.fleet.ship import Shipper, upload_base
from persistent_delta.fleet.transport import StreamOptions, Transport
from persistent_delta.fleet.wire import HEADROOM, Message

JOB = "job-mem"
DIM = 16


def _write(root: str, rank: int, batches: range) -> None:
    with LmdbDeltaStore(os.path.join(root, f"rank-{rank}"), updateMode=UpdateMode.LAST) as store:
        for b in batches:
            n = 50 + 37 * (b % 4)
            ids = torch.randperm(1000, generator=torch.Generator().manual_seed(b * 7 + rank))[:n] * 2 + rank
            store.append(b, "t", ids, torch.randn(n, DIM, generator=torch.Generator().manual_seed(b)))


def _ship(root: str, broker: MemoryBroker) -> None:
    with Shipper(root, None, JOB, channels=["lookups"], max_batches=3, transport=broker.connect("shipper")) as s:
        s.run(idle_exit_s=0.2)
        assert all(not st["last_error"] for st in s.stats()), s.stats()


def _assert_same(got, want) -> None:
    assert got.ranges == want.ranges
    for rank, w in want.ranks.items():
        for fqn, wt in w.tables.items():
            gt = got.ranks[rank].tables[fqn]
            assert torch.equal(gt.ids, wt.ids), (rank, fqn)
            assert torch.equal(gt.states, wt.states), (rank, fqn)
            assert gt.states.dtype == wt.states.dtype


def test_a_shipper_and_a_remote_consumer_run_unchanged_over_the_memory_transport(tmp_path):
    """Two ranks shipped in chunks (a small max payload splits every table's record), a shipper
    restarted on a new connection (it resumes from its last marker, shipping nothing twice), and
    a remote consumer whose polls equal a local reader's over the same batches, bit for bit."""
    root = str(tmp_path / "log")
    broker = MemoryBroker(max_payload=HEADROOM + 2048)
    for rank in (0, 1):
        _write(root, rank, range(0, 7))
    _ship(root, broker)
    sent = broker.streams[f"PD_{JOB}"].next_seq
    _ship(root, broker)  # nothing new: a restarted shipper sends nothing
    assert broker.streams[f"PD_{JOB}"].next_seq == sent
    for rank in (0, 1):
        _write(root, rank, range(7, 12))
    _ship(root, broker)
    assert any(int(s.msg.headers["PD-Part"].split("/")[2]) > 1 for s in broker.streams[f"PD_{JOB}"].messages
               if "PD-Part" in s.msg.headers), "records should have been chunked"

    with RemoteConsumer(None, JOB, "replica", wait=5, transport=broker.connect("replica")) as c:
        assert c.end_offsets() == {0: 12, 1: 12}
        start = 0
        while c.position() != c.end_offsets():
            got = c.poll(max_batches=4)
            (lo, hi), = set(got.ranges.values())
            assert lo == start
            with DeltaReader(root, start=lo) as local:
                _assert_same(got, local.poll(max_batches=hi - lo))
            start = hi
        c.commit()
        with pytest.raises(LogLockedError):
            RemoteConsumer(None, JOB, "replica", transport=broker.connect())
    with RemoteConsumer(None, JOB, "replica", transport=broker.connect()) as again:
        assert again.committed() == {0: 12, 1: 12} and again.poll().empty


def test_a_base_uploaded_through_a_transport_bootstraps_a_replica(tmp_path):
    """``upload_base`` into the memory transport's object store; ``bootstrap`` returns the
    tables and moves the position just past the base's publish."""
    root = str(tmp_path / "log")
    broker = MemoryBroker()
    _write(root, 0, range(0, 4))
    _ship(root, broker)
    weights = torch.randn(2000, DIM)
    conn = broker.connect()
    upload_base(None, JOB, 0, 2, {"t": weights}, transport=conn)
    conn.close()
    with RemoteConsumer(None, JOB, "late", transport=broker.connect()) as c:
        seen = []
        tables = c.bootstrap(progress=lambda done, total: seen.append((done, total)))
        assert seen == [(0, 1), (1, 1)]  # before the rank's base and after it
        assert torch.equal(tables["t"], weights)
        assert c.position() == {0: 3}
        with DeltaReader(root, start=3) as local:
            _assert_same(c.poll(), local.poll())


def test_bootstrap_waits_for_a_base_uploaded_after_it_started(tmp_path):
    """A replica started alongside its trainer: with no base yet, ``bootstrap()`` refuses at
    once, and ``bootstrap(wait=)`` returns the base uploaded while it waits."""
    from persistent_delta.errors import NotALogError

    root = str(tmp_path / "log")
    broker = MemoryBroker()
    _write(root, 0, range(0, 4))
    _ship(root, broker)
    weights = torch.randn(2000, DIM)
    conn = broker.connect()
    with RemoteConsumer(None, JOB, "early", transport=broker.connect()) as c:
        with pytest.raises(NotALogError, match="no base"):
            c.bootstrap()
        upload = threading.Timer(0.5, upload_base, (None, JOB, 0, 2, {"t": weights}), {"transport": conn})
        upload.start()
        try:
            tables = c.bootstrap(wait=30)
        finally:
            upload.join()
        assert torch.equal(tables["t"], weights)
        assert c.position() == {0: 3}
    conn.close()


def test_a_fleet_object_needs_a_server_or_a_transport(tmp_path):
    with pytest.raises(InvalidInputError):
        Shipper(str(tmp_path), None, JOB)
    with pytest.raises(InvalidInputError):
        RemoteConsumer(None, JOB, "r")
    with pytest.raises(InvalidInputError):
        upload_base(None, JOB, 0, 1, {})


def test_the_memory_transport_drops_old_messages_past_the_streams_byte_limit():
    """``max_bytes`` with the oldest first, as JetStream's ``discard=old``; de-duplication
    remembers an id whose message was dropped, within the window."""
    conn = MemoryBroker().connect()
    assert isinstance(conn, Transport)
    conn.ensure_job(JOB, StreamOptions(max_bytes=3000))
    subject = subjects.end_subject(JOB, "lookups", 0)
    for i in range(10):
        assert conn.send_all([Message(subject, bytes(1000), {}, f"id-{i}")]) == []
    got, more = conn.get_batch(JOB, subject, 1, 100, 1 << 20)
    assert [m.seq for m in got] == [9, 10] and not more
    assert conn.send_all([Message(subject, bytes(1000), {}, "id-0")]) == []
    assert conn.last_message(JOB, subject).seq == 10
    conn.close()
    with pytest.raises(TransportError):
        conn.last_message(JOB, subject)
    assert conn.send_all([Message(subject, b"", {}, "id-x")]) != []


def test_the_memory_transport_is_thread_safe():
    """Concurrent senders on one connection: every message stored once, sequences unique."""
    conn = MemoryBroker().connect()
    conn.ensure_job(JOB, StreamOptions())
    subject = subjects.end_subject(JOB, "lookups", 0)

    def send(t: int) -> None:
        for i in range(200):
            conn.send_all([Message(subject, b"x", {}, f"{t}-{i}"), Message(subject, b"x", {}, f"{t}-{i}")])

    threads = [threading.Thread(target=send, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got, _ = conn.get_batch(JOB, subject, 1, 10_000, 1 << 30)
    assert [m.seq for m in got] == list(range(1, 801))
