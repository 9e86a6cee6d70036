"""Both transports keep the ``Transport`` protocol's promises alike: the NATS JetStream connection
(against a local server) and the in-process memory transport show the same observable behaviour
for message-id de-duplication, per-subject order, reads by filter, compare-and-set on keys
(a lost one raises ``KeyConflictError``), objects, wake-ups and use after close, and a job
laid out over two streams (routing by subject, reads by stream, overlapping subjects refused)."""

from __future__ import annotations

import threading
from typing import Iterator

import pytest

from nats_servers import nats_server  # noqa: F401 - fixture
from persistent_delta.errors import KeyConflictError, StreamLayoutError, TransportError
from persistent_delta.fleet import subjects
from persistent_delta.fleet.memory import MemoryBroker
from persistent_delta.fleet.nats import Connection
from persistent_delta.fleet.streams import Layout
from persistent_delta.fleet.transport import StreamOptions, Transport
from persistent_delta.fleet.wire import Message

JOB = "job-contract"


@pytest.fixture(params=["memory", "nats"])
def transport(request) -> Iterator[Transport]:
    if request.param == "memory":
        conn: Transport = MemoryBroker().connect()
    else:
        conn = Connection(request.getfixturevalue("nats_server").url)
    assert isinstance(conn, Transport)
    try:
        yield conn
    finally:
        conn.close()


def _msg(subject: str, data: bytes, mid: str) -> Message:
    return Message(subject, data, {"PD-Format": "1", "PD-Test": mid}, mid)


def test_a_message_id_is_stored_once_and_a_subject_keeps_its_order(transport):
    assert not transport.job_exists(JOB)  # asking creates nothing
    assert not transport.job_exists(JOB)
    transport.ensure_job(JOB, StreamOptions())
    assert transport.job_exists(JOB) and transport.connected
    assert transport.stream_id(JOB) and transport.stream_id(JOB) == transport.stream_id(JOB)
    transport.ensure_job(JOB, StreamOptions())  # idempotent
    a, b = subjects.data_subject(JOB, "lookups", 0, "t"), subjects.end_subject(JOB, "lookups", 0)
    other = subjects.end_subject(JOB, "lookups", 1)
    sent = [_msg(a, b"a1", "1"), _msg(a, b"dup", "1"), _msg(b, b"b1", "2"), _msg(other, b"o", "3"), _msg(a, b"a2", "4")]
    assert transport.send_all(sent) == []
    assert transport.send_all([_msg(a, b"again", "1")]) == []  # a re-send: acknowledged, not stored
    got, more = transport.get_batch(JOB, subjects.rank_filter(JOB, "lookups", 0), 1, 100, 1 << 20)
    assert [(m.subject, m.data, m.headers["PD-Test"]) for m in got] == [(a, b"a1", "1"), (b, b"b1", "2"), (a, b"a2", "4")]
    assert not more
    seqs = [m.seq for m in got]
    assert seqs == sorted(seqs) and len(set(seqs)) == 3
    first, more = transport.get_batch(JOB, subjects.rank_filter(JOB, "lookups", 0), 1, 1, 1 << 20)
    assert [m.data for m in first] == [b"a1"] and more
    rest, more = transport.get_batch(JOB, subjects.rank_filter(JOB, "lookups", 0), seqs[0] + 1, 100, 1 << 20)
    assert [m.data for m in rest] == [b"b1", b"a2"] and not more
    ends, _ = transport.get_batch(JOB, subjects.ends_filter(JOB, "lookups"), 1, 100, 1 << 20)
    assert [m.data for m in ends] == [b"b1", b"o"]
    last = transport.last_message(JOB, a)
    assert last is not None and last.data == b"a2" and last.seq == seqs[2] and last.subject == a
    assert transport.last_message(JOB, subjects.end_subject(JOB, "snapshots", 0)) is None
    assert transport.max_payload > 0 and transport.servers


def test_compare_and_set_on_a_key_and_a_lost_one_raises_key_conflict(transport):
    transport.ensure_job(JOB, StreamOptions())
    r1 = transport.kv_create(JOB, subjects.LOCKS, "k", b"one")
    with pytest.raises(KeyConflictError):
        transport.kv_create(JOB, subjects.LOCKS, "k", b"two")
    r2 = transport.kv_update(JOB, subjects.LOCKS, "k", b"two", r1)
    assert r2 > r1
    with pytest.raises(KeyConflictError):
        transport.kv_update(JOB, subjects.LOCKS, "k", b"three", r1)
    assert transport.kv_get(JOB, subjects.LOCKS, "k") == (b"two", r2)
    transport.kv_delete(JOB, subjects.LOCKS, "k")
    transport.kv_delete(JOB, subjects.LOCKS, "never")  # no error
    assert transport.kv_get(JOB, subjects.LOCKS, "k") is None
    with pytest.raises(KeyConflictError):
        transport.kv_update(JOB, subjects.LOCKS, "k", b"four", r2)
    assert transport.kv_create(JOB, subjects.LOCKS, "k", b"back") > r2  # a deleted key may be created again
    for key in ("tables.1", "tables.0", "ship.0.lookups"):
        transport.kv_put(JOB, subjects.META, key, key.encode())
    tables = transport.kv_entries(JOB, subjects.META, subjects.TABLES_KEYS)
    assert list(tables) == ["tables.0", "tables.1"] and tables["tables.1"].value == b"tables.1"
    assert list(transport.kv_entries(JOB, subjects.OFFSETS)) == []


