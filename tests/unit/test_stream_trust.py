"""What a remote consumer accepts from a stream, over the in-process transport: signed data
that does not match the job's table metadata is refused before anything is applied or any
position moves, every size read from the stream is bounded before allocation, foreign or
damaged messages are reported and skipped, and stream keys are handled safely."""

from __future__ import annotations

import os
import stat
import time

import pytest
import torch
from torchrec.distributed.model_tracker.types import UniqueRows, UpdateMode

from persistent_delta import DeltaReader
from persistent_delta.errors import AuthenticationError, KeyFileError, StreamDataError, StreamKeyError
from persistent_delta.fleet import subjects, wire
from persistent_delta.fleet.auth import (Keyring, generate_key, key_file_refusal, read_key_file, resolve_keyring,
                                         write_key_file)
from persistent_delta.fleet.memory import MemoryBroker
from persistent_delta.fleet.remote import RemoteConsumer
from persistent_delta.fleet.ship import Shipper, upload_base
from persistent_delta.fleet.transport import StreamOptions
from persistent_delta.fleet.wire import FORMAT_HEADER, FORMAT_VERSION, Message
from persistent_delta.log import codec
from persistent_delta.log.deltalog import DeltaLog
from logs import fill_store

JOB, ROWS, DIM = "job-trust", 100, 8
KEY = generate_key("k1")


def _log(tmp_path, batches: int = 8) -> str:
    root = str(tmp_path / "log")
    path = os.path.join(root, "rank-0")
    fill_store(path, lambda b: [("t", (torch.arange(6) * 11 + b) % ROWS, torch.full((6, DIM), float(b)))],
               batches=batches, mode=UpdateMode.LAST)
    shard = {"table_name": "t", "sharding_type": "row_wise", "row_offset": 0, "col_offset": 0, "local_rows": ROWS,
             "local_cols": DIM, "global_rows": ROWS, "global_cols": DIM}

    def stage(w):
        e = w.ensure_table("t")
        e.meta["shard"] = shard
        e.values_dtype, e.values_tail = "float32", [DIM]
        w.stage_table(e)

    with DeltaLog(path) as log:
        log.write(stage)
    return root


def _ship(root: str, broker: MemoryBroker) -> None:
    with Shipper(root, None, JOB, channels=["lookups"], max_batches=4, transport=broker.connect(), key=KEY) as s:
        s.run(idle_exit_s=0.2)


def _signed_range(conn, start: int, end: int, rows, epoch: str = "crafted") -> None:
    parts, marker, _ = wire.encode_range(JOB, epoch, "lookups", 0, start, end, rows, 1 << 20, ring=Keyring([KEY]))
    assert conn.send_all(parts + [marker]) == []


def _all_rows(c: RemoteConsumer) -> int:
    n = 0
    for _ in range(50):
        got = c.poll(timeout=0.2)
        if got.empty:
            break
        n += sum(t.ids.numel() for d in got.ranks.values() for t in d.tables.values())
    return n


def _local_rows(root: str) -> int:
    with DeltaReader(root) as r:
        return sum(t.ids.numel() for d in r.poll().ranks.values() for t in d.tables.values())


@pytest.mark.parametrize("bad", ["width", "dtype", "negative_id", "id_past_shard", "unknown_table"])
def test_signed_rows_that_do_not_match_the_table_metadata_are_never_delivered(tmp_path, bad):
    """A key holder's range with rows of width 3 for an 8-column table, float64 states for a
    float32 table, ids -5 or past the rank's shard, or a table the rank does not have: reported
    (``StreamDataError``) and skipped; the consumer reads exactly the shipper's rows."""
    root = _log(tmp_path)
    broker = MemoryBroker()
    conn = broker.connect()
    conn.ensure_job(JOB, StreamOptions())
    ids = torch.tensor([1, 2, 3])
    rows = {"width": {"t": UniqueRows(ids, torch.full((3, 3), 9.0))},
            "dtype": {"t": UniqueRows(ids, torch.full((3, DIM), 9.0, dtype=torch.float64))},
            "negative_id": {"t": UniqueRows(torch.tensor([-5, 1, 2]), torch.full((3, DIM), 9.0))},
            "id_past_shard": {"t": UniqueRows(torch.tensor([1, 2, 10 ** 12]), torch.full((3, DIM), 9.0))},
            "unknown_table": {"u": UniqueRows(ids, torch.full((3, DIM), 9.0))}}[bad]
    _ship(root, broker)  # the rank's metadata
    _signed_range(conn, 8, 12, rows, epoch="buggy")
    with RemoteConsumer(None, JOB, "r", transport=broker.connect(), key=KEY, reset="earliest") as c:
        assert _all_rows(c) == _local_rows(root)
        assert c.position() == {0: 8}
        assert any(isinstance(e, StreamDataError) for e in c.rejected), list(c.rejected)
        assert c.poll(timeout=0.1).empty and c.position() == {0: 8}


