"""The log's on-disk format: keys, record values and small metadata values.

Owns: the bytes -- record keys, record values, the format version, metadata packing.

Design note
-----------
Keys are fixed-width big-endian integers so that LMDB's byte order is numeric order:

    record key = table_id (u32) | batch_idx (u64) | seq (u32)        -- 16 bytes

``seq`` orders the records that share (table, batch_idx), in append order. A cursor positioned
at ``record_key(t, b, 0)`` therefore walks table ``t`` from batch ``b`` upwards, in call order.

A record value is a small msgpack header followed by raw tensor bytes, so decoding is a
``torch.frombuffer`` view, not a copy (msgpack would copy ``bin`` fields):

    u32 header_len | u32 check | header (msgpack) | pad | ids bytes | pad | states bytes

``check = crc32c(value[8:]) XOR crc32c(key)``: the checksum covers the record's key as well as
its bytes, so a flipped byte in either is reported as :class:`CorruptRecordError` on every
read instead of being returned as data (a flipped key byte would otherwise move a record to
another batch silently). :func:`encode_record` computes the value's part;
:func:`seal_record` folds in the key when the record is stored under it. Tensor payloads start
at 8-byte aligned offsets within the value. The header holds the record kind, the dtypes and the
shapes; an unknown kind or dtype raises, it is never skipped.

The format version (``FORMAT_VERSION``) is stored in the log's meta DB and checked on open.

Format history and plan (every format change of this round is here, once):

* **1** -- the checksum covered the value only.
* **2** -- the checksum covers the key too. Logs of version 1 are refused on open with
  :class:`FormatMismatchError`; ``persistent-delta upgrade ROOT --execute`` rewrites them in
  place (every record's checksum verified the old way, then sealed the new way, in one
  transaction per rank). Reserved in version 2 for this round's other issues, so that they
  need no further version: record kinds 2 (raw ids behind a batch's slot ids) and 3
  (evictions: slots taken from raw ids). Kinds 2 and 3 are stored under the table's *side
  id* (``table_id | 2**31``, :func:`side_table_id`) in the lookups database: kind 2 holds a
  batch's slot ids (``ids``) and int64 states ``[n, 2]`` = (raw id, admitted 0/1); kind 3 the
  slots reassigned (``ids``) and int64 states ``[n, 2]`` = (raw id taken from the slot, raw id
  given it), :data:`NO_RAW_ID` for none. Header fields in version 2: ``"w"`` (window start of
  a filtered record), ``"e"`` (covered end of a compacted record), ``"t"`` (on snapshot
  records: wall-clock time of the ``publish()`` call that wrote them, seconds since the
  epoch; records written before it existed have none). A reader of this version raises on a kind it does not
  know and ignores header fields it does not know.
  ``"f"`` (on snapshot records: the *row format* the rows were converted to for serving,
  :data:`ROW_FORMATS`; absent: ``"native"``, the table's own dtype -- every record written
  before formats existed). A reader refuses a record whose ``"f"`` it does not know, or whose
  states do not have that format's dtype (:class:`CorruptRecordError`). A reader older than
  formats ignores ``"f"`` and would take converted rows for native ones: a log whose
  publishes write other formats is for readers of this version (see the CHANGELOG).

Row formats (:data:`ROW_FORMATS`): what a snapshots consumer asks for at registration.
``"native"``: the table's dtype, ``[n, dim]``. ``"float32"``/``"float16"``/``"bfloat16"``:
``[n, dim]`` of that dtype (``rows.to(dtype)``). ``"int8"``: FBGEMM's row-wise int8, uint8
``[n, dim + 4]`` -- ``dim`` quantized values, then an fp16 scale and an fp16 bias, exactly
``torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(rows_float32, 8)``
(:func:`quantize_int8`), the bytes TorchRec's inference quantization gives that row. A
column-wise shard's half-row cannot be quantized alone (the scale is the whole row's), so
ranks store a column-wise table's int8 records as float32 halves flagged ``"int8"``
(:func:`format_states`), and the reader joins and quantizes them.
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import crc32c
import msgpack
import numpy as np
import torch

from persistent_delta.errors import CorruptRecordError, InvalidInputError

# See the module docstring for the format history.
FORMAT_VERSION = 2

# Record kinds. A reader that meets a kind it does not know raises CorruptRecordError.
KIND_LOOKUP = 0  # ids (+ states) recorded from a batch, or a compacted range of them
KIND_SNAPSHOT = 1  # ids + current row values written by a publish
# Managed-collision (ZCH) tables (see "Side records" below and persistent_delta/zchlog.py):
KIND_RAW_IDS = 2  # ids: the slot ids a batch looked up; states int64 [n, 2]: (raw id, admitted 0/1)
KIND_SLOTS = 3  # ids: slots reassigned; states int64 [n, 2]: (raw id taken from the slot, raw id given it)
SIDE_KINDS = (KIND_RAW_IDS, KIND_SLOTS)
_KNOWN_KINDS = (KIND_LOOKUP, KIND_SNAPSHOT, KIND_RAW_IDS, KIND_SLOTS)
NO_RAW_ID = -1  # in a KIND_SLOTS record: the slot held no raw id (before), or holds none (after)

# Side records (kinds 2 and 3) of table ``t`` live in the lookups database under the table id
# ``t | SIDE_TABLE_BIT`` (the table's *side id*): readers of the lookups channel walk the
# table's own id and never meet them, compaction never merges them, and the deletions that
# apply to a table's lookups (retention, restart settling) apply to its side id too.
SIDE_TABLE_BIT = 1 << 31

_KEY = struct.Struct(">IQI")
_TABLE_PREFIX = struct.Struct(">I")
_PREFIX = struct.Struct(">II")
KEY_SIZE = _KEY.size
MAX_BATCH_IDX = (1 << 64) - 1
MAX_SEQ = (1 << 32) - 1

# torch.frombuffer warns once per process (TORCH_WARN_ONCE) on a read-only buffer, and LMDB's
# map is read-only. Our views are never written to and never outlive their transaction (see
# log.py), so the warning is noise: spend the one warning here, inside a scoped filter, instead
# of installing a process-wide filter that would hide it from the rest of the program.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(bytes(8), dtype=torch.uint8)
    torch.from_numpy(np.frombuffer(bytes(8), dtype=np.uint8))  # (its own once-warning: from_view)

_DTYPES: Dict[str, torch.dtype] = {
    name: dt
    for name, dt in (
        ("bool", torch.bool),
        ("uint8", torch.uint8),
        ("int8", torch.int8),
        ("int16", torch.int16),
        ("int32", torch.int32),
        ("int64", torch.int64),
        ("uint16", torch.uint16),
        ("uint32", torch.uint32),
        ("uint64", torch.uint64),
        ("float16", torch.float16),
        ("bfloat16", torch.bfloat16),
        ("float32", torch.float32),
        ("float64", torch.float64),
        ("complex64", torch.complex64),
        ("complex128", torch.complex128),
        ("float8_e4m3fn", torch.float8_e4m3fn),
        ("float8_e5m2", torch.float8_e5m2),
    )
}
_DTYPE_NAMES: Dict[torch.dtype, str] = {dt: name for name, dt in _DTYPES.items()}
INTEGER_ID_DTYPES = frozenset(
    (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
     torch.uint16, torch.uint32, torch.uint64)
)


def dtype_name(dtype: torch.dtype) -> str:
    """The stored name of ``dtype``; raises :class:`InvalidInputError` for unsupported ones."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise InvalidInputError(f"dtype {dtype} cannot be stored in a delta log") from None


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype stored as ``name``; raises :class:`CorruptRecordError` when unknown."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise CorruptRecordError(f"unknown dtype {name!r} in a stored record") from None


