"""The transport: the seam between the fleet and a streaming engine.

Owns: the :class:`Transport` protocol -- exactly what the shipper
(:mod:`persistent_delta.fleet.ship`), the remote consumer (:mod:`persistent_delta.fleet.remote`)
and ``persistent-delta offsets --server`` ask of a streaming engine -- with the types it
speaks (:class:`StoredMessage`, :class:`KvEntry`, :class:`StreamOptions`,
:class:`ConnectOptions`). The default implementation for a server URL
(:class:`persistent_delta.fleet.nats.Connection`, NATS JetStream) is opened by
:func:`persistent_delta.fleet.connect.open_transport`.
:class:`persistent_delta.fleet.memory.MemoryTransport` is a second implementation, in process.
What travels is :mod:`persistent_delta.fleet.wire`'s; its names are
:mod:`persistent_delta.fleet.subjects`'.

Design note
-----------
A transport is a connection to one streaming engine that holds, per job, append-only
**streams** of messages (each with a subject, headers, payload, and a sequence number that
increases along its stream): by default one, ``PD_<job>``; a job laid out over rank groups
has one per group (:mod:`persistent_delta.fleet.streams`), and the calls that read a stream
name it (``stream``; None: the job's single stream). A message goes to the stream whose
subjects select it, as JetStream routes a publish. Per job there are also three small **key-value buckets** (``meta``, ``offsets``,
``locks``; :data:`~persistent_delta.fleet.subjects.BUCKETS`) with revisions for
compare-and-set, and an **object store** (``base``) for large values. A Kafka implementation
would map a stream to a topic (a partition per channel and rank, the subject as the record key,
the message id as the idempotent producer's key for de-duplication) and the buckets to
compacted topics; the shipper and the remote consumer would not change.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Dict, List, Mapping, NamedTuple, Optional, Protocol, Sequence, Tuple, Union, runtime_checkable

from persistent_delta.fleet.wire import Message

ServerSpec = Union[str, Sequence[str]]


class StoredMessage(NamedTuple):
    """A message as read back from one of a job's streams.

    Attributes:
        seq: its sequence number in that stream (from 1; increases along the stream).
        subject: its subject.
        headers: the headers it was sent with (a transport may add its own).
        data: its payload.
    """

    seq: int
    subject: str
    headers: Dict[str, str]
    data: bytes


class KvEntry(NamedTuple):
    """A key's value in a key-value bucket, and its revision (for compare-and-set)."""

    value: bytes
    revision: int


@dataclass(frozen=True)
class StreamOptions:
    """A job's stream and buckets, as created by the first shipper (later ones reuse them).

    Attributes:
        replicas: replicas of the stream and buckets (3 in a 3-node cluster).
        max_bytes / max_age_s: the stream's own limits (-1 / 0: none). The oldest messages go
            first; a remote consumer whose next range was dropped gets
            :class:`~persistent_delta.errors.OffsetOutOfRangeError` (or its reset policy),
            never a silent gap.
        duplicate_window_s: the transport drops a re-sent message id within this window.
        lock_ttl_s: a key of the ``locks`` bucket expires this long after its last write (a
            dead remote consumer's name is free again).
    """

    replicas: int = 1
    max_bytes: int = -1
    max_age_s: float = 0.0
    duplicate_window_s: float = 120.0
    lock_ttl_s: float = 6.0


@dataclass(frozen=True)
class ConnectOptions:
    """How to reach the servers of a URL: authentication and TLS (passed through to the
    client library: nats-py for ``nats://`` and ``tls://``).

    Attributes:
        token: a server token. user / password: user credentials.
        creds: a ``.creds`` file (JWT + nkey seed). nkeys_seed: an nkey seed file.
        tls_ca / tls_cert / tls_key: PEM files for TLS (``tls://`` URLs, or any with tls_ca).
        connect_timeout: seconds per connection attempt.
        request_timeout: seconds a request (a send's acknowledgement, a key, a read) may take.
    """

    token: Optional[str] = None
    user: Optional[str] = None
    password: Optional[str] = None
    creds: Optional[str] = None
    nkeys_seed: Optional[str] = None
    tls_ca: Optional[str] = None
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    connect_timeout: float = 2.0
    request_timeout: float = 5.0


