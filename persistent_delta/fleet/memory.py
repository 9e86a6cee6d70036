"""An in-process transport: the fleet's streaming engine held in this process's memory.

Owns: :class:`MemoryBroker` (the engine: per job its streams -- one by default, or one per rank
group -- its key-value buckets and its object store) and :class:`MemoryTransport` (a connection to it, a
:class:`~persistent_delta.fleet.transport.Transport`). It keeps every promise of the protocol
-- message-id de-duplication within the duplicate window, per-subject order, one sequence per
stream, a message stored in the stream whose subjects select it (two streams never overlap), atomic compare-and-set on keys, expiring ``locks`` keys, the stream's byte and age
limits with the oldest messages dropped first -- so a shipper and a remote consumer in one
process run against it unchanged: tests without a server, and the proof that the seam holds
for an engine other than NATS. Nothing is durable: the broker lives as long as its process.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from persistent_delta.errors import InvalidInputError, KeyConflictError, StreamLayoutError, TransportError
from persistent_delta.fleet.subjects import (
    BUCKETS,
    LOCKS,
    check_job,
    filters_overlap,
    stream_name,
    stream_subjects,
    subject_matches,
)
from persistent_delta.fleet.transport import KvEntry, StoredMessage, StreamOptions
from persistent_delta.fleet.wire import Message


@dataclass
class _Stored:
    msg: StoredMessage
    size: int
    at: float


@dataclass
class _Bucket:
    ttl: Optional[float]
    revision: int = 0
    entries: Dict[str, Tuple[bytes, int, float]] = field(default_factory=dict)  # key -> (value, revision, written at)


@dataclass
class _Job:
    opts: StreamOptions
    buckets: Dict[str, _Bucket] = field(default_factory=dict)


@dataclass
class _Stream:
    job: str
    subjects: List[str]
    opts: StreamOptions
    messages: List[_Stored] = field(default_factory=list)
    next_seq: int = 1
    nbytes: int = 0
    ids: Dict[str, float] = field(default_factory=dict)  # message id -> when it was stored
    uid: str = field(default_factory=lambda: os.urandom(8).hex())  # this incarnation of the stream


class MemoryBroker:
    """The engine that :class:`MemoryTransport` connections share (one per test, say).

    Args:
        max_payload: the largest message, in bytes, headers included (NATS's default: 1 MiB).
        clock: seconds, increasing (``time.monotonic``); a test may pass its own to expire
            keys and ids without sleeping.

    Thread-safe: every operation holds the broker's lock.
    """

    def __init__(self, max_payload: int = 1 << 20, clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(max_payload, bool) or not isinstance(max_payload, int) or max_payload < 1:
            raise InvalidInputError(f"max_payload must be a positive int, got {max_payload!r}")
        self.max_payload = max_payload
        self.clock = clock
        self.lock = threading.Lock()
        self.jobs: Dict[str, _Job] = {}  # job -> its buckets
        self.streams: Dict[str, _Stream] = {}  # stream name -> its messages
        self.objects: Dict[str, Dict[str, bytes]] = {}
        self.watches: List[Tuple[str, threading.Event, "MemoryTransport"]] = []

    def connect(self, name: str = "memory") -> "MemoryTransport":
        """A new connection to this broker."""
        return MemoryTransport(self, name)


class MemoryTransport:
    """A connection to a :class:`MemoryBroker`; a :class:`~persistent_delta.fleet.transport.Transport`
    (see its contract). Thread-safe.

    Args:
        broker: the engine.
        name: how :attr:`servers` names it (``memory://<name>``).
    """

    def __init__(self, broker: MemoryBroker, name: str = "memory") -> None:
        self.broker = broker
        self._servers = [f"memory://{name}"]
        self._closed = False

    # ------------------------------------------------------------------ the connection
    @property
    def servers(self) -> Sequence[str]:
        """``["memory://<name>"]``."""
        return list(self._servers)

    @property
    def connected(self) -> bool:
        """Whether this connection is open."""
        return not self._closed

    @property
    def max_payload(self) -> int:
        """The broker's max payload, in bytes."""
        return self.broker.max_payload

    def close(self) -> None:
        """Close this connection (idempotent); the broker keeps what it stored."""
        with self.broker.lock:
            self._closed = True
            self.broker.watches = [w for w in self.broker.watches if w[2] is not self]

    def _job(self, job: str, what: str) -> _Job:
        """The job's buckets (the broker's lock held)."""
        if self._closed:
            raise TransportError(f"{what}: the connection to {self._servers[0]} is closed")
        j = self.broker.jobs.get(check_job(job))
        if j is None:
            raise TransportError(f"{what} on {self._servers[0]} failed: no buckets of job {job!r}")
        return j

    def _stream(self, job: str, stream: Optional[str], what: str) -> _Stream:
        """A stream of the job (None: its single stream; the broker's lock held)."""
        if self._closed:
            raise TransportError(f"{what}: the connection to {self._servers[0]} is closed")
        name = stream or stream_name(job)
        st = self.broker.streams.get(name)
        if st is None or st.job != check_job(job):
            raise TransportError(f"{what} on {self._servers[0]} failed: no stream {name}")
        return st

    # ------------------------------------------------------------------ stream and buckets
    def ensure_job(self, job: str, opts: StreamOptions, streams: Optional[Mapping[str, Sequence[str]]] = None
                   ) -> None:
        """Create the job's buckets and streams (default: its single stream) where missing
        (idempotent).

        Raises:
            StreamLayoutError: a new stream's subjects overlap an existing stream's.
        """
        wanted = {stream_name(job): [stream_subjects(job)]} if streams is None else dict(streams)
        with self.broker.lock:
            if self._closed:
                raise TransportError(f"create the stream of job {job!r}: the connection is closed")
            for name, subjects in wanted.items():
                if name in self.broker.streams:
                    continue
                for other in self.broker.streams.values():
                    if any(filters_overlap(a, b) for a in subjects for b in other.subjects):
                        raise StreamLayoutError(f"stream {name} of job {job!r} cannot take subjects {list(subjects)[:4]}: "
                                                f"they overlap another stream's on {self._servers[0]}")
                self.broker.streams[name] = _Stream(check_job(job), list(subjects), opts)
            if check_job(job) not in self.broker.jobs:
                self.broker.jobs[job] = _Job(opts, buckets={
                    what: _Bucket(opts.lock_ttl_s if what == LOCKS else None) for what in BUCKETS})

    def job_exists(self, job: str, streams: Optional[Sequence[str]] = None) -> bool:
        """Whether the job's buckets and streams (default: its single stream) exist."""
        names = [stream_name(job)] if streams is None else list(streams)
        with self.broker.lock:
            if self._closed:
                raise TransportError(f"look up the stream of job {job!r}: the connection is closed")
            return check_job(job) in self.broker.jobs and all(
                n in self.broker.streams and self.broker.streams[n].job == job for n in names)

    # ------------------------------------------------------------------ sending
    def send_all(self, msgs: Sequence[Message]) -> List[Message]:
        """Store ``msgs`` in the streams that take their subjects; returns the ones not stored
        (no such stream, over the max payload, or a closed connection). A message whose id was
        stored within the duplicate window is acknowledged and not stored again."""
        failed: List[Message] = []
        with self.broker.lock:
            now = self.broker.clock()
            for m in msgs:
                j = None if self._closed else next((st for st in self.broker.streams.values() if any(
                    subject_matches(f, m.subject) for f in st.subjects)), None)
                size = len(m.subject) + len(m.payload) + sum(len(k) + len(v) for k, v in m.headers.items()) + len(m.id)
                if j is None or size > self.broker.max_payload:
                    failed.append(m)
                    continue
                self._store(j, m, size, now)
        return failed

    def _store(self, j: _Stream, m: Message, size: int, now: float) -> None:
        window = j.opts.duplicate_window_s
        j.ids = {i: t for i, t in j.ids.items() if now - t < window}
        if m.id in j.ids:
            return  # a re-send within the window: acknowledged, not stored twice
        j.ids[m.id] = now
        stored = StoredMessage(j.next_seq, m.subject, dict(m.headers), bytes(m.payload))
        j.next_seq += 1
        j.messages.append(_Stored(stored, size, now))
        j.nbytes += size
        self._trim(j, now)
        for filter_, event, _ in self.broker.watches:
            if subject_matches(filter_, m.subject):
                event.set()

    @staticmethod
    def _trim(j: _Stream, now: float) -> None:
        """Drop the oldest messages past the stream's byte or age limit."""
        drop = 0
        while drop < len(j.messages) and (
                (j.opts.max_bytes >= 0 and j.nbytes > j.opts.max_bytes)
                or (j.opts.max_age_s > 0 and now - j.messages[drop].at > j.opts.max_age_s)):
            j.nbytes -= j.messages[drop].size
            drop += 1
        if drop:
            del j.messages[:drop]

    # ------------------------------------------------------------------ reading
    def get_batch(self, job: str, subject: str, seq: int, batch: int, max_bytes: int, stream: Optional[str] = None
                  ) -> Tuple[List[StoredMessage], bool]:
        """The stream's (default: the job's single stream) messages on ``subject`` (a filter)
        from sequence ``seq`` on: at most ``batch``, about ``max_bytes`` (at least one).
        Returns ``(messages, more)``."""
        with self.broker.lock:
            j = self._stream(job, stream, f"read {subject} from seq {seq}")
            self._trim(j, self.broker.clock())
            out: List[StoredMessage] = []
            held = 0
            for s in j.messages:
                if s.msg.seq < seq or not subject_matches(subject, s.msg.subject):
                    continue
                if out and (len(out) >= batch or held + len(s.msg.data) > max_bytes):
                    return out, True
                out.append(s.msg)
                held += len(s.msg.data)
            return out, False

    def last_message(self, job: str, subject: str, stream: Optional[str] = None) -> Optional[StoredMessage]:
        """The stream's (default: the job's single stream) last message on ``subject``, or None."""
        with self.broker.lock:
            j = self._stream(job, stream, f"read the last message on {subject}")
            self._trim(j, self.broker.clock())
            for s in reversed(j.messages):
                if s.msg.subject == subject:
                    return s.msg
            return None

    def stream_id(self, job: str, stream: Optional[str] = None) -> str:
        """An identifier of the stream (default: the job's single stream) as created."""
        with self.broker.lock:
            return self._stream(job, stream, "identify the stream").uid

    def watch(self, subject: str, event: threading.Event) -> None:
        """Set ``event`` whenever a message on ``subject`` (a filter) is stored, until :meth:`close`."""
        with self.broker.lock:
            if self._closed:
                raise TransportError(f"subscribe {subject}: the connection is closed")
            self.broker.watches.append((subject, event, self))

    # ------------------------------------------------------------------ key-value buckets
    def _bucket(self, job: str, what: str, doing: str) -> _Bucket:
        """A bucket with its expired keys dropped (the broker's lock held)."""
        b = self._job(job, doing).buckets.get(what)
        if b is None:
            raise TransportError(f"{doing} on {self._servers[0]} failed: no bucket {what!r} of job {job!r}")
        if b.ttl:
            now = self.broker.clock()
            ttl = b.ttl
            b.entries = {k: e for k, e in b.entries.items() if now - e[2] < ttl}
        return b

    def _write(self, b: _Bucket, key: str, value: bytes) -> int:
        b.revision += 1
        b.entries[key] = (bytes(value), b.revision, self.broker.clock())
        return b.revision

    def kv_get(self, job: str, what: str, key: str) -> Optional[KvEntry]:
        """A key's value and revision, or None."""
        with self.broker.lock:
            e = self._bucket(job, what, f"read {what}/{key}").entries.get(key)
            return None if e is None else KvEntry(e[0], e[1])

    def kv_entries(self, job: str, what: str, prefix: str = "") -> Dict[str, KvEntry]:
        """The live keys of a bucket that start with ``prefix``, sorted, with their entries."""
        with self.broker.lock:
            b = self._bucket(job, what, f"list {what}")
            return {k: KvEntry(e[0], e[1]) for k, e in sorted(b.entries.items()) if k.startswith(prefix)}

    def kv_put(self, job: str, what: str, key: str, value: bytes) -> int:
        """Write a key unconditionally; returns its new revision."""
        with self.broker.lock:
            return self._write(self._bucket(job, what, f"write {what}/{key}"), key, value)

    def kv_create(self, job: str, what: str, key: str, value: bytes) -> int:
        """Create a key that must not exist; returns its revision.

        Raises:
            KeyConflictError: the key exists.
        """
        with self.broker.lock:
            b = self._bucket(job, what, f"create {what}/{key}")
            if key in b.entries:
                raise KeyConflictError(f"{what}/{key} of job {job!r} exists")
            return self._write(b, key, value)

    def kv_update(self, job: str, what: str, key: str, value: bytes, last: int) -> int:
        """Write a key that is at revision ``last``; returns its new revision.

        Raises:
            KeyConflictError: the key is at another revision (or gone).
        """
        with self.broker.lock:
            b = self._bucket(job, what, f"update {what}/{key}")
            e = b.entries.get(key)
            if e is None or e[1] != last:
                raise KeyConflictError(f"{what}/{key} of job {job!r} is no longer at revision {last}")
            return self._write(b, key, value)

    def kv_delete(self, job: str, what: str, key: str) -> None:
        """Delete a key (a missing key is no error)."""
        with self.broker.lock:
            b = self._bucket(job, what, f"delete {what}/{key}")
            if b.entries.pop(key, None) is not None:
                b.revision += 1

    # ------------------------------------------------------------------ objects
    def object_put(self, job: str, name: str, data: bytes, replicas: int = 1) -> None:
        """Store ``data`` as object ``name`` of the job's store (``replicas``: one copy here)."""
        with self.broker.lock:
            if self._closed:
                raise TransportError(f"store object {name}: the connection is closed")
            self.broker.objects.setdefault(check_job(job), {})[name] = bytes(data)

    def object_get(self, job: str, name: str) -> Optional[bytes]:
        """Object ``name`` of the job's store, or None."""
        with self.broker.lock:
            if self._closed:
                raise TransportError(f"read object {name}: the connection is closed")
            return self.broker.objects.get(check_job(job), {}).get(name)

    def __repr__(self) -> str:
        return f"MemoryTransport({self._servers[0]!r})"


__all__ = ["MemoryBroker", "MemoryTransport"]