# --------------------------------------------------------------------------- row formats

NATIVE = "native"
#: The row formats a snapshots consumer may ask for (see the module docstring).
ROW_FORMATS = (NATIVE, "float32", "float16", "bfloat16", "int8")
INT8 = "int8"
#: A reader of every format (a shipper carries records as they are); never written.
ANY_FORMAT = "*"
_FLOAT_FORMATS: Dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16,
                                          "bfloat16": torch.bfloat16}
INT8_TAIL = 4  # bytes after a row's int8 values: fp16 scale, fp16 bias


def check_format(fmt: object, any_ok: bool = False) -> str:
    """``fmt`` if it names a row format (``any_ok``: or :data:`ANY_FORMAT`).

    Raises:
        InvalidInputError: it names none (the message lists the valid ones).
    """
    if isinstance(fmt, str) and (fmt in ROW_FORMATS or (any_ok and fmt == ANY_FORMAT)):
        return fmt
    raise InvalidInputError(f"unknown row format {fmt!r}; the formats are {', '.join(map(repr, ROW_FORMATS))}")


def format_states(fmt: str, dtype: torch.dtype, tail: Sequence[int],
                  column_half: bool = False) -> Tuple[torch.dtype, Tuple[int, ...]]:
    """The states' dtype and trailing shape of a ``fmt`` record of a table whose values are
    ``dtype`` rows of shape ``tail`` (``column_half``: a column-wise shard's, whose int8 rows
    are stored as float32 halves until the reader joins them).

    Raises:
        InvalidInputError: int8 of a table whose values are not float32 or float16, or not
            rows (1-D tails).
    """
    if fmt == NATIVE:
        return dtype, tuple(tail)
    if fmt in _FLOAT_FORMATS:
        return _FLOAT_FORMATS[fmt], tuple(tail)
    if dtype not in (torch.float32, torch.float16) or len(tail) != 1:
        raise InvalidInputError(f"row format 'int8' quantizes float32 or float16 rows; this table holds {dtype} "
                                f"of shape {list(tail)} (ask for 'native', 'float32', 'float16' or 'bfloat16')")
    return (torch.float32, tuple(tail)) if column_half else (torch.uint8, (int(tail[0]) + INT8_TAIL,))


