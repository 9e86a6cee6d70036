"""The stream is a trust boundary: another client on the same NATS server publishes forged or
replayed range markers, and no real data is skipped, no position moves past unshipped data,
and a replayed genuine marker never moves a rank's end back."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta import DeltaReader
from persistent_delta.errors import (
    AuthenticationError,
    JobNotFoundError,
    PermissionDeniedError,
    StreamKeyError,
    TransportError,
)
from persistent_delta.fleet import subjects, wire
from persistent_delta.fleet.nats import Connection
from persistent_delta.fleet.permissions import authorization_block
from persistent_delta.fleet.remote import RemoteConsumer
from persistent_delta.fleet.subjects import offsets_key
from persistent_delta.fleet.ship import Shipper, upload_base
from persistent_delta.fleet.transport import ConnectOptions, StreamOptions
from persistent_delta.fleet.wire import FORMAT_HEADER, FORMAT_VERSION, Message
from persistent_delta.log import codec
from persistent_delta.testing import LocalServer
from logs import fill_store

DIM = 8


def _records(b: int):
    n = 5 + b % 3
    ids = (torch.arange(n) * 7 + b) % 100
    return [("t", ids, torch.full((n, DIM), float(b)))]


def _write(root: str, start: int, batches: int) -> None:
    fill_store(os.path.join(root, "rank-0"), _records, batches=batches, mode=UpdateMode.LAST, start=start)


def _forge_marker(conn: Connection, job: str, epoch: str, start: int, end: int, mid: str) -> None:
    body = {"v": FORMAT_VERSION, "job": job, "epoch": epoch, "channel": "lookups", "rank": 0, "start": start,
            "end": end, "parts": [], "shipped": 0.0, "log_end": end, "publishes": []}
    subject = subjects.end_subject(job, "lookups", 0)
    msg = Message(subject, codec.pack(body), {FORMAT_HEADER: str(FORMAT_VERSION), "PD-Epoch": epoch,
                                              "PD-Range": f"{start}-{end}"}, mid)
    assert conn.send_all([msg]) == []


def _rows_read(c: RemoteConsumer) -> int:
    rows = 0
    while c.position() != c.end_offsets():
        got = c.poll(timeout=2)
        rows += sum(t.ids.numel() for d in got.ranks.values() for t in d.tables.values())
    return rows


def _local_rows(root: str, start: int, end: int) -> int:
    with DeltaReader(root, start=start) as r:
        got = r.poll(max_batches=end - start)
        assert got.ranges() == {0: (start, end)}
        return sum(t.ids.numel() for d in got.ranks.values() for t in d.tables.values())


def test_a_forged_marker_from_another_client_skips_no_real_data(tmp_path, nats_server):
    """A second client publishes a marker without parts, under a made-up epoch, covering
    [0, 32) before the shipper ships [0, 41): a consumer from the earliest range reads every
    real row, and reports the forged marker instead of delivering it."""
    root, job = str(tmp_path / "log"), "trust-a"
    _write(root, 0, 41)
    forger = Connection(nats_server.url)
    forger.ensure_job(job, StreamOptions())
    _forge_marker(forger, job, "made-up", 0, 32, "forged-1")
    with Shipper(root, nats_server.url, job, channels=["lookups"], max_batches=16) as s:
        s.run(idle_exit_s=0.3)
    forger.close()
    with RemoteConsumer(nats_server.url, job, "replica", reset="earliest", wait=10) as c:
        assert _rows_read(c) == _local_rows(root, 0, 41)
        assert c.position() == {0: 41}
        assert any(isinstance(e, AuthenticationError) and e.seq == 1 for e in c.rejected), list(c.rejected)


def test_a_forged_marker_with_the_shippers_epoch_does_not_move_its_position(tmp_path, nats_server):
    """The epoch is readable from the meta bucket: a marker forged with it for [21, 41) does not
    move a restarted shipper's position past data it never shipped."""
    root, job = str(tmp_path / "log"), "trust-b"
    _write(root, 0, 21)
    with Shipper(root, nats_server.url, job, channels=["lookups"], max_batches=16) as s:
        s.run(idle_exit_s=0.3)
    forger = Connection(nats_server.url)
    state = codec.unpack(forger.kv_get(job, subjects.META, subjects.shipper_key(0, "lookups")).value)
    _forge_marker(forger, job, state["epoch"], 21, 41, "forged-2")
    forger.close()
    _write(root, 21, 20)
    with Shipper(root, nats_server.url, job, channels=["lookups"], max_batches=16) as s:
        s.run(idle_exit_s=0.3)
    with RemoteConsumer(nats_server.url, job, "replica", wait=10) as c:
        assert _rows_read(c) == _local_rows(root, 0, 41)


