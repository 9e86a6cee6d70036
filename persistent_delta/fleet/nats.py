"""The NATS JetStream transport: a synchronous connection to a NATS server or cluster.

Owns: :class:`Connection`, the :class:`~persistent_delta.fleet.transport.Transport` for
``nats://`` and ``tls://`` URLs -- nats-py's asyncio client on a private event-loop thread, the
job's stream and buckets as JetStream streams, key-value buckets and an object store. nats-py
is an optional dependency (``pip install nats-py``), imported when a connection is opened.

Design note
-----------
The stream ``PD_<job>`` takes the subjects ``pd.<job>.>`` (a rank group's stream
``PDG_<job>_<g>`` its ranks' subjects: :mod:`persistent_delta.fleet.streams`; file storage, ``discard=old``,
direct gets allowed, no message size limit beyond the server's max payload); a message id
travels as ``Nats-Msg-Id``, which the server de-duplicates within the stream's duplicate
window. A bucket is a JetStream key-value bucket (history 1; ``locks`` with the lock TTL as
its max age), and a revision is its stream sequence. Reads are batch direct gets from a
stream sequence on (stateless on the server: nothing to recreate after a restart or a
leader change). Key listings read the bucket stream's per-subject state rather than nats-py's
``keys()`` (see :meth:`Connection.kv_entries`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
from typing import Any, Awaitable, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar

from persistent_delta.errors import (
    InvalidInputError,
    StreamLayoutError,
    KeyConflictError,
    PermissionDeniedError,
    PersistentDeltaError,
    TransportError,
)
from persistent_delta.fleet.subjects import BASE, BUCKETS, LOCKS, bucket, stream_name, stream_subjects
from persistent_delta.fleet.transport import ConnectOptions, KvEntry, ServerSpec, StoredMessage, StreamOptions
from persistent_delta.fleet.wire import Message

logger = logging.getLogger(__name__)

_MSG_ID = "Nats-Msg-Id"
_T = TypeVar("_T")


def nats_kwargs(options: ConnectOptions) -> Dict[str, Any]:
    """nats-py's ``connect`` arguments for ``options`` (authentication, TLS, timeout)."""
    kw: Dict[str, Any] = {"connect_timeout": options.connect_timeout}
    if options.token:
        kw["token"] = options.token
    if options.user:
        kw["user"], kw["password"] = options.user, options.password
    if options.creds:
        kw["user_credentials"] = options.creds
    if options.nkeys_seed:
        kw["nkeys_seed"] = options.nkeys_seed
    if options.tls_ca or options.tls_cert:
        import ssl

        ctx = ssl.create_default_context(cafile=options.tls_ca)
        if options.tls_cert:
            ctx.load_cert_chain(options.tls_cert, options.tls_key)
        kw["tls"] = ctx
    return kw


def _servers(server: ServerSpec) -> List[str]:
    urls = [server] if isinstance(server, str) else list(server)
    out = []
    for u in urls:
        out += [p.strip() for p in u.split(",") if p.strip()]
    if not out:
        raise InvalidInputError("no server given (nats://HOST:PORT)")
    return out


