"""The on-disk vocabulary: names, stored entries and validators, typed in one place.

Owns: what every stored name means and how a stored entry looks. The log
(:mod:`persistent_delta.log.deltalog`) stores these entries; the codec (:mod:`persistent_delta.log.codec`)
owns the bytes of records and keys. Nothing here knows LMDB or TorchRec's modules.

Channels
--------
A log holds two *channels*, each a sequence of records keyed by (table, batch_idx, seq):

* ``lookups`` -- what batches looked up (ids, plus the tracked states). Stored in the
  ``records`` database (the on-disk name is kept from format 1).
* ``snapshots`` -- current row values written by ``tracker.publish()``; stored in the
  ``snapshots`` database.

A consumer reads exactly one channel. Its stored entry (:class:`ConsumerEntry`) says how it
delivers (:class:`Delivery`), which decides what the trainer may filter and compact.
"""

from __future__ import annotations

import enum
import functools
import re
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from persistent_delta.log import codec
from persistent_delta.errors import CorruptRecordError, InvalidInputError

# ------------------------------------------------------------------------------ channels

LOOKUPS = "lookups"  # what batches looked up (get_unique, DeltaConsumer, replay)
SNAPSHOTS = "snapshots"  # current row values written by publish()
CHANNELS = (LOOKUPS, SNAPSHOTS)

# LMDB named databases. ``records`` holds the lookups channel (its name predates channels).
DB_OF_CHANNEL: Mapping[str, str] = {LOOKUPS: "records", SNAPSHOTS: "snapshots"}
DB_TABLES = "tables"
DB_CONSUMERS = "consumers"
DB_META = "meta"
DB_NAMES = (DB_OF_CHANNEL[LOOKUPS], DB_OF_CHANNEL[SNAPSHOTS], DB_TABLES, DB_CONSUMERS, DB_META)

# ------------------------------------------------------------------------------ meta keys
# Written when the log is created (persistent_delta's mark: a file without it is not ours).
META_FORMAT_VERSION = "format_version"
META_LOG_ID = "log_id"
# When the log's identity was made (seconds since the epoch; replaced, with the log id, by a
# start afresh): what orders a rank's identities (:class:`LogIdentity`).
META_CREATED_TIME = "created_time"
META_NEXT_TABLE_ID = "next_table_id"
META_TABLES_VERSION = "tables_version"  # bumped by every transaction that changes a table entry
META_UPDATE_MODE = "update_mode"  # torchrec UpdateMode value of the lookups channel
# Written by the position rules.
META_LOG_START = "log_start"  # batches below it were deleted (retention, clear)
META_SNAPSHOT_START = "snapshot_start"  # publishes stamped below it were deleted (retention)
# Written by the tracker.
META_TRACKER = "tracker"  # TrackerMeta
META_CURR_BATCH = "curr_batch_idx"  # the batch being recorded (complete: every batch below)
META_CLOSED_END = "closed_end"  # set by close(): every batch below it is complete
META_CHECKPOINT_FLOOR = "checkpoint_floor"  # first batch after the latest model checkpoint
# Agreed over a job's ranks and written by each rank in the transaction of a restart or restore
# (multi-rank): ranks that hold different values are mid-way, and a poll reads none of them.
META_RESTART_GEN = "restart_gen"
META_SNAPSHOT_END = "snapshot_end"  # one past the newest closed snapshot stamp (readable below it)
# the stamp of publishes not readable yet: their batch is still open (-1: none; position_rules)
META_SNAPSHOT_OPEN = "snapshot_open"
# Written by capped publishes (persistent_delta.log.deferred).
META_DEFERRED = "publish_deferred"  # consumer -> its deferred rows (ids per table, seq)
META_DEFERRED_ROWS = "publish_deferred_rows"  # consumer -> how many (read without the ids)


# ------------------------------------------------------------------------------ validators

_CONSUMER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")
MAX_FQN_BYTES = 400  # LMDB keys are limited to 511 bytes
MAX_BATCH_IDX = (1 << 63) - 1