def serves(record_format: str, states_dtype: Optional[torch.dtype], wanted: str) -> bool:
    """Whether a record of ``record_format`` (its states ``states_dtype``) belongs in a poll
    of a reader that asked for ``wanted``: the one filter of every reader, local and remote.
    A native record serves a float format of its own dtype too (a publish writes such rows
    once, as native)."""
    if wanted == ANY_FORMAT or record_format == wanted:
        return True
    return record_format == NATIVE and wanted in _FLOAT_FORMATS and states_dtype == _FLOAT_FORMATS[wanted]


def stored_format(fmt: str, dtype: torch.dtype) -> str:
    """The format a publish stores ``fmt`` rows of a ``dtype`` table as: a float format of the
    table's own dtype is stored once, as native (:func:`serves`)."""
    return NATIVE if _FLOAT_FORMATS.get(fmt) == dtype else fmt


def quantize_int8(rows: torch.Tensor) -> torch.Tensor:
    """FBGEMM's row-wise int8 of ``rows`` (2-D): uint8 ``[n, dim + 4]``, bit-equal to what
    TorchRec's inference quantization stores for those rows."""
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

    out: torch.Tensor = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(
        rows.to(torch.float32).contiguous(), 8)
    return out


def _check_record_format(header: Dict[str, Any], states_dtype: Optional[str]) -> str:
    """A record header's row format (``"f"``; absent: native), checked against its states.

    Raises:
        CorruptRecordError: an unknown format, or states of a dtype the format never has.
    """
    f = header.get("f")
    if f is None:
        return NATIVE
    if not isinstance(f, str) or f == NATIVE or f not in ROW_FORMATS:
        raise CorruptRecordError(f"record of unknown row format {str(f)[:40]!r} (the formats are "
                                 f"{', '.join(ROW_FORMATS[1:])}; written by a newer version?)")
    ok = ("uint8", "float32") if f == INT8 else (dtype_name(_FLOAT_FORMATS[f]),)
    if states_dtype is not None and states_dtype not in ok:  # (a record without states: stamps of such rows)
        raise CorruptRecordError(f"record of row format {f!r} holds states of dtype {states_dtype}")
    return str(f)


# ---------------------------------------------------------------------------------- keys


def record_key(table_id: int, batch_idx: int, seq: int) -> bytes:
    """The 16-byte key of record ``seq`` of ``(table_id, batch_idx)``."""
    return _KEY.pack(table_id, batch_idx, seq)


def decode_record_key(key: Union[bytes, memoryview]) -> Tuple[int, int, int]:
    """``(table_id, batch_idx, seq)`` of a record key."""
    if len(key) != KEY_SIZE:
        raise CorruptRecordError(f"record key of {len(key)} bytes, expected {KEY_SIZE}")
    t, b, s = _KEY.unpack(bytes(key))
    return int(t), int(b), int(s)