class Connection:
    """A synchronous JetStream connection: nats-py's asyncio client on a private event-loop
    thread; a :class:`~persistent_delta.fleet.transport.Transport` (see its contract).
    Thread-safe (calls are serialised onto the loop). Reconnects forever in the background;
    calls that need the server raise :class:`TransportError` after their timeout.

    Args:
        server: ``nats://HOST:PORT`` (or several, comma-separated, or a list: a cluster).
        options: authentication, TLS and timeouts.
        wait: seconds to keep trying to connect.

    Raises:
        TransportError: the servers cannot be reached within ``wait``.
        InvalidInputError: no server given.
    """

    def __init__(self, server: ServerSpec, options: Optional[ConnectOptions] = None, wait: float = 0.0) -> None:
        import nats  # optional dependency: pip install nats-py

        self.servers = _servers(server)
        self.options = options or ConnectOptions()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pd-nats", daemon=True)
        self._thread.start()
        self._closed = False
        self._subs: List[Any] = []
        self._denied: Tuple[float, str] = (0.0, "")  # the server's last permissions violation: (when, what)
        kw = nats_kwargs(self.options)

        async def connect() -> Any:
            return await nats.connect(servers=self.servers, allow_reconnect=True, max_reconnect_attempts=-1,
                                      reconnect_time_wait=0.1, ping_interval=2, max_outstanding_pings=2,
                                      error_cb=self._on_error, **kw)

        deadline = time.monotonic() + wait
        while True:
            try:
                self.nc = self._call(connect(), timeout=self.options.connect_timeout * (len(self.servers) + 1) + 2)
                break
            except Exception as exc:  # noqa: BLE001 - any failure to connect is retried or reported
                if time.monotonic() >= deadline:
                    self._stop_loop()
                    raise TransportError(f"cannot connect to {','.join(self.servers)}: {exc!r}") from exc
                time.sleep(0.2)
        self.js = self.nc.jetstream(timeout=self.options.request_timeout)

    async def _on_error(self, exc: Exception) -> None:
        logger.debug("nats: %r", exc)
        text = str(exc)
        if "permissions violation" in text.lower():  # a denied publish is otherwise only a timeout
            self._denied = (time.monotonic(), text[:300])

    def _call(self, coro: Awaitable[_T], timeout: Optional[float] = None) -> _T:
        fut: "concurrent.futures.Future[_T]" = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise

    def call(self, what: str, fn: Callable[[], Awaitable[_T]], timeout: Optional[float] = None) -> _T:
        """Run ``fn()`` on the loop; any failure is :class:`TransportError` naming ``what``
        (our own typed errors pass through)."""
        if self._closed:
            raise TransportError(f"{what}: the connection to {','.join(self.servers)} is closed")
        t = timeout if timeout is not None else self.options.request_timeout + 1
        started = time.monotonic()
        try:
            return self._call(fn(), t)
        except PersistentDeltaError:
            raise
        except Exception as exc:  # noqa: BLE001 - nats-py raises many types; callers act on one
            when, denied = self._denied
            if when >= started:
                raise PermissionDeniedError(
                    f"{what} on {','.join(self.servers)}: refused by the server's permissions for user "
                    f"{self.options.user or '(token/creds)'} ({denied}); see docs/guides/security.md") from exc
            raise TransportError(f"{what} on {','.join(self.servers)} failed: {exc!r}") from exc

    @property
    def connected(self) -> bool:
        """Whether the client is connected now (it reconnects by itself)."""
        return bool(self.nc.is_connected)

    @property
    def max_payload(self) -> int:
        """The server's max payload, in bytes."""
        return int(self.nc.max_payload or (1 << 20))

    # ------------------------------------------------------------------ stream and buckets
    def ensure_job(self, job: str, opts: StreamOptions, streams: Optional[Mapping[str, Sequence[str]]] = None
                   ) -> None:
        """Create the job's buckets and streams (default: its single stream) where missing
        (idempotent; retried while a cluster elects leaders).

        Raises:
            StreamLayoutError: a stream's subjects overlap another stream's (the server's
                error 10065).
        """
        from nats.js import api

        wanted = {stream_name(job): [stream_subjects(job)]} if streams is None else dict(streams)

        async def ensure() -> None:
            for name, subjects in wanted.items():
                try:
                    await self.js.stream_info(name)
                    continue
                except Exception:  # noqa: BLE001 - not found (or not yet elected): create
                    pass
                try:
                    await self.js.add_stream(api.StreamConfig(
                        name=name, subjects=list(subjects), storage=api.StorageType.FILE, num_replicas=opts.replicas,
                        max_bytes=opts.max_bytes, max_age=opts.max_age_s or None, discard=api.DiscardPolicy.OLD,
                        duplicate_window=opts.duplicate_window_s, allow_direct=True, max_msg_size=-1))
                except Exception as exc:  # noqa: BLE001 - one error is ours to type: overlapping subjects
                    if getattr(exc, "err_code", None) == 10065 or "overlap" in str(exc).lower():
                        raise StreamLayoutError(
                            f"stream {name} of job {job!r} cannot take subjects {list(subjects)[:4]}: they overlap "
                            f"another stream's on {','.join(self.servers)} (the job has another layout)") from exc
                    raise
            for what in BUCKETS:
                ttl = opts.lock_ttl_s if what == LOCKS else None
                try:
                    await self.js.key_value(bucket(job, what))
                except Exception:  # noqa: BLE001
                    await self.js.create_key_value(bucket=bucket(job, what), history=1, replicas=opts.replicas,
                                                   ttl=ttl, storage=api.StorageType.FILE)

        self.retry(f"create the stream of job {job!r}", ensure, attempts=20)

    def job_exists(self, job: str, streams: Optional[Sequence[str]] = None) -> bool:
        """Whether the job's streams (default: its single stream) and every bucket exist (one
        stream-info request each)."""
        from nats.js.errors import NotFoundError

        names = [stream_name(job)] if streams is None else list(streams)

        async def exists() -> bool:
            for name in names + [f"KV_{bucket(job, what)}" for what in BUCKETS]:
                try:
                    await self.js.stream_info(name)
                except NotFoundError:
                    return False
            return True

        return self.call(f"look up the stream of job {job!r}", exists)

    def retry(self, what: str, fn: Callable[[], Awaitable[_T]], attempts: int = 10, pause: float = 0.25) -> _T:
        """:meth:`call`, retried ``attempts`` times (leader elections, reconnects)."""
        for i in range(attempts):
            try:
                return self.call(what, fn)
            except PersistentDeltaError as exc:
                if not exc.retriable or i == attempts - 1:
                    raise  # not transient (a denied request, another layout, ...), or the last try
                time.sleep(pause)
        raise AssertionError("unreachable")

    def kv_get(self, job: str, what: str, key: str) -> Optional[KvEntry]:
        """A key's value and revision, or None."""
        from nats.js.errors import KeyNotFoundError

        async def get() -> Optional[KvEntry]:
            kv = await self.js.key_value(bucket(job, what))
            try:
                e = await kv.get(key)
            except KeyNotFoundError:
                return None
            return KvEntry(bytes(e.value or b""), int(e.revision or 0)) if e.value is not None else None

        return self.call(f"read {what}/{key}", get)

    def kv_entries(self, job: str, what: str, prefix: str = "") -> Dict[str, KvEntry]:
        """The live keys of a bucket that start with ``prefix``, sorted, each with its entry:
        complete while other processes write to the bucket.

        Not ``KeyValue.keys()``: nats-py's watcher decides it has seen every key from a
        consumer-info reply that can race the deliveries, and then returns a partial or empty
        list while keys are being updated. The stream's own per-subject state lists every key
        that has a message; a key whose last message is a delete or purge marker is left out
        by its ``get``."""
        from nats.js.errors import KeyNotFoundError

        name = bucket(job, what)
        subjects = f"$KV.{name}."

        async def entries() -> Dict[str, KvEntry]:
            kv = await self.js.key_value(name)
            info = await self.js.stream_info(f"KV_{name}", subjects_filter=f"{subjects}{prefix}>")
            out: Dict[str, KvEntry] = {}
            for subject in sorted(info.state.subjects or {}):
                key = subject[len(subjects):]
                try:
                    e = await kv.get(key)
                except KeyNotFoundError:  # deleted or purged (KeyDeletedError is one)
                    continue
                if e.value is not None:
                    out[key] = KvEntry(bytes(e.value), int(e.revision or 0))
            return out

        return self.call(f"list {what}", entries)

    def kv_put(self, job: str, what: str, key: str, value: bytes) -> int:
        """Write a key unconditionally; returns its new revision."""
        async def put() -> int:
            kv = await self.js.key_value(bucket(job, what))
            return int(await kv.put(key, value))

        return self.call(f"write {what}/{key}", put)

    def kv_create(self, job: str, what: str, key: str, value: bytes) -> int:
        """Create a key that must not exist; returns its revision.

        Raises:
            KeyConflictError: the key exists.
        """
        from nats.js.errors import KeyWrongLastSequenceError

        async def create() -> int:
            kv = await self.js.key_value(bucket(job, what))
            try:
                return int(await kv.create(key, value))
            except KeyWrongLastSequenceError as exc:
                raise KeyConflictError(f"{bucket(job, what)}/{key} exists") from exc

        return self.call(f"create {what}/{key}", create)

    def kv_update(self, job: str, what: str, key: str, value: bytes, last: int) -> int:
        """Write a key that is at revision ``last``; returns its new revision.

        Raises:
            KeyConflictError: the key is at another revision (or gone).
        """
        from nats.js.errors import KeyWrongLastSequenceError

        async def update() -> int:
            kv = await self.js.key_value(bucket(job, what))
            try:
                return int(await kv.update(key, value, last=last))
            except KeyWrongLastSequenceError as exc:
                raise KeyConflictError(f"{bucket(job, what)}/{key} is no longer at revision {last}") from exc

        return self.call(f"update {what}/{key}", update)

    def kv_delete(self, job: str, what: str, key: str) -> None:
        """Delete a key (a missing key is no error)."""
        async def delete() -> None:
            kv = await self.js.key_value(bucket(job, what))
            await kv.purge(key)

        self.call(f"delete {what}/{key}", delete)

    def object_put(self, job: str, name: str, data: bytes, replicas: int = 1) -> None:
        """Store ``data`` as object ``name`` in the job's ``PD_<job>_base`` object store,
        replacing it (the store is created where missing; JetStream chunks the object)."""
        from nats.js import api

        async def put() -> None:
            try:
                obs = await self.js.object_store(bucket(job, BASE))
            except Exception:  # noqa: BLE001 - not there yet
                obs = await self.js.create_object_store(bucket(job, BASE), api.ObjectStoreConfig(
                    replicas=replicas, storage=api.StorageType.FILE))
            await obs.put(name, data)

        self.call(f"store object {name}", put, timeout=self.options.request_timeout + 60)

    def object_get(self, job: str, name: str) -> Optional[bytes]:
        """Object ``name`` of the job's ``PD_<job>_base`` store, or None."""

        async def get() -> Optional[bytes]:
            try:
                obs = await self.js.object_store(bucket(job, BASE))
                res = await obs.get(name)
            except Exception as exc:  # noqa: BLE001 - missing store or object
                if "not found" in repr(exc).lower() or "NotFound" in type(exc).__name__:
                    return None
                raise
            return bytes(res.data or b"")

        return self.call(f"read object {name}", get, timeout=self.options.request_timeout + 60)

    # ------------------------------------------------------------------ sending
    def send_all(self, msgs: Sequence[Message], window: int = 64, timeout: Optional[float] = None) -> List[Message]:
        """Send ``msgs`` pipelined (``window`` unacknowledged at most) and wait for their
        acks. Returns the messages not acknowledged (to be sent again with the same ids).
        Raises nothing (a closed connection acknowledges nothing)."""
        t = timeout or self.options.request_timeout
        if self._closed:
            return list(msgs)

        async def send() -> List[Message]:
            failed: List[Message] = []
            inflight: List[Tuple[Message, Any]] = []

            async def drain(keep: int) -> None:
                while len(inflight) > keep:
                    m, fut = inflight.pop(0)
                    try:
                        await asyncio.wait_for(fut, t)
                    except Exception:  # noqa: BLE001 - not acknowledged: retried by the caller
                        failed.append(m)

            for m in msgs:
                try:
                    fut = await self.js.publish_async(m.subject, m.payload, headers={**m.headers, _MSG_ID: m.id},  # type: ignore[arg-type]
                                                      wait_stall=t)
                except Exception:  # noqa: BLE001
                    failed.append(m)
                    continue
                inflight.append((m, fut))
                await drain(window)
            await drain(0)
            return failed

        try:
            return self._call(send(), t * (len(msgs) // window + 2) + 5)
        except Exception:  # noqa: BLE001
            return list(msgs)

    # ------------------------------------------------------------------ reading
    def get_batch(self, job: str, subject: str, seq: int, batch: int, max_bytes: int, stream: Optional[str] = None
                  ) -> Tuple[List[StoredMessage], bool]:
        """Messages on ``subject`` (wildcards allowed) from stream sequence ``seq`` on (a batch
        direct get, stateless: nothing on the server to recreate after a restart). Returns
        ``(messages, more)``: ``more`` is False when the server said no
        message on ``subject`` follows the last one returned (a reader that has caught up
        need not ask again until something new arrives)."""

        name = stream or stream_name(job)

        async def get() -> Tuple[List[StoredMessage], bool]:
            inbox = self.nc.new_inbox()
            sub = await self.nc.subscribe(inbox)
            out: List[StoredMessage] = []
            more = True
            try:
                req = {"seq": max(1, seq), "next_by_subj": subject, "batch": batch, "max_bytes": max_bytes}
                await self.nc.publish(f"$JS.API.DIRECT.GET.{name}", json.dumps(req).encode(), reply=inbox)
                while True:
                    m = await sub.next_msg(self.options.request_timeout)
                    h = dict(m.headers or {})
                    status = h.get("Status")
                    if status is not None:
                        if status == "404":
                            more = False  # nothing at or after seq
                        if status in ("204", "404"):
                            break
                        raise TransportError(f"direct get on {name} answered {status} {h}")
                    out.append(StoredMessage(int(h["Nats-Sequence"]), h.get("Nats-Subject", ""), h, bytes(m.data)))
                    # pending after this one (the server still sends EOB; it is read, so the inbox is drained)
                    more = int(h.get("Nats-Num-Pending", "1") or 0) > 0
            finally:
                await sub.unsubscribe()
            return out, more

        return self.call(f"read {subject} from seq {seq}", get)

    def last_message(self, job: str, subject: str, stream: Optional[str] = None) -> Optional[StoredMessage]:
        """The stream's (default: the job's single stream) last message on ``subject``, or None."""
        from nats.js.errors import NotFoundError

        name = stream or stream_name(job)

        async def last() -> Optional[StoredMessage]:
            try:
                m = await self.js.get_last_msg(name, subject)
            except NotFoundError:
                return None
            return StoredMessage(int(m.seq), str(m.subject or subject), dict(m.headers or {}), bytes(m.data or b""))

        return self.call(f"read the last message on {subject}", last)

    def stream_id(self, job: str, stream: Optional[str] = None) -> str:
        """The stream's (default: the job's single stream) creation time (another after it was
        deleted and created again)."""
        name = stream or stream_name(job)

        async def created() -> str:
            si = await self.js.stream_info(name)
            return si.created.isoformat() if si.created is not None else ""

        return self.call(f"describe stream {name}", created)

    def stream_state(self, job: str, stream: Optional[str] = None) -> Dict[str, int]:
        """first_seq, last_seq, messages and bytes of the stream (default: the job's single stream)."""
        name = stream or stream_name(job)

        async def info() -> Dict[str, int]:
            si = await self.js.stream_info(name)
            s = si.state
            return {"first_seq": int(s.first_seq), "last_seq": int(s.last_seq), "messages": int(s.messages),
                    "bytes": int(s.bytes)}

        return self.call(f"describe stream {name}", info)

    def watch(self, subject: str, event: threading.Event) -> None:
        """Set ``event`` whenever a message on ``subject`` is sent (a core-NATS wake-up signal:
        cheap, best effort; readers re-check on a timer anyway)."""

        async def sub() -> None:
            async def cb(_m: Any) -> None:
                event.set()

            self._subs.append(await self.nc.subscribe(subject, cb=cb))

        self.call(f"subscribe {subject}", sub)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the connection and its loop thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self.nc.close(), 5)
        except Exception:  # noqa: BLE001 - closing a dead connection
            pass
        self._stop_loop()

    def _stop_loop(self) -> None:
        async def cancel_all() -> None:  # e.g. a connect still retrying: end it before the loop
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(5)
        except Exception:  # noqa: BLE001 - shutting down
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


__all__ = ["Connection", "nats_kwargs"]