@pytest.mark.parametrize("bad", ["few_rows", "missing_table", "few_cols", "float16", "huge_stamp", "one_dim",
                                 "unknown_table"])
def test_a_base_that_does_not_match_the_table_metadata_is_refused(tmp_path, bad):
    """``bootstrap()`` refuses a signed base with 10 of 100 rows, a table missing, 3 of 8
    columns, float16 values, stamp 2**62, a 1-D table or an unknown table; no position moves."""
    root = _log(tmp_path)
    broker = MemoryBroker()
    _ship(root, broker)
    w = torch.randn(ROWS, DIM)
    stamp, tables = {"few_rows": (2, {"t": w[:10]}), "missing_table": (2, {}), "few_cols": (2, {"t": w[:, :3]}),
                     "float16": (2, {"t": w.half()}), "huge_stamp": (2 ** 62, {"t": w}),
                     "one_dim": (2, {"t": w[:, 0]}), "unknown_table": (2, {"t": w, "u": w})}[bad]
    if bad == "huge_stamp":
        body = codec.pack({"v": FORMAT_VERSION, "stamp": stamp, "tables": {"t": bytes(codec.encode_record(
            torch.arange(ROWS), w, codec.KIND_SNAPSHOT))}})
        from persistent_delta.fleet.auth import seal_value
        broker.connect().object_put(JOB, subjects.base_name(0), seal_value(Keyring([KEY]), JOB, subjects.BASE,
                                                                          subjects.base_name(0), body))
    elif bad == "one_dim":
        rec = codec.encode_record(torch.arange(ROWS), w[:, 0].contiguous(), codec.KIND_SNAPSHOT)
        body = codec.pack({"v": FORMAT_VERSION, "stamp": stamp, "tables": {"t": bytes(rec)}})
        from persistent_delta.fleet.auth import seal_value
        broker.connect().object_put(JOB, subjects.base_name(0), seal_value(Keyring([KEY]), JOB, subjects.BASE,
                                                                          subjects.base_name(0), body))
    else:
        upload_base(None, JOB, 0, stamp, tables, transport=broker.connect(), key=KEY)
    with RemoteConsumer(None, JOB, "late", transport=broker.connect(), key=KEY) as c:
        before = c.position()
        with pytest.raises(StreamDataError):
            c.bootstrap()
        assert c.position() == before


def test_a_base_signed_with_another_key_is_refused(tmp_path):
    root = _log(tmp_path)
    broker = MemoryBroker()
    _ship(root, broker)
    upload_base(None, JOB, 0, 2, {"t": torch.randn(ROWS, DIM)}, transport=broker.connect(), key=generate_key("other"))
    with RemoteConsumer(None, JOB, "late", transport=broker.connect(), key=KEY) as c:
        with pytest.raises(AuthenticationError, match="other"):
            c.bootstrap()


def test_a_marker_declaring_huge_counts_neither_hangs_nor_allocates(tmp_path):
    """A signed marker declaring 10**10 chunks (or 10**10 bytes) of a part: refused at once,
    typed, and the consumer goes on with the real ranges."""
    root = _log(tmp_path)
    broker = MemoryBroker()
    conn = broker.connect()
    conn.ensure_job(JOB, StreamOptions())
    ring = Keyring([KEY])
    for i, (chunks, nbytes) in enumerate([(10 ** 10, 10 ** 10), (10 ** 10, 5), (1, 2 ** 60)]):
        body = {"v": FORMAT_VERSION, "epoch": f"huge{i}", "start": 0, "end": 4, "parts": [["t", chunks, nbytes]],
                "digests": ["0" * 64], "shipped": 0.0}
        subject = subjects.end_subject(JOB, "lookups", 0)
        headers = {FORMAT_HEADER: str(FORMAT_VERSION), "PD-Epoch": f"huge{i}", "PD-Range": "0-4"}
        from persistent_delta.fleet.auth import sign_message
        payload = codec.pack(body)
        sign_message(ring, JOB, subject, headers, payload)
        assert conn.send_all([Message(subject, payload, headers, f"huge-{i}")]) == []
    _ship(root, broker)
    t0 = time.monotonic()
    with RemoteConsumer(None, JOB, "r", transport=broker.connect(), key=KEY) as c:
        assert _all_rows(c) == _local_rows(root)
    assert time.monotonic() - t0 < 10


