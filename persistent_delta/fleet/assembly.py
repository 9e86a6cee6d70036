"""A rank's shipped parts reassembled into complete ranges, on the consumer side.

Owns: collecting one rank's part chunks per (epoch, range) attempt and handing out a complete
range when its marker comes (:class:`RangeAssembler`, :class:`RangeContent`): each part checked
against the digest its marker lists, decoded by :mod:`persistent_delta.log.codec` under its
message id, and sorted into table rows, managed-collision side records, replicated tables'
publish stamps and other row formats. The bytes are :mod:`persistent_delta.fleet.wire`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torchrec.distributed.model_tracker.types import UniqueRows

from persistent_delta.errors import CorruptRecordError, StreamDataError
from persistent_delta.fleet.auth import digest
from persistent_delta.fleet.subjects import msg_id, stream_name
from persistent_delta.fleet.wire import MAX_PART_BYTES, MAX_PARTS, Marker, SideRecord, record_kind
from persistent_delta.log import codec


@dataclass
class RangeContent:
    """A complete shipped range: fqn -> rows, managed-collision side records, and the per-row
    publish stamps of replicated tables."""

    tables: Dict[str, UniqueRows]
    side: Dict[str, List[SideRecord]]
    stamps: Dict[str, torch.Tensor]
    formats: Dict[str, Dict[str, UniqueRows]] = field(default_factory=dict)  # other row formats: format -> fqn -> rows
    format_stamps: Dict[str, Dict[str, torch.Tensor]] = field(default_factory=dict)  # their replicated tables' stamps


class RangeAssembler:
    """Collects one rank's part chunks and hands out complete ranges (consumer side).

    Chunks are kept per (epoch, range) attempt; a marker takes its attempt's chunks and drops
    every other pending attempt (a shipper that died mid-range left them; its successor shipped
    the range again, under the same ids within the transport's duplicate window, or as a new
    attempt). Memory: the pending chunks of the ranges not yet marked, at most ``max_pending``
    bytes (other attempts are dropped first; past it the part is refused).
    """

    def __init__(self, job: str, channel: str, rank: int, max_pending: int = 1 << 62) -> None:
        self.job, self.channel, self.rank = job, channel, rank
        self.max_pending = int(max_pending)
        self._pending: Dict[Tuple[str, str], Dict[Tuple[int, int], bytes]] = {}
        self.pending_bytes = 0

    def add_part(self, headers: Dict[str, str], data: bytes, seq: int = 0, subject: str = "") -> None:
        """Keep one part chunk (its ``PD-*`` headers say which); a chunk seen before is ignored.

        Raises:
            StreamDataError: the ``PD-Part`` header is missing or malformed, or the pending parts
                would pass ``max_pending`` bytes (raise the consumer's ``max_buffer_bytes``).
        """
        key = (str(headers.get("PD-Epoch", ""))[:200], str(headers.get("PD-Range", ""))[:60])
        try:
            i, j, n = (int(x) for x in str(headers["PD-Part"])[:60].split("/"))
            if not (0 <= i < MAX_PARTS and 0 <= j < n <= MAX_PART_BYTES):
                raise ValueError("out of bounds")
        except (KeyError, ValueError) as exc:
            raise StreamDataError(f"{self._where()}: part message {seq} on {subject[:200]!r} has no valid PD-Part "
                                  "header", subject=subject, seq=seq) from exc
        chunks = self._pending.setdefault(key, {})
        if (i, j) in chunks:
            return
        if self.pending_bytes + len(data) > self.max_pending:
            for other in [k for k in self._pending if k != key]:  # stale attempts go first
                self.pending_bytes -= sum(len(c) for c in self._pending.pop(other).values())
            if self.pending_bytes + len(data) > self.max_pending:
                raise StreamDataError(
                    f"{self._where()}: part message {seq} on {subject[:200]!r}: the parts of range {key[1]!r} pass the "
                    f"consumer's buffer limit of {self.max_pending} bytes before their marker; raise max_buffer_bytes "
                    "(or check who publishes on the job's subjects)", subject=subject, seq=seq)
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
        try:
            return self._assemble(m, chunks, tables, side, stamps, n_sides)
        finally:
            self._pending.clear()
            self.pending_bytes = 0

    def _assemble(self, m: Marker, chunks: Dict[Tuple[int, int], bytes], tables: Dict[str, UniqueRows],
                  side: Dict[str, List[SideRecord]], stamps: Dict[str, torch.Tensor], n_sides: int
                  ) -> Optional["RangeContent"]:
        complete = True
        formats: Dict[str, Dict[str, UniqueRows]] = {}
        format_stamps: Dict[str, Dict[str, torch.Tensor]] = {}
        n_formats = n_sides + len(m.stamps)
        for i, (fqn, n, nbytes) in enumerate(m.listing):
            rec = self._record(chunks, m, i, fqn, n, nbytes)
            if rec is None:
                complete = False
                break
            if i >= n_formats:
                self._formatted(m, i, fqn, rec, formats, format_stamps)
            elif i < len(m.parts) and rec.format != codec.NATIVE:
                raise CorruptRecordError(f"{self._where()}: range [{m.start}, {m.end}) part {i} of {fqn!r} holds "
                                         f"{rec.format!r} rows where native rows are listed")
            elif i < len(m.parts):
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
        return RangeContent(tables, side, stamps, formats, format_stamps) if complete else None

    def _formatted(self, m: Marker, i: int, fqn: str, rec: codec.DecodedRecord, formats: Dict[str, Dict[str, UniqueRows]],
                   format_stamps: Dict[str, Dict[str, torch.Tensor]]) -> None:
        """Keep a part listed under ``"formats"``: rows of another row format, or the stamps of
        the rows just before them.

        Raises:
            CorruptRecordError: native, a table's rows twice, stamps that match no rows.
        """
        where = f"{self._where()}: range [{m.start}, {m.end}) part {i} of {fqn!r}"
        if rec.format == codec.NATIVE:
            raise CorruptRecordError(f"{where} is listed under other formats but holds native rows")
        rows = formats.setdefault(rec.format, {})
        if rec.kind == codec.KIND_LOOKUP and rec.states is None and rec.ids.dtype == torch.int64:
            if fqn not in rows or fqn in format_stamps.get(rec.format, {}) or rec.ids.numel() != rows[fqn].ids.numel():
                raise CorruptRecordError(f"{where}: the {rec.format} stamps do not match its rows")
            format_stamps.setdefault(rec.format, {})[fqn] = rec.ids
        elif rec.kind == record_kind(self.channel) and rec.states is not None and fqn not in rows:
            rows[fqn] = UniqueRows(ids=rec.ids, states=rec.states)
        else:
            raise CorruptRecordError(f"{where}: not {rec.format} rows of the table (kind {rec.kind}, or a second part)")

    def _record(self, chunks: Dict[Tuple[int, int], bytes], m: Marker, i: int, fqn: str, n: int, nbytes: int
                ) -> Optional[codec.DecodedRecord]:
        # count before building: a marker may declare any number of chunks (bounded by its bytes)
        if sum(1 for (a, b) in chunks if a == i and b < n) < n:
            return None
        pieces = [chunks[(i, j)] for j in range(n)]
        buf = pieces[0] if n == 1 else b"".join(pieces)
        if len(buf) != nbytes:
            raise StreamDataError(f"{self._where()}: range [{m.start}, {m.end}) part {i} has {len(buf)} bytes, "
                                  f"its marker (stream seq {m.seq}) says {nbytes}", seq=m.seq)
        if m.digests is not None and digest(buf) != m.digests[i]:
            raise StreamDataError(f"{self._where()}: range [{m.start}, {m.end}) part {i} of {fqn!r} is not the part "
                                  f"its marker (stream seq {m.seq}) lists (another digest)", seq=m.seq)
        base = msg_id(self.job, m.epoch, self.channel, self.rank, m.start, m.end, i)
        try:
            return codec.decode_record(buf, key=base.encode())  # type: ignore[arg-type]
        except CorruptRecordError as exc:
            raise CorruptRecordError(f"{self._where()}: range [{m.start}, {m.end}) table {fqn!r}: {exc}") from exc

    def _where(self) -> str:
        return f"stream {stream_name(self.job)} {self.channel} rank {self.rank}"


__all__ = ["RangeAssembler", "RangeContent"]
