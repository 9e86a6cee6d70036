"""The wire format: what a shipped range, a rank's table metadata and a base look like as bytes.

Owns: the message format (its version, the chunking of records larger than the transport's
max payload, range markers; their reassembly on the consumer side is
:mod:`persistent_delta.fleet.assembly`'s);
the encoding of the values a shipper stores in the job's buckets (:class:`RankTables`) and
of a rank's base (:func:`encode_base`). Names on the stream are
:mod:`persistent_delta.fleet.subjects`'; sending and reading is a
:class:`~persistent_delta.fleet.transport.Transport`'s.

Design note
-----------
**A range** ``[start, end)`` (half-open) of one rank and channel is what one shipper poll read
(the unique rows per table, by the channel's update mode: exactly what a local consumer at
``start`` would read). Its parts are the tables' records, encoded by
:mod:`persistent_delta.log.codec` (the log's own record format, its checksum sealed with the
part's message id), split into chunks of at most :func:`chunk_size` bytes; the marker lists
the parts and is sent only after every part was acknowledged, so a remote consumer applies a
range only when it has all of it. On the lookups channel a range also carries the *side
records* of managed-collision tables (:mod:`persistent_delta.log.zch_records`: at most two per
table, as :func:`~persistent_delta.log.zch_records.shipped_side` gives them): parts of their
own, in the same encoding, chunking and ids, numbered after the tables' parts, on the table's
subject, listed under the marker's ``"side"`` (present, possibly empty, whenever the shipper
ships them; a reader older than them ignores the extra parts and list). On the snapshots
channel a replicated (data-parallel) table's per-row publish stamps (which publish each row's
value comes from: newest wins across ranks) are a part of their own too, numbered last and
listed under ``"stamps"``: the marker stays small (lists and a few numbers) however many rows
move. Snapshot rows of other row formats than native (:data:`persistent_delta.log.codec.ROW_FORMATS`,
header ``"f"`` of their records) are carried as they are: a part per (table, format), and a
replicated table's stamps of that format a part after it, both record headers naming the
format, numbered after the stamps and listed under ``"formats"`` (a reader older than formats
refuses such a marker: its digests list more parts than it counts). A remote consumer keeps
the format it asked for, by the same filter as a local read
(:func:`persistent_delta.log.codec.serves`). A snapshots marker also says how many rows the
rank's capped publishes had left pending when the shipper read the range (``"deferred"``, the
local read's count: :mod:`persistent_delta.log.deferred`); a reader older than it ignores it.
It also carries the rank's batches ended, read with its snapshots end when the range reaches it
(``"batches_ended"``, at or above ``end``: what
:func:`~persistent_delta.log.position_rules.snapshots_behind` compares the other ranks' ends
with), and a rank whose batches ended moved while it published nothing ships an empty range
``[end, end)`` with no parts (a *progress marker*) to say so; a marker without the field (an
older shipper) reads as ``end``, and a reader older than it ignores both. A range without the
field may end at a cut (``max_batches``), not at a publish: only the publishes it lists count
against the other ranks (:meth:`Marker.proven_end`). A snapshots marker
also says how far back its range misses no publish (``"covers_from"``, at or below ``start``:
the local read's :func:`~persistent_delta.log.position_rules.snapshots_covered_from`), so a
replica's base taken before ``start`` with nothing published in between is continued by it
(:mod:`persistent_delta.read.base`); without it (an older shipper) a range covers from its start.

Every message carries the header ``PD-Format`` (:data:`FORMAT_VERSION`); a reader refuses
another one. Parts also carry ``PD-Epoch``, ``PD-Range`` (``start-end``) and ``PD-Part``
(``part/chunk/chunks``). Every message carries ``PD-Auth``, its authenticator under the job's
key (:mod:`persistent_delta.fleet.auth`). A marker also lists the sha256 of each part
(``"digests"``, in part order: the marker is bound to its parts) and the end of the range its
shipper shipped before it in the same epoch (``"prev"``; None: the first range of an epoch --
an epoch change is an explicit, authenticated event).

**Limits.** Everything read from the stream is untrusted until authenticated, and bounded
before anything is allocated: a marker lists at most :data:`MAX_PARTS` parts of at most
:data:`MAX_PART_BYTES` bytes each, in at most one chunk per byte; batch indices lie in
``[0, MAX_BATCH_IDX)``. A reader refuses anything else with
:class:`~persistent_delta.errors.StreamDataError`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torchrec.distributed.model_tracker.types import UniqueRows, UpdateMode

from persistent_delta.errors import CorruptRecordError, FormatMismatchError, StreamDataError
from persistent_delta.fleet.auth import Keyring, digest, sign_message
from persistent_delta.fleet.subjects import data_subject, end_subject, msg_id
from persistent_delta.log import codec
from persistent_delta.log.schema import SNAPSHOTS, LogIdentity, TableEntry

FORMAT_VERSION = 1
FORMAT_HEADER = "PD-Format"
# Bytes of a transport's max payload left for the headers (ours and the transport's own).
HEADROOM = 4096
_MIN_CHUNK = 1024
#: Bounds on what a marker may declare (checked before anything is allocated).
MAX_PARTS = 1 << 16
MAX_PART_BYTES = 1 << 40
MAX_BATCH_IDX = 1 << 62
MAX_DEFERRED = 1 << 62  # rows a rank's capped publishes left pending (a marker's "deferred")


def chunk_size(max_payload: int) -> int:
    """The largest part chunk a transport with this max payload (bytes) carries."""
    return max(_MIN_CHUNK, int(max_payload) - HEADROOM)


@dataclass
class Message:
    """One message to send: its subject, payload, headers (``PD-*``) and id.

    Attributes:
        subject: where it goes (:mod:`~persistent_delta.fleet.subjects`).
        payload: its bytes.
        headers: the format's headers (``PD-Format`` and the part's position).
        id: its message id (:func:`~persistent_delta.fleet.subjects.msg_id`): a transport
            stores a message once per id within its duplicate window.
    """

    subject: str
    payload: Union[bytes, bytearray, memoryview]
    headers: Dict[str, str]
    id: str


def record_kind(channel: str) -> int:
    """The record kind of a channel's rows (lookups or snapshots)."""
    return codec.KIND_SNAPSHOT if channel == SNAPSHOTS else codec.KIND_LOOKUP