def check_consumer_name(name: object) -> str:
    """Validate a consumer name: 1-128 chars of letters, digits and ``._:@/-``.

    Raises:
        InvalidInputError: anything else.
    """
    if not isinstance(name, str) or not _CONSUMER_NAME.match(name):
        raise InvalidInputError(
            f"invalid consumer name {name!r}: use 1-128 characters of letters, digits and ._:@/- "
            "(starting with a letter or digit)"
        )
    return name


def check_fqn(fqn: object) -> str:
    """Validate a table fqn: a non-empty string of at most ``MAX_FQN_BYTES`` UTF-8 bytes."""
    if not isinstance(fqn, str) or not fqn or len(fqn.encode("utf-8", "surrogatepass")) > MAX_FQN_BYTES:
        shown = repr(fqn) if len(repr(fqn)) <= 80 else repr(fqn)[:60] + f"... ({len(repr(fqn))} chars)"
        raise InvalidInputError(f"table fqn must be a non-empty string of at most {MAX_FQN_BYTES} bytes, got {shown}")
    return fqn


def check_batch_idx(batch_idx: object, what: str = "batch_idx") -> int:
    """Validate a batch index (a non-negative int below 2**63); returns it."""
    if isinstance(batch_idx, bool) or not isinstance(batch_idx, int):
        raise InvalidInputError(f"{what} must be an int, got {type(batch_idx).__name__}")
    if batch_idx < 0 or batch_idx > MAX_BATCH_IDX:
        raise InvalidInputError(f"{what} must be in [0, 2**63), got {batch_idx}")
    return batch_idx


def check_table_filter(tables: object, known: Optional[Sequence[str]]) -> Optional[List[str]]:
    """Validate a table filter (a list of fqns, or None for all). ``known``: the job's table
    set (None when it cannot be known yet: then only the type is checked).

    Raises:
        InvalidInputError: not a list of strings (a plain ``str`` included), or unknown fqns:
            a filter that matches nothing would skip those tables' batches for good.
    """
    if tables is None:
        return None
    if isinstance(tables, (str, bytes)) or not isinstance(tables, (list, tuple, set, frozenset)) or not all(
        isinstance(t, str) for t in tables
    ):
        raise InvalidInputError(f"tables must be a list of table fqns, got {tables!r}")
    if known is not None:
        unknown = sorted(set(tables) - set(known))
        if unknown:
            raise InvalidInputError(f"unknown tables {unknown}; the job's tables are {sorted(known)}")
    return list(tables)


def check_channel(channel: object) -> str:
    """Validate a channel name (``"lookups"`` or ``"snapshots"``)."""
    if channel not in CHANNELS:
        raise InvalidInputError(f"channel must be one of {CHANNELS}, got {channel!r}")
    return str(channel)


def check_read_format(fmt: object, channel: str) -> str:
    """Validate a reader's row format for ``channel``: any of
    :data:`~persistent_delta.log.codec.ROW_FORMATS` (or ``"*"``, a shipper's: every format)
    on the snapshots channel, ``"native"`` on the lookups channel."""
    out = codec.check_format(fmt, any_ok=True)
    if channel != SNAPSHOTS and out != codec.NATIVE:
        raise InvalidInputError(f"row format {out!r}: formats are for snapshots (published rows); the {channel!r} "
                                "channel holds the tracked rows as recorded")
    return out


# ------------------------------------------------------------------------------ entries


def _as_map(value: object, what: str) -> Dict[str, Any]:
    if not isinstance(value, dict):
        raise CorruptRecordError(f"{what} is not a map")
    return value