def test_pending_parts_respect_max_buffer_bytes(tmp_path):
    """Signed parts with no marker beyond ``max_buffer_bytes`` are refused (typed) instead of
    buffered without bound; the real ranges still arrive."""
    root = _log(tmp_path)
    broker = MemoryBroker()
    conn = broker.connect()
    conn.ensure_job(JOB, StreamOptions())
    big = {"t": UniqueRows(torch.arange(ROWS), torch.randn(ROWS, 64))}  # 25 KiB a range, without a marker
    for k in range(6):
        parts, _, _ = wire.encode_range(JOB, f"orphan{k}", "lookups", 0, 0, 4, big, 1024, ring=Keyring([KEY]))
        assert conn.send_all(parts) == []
    _ship(root, broker)
    with RemoteConsumer(None, JOB, "r", transport=broker.connect(), key=KEY, max_buffer_bytes=4096) as c:
        assert _all_rows(c) == _local_rows(root)
        assert c.position() == {0: 8}
        assert any(isinstance(e, StreamDataError) and "buffer limit of 4096" in str(e) for e in c.rejected)


@pytest.mark.parametrize("junk", ["garbage", "no_headers", "bad_marker", "bad_part_header", "inf_start"])
def test_foreign_or_damaged_messages_are_reported_and_skipped(tmp_path, junk):
    """One undecodable or foreign message on a rank's marker or table subject, before and in the
    middle of the real ranges: neither a shipper start nor a consumer stops; each is reported
    with a typed error naming its subject and stream sequence."""
    root = _log(tmp_path, batches=4)
    broker = MemoryBroker()
    conn = broker.connect()
    conn.ensure_job(JOB, StreamOptions())
    ring = Keyring([KEY])
    end = subjects.end_subject(JOB, "lookups", 0)

    def send(subject: str, payload: bytes, headers, mid: str, sign: bool = True) -> None:
        headers = dict(headers)
        if sign:
            from persistent_delta.fleet.auth import sign_message
            sign_message(ring, JOB, subject, headers, payload)
        assert conn.send_all([Message(subject, payload, headers, mid)]) == []

    fmt = {FORMAT_HEADER: str(FORMAT_VERSION)}
    junk_msgs = {
        "garbage": (end, b"\xc1\xff garbage", {**fmt, "PD-Epoch": "x", "PD-Range": "0-4"}, False),
        "no_headers": (end, b"hello", {}, False),
        "bad_marker": (end, b"\xc1\xff garbage", {**fmt, "PD-Epoch": "x", "PD-Range": "0-4"}, True),
        "bad_part_header": (subjects.data_subject(JOB, "lookups", 0, "t"), b"x", {**fmt, "PD-Part": "a/b"}, True),
        "inf_start": (end, codec.pack({"epoch": "x", "start": float("inf"), "end": 4, "parts": []}),
                      {**fmt, "PD-Epoch": "x", "PD-Range": "0-4"}, True),
    }
    subject, payload, headers, sign = junk_msgs[junk]
    send(subject, payload, headers, "junk-1", sign)
    _ship(root, broker)
    send(subject, payload, headers, "junk-2", sign)
    fill_store(os.path.join(root, "rank-0"), lambda b: [("t", torch.tensor([b]), torch.full((1, DIM), 1.0))],
               batches=4, mode=UpdateMode.LAST, start=4)
    _ship(root, broker)  # a shipper start reads past both
    with RemoteConsumer(None, JOB, "r", transport=broker.connect(), key=KEY) as c:
        assert _all_rows(c) == _local_rows(root)
        assert c.position() == {0: 8} and c.end_offsets() == {0: 8}
        seqs = {e.seq for e in c.rejected}
        assert {1} <= seqs and len(seqs) >= 2, list(c.rejected)
        assert all(e.subject == subject or e.subject == "" for e in c.rejected)