def test_a_replayed_genuine_marker_never_moves_a_ranks_end_back(tmp_path, nats_server):
    """A genuine earlier marker and its parts, re-published later under new message ids, are
    recognised as a replay: ``end_offsets()`` stays at the real end, and a new consumer at
    ``"latest"`` starts there."""
    root, job = str(tmp_path / "log"), "trust-c"
    _write(root, 0, 45)
    with Shipper(root, nats_server.url, job, channels=["lookups"], max_batches=16) as s:
        s.run(idle_exit_s=0.3)
    forger = Connection(nats_server.url)
    msgs, _ = forger.get_batch(job, subjects.rank_filter(job, "lookups", 0), 1, 1000, 1 << 24)
    first_end = next(i for i, m in enumerate(msgs) if m.subject.endswith(".end"))
    replay = [Message(m.subject, m.data, {k: v for k, v in m.headers.items() if k.startswith("PD-")}, f"replay-{i}")
              for i, m in enumerate(msgs[:first_end + 1])]
    assert wire.Marker.decode(bytes(replay[-1].payload), 0, "test").end == 16
    assert forger.send_all(replay) == []
    forger.close()
    with RemoteConsumer(nats_server.url, job, "late", reset="latest", wait=10) as c:
        assert c.end_offsets() == {0: 45}
        assert c.position() == {0: 45}
    with RemoteConsumer(nats_server.url, job, "all", reset="earliest", wait=10) as c:
        assert _rows_read(c) == _local_rows(root, 0, 45)
        assert c.poll(timeout=0.5).empty


def test_no_key_no_data(tmp_path, nats_server, monkeypatch):
    """Without a key a shipper and a remote consumer are refused with a typed error saying what
    to do, unless the user opts out explicitly; a consumer with a key skips unsigned data."""
    monkeypatch.delenv("PERSISTENT_DELTA_STREAM_KEY_FILE")
    root, job = str(tmp_path / "log"), "trust-d"
    _write(root, 0, 4)
    with pytest.raises(StreamKeyError, match="persistent-delta keygen"):
        Shipper(root, nats_server.url, job)
    with pytest.raises(StreamKeyError, match="insecure=True"):
        RemoteConsumer(nats_server.url, job, "r")
    with Shipper(root, nats_server.url, job, channels=["lookups"], insecure=True) as s:
        s.run(idle_exit_s=0.3)
    with RemoteConsumer(nats_server.url, job, "open", insecure=True, wait=10) as c:
        assert _rows_read(c) == _local_rows(root, 0, 4)
    monkeypatch.undo()
    with pytest.raises(Exception) as info:  # its table metadata is unsigned: no rank is known
        RemoteConsumer(nats_server.url, job, "keyed", wait=0.5)
    assert "no shipper has stored table metadata" in str(info.value)