@runtime_checkable
class Transport(Protocol):
    """What the fleet needs of a streaming engine: a connection to it.

    **Call order.** The constructor connects (an implementation's own; :func:`open_transport`
    for a URL). :meth:`ensure_job` comes before any other call about a job, by the shipper side
    only (a shipper; it is idempotent); a remote consumer asks :meth:`job_exists` and creates
    nothing (it may hold read-only permissions). :meth:`object_put` and
    :meth:`object_get` need no :meth:`ensure_job` (a base may be uploaded before any shipper
    ran). Then any method, in any order, until :meth:`close`. Every method takes the job's
    name (:func:`~persistent_delta.fleet.subjects.check_job`) and, for buckets, ``what``:
    one of :data:`~persistent_delta.fleet.subjects.BUCKETS`.

    **Who calls what.** The shipper: :meth:`ensure_job`, :meth:`send_all` (the parts of a range,
    then its marker), :meth:`last_message` (its last marker, after a restart), :meth:`kv_get`,
    :meth:`kv_put` and :meth:`kv_create` (the job's layout) on ``meta``, :attr:`max_payload`; :meth:`object_put` for a base. A
    remote consumer: :meth:`job_exists`, :meth:`get_batch`, :meth:`last_message`,
    :meth:`stream_id`, :meth:`watch`, :meth:`kv_get` (the job's layout) and :meth:`kv_entries` on
    ``meta``, :meth:`kv_get` / :meth:`kv_put` on
    ``offsets``, :meth:`kv_create` / :meth:`kv_update` / :meth:`kv_delete` on ``locks``,
    :meth:`object_get`. ``offsets --server``: :meth:`kv_entries`, :meth:`kv_get`,
    :meth:`kv_put`, :meth:`kv_delete`, :meth:`last_message`.

    **Promises.** A message id accepted within the stream's duplicate window
    (:attr:`StreamOptions.duplicate_window_s`) is acknowledged again and not stored twice.
    Messages sent by one :meth:`send_all` on one subject are stored in their order, and a
    sequence number is never reused. A bucket key's revision increases with every write;
    :meth:`kv_create` and :meth:`kv_update` are atomic compare-and-sets. Keys of ``locks``
    expire :attr:`StreamOptions.lock_ttl_s` after their last write.

    **Threads and processes.** Every method is thread-safe (a remote consumer's heartbeat
    thread shares its connection). A transport belongs to the process that opened it: open
    another one after a fork.

    **Errors.** A method that needs the engine raises
    :class:`~persistent_delta.errors.TransportError` when it cannot be reached in time or
    refuses the request (also: a job whose stream or buckets do not exist, any call after
    :meth:`close`); a request the engine refuses for the user's permissions raises
    :class:`~persistent_delta.errors.PermissionDeniedError` (a ``TransportError``) naming what was
    refused; a lost compare-and-set raises
    :class:`~persistent_delta.errors.KeyConflictError`. :meth:`send_all` raises nothing: it
    returns what was not acknowledged.
    """

    @property
    def servers(self) -> Sequence[str]:
        """Where it is connected (for messages and logs)."""
        ...

    @property
    def connected(self) -> bool:
        """Whether it is connected now (a client that reconnects by itself may not be, for a while)."""
        ...

    @property
    def max_payload(self) -> int:
        """The largest message payload, in bytes, headers included."""
        ...

    def ensure_job(self, job: str, opts: StreamOptions, streams: Optional[Mapping[str, Sequence[str]]] = None
                   ) -> None:
        """Create the job's key-value buckets and the streams ``streams`` (name -> subject
        filters; default: the job's single stream ``PD_<job>`` taking ``pd.<job>.>``) where
        missing (idempotent); ``opts`` apply to what this call creates.

        Raises:
            StreamLayoutError: a stream's subjects overlap another existing stream's (JetStream
                refuses it: one subject, one stream).
        """
        ...

    def job_exists(self, job: str, streams: Optional[Sequence[str]] = None) -> bool:
        """Whether every key-value bucket of the job and the streams ``streams`` (default: the
        job's single stream) exist now (creates nothing: a remote consumer asks, only a shipper
        creates)."""
        ...

    def send_all(self, msgs: Sequence[Message]) -> List[Message]:
        """Send ``msgs`` to the streams that take their subjects and wait for their
        acknowledgements. Returns the messages not acknowledged, to be sent again with the
        same ids (a message already stored under its id is acknowledged, not stored again)."""
        ...

    def get_batch(self, job: str, subject: str, seq: int, batch: int, max_bytes: int, stream: Optional[str] = None
                  ) -> Tuple[List[StoredMessage], bool]:
        """The messages of stream ``stream`` (default: the job's single stream) on ``subject`` (a filter: ``*`` one token, a last ``>`` the rest)
        from stream sequence ``seq`` on, at most ``batch`` of them and about ``max_bytes`` (at
        least one). Returns ``(messages, more)``: ``more`` is False when no message on
        ``subject`` follows the last one returned (a reader that caught up need not ask again
        until :meth:`watch` signals)."""
        ...

    def last_message(self, job: str, subject: str, stream: Optional[str] = None) -> Optional[StoredMessage]:
        """The last message on ``subject`` (an exact subject) of stream ``stream`` (default:
        the job's single stream), or None."""
        ...

    def stream_id(self, job: str, stream: Optional[str] = None) -> str:
        """An identifier of stream ``stream`` of the job (default: its single stream) as
        created: a stream deleted and created again has another (its sequence numbers started
        again at 1)."""
        ...

    def watch(self, subject: str, event: threading.Event) -> None:
        """Set ``event`` whenever a message on ``subject`` (a filter) is sent, until
        :meth:`close` (a wake-up signal, best effort: readers re-check on a timer)."""
        ...

    def kv_get(self, job: str, what: str, key: str) -> Optional[KvEntry]:
        """A key's value and revision, or None (missing, deleted or expired)."""
        ...

    def kv_entries(self, job: str, what: str, prefix: str = "") -> Dict[str, KvEntry]:
        """The live keys of a bucket that start with ``prefix``, sorted, with their entries:
        every key live for the whole call is listed, also while others write to the bucket."""
        ...

    def kv_put(self, job: str, what: str, key: str, value: bytes) -> int:
        """Write a key unconditionally; returns its new revision."""
        ...

    def kv_create(self, job: str, what: str, key: str, value: bytes) -> int:
        """Create a key that must not exist (deleted and expired keys do not); returns its
        revision.

        Raises:
            KeyConflictError: the key exists.
        """
        ...

    def kv_update(self, job: str, what: str, key: str, value: bytes, last: int) -> int:
        """Write a key that is at revision ``last``; returns its new revision.

        Raises:
            KeyConflictError: the key is at another revision (or gone).
        """
        ...

    def kv_delete(self, job: str, what: str, key: str) -> None:
        """Delete a key (a missing key is no error)."""
        ...

    def object_put(self, job: str, name: str, data: bytes, replicas: int = 1) -> None:
        """Store ``data`` as object ``name`` of the job's object store, replacing it (the store
        is created where missing, with ``replicas``)."""
        ...

    def object_get(self, job: str, name: str) -> Optional[bytes]:
        """Object ``name`` of the job's object store, or None (no such object or store)."""
        ...

    def close(self) -> None:
        """Close the connection (idempotent); the engine keeps what it stored."""
        ...


__all__ = ["Transport", "StoredMessage", "KvEntry", "StreamOptions", "ConnectOptions", "ServerSpec"]