def test_a_key_file_is_owner_only_whatever_the_umask_and_never_overwritten(tmp_path):
    old = os.umask(0)
    try:
        path = tmp_path / "k"
        key = write_key_file(path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert read_key_file(path) == key and "secret" not in repr(key) and key.secret.hex() not in repr(key)
    with pytest.raises(StreamKeyError, match="exists"):
        write_key_file(path)
    os.chmod(path, 0o644)
    with pytest.raises(StreamKeyError, match="chmod 600"):
        read_key_file(path)
    (tmp_path / "bad").write_text("nonsense")
    os.chmod(tmp_path / "bad", 0o600)
    with pytest.raises(StreamKeyError, match="malformed"):
        read_key_file(tmp_path / "bad")


def secret_volume(tmp_path, mode: int) -> str:
    """A key laid out as a Kubernetes secret volume lays it out -- ``key -> ..data/key``,
    ``..data -> ..<timestamp>``, the file itself of mode ``mode`` -- and the path a pod reads."""
    vol = tmp_path / "secret"
    stamp = vol / "..2026_12_05_10_00_00.123456789"
    stamp.mkdir(parents=True)
    write_key_file(stamp / "key", KEY)
    os.chmod(stamp / "key", mode)
    os.symlink(stamp.name, vol / "..data")
    os.symlink(os.path.join("..data", "key"), vol / "key")
    return str(vol / "key")


def test_a_key_in_a_secret_volume_is_read_through_its_links_and_its_mode_checked(tmp_path):
    """The links are followed and the rule applies to the file they end at: mode 0400 is read;
    0644 (a secret volume's default) is refused, the error naming the path, the file, the mode
    and the fix."""
    path = secret_volume(tmp_path, 0o400)
    assert read_key_file(path) == KEY and resolve_keyring(path, False, "test").keys == [KEY]
    target = os.path.realpath(path)
    os.chmod(target, 0o644)
    with pytest.raises(KeyFileError) as info:
        read_key_file(path)
    err = info.value
    assert (err.path, err.target, err.refused) == (path, target, "mode 0644")
    for part in (path, target, "mode 0644 lets others read it", f"chmod 600 {target}", "defaultMode: 0400"):
        assert part in str(err), str(err)


@pytest.mark.parametrize("mode, uid, refused", [
    (0o600, 1000, None), (0o400, 1000, None), (0o640, 0, None), (0o440, 0, None), (0o400, 0, None),
    (0o640, 1000, "mode 0640"), (0o644, 0, "mode 0644"), (0o660, 0, "mode 0660"), (0o604, 1000, "mode 0604"),
    (0o620, 0, "mode 0620"), (stat.S_IFIFO | 0o600, 1000, "a FIFO"), (stat.S_IFDIR | 0o700, 0, "a directory"),
])
def test_the_key_file_rule_owner_only_or_group_readable_when_root_owns_it(mode, uid, refused):
    """Owner-only (0600/0400); a file root owns may also be read by its group (0640/0440: a
    secret volume with fsGroup); others never; the group never writes; a regular file only."""
    st = os.stat_result(((mode if mode & ~0o7777 else stat.S_IFREG | mode), 1, 1, 1, uid, 0, 77, 0, 0, 0))
    found = key_file_refusal(st)
    assert (found[0] if found else None) == refused, found


def test_a_rotation_consumer_holds_the_old_and_the_new_key(tmp_path, monkeypatch):
    """During a rotation a consumer holding both keys reads ranges signed with either; one
    holding only the new key skips the old ones (reported, naming the key id it lacks)."""
    monkeypatch.delenv("PERSISTENT_DELTA_STREAM_KEY_FILE", raising=False)
    root = _log(tmp_path, batches=4)
    broker = MemoryBroker()
    new = generate_key("k2")
    _ship(root, broker)  # signed with KEY (k1)
    fill_store(os.path.join(root, "rank-0"), lambda b: [("t", torch.tensor([b]), torch.full((1, DIM), 1.0))],
               batches=4, mode=UpdateMode.LAST, start=4)
    with Shipper(root, None, JOB, channels=["lookups"], max_batches=4, transport=broker.connect(), key=[new, KEY]) as s:
        s.run(idle_exit_s=0.2)
    with RemoteConsumer(None, JOB, "both", transport=broker.connect(), key=[new, KEY]) as c:
        assert _all_rows(c) == _local_rows(root)
    with RemoteConsumer(None, JOB, "new", transport=broker.connect(), key=new, reset="earliest") as c:
        c.poll(timeout=0.2)
        assert any("k1" in str(e) for e in c.rejected)
    paths = []
    for i, k in enumerate((new, KEY)):
        paths.append(str(tmp_path / f"key{i}"))
        write_key_file(paths[-1], k)
    monkeypatch.setenv("PERSISTENT_DELTA_STREAM_KEY_FILE", os.pathsep.join(paths))
    ring = resolve_keyring(None, False, "test")
    assert [k.key_id for k in ring.keys] == ["k2", "k1"]


def test_keygen_writes_an_owner_only_key_and_never_overwrites_one(tmp_path, capsys):
    from persistent_delta.cli.main import main

    path = str(tmp_path / "job.key")
    assert main(["keygen", path, "--key-id", "prod-1"]) == 0
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and read_key_file(path).key_id == "prod-1"
    assert main(["keygen", path]) == 1
    assert "exists" in capsys.readouterr().err


def test_a_table_that_appears_later_is_shipped_and_accepted(tmp_path):
    """The shipper stores its table metadata again when a range holds a table new since its
    last store, so consumers validating against the metadata accept the new table's rows."""
    root = _log(tmp_path, batches=4)
    broker = MemoryBroker()
    with Shipper(root, None, JOB, channels=["lookups"], max_batches=4, transport=broker.connect(), key=KEY) as s:
        s.run(idle_exit_s=0.2)
        with RemoteConsumer(None, JOB, "r", transport=broker.connect(), key=KEY) as c:
            assert _all_rows(c) == _local_rows(root)
            fill_store(os.path.join(root, "rank-0"), lambda b: [("u", torch.tensor([b]), torch.ones(1, 2))],
                       batches=4, mode=UpdateMode.LAST, start=4)
            s.run(idle_exit_s=0.2)
            got = c.poll(timeout=1)
            assert got.ranges() == {0: (4, 8)} and got.ranks[0].tables["u"].ids.numel() == 4
            assert not c.rejected


@pytest.mark.parametrize("stored", [{"ranks": {"0": 5}}, {"ranks": {"0": {"pos": "abc", "seq": 1}}}, {"ranks": 3},
                                    {"ranks": {"0": {"pos": -100, "seq": 1}}}])
def test_a_malformed_stored_position_is_a_typed_error(tmp_path, stored):
    """A rank entry that is an int, a position "abc" or -100: StreamDataError naming how to
    reset it, from the constructor and from ``committed()``, never AttributeError/ValueError."""
    root = _log(tmp_path, batches=2)
    broker = MemoryBroker()
    _ship(root, broker)
    from persistent_delta.fleet.subjects import offsets_key

    broker.connect().kv_put(JOB, subjects.OFFSETS, offsets_key("r", "lookups"), codec.pack(stored))
    if isinstance(stored["ranks"], dict):
        with pytest.raises(StreamDataError, match="reset"):
            RemoteConsumer(None, JOB, "r", transport=broker.connect(), key=KEY)
    with RemoteConsumer(None, JOB, "other", transport=broker.connect(), key=KEY) as c:
        c.commit()
        broker.connect().kv_put(JOB, subjects.OFFSETS, offsets_key("other", "lookups"), codec.pack(stored))
        if isinstance(stored["ranks"], dict):
            with pytest.raises(StreamDataError):
                c.committed()
        else:
            assert c.committed() == {}


@pytest.mark.parametrize("deferred", [-1, 1 << 62, "3", 2.5, True])
def test_a_markers_deferred_count_is_bounded(deferred):
    """A marker's ``deferred`` (rows capped publishes left pending) is a bounded count: a forged
    one is a typed error, a good one reaches the range's info."""
    body = {"v": FORMAT_VERSION, "epoch": "e", "start": 0, "end": 4, "parts": [], "digests": [], "shipped": 0.0}
    assert wire.Marker.decode(codec.pack(dict(body, deferred=7)), 0, "test").info["deferred"] == 7
    with pytest.raises(StreamDataError, match="deferred"):
        wire.Marker.decode(codec.pack(dict(body, deferred=deferred)), 0, "test")