def side_table_id(table_id: int) -> int:
    """The key table id of table ``table_id``'s side records (kinds 2 and 3)."""
    if not 0 <= table_id < SIDE_TABLE_BIT:
        raise InvalidInputError(f"table id {table_id} out of range for side records")
    return table_id | SIDE_TABLE_BIT


def record_where(label: str, table: Union[str, int], side: bool, batch_idx: int, seq: int) -> str:
    """How messages name a stored record: ``<label> record (table 'fqn'[ side], batch B, seq S)``
    (``table``: the fqn, or the key's table id when it names no table; ``label``: the database
    or channel it was read from)."""
    return f"{label} record (table {table!r}{' side' if side else ''}, batch {batch_idx}, seq {seq})"


def is_side_table_id(key_table_id: int) -> bool:
    """Whether a record key's table id is a side id (:func:`side_table_id`)."""
    return bool(key_table_id & SIDE_TABLE_BIT)


def table_prefix(table_id: int) -> bytes:
    """The 4-byte prefix shared by every record key of ``table_id``."""
    return _TABLE_PREFIX.pack(table_id)


def range_stop_key(table_id: int, end_idx: Optional[int]) -> bytes:
    """The first key past the records of ``table_id`` with ``batch_idx < end_idx`` (None: all
    of them). Keys are big-endian ``(table_id, batch_idx, seq)``, so bytes order is key order."""
    if end_idx is not None and end_idx < 1 << 64:
        return record_key(table_id, max(0, end_idx), 0)
    if table_id + 1 < 1 << 32:
        return table_prefix(table_id + 1)
    return table_prefix(table_id) + b"\xff" * (KEY_SIZE - 4) + b"\xff"  # the last table id


def key_name(key: Union[bytes, memoryview], db: str) -> str:
    """A table fqn or consumer name stored as a key of database ``db``; a damaged one is a
    typed error."""
    try:
        return bytes(key).decode()
    except UnicodeDecodeError as exc:
        raise CorruptRecordError(f"a key of the {db} database is not valid UTF-8 ({bytes(key)[:40]!r}): damaged") from exc


# ------------------------------------------------------------------------------- records


@dataclass
class DecodedRecord:
    """A decoded record value. ``ids``/``states`` may be views into LMDB's map: valid only
    inside the read transaction that produced the buffer (copy them to keep them)."""

    kind: int
    ids: torch.Tensor
    states: Optional[torch.Tensor]
    nbytes: int
    window_start: Optional[int] = None
    covers_end: Optional[int] = None
    publish_time: Optional[float] = None
    format: str = NATIVE  # the row format (header "f")


def _raw_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def _pad(n: int) -> int:
    return (-n) % 8


_ZEROS = bytes(8)


def encode_record(
    ids: torch.Tensor, states: Optional[torch.Tensor], kind: int = KIND_LOOKUP, window_start: Optional[int] = None,
    covers_end: Optional[int] = None, publish_time: Optional[float] = None, fmt: str = NATIVE,
    into: Optional[bytearray] = None,
) -> Encoded:
    """Encode one record value (unsealed: see :func:`seal_record`). ``ids`` is 1-D;
    ``states`` (optional) has ``len(ids)`` rows.

    ``window_start``: the record omits ids already recorded in ``[window_start, batch_idx)``
    (the writer's window filter); a reader starting after ``window_start`` must start there.
    ``covers_end``: a compacted record stamped ``b`` holds the batches ``[b, covers_end)``; a
    reader starting inside that range must start at ``b``. ``publish_time``: the wall-clock
    time (seconds since the epoch) of the publish that wrote a snapshot record. ``fmt``: the
    row format ``states`` are in (header ``"f"``; native: none). ``into``: a buffer to encode
    into when it is large enough (as :func:`encode_gathered`'s).
    """
    return _encode(ids, None if states is None else (states.dtype, list(states.shape)),
                   None if states is None else lambda out: out.copy_(states.detach().reshape(out.shape)),
                   kind, window_start, covers_end, publish_time, into=into, fmt=fmt)


Encoded = Union[bytearray, memoryview]  # an encoded record: its own buffer, or a writable view of a reused one