SideRecord = Tuple[int, torch.Tensor, torch.Tensor]  # (kind, ids, states): a managed-collision side record


def encode_range(
    job: str, epoch: str, channel: str, rank: int, start: int, end: int, rows: Dict[str, UniqueRows],
    chunk_bytes: int, info: Optional[Dict[str, Any]] = None, side: Optional[Dict[str, List[SideRecord]]] = None,
    stamps: Optional[Dict[str, torch.Tensor]] = None, ring: Optional[Keyring] = None, prev: Optional[int] = None,
    formats: Optional[Dict[str, Dict[str, Tuple[UniqueRows, Optional[torch.Tensor]]]]] = None,
) -> Tuple[List[Message], Message, int]:
    """The messages of one shipped range: every table's part (chunked to ``chunk_bytes``), the
    side records of managed-collision tables (``side``: fqn -> records in order, each a part of
    its own numbered after the tables', on the table's subject; the marker lists them under
    ``"side"``, present whenever ``side`` is given, also empty), the per-row publish stamps of
    replicated tables (``stamps``: fqn -> int64, one per row of its part; a part each, numbered
    last, listed under ``"stamps"``: chunked like rows, so a large replicated table never
    outgrows the marker) and the marker, to be sent last.

    Args:
        job: the job whose range it is (:mod:`~persistent_delta.fleet.subjects`).
        epoch: the shipper's epoch (log id and registration token).
        channel: the channel shipped.
        rank: the rank whose log the range comes from.
        start: the first batch index of the range.
        end: the range's end, ``[start, end)``.
        rows: fqn -> the range's unique rows of the table.
        chunk_bytes: the largest chunk (:func:`chunk_size` of the transport's max payload).
        info: extra marker fields (``log_id``, ``log_stamp``, ``log_end``, ``publishes``, ``deferred``).
        side: the managed-collision tables' side records (None: not shipped on this channel).
        stamps: the replicated tables' per-row publish stamps.
        ring: the shipper's keyring: every message is signed with its first key (None or an
            insecure keyring: unsigned).
        prev: the end of the range shipped before this one in the same epoch (None: the
            epoch's first range).
        formats: snapshot rows of other row formats: format -> fqn -> (rows, the replicated
            table's stamps or None), listed under ``"formats"``.

    Returns:
        ``(parts, marker, row_bytes)``: the part messages in order, the marker, and the bytes
        of the rows' ids and states.
    """
    parts: List[Message] = []
    listing: List[List[Any]] = []
    side_listing: List[List[Any]] = []
    stamps_listing: List[List[Any]] = []
    digests: List[str] = []
    row_bytes = 0
    ring = ring or Keyring([])

    def add(i: int, fqn: str, value: bytearray) -> int:
        base = msg_id(job, epoch, channel, rank, start, end, i)
        codec.seal_record(value, base.encode())
        digests.append(digest(value))
        mv = memoryview(value)
        n = max(1, -(-len(value) // chunk_bytes))
        subject = data_subject(job, channel, rank, fqn)
        for j in range(n):
            payload = mv[j * chunk_bytes:(j + 1) * chunk_bytes]
            headers = {FORMAT_HEADER: str(FORMAT_VERSION), "PD-Epoch": epoch, "PD-Range": f"{start}-{end}",
                       "PD-Part": f"{i}/{j}/{n}"}
            sign_message(ring, job, subject, headers, payload)
            parts.append(Message(subject, payload, headers, msg_id(job, epoch, channel, rank, start, end, i, j)))
        return n

    for i, (fqn, u) in enumerate(sorted(rows.items())):
        value = codec.encode_record(u.ids, u.states, record_kind(channel))
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
    formats_listing: List[List[Any]] = []
    for f, by_fqn in sorted((formats or {}).items()):
        for fqn, (u, st) in sorted(by_fqn.items()):
            value = codec.encode_record(u.ids, u.states, record_kind(channel), fmt=f)
            row_bytes += u.ids.numel() * u.ids.element_size() + (0 if u.states is None else u.states.numel() * u.states.element_size())
            formats_listing.append([fqn, add(i, fqn, value), len(value)])
            i += 1
            if st is not None:
                value = codec.encode_record(st.to(torch.int64).reshape(-1), None, codec.KIND_LOOKUP, fmt=f)
                formats_listing.append([fqn, add(i, fqn, value), len(value)])
                i += 1
    body = {"v": FORMAT_VERSION, "job": job, "epoch": epoch, "channel": channel, "rank": int(rank), "start": int(start),
            "end": int(end), "parts": listing, "shipped": time.time(), "prev": None if prev is None else int(prev),
            "digests": digests, **(info or {})}
    if side is not None:
        body["side"] = side_listing
    if stamps_listing:
        body["stamps"] = stamps_listing
    if formats_listing:
        body["formats"] = formats_listing
    payload = codec.pack(body)
    headers = {FORMAT_HEADER: str(FORMAT_VERSION), "PD-Epoch": epoch, "PD-Range": f"{start}-{end}"}
    sign_message(ring, job, end_subject(job, channel, rank), headers, payload)
    marker = Message(end_subject(job, channel, rank), payload, headers, msg_id(job, epoch, channel, rank, start, end, "end"))
    return parts, marker, row_bytes


def check_format(headers: Optional[Dict[str, str]], where: str) -> None:
    """Refuse a message of another format version.

    Raises:
        FormatMismatchError: its ``PD-Format`` header is not :data:`FORMAT_VERSION`.
    """
    v = (headers or {}).get(FORMAT_HEADER)
    if v != str(FORMAT_VERSION):
        raise FormatMismatchError(f"{where}: message format {v!r}, this reader reads {FORMAT_VERSION}; upgrade the "
                                  "older side (shipper or consumer)")


Listing = Tuple[str, int, int]  # a marker's entry of one part: (fqn, chunks, bytes)


def _bounded_int(v: object, lo: int, hi: int, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v < hi:
        raise ValueError(f"{what} must be an integer in [{lo}, {hi}), got {str(v)[:40]}")
    return v


def _listing(v: object, what: str) -> List[Listing]:
    if not isinstance(v, list) or len(v) > MAX_PARTS:
        raise ValueError(f"{what} must be a list of at most {MAX_PARTS} entries")
    out = []
    for e in v:
        if not isinstance(e, (list, tuple)) or len(e) != 3 or not isinstance(e[0], str):
            raise ValueError(f"an entry of {what} is not [fqn, chunks, bytes]")
        nbytes = _bounded_int(e[2], 0, MAX_PART_BYTES, f"{what} bytes")
        out.append((e[0], _bounded_int(e[1], 1, max(1, nbytes) + 1, f"{what} chunks"), nbytes))
    return out


@dataclass
class Marker:
    """A decoded range marker (see the module docs): every field bounded and typed."""

    epoch: str
    start: int
    end: int
    parts: List[Listing]  # (fqn, chunks, bytes)
    seq: int  # its stream sequence
    shipped: float
    info: Dict[str, Any] = field(default_factory=dict)
    # managed-collision side parts (fqn, chunks, bytes), numbered after ``parts``; None: the
    # shipper did not ship side records (an older one, or a channel without them)
    side: Optional[List[Listing]] = None
    # replicated tables' per-row publish stamps (fqn, chunks, bytes), numbered last
    stamps: List[Listing] = field(default_factory=list)
    prev: Optional[int] = None  # the end of the epoch's previous range (None: the epoch's first)
    digests: Optional[List[str]] = None  # sha256 of each part, in part order
    publishes: Dict[int, float] = field(default_factory=dict)  # publish stamp -> time, within [start, end)
    # snapshot rows of other row formats (and their stamps), numbered after ``stamps``
    formats: List[Listing] = field(default_factory=list)
    # the identity of the log the range was read from (None: a marker without a log id)
    log: Optional[LogIdentity] = None

    @property
    def batches_ended(self) -> int:
        """Snapshots: the rank's batches ended (:func:`~persistent_delta.log.position_rules.batches_ended`)
        read with the snapshots end ``end`` (``"batches_ended"``); ``end`` when the marker says
        nothing more (an older shipper, a range that stops below the snapshots end)."""
        return int(self.info.get("batches_ended", self.end))

    def proven_end(self, before: int) -> int:
        """Snapshots: one past the newest publish stamp this marker shows the rank holds: its
        end when it was read with the rank's snapshots end (it carries ``"batches_ended"``),
        else one past its newest listed publish (a range cut short by the shipper's
        ``max_batches`` ends at a cut, not at a publish), else ``before`` (what the rank's
        earlier markers showed). What :func:`~persistent_delta.log.position_rules.snapshots_behind`
        may hold against another rank."""
        if "batches_ended" in self.info:
            return self.end
        return max(before, max(self.publishes, default=-1) + 1)

    @property
    def listing(self) -> List[Listing]:
        """Every part in order: tables, side records, stamps, other formats."""
        return self.parts + (self.side or []) + self.stamps + self.formats

    @staticmethod
    def decode(data: bytes, seq: int, where: str, headers: Optional[Dict[str, str]] = None) -> "Marker":
        """Decode and bound a marker (``headers``: its message's, checked against its body).

        Raises:
            StreamDataError: malformed, or a field out of bounds (naming ``where`` and ``seq``).
        """
        try:
            d = codec.unpack(data, "range marker")
            if not isinstance(d, dict):
                raise ValueError("not a map")
            epoch = d["epoch"]
            if not isinstance(epoch, str) or not 0 < len(epoch) <= 200:
                raise ValueError("epoch must be a string of 1 to 200 characters")
            start = _bounded_int(d["start"], 0, MAX_BATCH_IDX, "start")
            end = _bounded_int(d["end"], start, MAX_BATCH_IDX, "end")
            prev = d.get("prev")
            # prev may exceed start: a restored trainer re-delivers from below its last range's end
            prev = None if prev is None else _bounded_int(prev, 0, MAX_BATCH_IDX, "prev")
            side = d.get("side")
            parts, side_l, stamps = _listing(d["parts"], "parts"), None if side is None else _listing(side, "side"), \
                _listing(d.get("stamps", []), "stamps")
            formats = _listing(d.get("formats", []), "formats")
            n = len(parts) + len(side_l or []) + len(stamps) + len(formats)
            if n > MAX_PARTS:
                raise ValueError(f"{n} parts, at most {MAX_PARTS}")
            digests = d.get("digests")
            if digests is not None and (not isinstance(digests, list) or len(digests) != n
                                        or not all(isinstance(x, str) and len(x) == 64 for x in digests)):
                raise ValueError("digests must list one sha256 per part")
            shipped = d.get("shipped", 0.0)
            if isinstance(shipped, bool) or not isinstance(shipped, (int, float)) or not math.isfinite(shipped):
                raise ValueError("shipped must be a finite time")
            publishes: Dict[int, float] = {}
            pubs = d.get("publishes", [])
            if not isinstance(pubs, list) or len(pubs) > max(0, end - start):
                raise ValueError("publishes must list at most one publish per batch")
            for e in pubs:
                if not isinstance(e, (list, tuple)) or len(e) != 2 or isinstance(e[1], bool) or \
                        not isinstance(e[1], (int, float)) or not math.isfinite(e[1]):
                    raise ValueError("a publish must be [stamp, time]")
                publishes[_bounded_int(e[0], start, max(start, end), "a publish stamp")] = float(e[1])
            log_end = d.get("log_end")
            if log_end is not None:
                _bounded_int(log_end, 0, MAX_BATCH_IDX, "log_end")
            deferred = d.get("deferred")
            if deferred is not None:
                _bounded_int(deferred, 0, MAX_DEFERRED, "deferred")
            ended = d.get("batches_ended")
            if ended is not None:
                _bounded_int(ended, end, MAX_BATCH_IDX, "batches_ended")
            covers = d.get("covers_from")
            if covers is not None:
                _bounded_int(covers, 0, start + 1, "covers_from")
            if headers is not None and (headers.get("PD-Epoch") != epoch or headers.get("PD-Range") != f"{start}-{end}"):
                raise ValueError("its headers name another epoch or range than its body")
            log = LogIdentity.from_value(d)
            info = {k: v for k, v in d.items() if k in ("log_id", "log_stamp", "log_end", "v", "job", "channel", "rank",
                                                        "deferred", "batches_ended", "covers_from")}
            info["publishes"] = [[b, t] for b, t in publishes.items()]
            return Marker(epoch, start, end, parts, seq, float(shipped), info, side_l, stamps, prev, digests, publishes,
                          formats, log)
        except (AssertionError, KeyError, TypeError, ValueError, OverflowError, AttributeError, IndexError,
                CorruptRecordError) as exc:
            raise StreamDataError(f"range marker {seq} in {where} is malformed: {str(exc)[:300]}", seq=seq) from exc


@dataclass
class RankTables:
    """What a remote consumer needs of one rank's log (stored by its shipper in the
    ``meta`` bucket, key ``tables.<rank>``): the table entries (shard info, dtypes, row
    shapes), the channels' update modes, the tracker's world size, tracking mode and table set,
    and the log's creation stamp (``log_stamp``: with ``log_id``, its :class:`LogIdentity`; 0
    in metadata written before stamps)."""

    rank: int
    log_id: str
    world_size: Optional[int]
    tracker: Optional[Dict[str, Any]]
    modes: Dict[str, str]
    entries: Dict[str, bytes]  # fqn -> TableEntry.to_bytes()
    log_stamp: int = 0

    @property
    def identity(self) -> LogIdentity:
        """The identity of the rank's log this metadata was read from."""
        return LogIdentity(self.log_id, self.log_stamp)

    def encode(self) -> bytes:
        """The bytes stored in the ``meta`` bucket."""
        return codec.pack({"v": FORMAT_VERSION, "rank": self.rank, "log_id": self.log_id, "world_size": self.world_size,
                           "tracker": self.tracker, "modes": self.modes, "entries": self.entries,
                           "log_stamp": self.log_stamp})

    @staticmethod
    def decode(buf: bytes, where: str) -> "RankTables":
        """Inverse of :meth:`encode` (``where`` names the source in errors).

        Raises:
            FormatMismatchError: another format version.
            CorruptRecordError: malformed.
        """
        d = codec.unpack(buf, f"table metadata in {where}")
        if not isinstance(d, dict) or d.get("v") != FORMAT_VERSION:
            raise FormatMismatchError(f"{where}: table metadata of format "
                                      f"{d.get('v') if isinstance(d, dict) else '?'}, this reader reads {FORMAT_VERSION}")
        try:
            ws = d.get("world_size")
            rt = RankTables(int(d["rank"]), str(d["log_id"]), None if ws is None else int(ws), d.get("tracker"),
                              {str(k): str(v) for k, v in d["modes"].items()},
                              {str(k): bytes(v) for k, v in d["entries"].items()})
            ident = LogIdentity.from_value(d)
            rt.log_stamp = 0 if ident is None else ident.stamp
            if ws is not None and not 1 <= int(ws) <= 1 << 20:
                raise ValueError(f"world_size {ws} out of [1, 2**20]")
            if not 0 <= rt.rank < (rt.world_size or 1 << 20):
                raise ValueError(f"rank {rt.rank} out of the job's ranks")
            for channel, mode in rt.modes.items():
                UpdateMode(mode)  # ValueError: not an update mode
            for fqn, entry in rt.entries.items():
                TableEntry.from_bytes(fqn, entry)  # CorruptRecordError: malformed
            return rt
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError, IndexError, CorruptRecordError) as exc:
            raise StreamDataError(f"table metadata in {where} is malformed: {str(exc)[:300]}") from exc


def encode_base(stamp: int, tables: Dict[str, torch.Tensor], log: Optional[LogIdentity] = None) -> bytes:
    """A rank's base: its shards' full values as of publish ``stamp`` (each table a record
    of the log's encoding, ids = every local row), and the identity of the rank's log it
    belongs to (``log_id``/``log_stamp``; None: none, a base a reader cannot check)."""
    body: Dict[str, Any] = {"v": FORMAT_VERSION, "stamp": int(stamp), "tables": {}, **(log.to_value() if log else {})}
    for fqn, w in sorted(tables.items()):
        ids = torch.arange(w.shape[0], dtype=torch.int64)
        body["tables"][fqn] = bytes(codec.encode_record(ids, w.detach().contiguous(), codec.KIND_SNAPSHOT))
    return codec.pack(body)


def decode_base(buf: bytes, where: str) -> Tuple[int, Dict[str, torch.Tensor], Optional[LogIdentity]]:
    """(stamp, fqn -> local shard values, the identity of its log or None) of a base
    (:func:`encode_base`).

    Raises:
        FormatMismatchError: another format version.
        CorruptRecordError: a table without values.
    """
    d = codec.unpack(buf, f"base in {where}")
    if not isinstance(d, dict) or d.get("v") != FORMAT_VERSION:
        raise FormatMismatchError(f"{where}: base of another format, this reader reads {FORMAT_VERSION}")
    out = {}
    try:
        stamp = _bounded_int(d["stamp"], 0, MAX_BATCH_IDX, "stamp")
        log = LogIdentity.from_value(d)
        tables = d["tables"]
        if not isinstance(tables, dict):
            raise ValueError("tables must be a map")
        for fqn, raw in tables.items():
            if not isinstance(fqn, str) or not isinstance(raw, bytes):
                raise ValueError("a table must be fqn -> record bytes")
            rec = codec.decode_record(raw)
            if rec.states is None:
                raise ValueError(f"base of {fqn!r} holds no values")
            out[fqn] = rec.states.clone()
    except (KeyError, TypeError, ValueError, OverflowError, AttributeError, IndexError) as exc:
        raise StreamDataError(f"{where}: base is malformed: {str(exc)[:300]}") from exc
    return stamp, out, log


__all__ = ["FORMAT_VERSION", "FORMAT_HEADER", "HEADROOM", "chunk_size", "Message", "SideRecord", "encode_range",
           "record_kind",
           "check_format", "Marker", "RankTables", "encode_base", "decode_base"]
