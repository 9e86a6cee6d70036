"""The wire format: what a shipped range, a rank's table metadata and a base look like as bytes.

Owns: the message format (its version, the chunking of records larger than the transport's
max payload, range markers) and its decoding on the consumer side (:class:`RangeAssembler`);
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
move.

Every message carries the header ``PD-Format`` (:data:`FORMAT_VERSION`); a reader refuses
another one. Parts also carry ``PD-Epoch``, ``PD-Range`` (``start-end``) and ``PD-Part``
(``part/chunk/chunks``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torchrec.distributed.model_tracker.types import UniqueRows

from persistent_delta.errors import CorruptRecordError, FormatMismatchError
from persistent_delta.fleet.subjects import data_subject, end_subject, msg_id, stream_name
from persistent_delta.log import codec
from persistent_delta.log.schema import SNAPSHOTS

FORMAT_VERSION = 1
FORMAT_HEADER = "PD-Format"
# Bytes of a transport's max payload left for the headers (ours and the transport's own).
HEADROOM = 4096
_MIN_CHUNK = 1024


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
        info: extra marker fields (``log_id``, ``log_end``, ``publishes``).
        side: the managed-collision tables' side records (None: not shipped on this channel).
        stamps: the replicated tables' per-row publish stamps.

    Returns:
        ``(parts, marker, row_bytes)``: the part messages in order, the marker, and the bytes
        of the rows' ids and states.
    """
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
                FORMAT_HEADER: str(FORMAT_VERSION), "PD-Epoch": epoch, "PD-Range": f"{start}-{end}",
                "PD-Part": f"{i}/{j}/{n}",
            }, msg_id(job, epoch, channel, rank, start, end, i, j)))
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
        FORMAT_HEADER: str(FORMAT_VERSION), "PD-Epoch": epoch, "PD-Range": f"{start}-{end}",
    }, msg_id(job, epoch, channel, rank, start, end, "end"))
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
    the range again, under the same ids within the transport's duplicate window, or as a new
    attempt). Memory: the pending chunks of the ranges not yet marked.
    """

    def __init__(self, job: str, channel: str, rank: int) -> None:
        self.job, self.channel, self.rank = job, channel, rank
        self._pending: Dict[Tuple[str, str], Dict[Tuple[int, int], bytes]] = {}
        self.pending_bytes = 0

    def add_part(self, headers: Dict[str, str], data: bytes) -> None:
        """Keep one part chunk (its ``PD-*`` headers say which); a chunk seen before is ignored.

        Raises:
            CorruptRecordError: the ``PD-Part`` header is missing or malformed.
        """
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


@dataclass
class RankTables:
    """What a remote consumer needs of one rank's log (stored by its shipper in the
    ``meta`` bucket, key ``tables.<rank>``): the table entries (shard info, dtypes, row
    shapes), the channels' update modes, the tracker's world size, tracking mode and table set."""

    rank: int
    log_id: str
    world_size: Optional[int]
    tracker: Optional[Dict[str, Any]]
    modes: Dict[str, str]
    entries: Dict[str, bytes]  # fqn -> TableEntry.to_bytes()

    def encode(self) -> bytes:
        """The bytes stored in the ``meta`` bucket."""
        return codec.pack({"v": FORMAT_VERSION, "rank": self.rank, "log_id": self.log_id, "world_size": self.world_size,
                           "tracker": self.tracker, "modes": self.modes, "entries": self.entries})

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
            return RankTables(int(d["rank"]), str(d["log_id"]), None if ws is None else int(ws), d.get("tracker"),
                              {str(k): str(v) for k, v in d["modes"].items()},
                              {str(k): bytes(v) for k, v in d["entries"].items()})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptRecordError(f"table metadata in {where} is malformed: {exc}") from exc


def encode_base(stamp: int, tables: Dict[str, torch.Tensor]) -> bytes:
    """A rank's base: its shards' full values as of publish ``stamp`` (each table a record
    of the log's encoding, ids = every local row)."""
    body: Dict[str, Any] = {"v": FORMAT_VERSION, "stamp": int(stamp), "tables": {}}
    for fqn, w in sorted(tables.items()):
        ids = torch.arange(w.shape[0], dtype=torch.int64)
        body["tables"][fqn] = bytes(codec.encode_record(ids, w.detach().contiguous(), codec.KIND_SNAPSHOT))
    return codec.pack(body)


def decode_base(buf: bytes, where: str) -> Tuple[int, Dict[str, torch.Tensor]]:
    """(stamp, fqn -> local shard values) of a base (:func:`encode_base`).

    Raises:
        FormatMismatchError: another format version.
        CorruptRecordError: a table without values.
    """
    d = codec.unpack(buf, f"base in {where}")
    if not isinstance(d, dict) or d.get("v") != FORMAT_VERSION:
        raise FormatMismatchError(f"{where}: base of another format, this reader reads {FORMAT_VERSION}")
    out = {}
    for fqn, raw in d["tables"].items():
        rec = codec.decode_record(bytes(raw))
        if rec.states is None:
            raise CorruptRecordError(f"{where}: base of {fqn!r} holds no values")
        out[str(fqn)] = rec.states.clone()
    return int(d["stamp"]), out


__all__ = ["FORMAT_VERSION", "FORMAT_HEADER", "HEADROOM", "chunk_size", "Message", "SideRecord", "encode_range",
           "check_format", "Marker", "RangeContent", "RangeAssembler", "RankTables", "encode_base", "decode_base"]
