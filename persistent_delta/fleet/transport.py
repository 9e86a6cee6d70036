"""Transport: the seam between the rank logs and a streaming engine (NATS JetStream).

Owns: how a job looks on the stream -- subject names, message ids, the message format
(version, chunking of records larger than the server's max payload, range markers), the
stream and key-value buckets of a job -- and a synchronous JetStream connection. The
shipper (:mod:`persistent_delta.fleet.ship`) and remote consumers (:mod:`persistent_delta.fleet.remote`)
speak only through this module; a Kafka transport would be another implementation of the same
functions (topic per job, key = rank, the same payloads and ids).

Design note
-----------
**Subjects** (one stream per job, ``PD_<job>``, subjects ``pd.<job>.>``)::

    pd.<job>.<channel>.<rank>.t<base32(fqn)>   a table's rows of one shipped range (chunked)
    pd.<job>.<channel>.<rank>.end              the range's marker: it is complete

``base32`` (lower case, no padding) of the fqn's UTF-8 bytes is injective and uses only
``[a-z2-7]``, so every fqn the log accepts maps to one valid subject token. A job name is
``[A-Za-z0-9_-]{1,64}``; channel and rank are fixed words and integers.

**A range** ``[start, end)`` of one rank and channel is what one shipper poll read (the unique
rows per table, by the channel's update mode: exactly what a local consumer at ``start``
would read). Its parts are the tables' records, encoded by :mod:`persistent_delta.log.codec` (the
log's own record format, its checksum sealed with the part's message id), split into chunks
of at most the server's max payload; the marker lists the parts and is published only after
every part was acknowledged, so a remote consumer applies a range only when it has all of it.
On the lookups channel a range also carries the *side records* of managed-collision tables
(:mod:`persistent_delta.log.zch_records`: at most two per table, as
:func:`~persistent_delta.log.zch_records.shipped_side` gives them): parts of their own, in the same
encoding, chunking and ids, numbered after the tables' parts, on the table's subject, listed
under the marker's ``"side"`` (present, possibly empty, whenever the shipper ships them; a
reader older than them ignores the extra parts and list). On the snapshots channel a
replicated (data-parallel) table's per-row publish stamps (which publish each row's value
comes from: newest wins across ranks) are a part of their own too, numbered last and listed
under ``"stamps"``: the marker stays small (lists and a few numbers) however many rows move.

**Message ids** (``Nats-Msg-Id``) are ``<job>:<epoch>:<channel>:<rank>:<start>:<end>:<part>:
<chunk>``. The *epoch* is the shipper registration's identity (the log id plus a random
token, new whenever the shipper registers afresh: a new log, a log started afresh with
``fresh=True``), so ids are unique for the stream's whole life across jobs and re-created
logs; a re-send of the same range has the same ids, and the server drops it within its
duplicate window. After the window the consumer drops it: a range ending at or below its
position is never applied again.

**Buckets** (key-value, same replicas as the stream): ``PD_<job>_meta`` (per rank: the table
metadata a remote consumer needs -- shard info, dtypes, row shapes, update modes, world size,
table set; per shipper: its epoch and statistics), ``PD_<job>_offsets`` (remote consumers'
positions), ``PD_<job>_locks`` (one active process per remote consumer name: a key created
exclusively, refreshed by a heartbeat, expiring by the bucket's TTL when its holder died).

Every message carries ``PD-Format`` (:data:`FORMAT_VERSION`); a reader refuses another one.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar, Union

import torch
from torchrec.distributed.model_tracker.types import UniqueRows

from persistent_delta.log import codec
from persistent_delta.errors import CorruptRecordError, FormatMismatchError, InvalidInputError, TransportError
from persistent_delta.log.schema import CHANNELS, LOOKUPS, SNAPSHOTS

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_FORMAT_HEADER = "PD-Format"
_MSG_ID = "Nats-Msg-Id"
_JOB = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_HEADROOM = 4096  # bytes of a max payload left for headers
_T = TypeVar("_T")


# ------------------------------------------------------------------------------ names


def check_job(job: object) -> str:
    """A valid job name (``[A-Za-z0-9_-]{1,64}``).

    Raises:
        InvalidInputError: anything else.
    """
    if not isinstance(job, str) or not _JOB.match(job):
        raise InvalidInputError(f"job must match [A-Za-z0-9_-]{{1,64}}, got {job!r}")
    return job


def token(text: str) -> str:
    """An injective, valid subject token / KV key for any string (base32 of its UTF-8)."""
    return base64.b32encode(text.encode("utf-8")).decode("ascii").rstrip("=").lower() or "0"


def untoken(tok: str) -> str:
    """Inverse of :func:`token`."""
    if tok == "0":
        return ""
    t = tok.upper()
    return base64.b32decode(t + "=" * (-len(t) % 8)).decode("utf-8")


def stream_name(job: str) -> str:
    return f"PD_{check_job(job)}"


def bucket(job: str, what: str) -> str:
    """``PD_<job>_<what>``: ``meta``, ``offsets``, ``locks`` (key-value) or ``base`` (objects)."""
    return f"PD_{check_job(job)}_{what}"


def data_subject(job: str, channel: str, rank: int, fqn: str) -> str:
    return f"pd.{job}.{channel}.{int(rank)}.t{token(fqn)}"


def end_subject(job: str, channel: str, rank: int) -> str:
    return f"pd.{job}.{channel}.{int(rank)}.end"


def rank_filter(job: str, channel: str, rank: int) -> str:
    return f"pd.{job}.{channel}.{int(rank)}.>"


def ends_filter(job: str, channel: str) -> str:
    return f"pd.{job}.{channel}.*.end"


def fqn_of_subject(subject: str) -> str:
    last = subject.rsplit(".", 1)[-1]
    if not last.startswith("t"):
        raise CorruptRecordError(f"subject {subject!r} is not a table subject")
    return untoken(last[1:])


def msg_id(job: str, epoch: str, channel: str, rank: int, start: int, end: int, part: Union[int, str], chunk: int = 0) -> str:
    return f"{job}:{epoch}:{channel}:{rank}:{start}:{end}:{part}:{chunk}"


def new_epoch(log_id: object) -> str:
    """A shipper registration's identity: the log id and a random token."""
    return f"{log_id}-{os.urandom(6).hex()}"