def test_objects_wake_ups_unknown_jobs_and_use_after_close(transport):
    assert transport.object_get(JOB, subjects.base_name(0)) is None
    transport.object_put(JOB, subjects.base_name(0), b"x" * 100_000)  # before any ensure_job
    assert transport.object_get(JOB, subjects.base_name(0)) == b"x" * 100_000
    with pytest.raises(TransportError):
        transport.kv_get("job-none", subjects.META, "k")
    transport.ensure_job(JOB, StreamOptions())
    woke = threading.Event()
    transport.watch(subjects.ends_filter(JOB, "lookups"), woke)
    transport.send_all([_msg(subjects.data_subject(JOB, "lookups", 0, "t"), b"p", "p")])
    assert not woke.wait(0.3)
    transport.send_all([_msg(subjects.end_subject(JOB, "lookups", 3), b"m", "m")])
    assert woke.wait(5)
    transport.close()
    transport.close()  # idempotent
    with pytest.raises(TransportError):
        transport.kv_get(JOB, subjects.META, "k")
    m = _msg(subjects.end_subject(JOB, "lookups", 0), b"late", "late")
    assert transport.send_all([m]) == [m]


def test_a_job_over_two_streams_routes_each_rank_to_its_groups_stream(transport):
    """A job laid out over rank groups: each rank's messages go to its group's stream (numbered
    from 1 there), reads name the stream, a subject no stream takes is not acknowledged, and the
    job's single stream cannot be created over the group streams' subjects."""
    layout = Layout(JOB, 2)
    s0, s1 = layout.stream(0), layout.stream(2)
    assert (s0, s1) == (f"PDG_{JOB}_0", f"PDG_{JOB}_1") and layout.stream(1) == s0
    transport.ensure_job(JOB, StreamOptions(), streams={})  # the buckets only
    assert transport.job_exists(JOB, streams=()) and not transport.job_exists(JOB)
    transport.ensure_job(JOB, StreamOptions(), streams=layout.spec(0))
    assert transport.job_exists(JOB, streams=[s0]) and not transport.job_exists(JOB, streams=[s0, s1])
    transport.ensure_job(JOB, StreamOptions(), streams=layout.spec(3))
    transport.ensure_job(JOB, StreamOptions(), streams=layout.spec(2))  # idempotent
    assert transport.job_exists(JOB, streams=[s0, s1])
    assert transport.stream_id(JOB, stream=s0) != transport.stream_id(JOB, stream=s1)
    sent = [_msg(subjects.data_subject(JOB, "lookups", r, "t"), f"d{r}".encode(), f"d{r}") for r in range(4)]
    sent += [_msg(subjects.end_subject(JOB, "snapshots", r), f"e{r}".encode(), f"e{r}") for r in range(4)]
    assert transport.send_all(sent) == []
    stray = _msg(subjects.end_subject(JOB, "lookups", 4), b"no stream", "stray")  # rank 4: group 2, not created
    assert transport.send_all([stray]) == [stray]
    got, more = transport.get_batch(JOB, subjects.rank_filter(JOB, "lookups", 2), 1, 100, 1 << 20, stream=s1)
    assert [(m.seq, m.data) for m in got] == [(1, b"d2")] and not more
    ends, _ = transport.get_batch(JOB, subjects.ends_filter(JOB, "snapshots"), 1, 100, 1 << 20, stream=s0)
    assert [m.data for m in ends] == [b"e0", b"e1"]
    ends, _ = transport.get_batch(JOB, subjects.ends_filter(JOB, "snapshots"), 1, 100, 1 << 20, stream=s1)
    assert [(m.seq, m.data) for m in ends] == [(3, b"e2"), (4, b"e3")]
    last = transport.last_message(JOB, subjects.end_subject(JOB, "snapshots", 3), stream=s1)
    assert last is not None and last.data == b"e3"
    assert transport.last_message(JOB, subjects.end_subject(JOB, "snapshots", 3), stream=s0) is None
    with pytest.raises(StreamLayoutError):  # pd.<job>.> overlaps both group streams' subjects
        transport.ensure_job(JOB, StreamOptions())
    assert not transport.job_exists(JOB)