def test_the_operators_tools_show_only_authenticated_ends(tmp_path, nats_server, monkeypatch, capsys):
    """Another client publishes a marker claiming the rank was shipped to batch 1000: ``offsets
    --server``, the exporter and ``top`` still show the genuine end (the last message on the
    marker subject is not trusted), count the forged marker, and ``--reset --to-latest`` stores
    the genuine end, never the forged one. Without a key they are refused unless ``--insecure``."""
    from persistent_delta.cli.main import main
    from persistent_delta.cli.top import snapshot
    from persistent_delta.ops.remote_positions import describe_remote, stream_ends_of

    root, job = str(tmp_path / "log"), "trust-ops"
    _write(root, 0, 10)
    with Shipper(root, nats_server.url, job, channels=["lookups"], max_batches=4) as s:
        s.run(idle_exit_s=0.3)
    with RemoteConsumer(nats_server.url, job, "replica", reset="earliest", wait=10) as c:
        c.poll(max_batches=4)
        c.commit()
    forger = Connection(nats_server.url)
    _forge_marker(forger, job, "made-up", 0, 1000, "forged-ops")
    forger.close()

    found = describe_remote(nats_server.url, job)
    (row,) = found["consumers"]
    assert (row.offset, row.stream_end, row.lag) == (4, 10, 6)
    assert found["rejected_markers"] == 1 and "no authenticator" in found["last_rejected"]
    assert main(["offsets", "--server", nats_server.url, "--job", job]) == 0
    out = capsys.readouterr().out
    assert "1 range marker(s) on the stream did not authenticate" in out and "1000" not in out
    view = snapshot(None, nats_server.url, job, ends=stream_ends_of(None, False, "test"))
    assert [r.stream_end for r in view.remote] == [10] and any("did not authenticate" in e for e in view.errors)
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest

    from persistent_delta.ops.metrics import build_registry

    text = generate_latest(build_registry(server=nats_server.url, job=job)).decode()
    assert f'persistent_delta_remote_consumer_lag_batches{{channel="lookups",consumer="replica",job="{job}",rank="0"}} 6.0' in text
    assert f'persistent_delta_stream_markers_rejected_total{{job="{job}"}} 1.0' in text

    assert main(["offsets", "--server", nats_server.url, "--job", job, "--reset", "replica", "--to-latest",
                 "--execute"]) == 0
    capsys.readouterr()
    with RemoteConsumer(nats_server.url, job, "replica", wait=10) as c:
        assert c.committed() == {0: 10} and c.end_offsets() == {0: 10}
        assert c.poll(timeout=0.5).empty  # at the genuine end: nothing skipped, nothing forged ahead

    monkeypatch.delenv("PERSISTENT_DELTA_STREAM_KEY_FILE")
    with pytest.raises(StreamKeyError, match="insecure"):
        describe_remote(nats_server.url, job)
    assert main(["offsets", "--server", nats_server.url, "--job", job]) != 0
    assert "--insecure" in capsys.readouterr().err
    assert main(["offsets", "--server", nats_server.url, "--job", job, "--insecure", "--format", "json"]) == 0


def _stored_stats(conn: Connection, job: str) -> dict:
    try:
        got = conn.kv_get(job, subjects.META, subjects.shipper_key(0, "lookups"))
    except TransportError:  # not created yet
        return {}
    return codec.unpack(got.value)["stats"] if got is not None else {}


def test_a_stream_deleted_under_a_running_shipper_is_created_again(tmp_path, nats_server):
    """Another client deletes the job's stream while a shipper runs: the shipper creates it again
    and ships on; its stored statistics say what happened (not a lag of 0 while it is stuck); a
    new consumer reads every batch shipped after the deletion, and one that had read the old
    stream goes on from its position in the new one."""
    root, job = str(tmp_path / "log"), "trust-e"
    _write(root, 0, 10)
    admin = Connection(nats_server.url)
    with Shipper(root, nats_server.url, job, channels=["lookups"], max_batches=4) as s:
        s.start()
        deadline = time.monotonic() + 15
        while _stored_stats(admin, job).get("position") != 10 and time.monotonic() < deadline:
            time.sleep(0.1)

        async def delete() -> None:
            await admin.js.delete_stream(subjects.stream_name(job))

        with RemoteConsumer(nats_server.url, job, "before", reset=None, wait=10) as c:
            assert _rows_read(c) == _local_rows(root, 0, 10)
            c.commit()
        live = RemoteConsumer(nats_server.url, job, "live", reset=None, wait=10)
        assert _rows_read(live) == _local_rows(root, 0, 10)
        admin.call("delete the stream", delete)
        assert not admin.job_exists(job)
        _write(root, 10, 20)
        deadline = time.monotonic() + 15
        while _stored_stats(admin, job).get("position") != 30 and time.monotonic() < deadline:
            time.sleep(0.1)
        stats = _stored_stats(admin, job)
        assert stats["position"] == 30 and stats["lag_batches"] == 0, stats
        assert stats["recreated"] == 1 and "deleted" in stats["last_error"], stats
    admin.close()
    with RemoteConsumer(nats_server.url, job, "after", reset="earliest", wait=10) as c:
        assert _rows_read(c) == _local_rows(root, 10, 30)
        assert c.position() == {0: 30}
    # consumers that read the old stream to 10 -- one open all along, one reopened from its
    # committed position -- read the new stream from its start: [10, 30), no gap
    with live:
        assert _rows_read(live) == _local_rows(root, 10, 30)
    with RemoteConsumer(nats_server.url, job, "before", reset=None, wait=10) as c:
        assert c.position() == {0: 10}
        assert _rows_read(c) == _local_rows(root, 10, 30)