@dataclass
class TableEntry:
    """One table of a log (an embedding table fqn on this rank)."""

    fqn: str
    table_id: int
    last_batch_idx: int = -1  # highest batch_idx ever appended; appends below it are refused
    listed: bool = True  # False after delete(None), until the next append (DeltaStoreTrec view)
    ids_dtype: str = "int64"
    states_dtype: Optional[str] = None
    states_tail: Optional[List[int]] = None  # states shape after the first dim
    meta: Dict[str, Any] = field(default_factory=dict)  # "shard": ShardInfo fields
    values_dtype: Optional[str] = None  # the snapshots channel's row values (the table's weights)
    values_tail: Optional[List[int]] = None

    def to_bytes(self) -> bytes:
        return codec.pack(
            {
                "id": self.table_id,
                "last": self.last_batch_idx,
                "listed": self.listed,
                "ids_dtype": self.ids_dtype,
                "states_dtype": self.states_dtype,
                "states_tail": self.states_tail,
                "meta": self.meta,
                "values_dtype": self.values_dtype,
                "values_tail": self.values_tail,
            }
        )

    @staticmethod
    def from_bytes(fqn: str, buf: bytes) -> "TableEntry":
        d = _as_map(codec.unpack(buf, f"table entry {fqn!r}"), f"table entry {fqn!r}")
        try:
            return TableEntry(
                fqn=fqn,
                table_id=int(d["id"]),
                last_batch_idx=int(d["last"]),
                listed=bool(d["listed"]),
                ids_dtype=str(d["ids_dtype"]),
                states_dtype=d.get("states_dtype"),
                states_tail=d.get("states_tail"),
                meta=dict(d.get("meta") or {}),
                values_dtype=d.get("values_dtype"),
                values_tail=d.get("values_tail"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptRecordError(f"table entry {fqn!r} is malformed: {exc}") from exc

    def copy(self) -> "TableEntry":
        return TableEntry.from_bytes(self.fqn, self.to_bytes())

    def empty_ids(self) -> torch.Tensor:
        return torch.empty(0, dtype=codec.dtype_from_name(self.ids_dtype))

    def empty_states(self, channel: str = LOOKUPS) -> Optional[torch.Tensor]:
        """``(0, *row_shape)`` in the channel's dtype (lookups: the tracked states; snapshots:
        the table's values); None when the table has no such rows."""
        dtype, tail = (self.values_dtype, self.values_tail) if channel == SNAPSHOTS else (self.states_dtype,
                                                                                         self.states_tail)
        if dtype is None:
            return None
        return torch.empty([0, *(tail or [])], dtype=codec.dtype_from_name(dtype))


class Delivery(str, enum.Enum):
    """How a consumer reads and commits, which decides what the trainer may do around it.

    * ``IN_TRANSACTION`` -- read and committed in one write transaction (the tracker's
      ``get_unique`` / ``publish``). No uncommitted position ever exists, so the trainer may
      drop rows already recorded since its offset (window filter) and compact behind it.
    * ``POLL_COMMIT`` -- read in one transaction and committed in a later one
      (:class:`~persistent_delta.DeltaConsumer`, ``replay --commit``, the offsets tool). Its
      position between poll and commit is not in the log, so nothing may be merged across it:
      while one reads the lookups channel, the trainer neither filters nor compacts, and each
      batch reaches it exactly once.
    """

    IN_TRANSACTION = "in_transaction"
    POLL_COMMIT = "poll_commit"


# Who registered an entry: informational (the offsets tool shows it), never a switch.
BY_TRAINER = "trainer"
BY_EXTERNAL = "external"

# What a trainer's lookups consumer is used for, recorded at its first commit (a switch: the
# tracker refuses the other use, :class:`~persistent_delta.errors.ConsumerRoleError`).
ROLE_READS = "reads"  # get_unique / consume_exact: the rows read are handed to the caller
ROLE_PUBLISHES = "publishes"  # publish(): the rows read are written as snapshot records
ROLES = (ROLE_READS, ROLE_PUBLISHES)

#: Commits a consumer entry remembers (its health window; Burrow's default window is ten commits).
COMMIT_HISTORY = 10

#: A stored commit time is seconds since the epoch in ``[0, MAX_COMMIT_TIME_S)`` (up to the year
#: 2242): past it, negative, NaN or infinite, it is malformed (and could not be printed as a date).
MAX_COMMIT_TIME_S = 1 << 33


def valid_commit_time(t: object) -> bool:
    """Whether ``t``, read from a stored entry, is a commit time: a number (not a bool) in
    ``[0, MAX_COMMIT_TIME_S)``, so finite and not NaN."""
    return isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t < MAX_COMMIT_TIME_S


@dataclass(frozen=True)
class CommitPoint:
    """One past commit of a consumer: when, the offset committed and the channel's end then
    (``end`` is -1 when the committer did not know it)."""

    time: float
    offset: int
    end: int = -1

    @property
    def lag(self) -> Optional[int]:
        """Batches behind the end at that commit (None when the end is unknown)."""
        return None if self.end < 0 else max(0, self.end - self.offset)


@dataclass(frozen=True)
class ConsumerEntry:
    """A registered consumer of one channel of one rank's log (immutable: a change is a new
    entry, :meth:`committed` or ``dataclasses.replace``, written with ``WriteTxn.set_consumer``).

    Attributes:
        offset: the next batch_idx to read (Kafka's committed offset: last read + 1).
        channel: ``"lookups"`` or ``"snapshots"``.
        delivery: see :class:`Delivery`.
        commit_time: wall-clock time of the last commit (seconds since the epoch).
        registered_by: ``"trainer"`` or ``"external"`` (shown by the tools only).
        expired: set when the retention bound dropped the consumer behind the log start; it
            no longer holds back retention, and its next read gets ``OffsetOutOfRangeError``
            (or its reset policy). A commit clears it.
        history: its last :data:`COMMIT_HISTORY` commits, oldest first (the health window of
            :mod:`persistent_delta.ops.health`). Entries written before this field read back
            with an empty history; readers that predate it ignore the field.
        format: the row format a snapshots consumer asked for at registration
            (:data:`persistent_delta.log.codec.ROW_FORMATS`; ``"*"``: a shipper, which reads
            every format and asks for none). Entries written before this field read back as
            ``"native"``; readers that predate it ignore the field.
        role: what the trainer uses a lookups consumer for, set by its first commit there
            (:data:`ROLE_READS` or :data:`ROLE_PUBLISHES`; ``""``: not used yet, any other
            consumer, and entries written before this field). Kept by every later commit;
            readers that predate it ignore the field.
    """

    offset: int
    channel: str = LOOKUPS
    delivery: Delivery = Delivery.IN_TRANSACTION
    commit_time: float = 0.0
    registered_by: str = BY_TRAINER
    expired: bool = False
    history: Tuple[CommitPoint, ...] = ()
    format: str = codec.NATIVE
    role: str = ""

    @staticmethod
    def new(offset: int, channel: str, delivery: Delivery, fmt: str = codec.NATIVE) -> "ConsumerEntry":
        """A fresh registration at ``offset`` (now as its commit time), asking for rows in
        ``fmt``."""
        by = BY_TRAINER if delivery == Delivery.IN_TRANSACTION else BY_EXTERNAL
        return ConsumerEntry(offset=offset, channel=channel, delivery=delivery, commit_time=time.time(), registered_by=by,
                             format=fmt)

    def committed(self, offset: int, end: int = -1, role: Optional[str] = None) -> "ConsumerEntry":
        """This entry with ``offset`` committed now (clears ``expired``); the commit joins the
        history, which keeps the last :data:`COMMIT_HISTORY`.

        Args:
            offset: the new committed offset.
            end: the channel's end at this commit, when the committer knows it (-1 otherwise).
            role: the use this commit makes of the consumer (:data:`ROLES`), recorded when the
                entry has none yet (None: leave it).
        """
        now = time.time()
        history = (*self.history, CommitPoint(now, offset, end))[-COMMIT_HISTORY:]
        return ConsumerEntry(offset, self.channel, self.delivery, now, self.registered_by, False, history, self.format,
                             self.role or role or "")

    def to_bytes(self) -> bytes:
        d = {f.name: getattr(self, f.name) for f in fields(self)}  # every field (shallow: no asdict deep copy)
        d["delivery"] = self.delivery.value
        d["history"] = [[p.time, p.offset, p.end] for p in self.history]
        return codec.pack(d)

    @staticmethod
    def from_bytes(name: str, buf: bytes) -> "ConsumerEntry":
        """Decode a stored entry. Entries are immutable and decoding is a function of
        ``(name, buf)`` alone, so recent decodes are reused: a writer's transaction reads every
        consumer several times (the window filter, the consume rule, retention), and most
        entries do not change between transactions."""
        return _decode_consumer(name, bytes(buf))

    @staticmethod
    def _decode(name: str, buf: bytes) -> "ConsumerEntry":
        what = f"consumer entry {name!r}"
        d = _as_map(codec.unpack(buf, what), what)
        offset = d.get("offset")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise CorruptRecordError(f"{what}: offset is not a non-negative int: {offset!r}")
        channel = d.get("channel", LOOKUPS)
        if channel not in CHANNELS:
            raise CorruptRecordError(f"{what}: unknown channel {channel!r}")
        registered_by = str(d.get("registered_by") or BY_TRAINER)
        raw = d.get("delivery")
        if raw is None:
            # Entries written before the delivery field: the trainer read in-transaction,
            # everyone else polled.
            delivery = Delivery.IN_TRANSACTION if registered_by == BY_TRAINER else Delivery.POLL_COMMIT
        else:
            try:
                delivery = Delivery(raw)
            except ValueError:
                raise CorruptRecordError(f"{what}: unknown delivery {raw!r}") from None
        ct = d.get("commit_time")
        if ct is not None and not valid_commit_time(ct):
            raise CorruptRecordError(f"{what}: commit_time {str(ct)[:40]} is not a time (seconds since the epoch "
                                     f"in [0, {MAX_COMMIT_TIME_S}))")
        return ConsumerEntry(
            offset=offset,
            channel=str(channel),
            delivery=delivery,
            commit_time=float(ct) if ct is not None else 0.0,
            registered_by=registered_by,
            expired=bool(d.get("expired", False)),
            history=_history(d.get("history"), what),
            format=_format(d.get("format"), what),
            role=_role(d.get("role"), what),
        )


@functools.lru_cache(maxsize=256)
def _decode_consumer(name: str, buf: bytes) -> ConsumerEntry:
    return ConsumerEntry._decode(name, buf)


def _role(raw: object, what: str) -> str:
    """A stored role; an entry written before the field has none."""
    if raw is None or raw == "":
        return ""
    if raw not in ROLES:
        raise CorruptRecordError(f"{what}: unknown role {str(raw)[:40]!r}")
    return str(raw)


def _format(raw: object, what: str) -> str:
    """A stored row format; an entry written before the field asked for native rows."""
    if raw is None:
        return codec.NATIVE
    if not isinstance(raw, str) or (raw not in codec.ROW_FORMATS and raw != codec.ANY_FORMAT):
        raise CorruptRecordError(f"{what}: unknown row format {str(raw)[:40]!r}")
    return raw


def _history(raw: object, what: str) -> Tuple[CommitPoint, ...]:
    """A stored commit history; an entry written before the field has none."""
    if raw is None:
        return ()
    if not isinstance(raw, (list, tuple)):
        raise CorruptRecordError(f"{what}: history is not a list: {raw!r}")
    out = []
    for p in raw[-COMMIT_HISTORY:]:
        ok = isinstance(p, (list, tuple)) and len(p) == 3 and valid_commit_time(p[0])
        if not ok or not all(isinstance(v, int) and not isinstance(v, bool) for v in p[1:]):
            raise CorruptRecordError(f"{what}: a history point is not [time, offset, end]: {p!r}")
        out.append(CommitPoint(float(p[0]), int(p[1]), int(p[2])))
    return tuple(out)


#: TorchRec's sharding type of a replicated table (``ShardingType.DATA_PARALLEL.value``).
DATA_PARALLEL = "data_parallel"


@dataclass(frozen=True)
class ShardInfo:
    """Where a rank's shard of a table sits in the full table (written by the tracker).

    Global row id = local id + ``row_offset``; the shard holds columns
    ``[col_offset, col_offset + local_cols)`` of those rows.
    """

    table_name: str = ""
    sharding_type: str = ""
    row_offset: int = 0
    col_offset: int = 0
    local_rows: Optional[int] = None
    local_cols: Optional[int] = None
    global_rows: Optional[int] = None
    global_cols: Optional[int] = None

    @property
    def replicated(self) -> bool:
        """Whether every rank holds the whole table (data-parallel)."""
        return self.sharding_type == DATA_PARALLEL

    @staticmethod
    def from_dict(md: Mapping[str, Any]) -> "ShardInfo":
        def opt(key: str) -> Optional[int]:
            v = md.get(key)
            return None if v is None else int(v)

        return ShardInfo(
            table_name=str(md.get("table_name", "")),
            sharding_type=str(md.get("sharding_type", "")),
            row_offset=int(md.get("row_offset", 0)),
            col_offset=int(md.get("col_offset", 0)),
            local_rows=opt("local_rows"),
            local_cols=opt("local_cols"),
            global_rows=opt("global_rows"),
            global_cols=opt("global_cols"),
        )

    @staticmethod
    def from_entry(entry: TableEntry) -> Optional["ShardInfo"]:
        """The shard metadata of a table entry, or None for a log without it (a plain store)."""
        md = entry.meta.get("shard")
        return ShardInfo.from_dict(md) if isinstance(md, dict) else None


@dataclass(frozen=True)
class TrackerMeta:
    """What a tracker stores about itself (``META_TRACKER``): reopening with another tracking
    mode or table set is refused."""

    tracking_mode: str
    update_mode: str
    tables: List[str]
    rank: int
    world_size: Optional[int] = None  # the job's ranks: consumers know them from here, not from directories

    def to_value(self) -> Dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_value(value: object) -> Optional["TrackerMeta"]:
        if value is None:
            return None
        d = _as_map(value, "meta 'tracker'")
        try:
            ws = d.get("world_size")
            return TrackerMeta(str(d["tracking_mode"]), str(d.get("update_mode", "")), list(d["tables"]), int(d["rank"]),
                               None if ws is None else int(ws))
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptRecordError(f"meta 'tracker' is malformed: {exc}") from exc


@dataclass(frozen=True)
class LogIdentity:
    """Which log of a rank a record, a shipped range, a base or a shard file came from: the log
    id and its creation stamp (ns since the epoch, from ``META_CREATED_TIME``). A log created
    anew, or started afresh (``fresh=True``), gets a new id and a later stamp; so identities
    are ordered by stamp, and a reader that adopted one never goes back to an older one (the
    previous run's data, replayed). A stamp of 0: unknown (written before stamps), older than
    every stamped identity.

    Attributes:
        log_id: the log's id (``META_LOG_ID``).
        stamp: its creation stamp, ns since the epoch (0: unknown).
    """

    log_id: str
    stamp: int = 0

    def older_than(self, other: Optional["LogIdentity"]) -> bool:
        """Whether this is another log than ``other`` and was made before it (None: nothing to
        compare: False). Two unknown stamps of different logs are not ordered."""
        return other is not None and self.log_id != other.log_id and self.stamp < other.stamp

    def describe(self) -> str:
        """``log <id> (created <UTC time>)``, for messages."""
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.stamp / 1e9)) if self.stamp else "unknown"
        return f"log {self.log_id[:40]} (created {when})"

    def to_value(self) -> Dict[str, Any]:
        """The fields a wire value or a stored position carries (``log_id``, ``log_stamp``)."""
        return {"log_id": self.log_id, "log_stamp": self.stamp}

    @staticmethod
    def from_value(d: Mapping[str, Any]) -> Optional["LogIdentity"]:
        """The identity in a value's ``log_id``/``log_stamp`` fields (None without a log id; a
        missing stamp reads as 0).

        Raises:
            ValueError: a field of the wrong type or out of bounds.
        """
        log_id, stamp = d.get("log_id"), d.get("log_stamp", 0)
        if log_id is None:
            return None
        if not isinstance(log_id, str) or not 0 < len(log_id) <= 200:
            raise ValueError("log_id must be a string of 1 to 200 characters")
        if stamp is None:
            stamp = 0
        if isinstance(stamp, bool) or not isinstance(stamp, int) or not 0 <= stamp < 1 << 63:
            raise ValueError(f"log_stamp must be an integer in [0, 2**63), got {str(stamp)[:40]}")
        return LogIdentity(log_id, stamp)


def created_stamp(created_time: object) -> int:
    """The creation stamp (ns) of a stored ``META_CREATED_TIME`` (0: none, or not a number)."""
    if isinstance(created_time, bool) or not isinstance(created_time, (int, float)) or not created_time > 0:
        return 0
    return int(round(float(created_time) * 1e9))


def next_created_time(previous: object) -> float:
    """A ``META_CREATED_TIME`` for a new identity of a log whose previous one was made at
    ``previous``: now, and always later than ``previous`` (a clock stepped back still gives a
    newer identity)."""
    now = time.time()
    if isinstance(previous, (int, float)) and not isinstance(previous, bool) and now <= previous + 1e-6:
        now = float(previous) + 1e-6
    return now