# ------------------------------------------------------------------------------ messages


@dataclass
class Message:
    subject: str
    payload: Union[bytes, bytearray, memoryview]
    headers: Dict[str, str]

    @property
    def id(self) -> str:
        return self.headers[_MSG_ID]


def _kind(channel: str) -> int:
    return codec.KIND_SNAPSHOT if channel == SNAPSHOTS else codec.KIND_LOOKUP


SideRecord = Tuple[int, torch.Tensor, torch.Tensor]  # (kind, ids, states): a managed-collision side record


def encode_range(
    job: str, epoch: str, channel: str, rank: int, start: int, end: int, rows: Dict[str, UniqueRows],
    chunk_bytes: int, info: Optional[Dict[str, Any]] = None, side: Optional[Dict[str, List[SideRecord]]] = None,
    stamps: Optional[Dict[str, torch.Tensor]] = None,
) -> Tuple[List[Message], Message, int]:
    """The messages of one shipped range: every table's part (chunked to ``chunk_bytes``), the
    side records of managed-collision tables (``side``: fqn -> records in order, each a part of
    its own numbered after the tables', on the table's subject; the marker lists them under
    ``"side"``, present whenever ``side`` is given, also empty), the per-row publish stamps of
    replicated tables (``stamps``: fqn -> int64, one per row of its part; a part each, numbered
    last, listed under ``"stamps"``: chunked like rows, so a large replicated table never
    outgrows the marker) and the marker, published last. Returns ``(parts, marker, row_bytes)``."""
    parts: List[Message] = []
    listing: List[List[Any]] = []
    side_listing: List[List[Any]] = []
    stamps_listing: List[List[Any]] = []
    row_bytes = 0

    def add(i: int, fqn: str, value: bytearray) -> int:
        base = msg_id(job, epoch, channel, rank, start, end, i)
        codec.seal_record(value, base.encode())
        mv = memoryview(value)
        n = max(1, -(-len(value) // chunk_bytes))
        for j in range(n):
            parts.append(Message(data_subject(job, channel, rank, fqn), mv[j * chunk_bytes:(j + 1) * chunk_bytes], {
                _MSG_ID: msg_id(job, epoch, channel, rank, start, end, i, j), _FORMAT_HEADER: str(FORMAT_VERSION),
                "PD-Epoch": epoch, "PD-Range": f"{start}-{end}", "PD-Part": f"{i}/{j}/{n}",
            }))
        return n

    for i, (fqn, u) in enumerate(sorted(rows.items())):
        value = codec.encode_record(u.ids, u.states, _kind(channel))
        row_bytes += u.ids.numel() * u.ids.element_size() + (0 if u.states is None else u.states.numel() * u.states.element_size())
        listing.append([fqn, add(i, fqn, value), len(value)])
    i = len(listing)
    for fqn, records in sorted((side or {}).items()):
        for kind, ids, states in records:
            value = codec.encode_record(ids, states, kind)
            side_listing.append([fqn, add(i, fqn, value), len(value)])
            i += 1
    for fqn, t in sorted((stamps or {}).items()):
        value = codec.encode_record(t.to(torch.int64).reshape(-1), None, codec.KIND_LOOKUP)
        stamps_listing.append([fqn, add(i, fqn, value), len(value)])
        i += 1
    body = {"v": FORMAT_VERSION, "job": job, "epoch": epoch, "channel": channel, "rank": int(rank), "start": int(start),
            "end": int(end), "parts": listing, "shipped": time.time(), **(info or {})}
    if side is not None:
        body["side"] = side_listing
    if stamps_listing:
        body["stamps"] = stamps_listing
    marker = Message(end_subject(job, channel, rank), codec.pack(body), {
        _MSG_ID: msg_id(job, epoch, channel, rank, start, end, "end"), _FORMAT_HEADER: str(FORMAT_VERSION),
        "PD-Epoch": epoch, "PD-Range": f"{start}-{end}",
    })
    return parts, marker, row_bytes


def check_format(headers: Optional[Dict[str, str]], where: str) -> None:
    v = (headers or {}).get(_FORMAT_HEADER)
    if v != str(FORMAT_VERSION):
        raise FormatMismatchError(f"{where}: message format {v!r}, this reader reads {FORMAT_VERSION}; upgrade the "
                                  "older side (shipper or consumer)")


@dataclass
class Marker:
    """A decoded range marker (see the module docs)."""

    epoch: str
    start: int
    end: int
    parts: List[Tuple[str, int, int]]  # (fqn, chunks, bytes)
    seq: int  # its stream sequence
    shipped: float
    info: Dict[str, Any] = field(default_factory=dict)
    # managed-collision side parts (fqn, chunks, bytes), numbered after ``parts``; None: the
    # shipper did not ship side records (an older one, or a channel without them)
    side: Optional[List[Tuple[str, int, int]]] = None
    # replicated tables' per-row publish stamps (fqn, chunks, bytes), numbered last
    stamps: List[Tuple[str, int, int]] = field(default_factory=list)

    @staticmethod
    def decode(data: bytes, seq: int, where: str) -> "Marker":
        d = codec.unpack(data, f"range marker in {where}")
        try:
            assert isinstance(d, dict)
            side = d.get("side")
            return Marker(str(d["epoch"]), int(d["start"]), int(d["end"]),
                          [(str(f), int(n), int(b)) for f, n, b in d["parts"]], seq, float(d.get("shipped", 0.0)),
                          {k: v for k, v in d.items() if k not in ("epoch", "start", "end", "parts", "side", "stamps")},
                          None if side is None else [(str(f), int(n), int(b)) for f, n, b in side],
                          [(str(f), int(n), int(b)) for f, n, b in d.get("stamps", [])])
        except (AssertionError, KeyError, TypeError, ValueError) as exc:
            raise CorruptRecordError(f"range marker in {where} (stream seq {seq}) is malformed: {exc}") from exc


@dataclass
class RangeContent:
    """A complete shipped range: fqn -> rows, managed-collision side records, and the per-row
    publish stamps of replicated tables."""

    tables: Dict[str, UniqueRows]
    side: Dict[str, List[SideRecord]]
    stamps: Dict[str, torch.Tensor]


class RangeAssembler:
    """Collects one rank's part chunks and hands out complete ranges (consumer side).

    Chunks are kept per (epoch, range) attempt; a marker takes its attempt's chunks and drops
    every other pending attempt (a shipper that died mid-range left them; its successor shipped
    the range again, under the same ids within the server's duplicate window, or as a new
    attempt). Memory: the pending chunks of the ranges not yet marked.
    """

    def __init__(self, job: str, channel: str, rank: int) -> None:
        self.job, self.channel, self.rank = job, channel, rank
        self._pending: Dict[Tuple[str, str], Dict[Tuple[int, int], bytes]] = {}
        self.pending_bytes = 0

    def add_part(self, headers: Dict[str, str], data: bytes) -> None:
        key = (headers.get("PD-Epoch", ""), headers.get("PD-Range", ""))
        try:
            i, j, _n = (int(x) for x in headers["PD-Part"].split("/"))
        except (KeyError, ValueError) as exc:
            raise CorruptRecordError(f"{self._where()}: a part message without a valid PD-Part header") from exc
        chunks = self._pending.setdefault(key, {})
        if (i, j) not in chunks:
            chunks[(i, j)] = data
            self.pending_bytes += len(data)

    def complete(self, m: Marker) -> Optional["RangeContent"]:
        """The tables of the range ``m`` marks, its managed-collision side records (fqn ->
        records in order) and its replicated tables' stamps, or None when parts are missing
        (the stream dropped them: a gap). Clears every pending attempt."""
        chunks = self._pending.get((m.epoch, f"{m.start}-{m.end}"), {})
        tables: Dict[str, UniqueRows] = {}
        side: Dict[str, List[SideRecord]] = {}
        stamps: Dict[str, torch.Tensor] = {}
        complete = True
        n_sides = len(m.parts) + len(m.side or [])
        for i, (fqn, n, nbytes) in enumerate(m.parts + (m.side or []) + m.stamps):
            rec = self._record(chunks, m, i, fqn, n, nbytes)
            if rec is None:
                complete = False
                break
            if i < len(m.parts):
                tables[fqn] = UniqueRows(ids=rec.ids, states=rec.states)
            elif i >= n_sides:
                if rec.kind != codec.KIND_LOOKUP or rec.ids.dtype != torch.int64 or fqn not in tables or \
                        rec.ids.numel() != tables[fqn].ids.numel():
                    raise CorruptRecordError(f"{self._where()}: range [{m.start}, {m.end}) part {i}: the stamps of "
                                             f"{fqn!r} do not match its rows")
                stamps[fqn] = rec.ids
            elif rec.kind in codec.SIDE_KINDS and rec.states is not None:
                side.setdefault(fqn, []).append((rec.kind, rec.ids, rec.states))
            else:
                raise CorruptRecordError(f"{self._where()}: range [{m.start}, {m.end}) part {i} of {fqn!r} is listed as a "
                                         f"managed-collision side record but holds record kind {rec.kind}")
        self._pending.clear()
        self.pending_bytes = 0
        return RangeContent(tables, side, stamps) if complete else None

    def _record(self, chunks: Dict[Tuple[int, int], bytes], m: Marker, i: int, fqn: str, n: int, nbytes: int
                ) -> Optional[codec.DecodedRecord]:
        pieces = [chunks.get((i, j)) for j in range(n)]
        if any(p is None for p in pieces):
            return None
        buf = pieces[0] if n == 1 else b"".join(pieces)  # type: ignore[arg-type]
        if len(buf) != nbytes:  # type: ignore[arg-type]
            raise CorruptRecordError(f"{self._where()}: range [{m.start}, {m.end}) part {i} has {len(buf)} bytes, "  # type: ignore[arg-type]
                                     f"its marker says {nbytes}")
        base = msg_id(self.job, m.epoch, self.channel, self.rank, m.start, m.end, i)
        try:
            return codec.decode_record(buf, key=base.encode())  # type: ignore[arg-type]
        except CorruptRecordError as exc:
            raise CorruptRecordError(f"{self._where()}: range [{m.start}, {m.end}) table {fqn!r}: {exc}") from exc

    def _where(self) -> str:
        return f"stream {stream_name(self.job)} {self.channel} rank {self.rank}"


# ------------------------------------------------------------------------------ connection


@dataclass(frozen=True)
class ConnectOptions:
    """How to reach the servers: authentication and TLS pass through to nats-py.

    Attributes:
        token: a server token. user / password: user credentials.
        creds: a ``.creds`` file (JWT + nkey seed). nkeys_seed: an nkey seed file.
        tls_ca / tls_cert / tls_key: PEM files for TLS (``tls://`` URLs, or any with tls_ca).
        connect_timeout: seconds per connection attempt.
        request_timeout: seconds a request (publish ack, KV, get) may take.
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

    def nats_kwargs(self) -> Dict[str, Any]:
        kw: Dict[str, Any] = {"connect_timeout": self.connect_timeout}
        if self.token:
            kw["token"] = self.token
        if self.user:
            kw["user"], kw["password"] = self.user, self.password
        if self.creds:
            kw["user_credentials"] = self.creds
        if self.nkeys_seed:
            kw["nkeys_seed"] = self.nkeys_seed
        if self.tls_ca or self.tls_cert:
            import ssl

            ctx = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_cert:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
            kw["tls"] = ctx
        return kw


@dataclass(frozen=True)
class StreamOptions:
    """A job's stream and buckets, as created by the first shipper (later ones reuse them).

    Attributes:
        replicas: JetStream replicas of the stream and buckets (3 in a 3-node cluster).
        max_bytes / max_age_s: the stream's own limits (-1 / 0: none). With ``discard=old``
            (JetStream's default, used here) the oldest messages go first; a remote consumer
            whose next range was dropped gets :class:`OffsetOutOfRangeError` (or its reset
            policy), never a silent gap.
        duplicate_window_s: the server drops a re-sent message id within this window.
        lock_ttl_s: a dead remote consumer's name is free again after this long.
    """

    replicas: int = 1
    max_bytes: int = -1
    max_age_s: float = 0.0
    duplicate_window_s: float = 120.0
    lock_ttl_s: float = 6.0


def _servers(server: Union[str, Sequence[str]]) -> List[str]:
    urls = [server] if isinstance(server, str) else list(server)
    out = []
    for u in urls:
        out += [p.strip() for p in u.split(",") if p.strip()]
    if not out:
        raise InvalidInputError("no server given (nats://HOST:PORT)")
    return out


class Connection:
    """A synchronous JetStream connection: nats-py's asyncio client on a private event-loop
    thread. Thread-safe (calls are serialised onto the loop). Reconnects forever in the
    background; calls that need the server raise :class:`TransportError` after their timeout.
    """

    def __init__(self, server: Union[str, Sequence[str]], options: Optional[ConnectOptions] = None,
                 wait: float = 0.0) -> None:
        import nats  # optional dependency: pip install nats-py

        self.servers = _servers(server)
        self.options = options or ConnectOptions()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pd-nats", daemon=True)
        self._thread.start()
        self._closed = False
        self._subs: List[Any] = []
        kw = self.options.nats_kwargs()

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

    def _call(self, coro: Awaitable[_T], timeout: Optional[float] = None) -> _T:
        fut: "concurrent.futures.Future[_T]" = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise

    def call(self, what: str, fn: Callable[[], Awaitable[_T]], timeout: Optional[float] = None) -> _T:
        """Run ``fn()`` on the loop; any failure is :class:`TransportError` naming ``what``."""
        t = timeout if timeout is not None else self.options.request_timeout + 1
        try:
            return self._call(fn(), t)
        except TransportError:
            raise
        except Exception as exc:  # noqa: BLE001 - nats-py raises many types; callers act on one
            raise TransportError(f"{what} on {','.join(self.servers)} failed: {exc!r}") from exc

    @property
    def connected(self) -> bool:
        return bool(self.nc.is_connected)

    @property
    def max_payload(self) -> int:
        return int(self.nc.max_payload or (1 << 20))

    # ------------------------------------------------------------------ stream and buckets
    def ensure_job(self, job: str, opts: StreamOptions) -> None:
        """Create the job's stream and buckets where missing (idempotent; retried while a
        cluster elects leaders)."""
        from nats.js import api

        async def ensure() -> None:
            name = stream_name(job)
            try:
                await self.js.stream_info(name)
            except Exception:  # noqa: BLE001 - not found (or not yet elected): create
                await self.js.add_stream(api.StreamConfig(
                    name=name, subjects=[f"pd.{job}.>"], storage=api.StorageType.FILE, num_replicas=opts.replicas,
                    max_bytes=opts.max_bytes, max_age=opts.max_age_s or None, discard=api.DiscardPolicy.OLD,
                    duplicate_window=opts.duplicate_window_s, allow_direct=True, max_msg_size=-1))
            for what, ttl in (("meta", None), ("offsets", None), ("locks", opts.lock_ttl_s)):
                try:
                    await self.js.key_value(bucket(job, what))
                except Exception:  # noqa: BLE001
                    await self.js.create_key_value(bucket=bucket(job, what), history=1, replicas=opts.replicas,
                                                   ttl=ttl, storage=api.StorageType.FILE)

        self.retry(f"create the stream of job {job!r}", ensure, attempts=20)

    def retry(self, what: str, fn: Callable[[], Awaitable[_T]], attempts: int = 10, pause: float = 0.25) -> _T:
        """:meth:`call`, retried ``attempts`` times (leader elections, reconnects)."""
        for i in range(attempts):
            try:
                return self.call(what, fn)
            except TransportError:
                if i == attempts - 1:
                    raise
                time.sleep(pause)
        raise AssertionError("unreachable")

    def kv_get(self, job: str, what: str, key: str) -> Optional[Tuple[bytes, int]]:
        """(value, revision) of a key, or None."""
        from nats.js.errors import KeyNotFoundError

        async def get() -> Optional[Tuple[bytes, int]]:
            kv = await self.js.key_value(bucket(job, what))
            try:
                e = await kv.get(key)
            except KeyNotFoundError:
                return None
            return (bytes(e.value or b""), int(e.revision or 0)) if e.value is not None else None

        return self.call(f"read {what}/{key}", get)

    def kv_entries(self, job: str, what: str, prefix: str = "") -> Dict[str, Tuple[bytes, int]]:
        """The live keys of a bucket that start with ``prefix``, sorted, each with its
        ``(value, revision)``: complete while other processes write to the bucket.

        Not ``KeyValue.keys()``: nats-py's watcher decides it has seen every key from a
        consumer-info reply that can race the deliveries, and then returns a partial or empty
        list while keys are being updated (7 of 300 listings here, one key updated every
        millisecond). The stream's own per-subject state lists every key that has a message;
        a key whose last message is a delete or purge marker is left out by its ``get``."""
        from nats.js.errors import KeyNotFoundError

        name = bucket(job, what)
        subjects = f"$KV.{name}."

        async def entries() -> Dict[str, Tuple[bytes, int]]:
            kv = await self.js.key_value(name)
            info = await self.js.stream_info(f"KV_{name}", subjects_filter=f"{subjects}{prefix}>")
            out: Dict[str, Tuple[bytes, int]] = {}
            for subject in sorted(info.state.subjects or {}):
                key = subject[len(subjects):]
                try:
                    e = await kv.get(key)
                except KeyNotFoundError:  # deleted or purged (KeyDeletedError is one)
                    continue
                if e.value is not None:
                    out[key] = (bytes(e.value), int(e.revision or 0))
            return out

        return self.call(f"list {what}", entries)

    def kv_keys(self, job: str, what: str) -> List[str]:
        """The live keys of a bucket, sorted (:meth:`kv_entries`)."""
        return list(self.kv_entries(job, what))

    def kv_put(self, job: str, what: str, key: str, value: bytes) -> int:
        async def put() -> int:
            kv = await self.js.key_value(bucket(job, what))
            return int(await kv.put(key, value))

        return self.call(f"write {what}/{key}", put)

    def kv_create(self, job: str, what: str, key: str, value: bytes) -> Optional[int]:
        """Create a key that must not exist: its revision, or None when it exists."""
        from nats.js.errors import KeyWrongLastSequenceError

        async def create() -> Optional[int]:
            kv = await self.js.key_value(bucket(job, what))
            try:
                return int(await kv.create(key, value))
            except KeyWrongLastSequenceError:
                return None

        return self.call(f"create {what}/{key}", create)

    def kv_update(self, job: str, what: str, key: str, value: bytes, last: int) -> Optional[int]:
        """Update a key at revision ``last``: its new revision, or None when it moved."""
        from nats.js.errors import KeyWrongLastSequenceError

        async def update() -> Optional[int]:
            kv = await self.js.key_value(bucket(job, what))
            try:
                return int(await kv.update(key, value, last=last))
            except KeyWrongLastSequenceError:
                return None

        return self.call(f"update {what}/{key}", update)

    def kv_delete(self, job: str, what: str, key: str) -> None:
        async def delete() -> None:
            kv = await self.js.key_value(bucket(job, what))
            await kv.purge(key)

        self.call(f"delete {what}/{key}", delete)

    def object_put(self, job: str, name: str, data: bytes, replicas: int = 1) -> None:
        """Store ``data`` as object ``name`` in the job's ``PD_<job>_base`` object store
        (created where missing; JetStream chunks it)."""
        from nats.js import api

        async def put() -> None:
            try:
                obs = await self.js.object_store(bucket(job, "base"))
            except Exception:  # noqa: BLE001 - not there yet
                obs = await self.js.create_object_store(bucket(job, "base"), api.ObjectStoreConfig(
                    replicas=replicas, storage=api.StorageType.FILE))
            await obs.put(name, data)

        self.call(f"store object {name}", put, timeout=self.options.request_timeout + 60)

    def object_get(self, job: str, name: str) -> Optional[bytes]:
        """Object ``name`` of the job's ``PD_<job>_base`` store, or None."""

        async def get() -> Optional[bytes]:
            try:
                obs = await self.js.object_store(bucket(job, "base"))
                res = await obs.get(name)
            except Exception as exc:  # noqa: BLE001 - missing store or object
                if "not found" in repr(exc).lower() or "NotFound" in type(exc).__name__:
                    return None
                raise
            return bytes(res.data or b"")

        return self.call(f"read object {name}", get, timeout=self.options.request_timeout + 60)

    # ------------------------------------------------------------------ publishing
    def publish_all(self, msgs: Sequence[Message], window: int = 64, timeout: Optional[float] = None) -> List[Message]:
        """Publish ``msgs`` pipelined (``window`` unacknowledged at most) and wait for their
        acks. Returns the messages not acknowledged (to be retried with the same ids)."""
        t = timeout or self.options.request_timeout

        async def pub() -> List[Message]:
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
                    fut = await self.js.publish_async(m.subject, m.payload, headers=dict(m.headers), wait_stall=t)  # type: ignore[arg-type]
                except Exception:  # noqa: BLE001
                    failed.append(m)
                    continue
                inflight.append((m, fut))
                await drain(window)
            await drain(0)
            return failed

        try:
            return self._call(pub(), t * (len(msgs) // window + 2) + 5)
        except Exception:  # noqa: BLE001
            return list(msgs)

    # ------------------------------------------------------------------ reading
    def get_batch(self, job: str, subject: str, seq: int, batch: int, max_bytes: int
                  ) -> Tuple[List[Tuple[int, str, Dict[str, str], bytes]], bool]:
        """Messages on ``subject`` (wildcards allowed) from stream sequence ``seq`` on (a batch
        direct get, stateless: nothing on the server to recreate after a restart). Returns
        ``([(seq, subject, headers, data)], more)``: ``more`` is False when the server said no
        message on ``subject`` follows the last one returned (a reader that has caught up
        need not ask again until something new arrives)."""

        async def get() -> Tuple[List[Tuple[int, str, Dict[str, str], bytes]], bool]:
            inbox = self.nc.new_inbox()
            sub = await self.nc.subscribe(inbox)
            out: List[Tuple[int, str, Dict[str, str], bytes]] = []
            more = True
            try:
                req = {"seq": max(1, seq), "next_by_subj": subject, "batch": batch, "max_bytes": max_bytes}
                await self.nc.publish(f"$JS.API.DIRECT.GET.{stream_name(job)}", json.dumps(req).encode(), reply=inbox)
                while True:
                    m = await sub.next_msg(self.options.request_timeout)
                    h = dict(m.headers or {})
                    status = h.get("Status")
                    if status is not None:
                        if status == "404":
                            more = False  # nothing at or after seq
                        if status in ("204", "404"):
                            break
                        raise TransportError(f"direct get on {stream_name(job)} answered {status} {h}")
                    out.append((int(h["Nats-Sequence"]), h.get("Nats-Subject", ""), h, bytes(m.data)))
                    # pending after this one (the server still sends EOB; it is read, so the inbox is drained)
                    more = int(h.get("Nats-Num-Pending", "1") or 0) > 0
            finally:
                await sub.unsubscribe()
            return out, more

        return self.call(f"read {subject} from seq {seq}", get)

    def last_message(self, job: str, subject: str) -> Optional[Tuple[int, Dict[str, str], bytes]]:
        """The stream's last message on ``subject``: (seq, headers, data), or None."""
        from nats.js.errors import NotFoundError

        async def last() -> Optional[Tuple[int, Dict[str, str], bytes]]:
            try:
                m = await self.js.get_last_msg(stream_name(job), subject)
            except NotFoundError:
                return None
            return int(m.seq), dict(m.headers or {}), bytes(m.data or b"")

        return self.call(f"read the last message on {subject}", last)

    def stream_state(self, job: str) -> Dict[str, int]:
        """first_seq, last_seq, messages and bytes of the job's stream."""
        async def info() -> Dict[str, int]:
            si = await self.js.stream_info(stream_name(job))
            s = si.state
            return {"first_seq": int(s.first_seq), "last_seq": int(s.last_seq), "messages": int(s.messages),
                    "bytes": int(s.bytes)}

        return self.call(f"describe stream {stream_name(job)}", info)

    def watch(self, subject: str, event: threading.Event) -> None:
        """Set ``event`` whenever a message on ``subject`` is published (a core-NATS wake-up
        signal: cheap, best effort; readers re-check on a timer anyway)."""

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


# ------------------------------------------------------------------------------ table metadata


@dataclass
class RankTables:
    """What a remote consumer needs of one rank's log (published by its shipper in the
    ``meta`` bucket, key ``tables.<rank>``): the table entries (shard info, dtypes, row
    shapes), the channels' update modes, the tracker's world size, tracking mode and table set."""

    rank: int
    log_id: str
    world_size: Optional[int]
    tracker: Optional[Dict[str, Any]]
    modes: Dict[str, str]
    entries: Dict[str, bytes]  # fqn -> TableEntry.to_bytes()

    def encode(self) -> bytes:
        return codec.pack({"v": FORMAT_VERSION, "rank": self.rank, "log_id": self.log_id, "world_size": self.world_size,
                           "tracker": self.tracker, "modes": self.modes, "entries": self.entries})

    @staticmethod
    def decode(buf: bytes, where: str) -> "RankTables":
        d = codec.unpack(buf, f"table metadata in {where}")
        if not isinstance(d, dict) or d.get("v") != FORMAT_VERSION:
            raise FormatMismatchError(f"{where}: table metadata of format "
                                      f"{d.get('v') if isinstance(d, dict) else '?'}, this reader reads {FORMAT_VERSION}")
        try:
            ws = d.get("world_size")
            return RankTables(int(d["rank"]), str(d["log_id"]), None if ws is None else int(ws), d.get("tracker"),
                              {str(k): str(v) for k, v in d["modes"].items()},
                              {str(k): bytes(v) for k, v in d["entries"].items()})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptRecordError(f"table metadata in {where} is malformed: {exc}") from exc


def base_name(rank: int) -> str:
    return f"rank-{int(rank)}"


def encode_base(stamp: int, tables: Dict[str, torch.Tensor]) -> bytes:
    """A rank's base snapshot: its shards' full values as of publish ``stamp`` (each table a
    record of the log's encoding, ids = every local row)."""
    body: Dict[str, Any] = {"v": FORMAT_VERSION, "stamp": int(stamp), "tables": {}}
    for fqn, w in sorted(tables.items()):
        ids = torch.arange(w.shape[0], dtype=torch.int64)
        body["tables"][fqn] = bytes(codec.encode_record(ids, w.detach().contiguous(), codec.KIND_SNAPSHOT))
    return codec.pack(body)


def decode_base(buf: bytes, where: str) -> Tuple[int, Dict[str, torch.Tensor]]:
    """(stamp, fqn -> local shard values) of a base snapshot."""
    d = codec.unpack(buf, f"base snapshot in {where}")
    if not isinstance(d, dict) or d.get("v") != FORMAT_VERSION:
        raise FormatMismatchError(f"{where}: base snapshot of another format, this reader reads {FORMAT_VERSION}")
    out = {}
    for fqn, raw in d["tables"].items():
        rec = codec.decode_record(bytes(raw))
        if rec.states is None:
            raise CorruptRecordError(f"{where}: base snapshot of {fqn!r} holds no values")
        out[str(fqn)] = rec.states.clone()
    return int(d["stamp"]), out


# Keys of the job's ``meta`` bucket: each rank's table metadata, and each shipper's state.
TABLES_KEYS = "tables."
SHIPPER_KEYS = "ship."


def tables_key(rank: int) -> str:
    return f"{TABLES_KEYS}{int(rank)}"


def shipper_key(rank: int, channel: str) -> str:
    return f"{SHIPPER_KEYS}{int(rank)}.{channel}"


__all__ = ["FORMAT_VERSION", "CHANNELS", "LOOKUPS", "SNAPSHOTS", "Connection", "ConnectOptions", "StreamOptions",
           "Message", "Marker", "RangeAssembler", "RankTables", "encode_range", "check_job", "token", "untoken"]