def test_nats_permissions_only_the_shipper_writes_a_job(tmp_path):
    """A server whose ``authorization`` block is :func:`authorization_block`'s: a consumer user
    never creates the job's stream (a typed error until a shipper has), reads and commits its own
    position, and every write outside its own keys is refused with a typed error naming it --
    publishing on the job's subjects, writing its metadata or base, deleting its stream, taking
    another consumer's name."""
    root, job = str(tmp_path / "log"), "trust-p"
    _write(root, 0, 10)
    block = authorization_block(job, ("shipper", "ship-pw"), {"reader": ("read-pw", ["replica"])})
    server = LocalServer(str(tmp_path / "nats-auth"), extra_config=block).start()
    ship_as = ConnectOptions(user="shipper", password="ship-pw")
    read_as = ConnectOptions(user="reader", password="read-pw", request_timeout=0.5)
    try:
        with pytest.raises(JobNotFoundError, match="no shipper of it has run there"):
            RemoteConsumer(server.url, job, "replica", connect=read_as)
        admin = Connection(server.url, ship_as)
        assert not admin.job_exists(job)  # the consumer created nothing
        admin.close()
        with Shipper(root, server.url, job, channels=["lookups"], max_batches=4, connect=ship_as) as s:
            s.run(idle_exit_s=0.3)
        upload_base(server.url, job, 0, 9, {"t": torch.zeros(100, DIM)}, connect=ship_as)
        with RemoteConsumer(server.url, job, "replica", reset="earliest", connect=read_as, wait=5) as c:
            assert _rows_read(c) == _local_rows(root, 0, 10)
            c.commit()
            assert c.committed() == {0: 10}
            assert set(c.bootstrap()) == {"t"}
        forger = Connection(server.url, read_as)
        try:
            marker = Message(subjects.end_subject(job, "lookups", 0), b"x", {}, "forged")
            assert forger.send_all([marker]) == [marker]  # never acknowledged, never stored
            for write in (lambda: forger.kv_put(job, subjects.META, subjects.tables_key(0), b"x"),
                          lambda: forger.kv_put(job, subjects.OFFSETS, offsets_key("other", "lookups"), b"x"),
                          lambda: forger.object_put(job, subjects.base_name(0), b"x")):
                with pytest.raises(PermissionDeniedError, match="permissions violation"):
                    write()

            async def delete() -> None:
                await forger.js.delete_stream(subjects.stream_name(job))

            with pytest.raises(PermissionDeniedError, match="stream.delete"):
                forger.call("delete the stream", delete)
        finally:
            forger.close()
        with pytest.raises(PermissionDeniedError, match="locks"):
            RemoteConsumer(server.url, job, "other", connect=read_as)
        began = time.monotonic()  # a refusal is not retried until the deadline: waiting would not change it
        with pytest.raises(PermissionDeniedError, match="locks"):
            RemoteConsumer(server.url, job, "other", connect=read_as, wait=8)
        assert time.monotonic() - began < 4
    finally:
        server.stop()


def test_the_security_guide_shows_the_block_authorization_block_writes():
    """The ready-to-copy block in docs/guides/security.md is the one the tested function writes."""
    guide = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "guides", "security.md")).read()
    block = authorization_block("job-a", ("pd-ship", "SHIP-PASSWORD"), {"pd-serving": ("SERVING-PASSWORD", ["serving"])})
    assert f"```text\n{block}```" in guide