def encode_gathered(
    ids: torch.Tensor, source: torch.Tensor, rows: torch.Tensor, kind: int = KIND_SNAPSHOT,
    publish_time: Optional[float] = None, checksum: bool = True, into: Optional[bytearray] = None,
    window_start: Optional[int] = None,
) -> Encoded:
    """Encode a record whose states are ``source[rows]`` (rows of a 2-D tensor), gathered
    straight into the record's buffer: one copy of the row bytes, none through a temporary.
    ``checksum=False`` leaves the checksum to :func:`checksum_record` (another thread may
    compute it later, before the record is stored). ``into``: a buffer to encode into when it
    is large enough (the result is then a view of its start, valid until it is reused): a
    caller encoding records of similar sizes again and again (``publish``) skips allocating,
    zeroing and page-faulting a fresh buffer each time. ``window_start``: as
    :func:`encode_record`'s (the writer's window filter keeps some rows of a captured block)."""
    if source.dim() != 2:
        raise InvalidInputError(f"source must be 2-D, got shape {tuple(source.shape)}")
    rows = rows.long()
    return _encode(ids, (source.dtype, [int(rows.numel()), int(source.shape[1])]),
                   lambda out: _gather_into(source.detach(), rows, out), kind, window_start, None, publish_time,
                   checksum, into)


def gather_record(
    ids: torch.Tensor, source: torch.Tensor, rows: torch.Tensor, kind: int = KIND_SNAPSHOT,
    publish_time: Optional[float] = None, into: Optional[bytearray] = None,
) -> Tuple[Encoded, torch.Tensor]:
    """:func:`encode_gathered` with ``checksum=False``, returning the gathered rows too: a view
    of the record's states (valid as long as the record), from which a caller encodes the
    same rows in other formats without decoding the record."""
    if source.dim() != 2:
        raise InvalidInputError(f"source must be 2-D, got shape {tuple(source.shape)}")
    rows = rows.long()
    shape = [int(rows.numel()), int(source.shape[1])]
    views: List[torch.Tensor] = []

    def fill(out: torch.Tensor) -> None:
        _gather_into(source.detach(), rows, out)
        views.append(out)

    value = _encode(ids, (source.dtype, shape), fill, kind, None, None, publish_time, False, into)
    return value, (views[0] if views else torch.empty(shape, dtype=source.dtype))


def _gather_into(source: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
    """``out[:] = source[rows]``; a device table is gathered on its device, then copied to host."""
    if source.device.type == "cpu":
        torch.index_select(source, 0, rows, out=out)
    else:
        out.copy_(torch.index_select(source, 0, rows.to(source.device)))


def encode_cast(
    ids: torch.Tensor, states: torch.Tensor, dtype: torch.dtype, kind: int = KIND_SNAPSHOT,
    publish_time: Optional[float] = None, fmt: str = NATIVE, into: Optional[bytearray] = None,
) -> Encoded:
    """Encode a record of ``states`` cast to ``dtype`` on their way into the record's buffer
    (one pass: no converted copy in between), in row format ``fmt``; ``into``: a buffer to
    reuse, as for :func:`encode_gathered`."""
    return _encode(ids, (dtype, list(states.shape)), lambda out: out.copy_(states.detach().reshape(out.shape)), kind,
                   None, None, publish_time, True, into, fmt)


def encoded_size(ids: torch.Tensor, states_dtype: torch.dtype, states_shape: Sequence[int], kind: int = KIND_SNAPSHOT,
                 publish_time: Optional[float] = None, fmt: str = NATIVE) -> int:
    """The length of the record :func:`encode_gathered` (or :func:`encode_cast`) encodes for
    these arguments (to size an ``into`` buffer)."""
    head = _header(ids, (states_dtype, list(states_shape)), kind, None, None, publish_time, fmt)
    return _placement(head, ids.numel() * ids.element_size(), (states_dtype, list(states_shape)))[2]


def _header(ids: torch.Tensor, states_meta: Optional[Tuple[torch.dtype, List[int]]], kind: int,
            window_start: Optional[int], covers_end: Optional[int], publish_time: Optional[float],
            fmt: str = NATIVE) -> bytes:
    header: Dict[str, object] = {"k": kind, "i": [dtype_name(ids.dtype), int(ids.numel())]}
    if fmt != NATIVE:
        header["f"] = check_format(fmt)
    if window_start is not None:
        header["w"] = int(window_start)
    if covers_end is not None:
        header["e"] = int(covers_end)
    if publish_time is not None:
        header["t"] = float(publish_time)
    if states_meta is not None:
        header["s"] = [dtype_name(states_meta[0]), states_meta[1]]
    out: bytes = msgpack.packb(header)
    return out


def _placement(head: bytes, ids_len: int, states_meta: Optional[Tuple[torch.dtype, List[int]]]) -> Tuple[int, int, int]:
    """(ids offset, states offset, total length) of a record with this header."""
    states_len = 0
    if states_meta is not None:
        dtype, shape = states_meta
        states_len = dtype.itemsize
        for d in shape:
            states_len *= d
    # Offsets are relative to the value start; payloads start 8-byte aligned.
    ids_at = _PREFIX.size + len(head)
    ids_at += _pad(ids_at)
    states_at = ids_at + ids_len
    if states_meta is not None:
        states_at += _pad(states_at)
    return ids_at, states_at, states_at + states_len


def _encode(
    ids: torch.Tensor, states_meta: Optional[Tuple[torch.dtype, List[int]]], fill: Optional[Callable[[torch.Tensor], object]],
    kind: int, window_start: Optional[int], covers_end: Optional[int], publish_time: Optional[float],
    checksum: bool = True, into: Optional[bytearray] = None, fmt: str = NATIVE,
) -> Encoded:
    ids_buf = _raw_bytes(ids)
    head = _header(ids, states_meta, kind, window_start, covers_end, publish_time, fmt)
    ids_at, states_at, size = _placement(head, len(ids_buf), states_meta)
    states_len = size - states_at
    # One copy of each payload, straight into the (mutable: see seal_record) result.
    out: Encoded
    if into is not None and len(into) >= size:
        out = memoryview(into)[:size]
        pad_at = _PREFIX.size + len(head)
        out[pad_at:ids_at] = bytes(ids_at - pad_at)  # a reused buffer's padding is zeroed as a new one's
        out[ids_at + len(ids_buf):states_at] = bytes(states_at - ids_at - len(ids_buf))
    else:
        out = bytearray(size)
    out[_PREFIX.size:_PREFIX.size + len(head)] = head
    out[ids_at:ids_at + len(ids_buf)] = ids_buf
    if states_meta is not None and fill is not None and states_len:
        dtype, shape = states_meta
        fill(torch.frombuffer(out, dtype=dtype, count=states_len // dtype.itemsize, offset=states_at).view(shape))
    _PREFIX.pack_into(out, 0, len(head), 0)
    return checksum_record(out) if checksum else out


def checksum_record(value: Encoded) -> Encoded:
    """Compute an encoded, unsealed value's checksum in place (see ``checksum=False``)."""
    _TABLE_PREFIX.pack_into(value, 4, crc32c.crc32c(memoryview(value)[_PREFIX.size:]))  # (the crc half of _PREFIX)
    return value


def seal_record(value: Encoded, key: bytes) -> Encoded:
    """Fold ``key`` into the checksum of an encoded ``value``, in place, before it is stored
    under ``key`` (sealing twice with the same key unseals). A value stored unsealed reads back
    only under the empty key."""
    head_len, crc = _PREFIX.unpack_from(value, 0)
    _PREFIX.pack_into(value, 0, head_len, crc ^ crc32c.crc32c(key))
    return value


class _Layout(NamedTuple):
    """Where a checked record value's parts lie (offsets from the value's start)."""

    kind: int
    ids_dtype: str  # a stored dtype name (known)
    n_ids: int
    ids_at: int
    states_dtype: Optional[str]  # None: no states
    states_shape: List[int]
    states_count: int  # elements
    states_at: int
    header: Dict[str, Any]
    format: str = NATIVE


def _layout(mv: memoryview, verify: bool, key: bytes) -> _Layout:
    """Check a record value (checksum, header, kind, dtypes, lengths) and say where its parts
    lie: the one parser behind :func:`decode_record` and :func:`decode_record_rows`."""
    n = len(mv)
    if n < _PREFIX.size:
        raise CorruptRecordError(f"record value of {n} bytes is truncated")
    head_len, crc = _PREFIX.unpack_from(mv, 0)
    if verify and crc32c.crc32c(mv[_PREFIX.size:]) ^ crc32c.crc32c(key) != crc:
        raise CorruptRecordError("record checksum mismatch (the stored bytes or the record's key were altered)")
    try:
        header = msgpack.unpackb(mv[_PREFIX.size:_PREFIX.size + head_len])
        kind = int(header["k"])
        ids_dtype_name, n_ids = header["i"]
        states_meta = header.get("s")
    except Exception as exc:  # noqa: BLE001 - any decoding failure means a damaged record
        raise CorruptRecordError(f"record header cannot be decoded: {exc}") from exc
    if kind not in _KNOWN_KINDS:
        raise CorruptRecordError(f"unknown record kind {kind} (written by a newer version?)")
    pos = _PREFIX.size + head_len
    pos += _pad(pos)
    ids_len = int(n_ids) * dtype_from_name(ids_dtype_name).itemsize
    if pos + ids_len > n:
        raise CorruptRecordError("record value shorter than its header says")
    ids_at = pos
    pos += ids_len
    if states_meta is None:
        return _Layout(kind, ids_dtype_name, int(n_ids), ids_at, None, [], 0, pos, header,
                       _check_record_format(header, None) if "f" in header else NATIVE)
    pos += _pad(pos)
    try:
        s_name, shape = states_meta[0], [int(d) for d in states_meta[1]]
    except Exception as exc:  # noqa: BLE001
        raise CorruptRecordError(f"record header cannot be decoded: {exc}") from exc
    count = 1
    for d in shape:
        count *= d
    if pos + count * dtype_from_name(s_name).itemsize > n:
        raise CorruptRecordError("record value shorter than its header says")
    return _Layout(kind, ids_dtype_name, int(n_ids), ids_at, s_name, shape, count, pos, header,
                   _check_record_format(header, s_name))


def decode_record(buf: Union[bytes, bytearray, memoryview], verify: bool = True, key: bytes = b"") -> DecodedRecord:
    """Decode a record value stored under ``key`` into tensor views over ``buf`` (no copy).

    Raises:
        CorruptRecordError: checksum mismatch (value or key altered), truncated value, unknown
            kind or dtype.
    """
    mv = memoryview(buf)
    lay = _layout(mv, verify, bytes(key))
    ids = _view(mv, _DTYPES[lay.ids_dtype], lay.n_ids, lay.ids_at)
    states: Optional[torch.Tensor] = None
    if lay.states_dtype is not None:
        states = _view(mv, _DTYPES[lay.states_dtype], lay.states_count, lay.states_at).reshape(lay.states_shape)
    w, e, t = lay.header.get("w"), lay.header.get("e"), lay.header.get("t")
    return DecodedRecord(kind=lay.kind, ids=ids, states=states, nbytes=len(mv),
                         window_start=None if w is None else int(w), covers_end=None if e is None else int(e),
                         publish_time=None if t is None else float(t), format=lay.format)


# The stored names of the integer dtypes (ids), as numpy's dtypes.
_NP_ID_DTYPES: Dict[str, np.dtype] = {name: np.dtype(name) for name, dt in _DTYPES.items() if dt in INTEGER_ID_DTYPES}


class RecordRows(NamedTuple):
    """A record value as numpy views over its buffer (valid as long as the buffer: inside the
    read transaction for LMDB's map): ``ids`` (1-D, the stored integer dtype) and ``rows``,
    the states' bytes one row per id (``uint8``, ``(len(ids), row_bytes)``) whatever their
    dtype, or None without states; ``states_dtype``/``states_tail`` give them back their type
    (:func:`rows_as_states`)."""

    ids: np.ndarray
    rows: Optional[np.ndarray]
    states_dtype: Optional[torch.dtype]
    states_tail: Tuple[int, ...]
    format: str = NATIVE  # the row format (header "f")


def decode_record_rows(buf: Union[bytes, bytearray, memoryview], verify: bool = True, key: bytes = b"") -> RecordRows:
    """:func:`decode_record` for the read path, into numpy views: numpy's per-call overhead is
    a fraction of torch's (``torch.frombuffer``, ``reshape``), and per-call overhead is most of
    a poll of many small records. The same checks.

    Raises:
        CorruptRecordError: as :func:`decode_record`; also ids of a dtype that is not an
            integer one, or states that do not have one row per id.
    """
    mv = memoryview(buf)
    lay = _layout(mv, verify, key)
    id_dtype = _NP_ID_DTYPES.get(lay.ids_dtype)
    if id_dtype is None:
        raise CorruptRecordError(f"record ids of dtype {lay.ids_dtype} (ids are integers)")
    ids = np.frombuffer(mv, dtype=id_dtype, count=lay.n_ids, offset=lay.ids_at)
    if lay.states_dtype is None:
        return RecordRows(ids, None, None, (), lay.format)
    shape = lay.states_shape
    if not shape or shape[0] != lay.n_ids:
        raise CorruptRecordError(f"record states of shape {shape} for {lay.n_ids} ids")
    dtype = _DTYPES[lay.states_dtype]
    tail = tuple(shape[1:])
    row_bytes = dtype.itemsize
    for d in tail:
        row_bytes *= d  # (from the tail, not the count: a record of no ids keeps its row width)
    rows = np.frombuffer(mv, dtype=np.uint8, count=lay.n_ids * row_bytes, offset=lay.states_at)
    return RecordRows(ids, rows.reshape(lay.n_ids, row_bytes), dtype, tail, lay.format)


def from_view(a: np.ndarray) -> torch.Tensor:
    """A tensor over a numpy view of a record (no copy; read-only memory: never written)."""
    return torch.from_numpy(a)


def rows_as_states(rows: torch.Tensor, dtype: torch.dtype, tail: Sequence[int]) -> torch.Tensor:
    """Byte rows (``uint8``, ``(n, row_bytes)``, as :func:`decode_record_rows` gives them) as
    the states they hold: ``(n, *tail)`` of ``dtype``, a view of the same memory."""
    n = rows.shape[0]
    if rows.shape[1] == 0 or n == 0:
        return torch.empty((n, *tail), dtype=dtype)
    return rows.view(dtype).reshape(n, *tail)


def upgrade_v1_value(value: Union[bytes, memoryview], key: bytes) -> bytearray:
    """A format-1 record value, checked the format-1 way, sealed the format-2 way.

    Raises:
        CorruptRecordError: it fails its format-1 checksum.
    """
    out = bytearray(value)
    if len(out) < _PREFIX.size:
        raise CorruptRecordError("record value is truncated")
    _, crc = _PREFIX.unpack_from(out, 0)
    if crc32c.crc32c(memoryview(out)[_PREFIX.size:]) != crc:
        raise CorruptRecordError("record checksum mismatch (format 1)")
    return seal_record(out, key)


def record_header(buf: Union[bytes, memoryview]) -> Dict[str, object]:
    """The msgpack header of a record value, read alone (no checksum: the record itself is
    checked when it is read)."""
    mv = memoryview(buf)
    if len(mv) < _PREFIX.size:
        raise CorruptRecordError("record value is truncated")
    head_len, _ = _PREFIX.unpack_from(mv, 0)
    try:
        header = msgpack.unpackb(mv[_PREFIX.size:_PREFIX.size + head_len])
    except Exception as exc:  # noqa: BLE001
        raise CorruptRecordError(f"record header cannot be decoded: {exc}") from exc
    if not isinstance(header, dict):
        raise CorruptRecordError("record header is not a map")
    return header


def record_bounds(buf: Union[bytes, memoryview]) -> Tuple[Optional[int], Optional[int]]:
    """``(window_start, covers_end)`` of a record value, from its header alone."""
    header = record_header(buf)
    w, e = header.get("w"), header.get("e")
    try:
        return None if w is None else int(w), None if e is None else int(e)  # type: ignore[call-overload]
    except (TypeError, ValueError) as exc:
        raise CorruptRecordError(f"record header field cannot be decoded: {exc}") from exc


def record_publish_time(buf: Union[bytes, memoryview]) -> Optional[float]:
    """The publish time (header ``"t"``) of a snapshot record value, from its header alone;
    None when it has none."""
    t = record_header(buf).get("t")
    try:
        return None if t is None else float(t)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise CorruptRecordError(f"record header field cannot be decoded: {exc}") from exc


def _view(mv: memoryview, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(mv, dtype=dtype, count=count, offset=offset)


# ------------------------------------------------------------------------- small values


def pack(obj: object) -> bytes:
    """msgpack-encode a small metadata value."""
    return msgpack.packb(obj)  # type: ignore[no-any-return]


def unpack(buf: Union[bytes, memoryview], what: str = "metadata value") -> object:
    """msgpack-decode a small metadata value; raises :class:`CorruptRecordError` on damage."""
    try:
        return msgpack.unpackb(bytes(buf))
    except Exception as exc:  # noqa: BLE001
        raise CorruptRecordError(f"{what} cannot be decoded: {exc}") from exc
