"""``verify``: check every rank's log, record by record, and report damage precisely.

Owns: the list of structural checks and their severities.

Checks, per rank (each log opened read-only, one read transaction):

* the LMDB file's structure, before it is opened: meta pages, file size, every reachable page
  (py-lmdb's offline verifier, ``lmdb.verify``, through :func:`persistent_delta.log.lmdbenv.check_file`);
* the log opens: format version, table entries decode;
* meta: format version, a known update mode, the tracker's table list has a table entry for
  every fqn, its rank matches the directory, batch indices are non-negative ints;
* table entries: unique ids, ``next_table_id`` above every id;
* every record of ``records`` and ``snapshots``: a well-formed 16-byte key, a known table id,
  the value decodes and its crc32c matches, the kind matches the DB, states have one row per id;
  a managed-collision table's side records (under its side id in ``records``: raw ids, slot
  reassignments) have a side kind and int64 ``[n, 2]`` states;
  per table ``last_batch_idx`` is at least the highest stored batch; snapshot stamps are below
  ``snapshot_end``, or are the open one (``snapshot_open``: its batch had not ended);
* consumers: each entry decodes, its channel is known, its offset is not past the channel end
  (:func:`persistent_delta.log.position_rules.position_status`).

Damage is an ``error`` (nonzero exit from the CLI); oddities that a valid log can show (records
left below the log start, unlisted leftovers of an older table set) are ``warning``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set

import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta.log import codec, position_rules
from persistent_delta.errors import CorruptRecordError, PersistentDeltaError
from persistent_delta.log.layout import PathLike, rank_of_dir, rank_paths
from persistent_delta.log.deltalog import DeltaLog, ReadTxn
from persistent_delta.log.schema import (
    DB_OF_CHANNEL,
    LOOKUPS,
    META_CHECKPOINT_FLOOR,
    META_CURR_BATCH,
    META_FORMAT_VERSION,
    META_LOG_START,
    META_NEXT_TABLE_ID,
    META_SNAPSHOT_END,
    META_SNAPSHOT_OPEN,
    META_TRACKER,
    META_UPDATE_MODE,
    SNAPSHOTS,
    ConsumerEntry,
)

logger = logging.getLogger(__name__)

ProgressFn = Callable[[int], None]  # records checked since the last call
_PROGRESS_EVERY = 1000


@dataclass
class Problem:
    """One finding: where (a precise location) and what."""

    rank: int
    where: str
    message: str
    severity: str = "error"


@dataclass
class RankCheck:
    """What was checked on one rank."""

    rank: int
    path: str
    records: int = 0
    snapshots: int = 0
    side_records: int = 0  # managed-collision raw ids / slot reassignments (counted in records too)
    bytes: int = 0
    tables: int = 0
    consumers: int = 0
    problems: List[Problem] = field(default_factory=list)


@dataclass
class VerifyReport:
    """The result of :func:`verify`; ``ok`` when no rank has an error."""

    root: str
    ranks: List[RankCheck]

    @property
    def problems(self) -> List[Problem]:
        return [p for rc in self.ranks for p in rc.problems]

    @property
    def errors(self) -> List[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def ok(self) -> bool:
        return not self.errors


class _Checker:
    def __init__(self, rc: RankCheck, progress: Optional[ProgressFn]) -> None:
        self.rc = rc
        self.progress = progress
        self._since = 0

    def bad(self, where: str, message: str, severity: str = "error") -> None:
        self.rc.problems.append(Problem(self.rc.rank, where, message, severity))

    def tick(self) -> None:
        self._since += 1
        if self.progress is not None and self._since >= _PROGRESS_EVERY:
            self.progress(self._since)
            self._since = 0

    def flush(self) -> None:
        if self.progress is not None and self._since:
            self.progress(self._since)
            self._since = 0

    # ------------------------------------------------------------------ checks
    def run(self, r: ReadTxn) -> None:
        try:
            meta = r.all_meta()
        except CorruptRecordError as exc:
            self.bad("meta", f"a meta value does not decode: {exc}")
            meta = {}
        tables = r.tables()
        self.rc.tables = len(tables)
        self.check_meta(meta, set(tables))
        self.check_tables(r, meta)
        by_id = {e.table_id: fqn for fqn, e in tables.items()}
        last_lookup = self.check_db(r, LOOKUPS, codec.KIND_LOOKUP, by_id, _int(meta.get(META_LOG_START)), None)
        # the open batch's publishes are stored and not readable yet (position_rules.open_stamp)
        open_stamp = meta.get(META_SNAPSHOT_OPEN)
        stamp_end = _int(meta.get(META_SNAPSHOT_END))
        if isinstance(open_stamp, int) and not isinstance(open_stamp, bool) and open_stamp >= 0:
            stamp_end = max(stamp_end, open_stamp + 1)
        self.check_db(r, SNAPSHOTS, codec.KIND_SNAPSHOT, by_id, None, stamp_end)
        for fqn, e in tables.items():
            top = last_lookup.get(e.table_id)
            if top is not None and top > e.last_batch_idx:
                self.bad(f"table {fqn!r}", f"stores batch {top} but its last_batch_idx is {e.last_batch_idx}")
        self.check_consumers(r)
        self.flush()

    def check_meta(self, meta: Dict[str, object], fqns: Set[str]) -> None:
        if meta.get(META_FORMAT_VERSION) != codec.FORMAT_VERSION:
            self.bad("meta format_version", f"is {meta.get(META_FORMAT_VERSION)!r}, expected {codec.FORMAT_VERSION}")
        mode = meta.get(META_UPDATE_MODE)
        if mode is None:
            self.bad("meta update_mode", "missing (a log written before its first append?)", "warning")
        elif mode not in {m.value for m in UpdateMode}:
            self.bad("meta update_mode", f"unknown update mode {mode!r}")
        for key in (META_LOG_START, META_CURR_BATCH, META_SNAPSHOT_END, META_CHECKPOINT_FLOOR):
            v = meta.get(key)
            if v is not None and (not isinstance(v, int) or v < 0):
                self.bad(f"meta {key}", f"must be a non-negative int, got {v!r}")
        tracker = meta.get(META_TRACKER)
        if tracker is None:
            return
        if not isinstance(tracker, dict) or not isinstance(tracker.get("tables"), list):
            self.bad("meta tracker", f"malformed tracker settings: {tracker!r}")
            return
        missing = sorted(set(tracker["tables"]) - fqns)
        if missing:
            self.bad("meta tracker", f"tracked tables without a table entry: {missing}")
        if META_CURR_BATCH not in meta:
            self.bad("meta curr_batch_idx", "missing although a tracker wrote this log")
        dir_rank = rank_of_dir(self.rc.path)
        if dir_rank is not None and tracker.get("rank") is not None and int(tracker["rank"]) != dir_rank:
            self.bad("meta tracker", f"written by rank {tracker['rank']} but stored in rank-{dir_rank}")

    def check_tables(self, r: ReadTxn, meta: Dict[str, object]) -> None:
        ids: Dict[int, str] = {}
        for fqn, e in r.tables().items():
            if e.table_id in ids:
                self.bad(f"table {fqn!r}", f"shares table id {e.table_id} with {ids[e.table_id]!r}")
            ids[e.table_id] = fqn
            try:
                codec.dtype_from_name(e.ids_dtype)
                if e.states_dtype is not None:
                    codec.dtype_from_name(e.states_dtype)
            except CorruptRecordError as exc:
                self.bad(f"table {fqn!r}", str(exc))
        nxt = meta.get(META_NEXT_TABLE_ID)
        if ids and (not isinstance(nxt, int) or nxt <= max(ids)):
            self.bad("meta next_table_id", f"is {nxt!r} but table id {max(ids)} exists")

    def check_db(self, r: ReadTxn, channel: str, kind: int, by_id: Dict[int, str], log_start: Optional[int],
                 stamp_end: Optional[int]) -> Dict[int, int]:
        """Check every record of a channel; returns the highest batch_idx per table id."""
        top: Dict[int, int] = {}
        db = DB_OF_CHANNEL[channel]
        for key, value in r.iter_raw(channel):
            self.tick()
            if channel == LOOKUPS:
                self.rc.records += 1
            else:
                self.rc.snapshots += 1
            self.rc.bytes += len(value)
            try:
                t, b, s = codec.decode_record_key(key)
            except CorruptRecordError as exc:
                self.bad(f"{db} key {key.hex()}", str(exc))
                continue
            side = codec.is_side_table_id(t)  # snapshots: the slot reassignments a publish carried
            table_id = t & ~codec.SIDE_TABLE_BIT if side else t
            where = codec.record_where(db, by_id.get(table_id, t), side, b, s)
            if table_id not in by_id:
                self.bad(where, f"unknown table id {t}")
            if side:
                self.rc.side_records += 1
            else:
                top[t] = max(top.get(t, b), b)
            try:
                rec = codec.decode_record(value, verify=True, key=key)
            except CorruptRecordError as exc:
                self.bad(where, str(exc))
                continue
            if side:  # a managed-collision table's raw ids / slot reassignments (codec, zchlog)
                if rec.kind not in codec.SIDE_KINDS:
                    self.bad(where, f"record kind {rec.kind} under a side id (expected {codec.SIDE_KINDS})")
                elif (rec.states is None or rec.states.dtype != torch.int64 or tuple(rec.states.shape) != (rec.ids.numel(), 2)):
                    self.bad(where, "a side record without int64 [n, 2] states")
                if log_start is not None and b < log_start:
                    self.bad(where, f"below the log start {log_start} (left behind by a deletion)", "warning")
                continue
            if rec.kind != kind:
                self.bad(where, f"record kind {rec.kind} in the {db} DB (expected {kind})")
            entry = r.tables().get(by_id.get(t, ""))
            if (channel == LOOKUPS and rec.states is not None and entry is not None and entry.states_dtype is not None
                    and (codec.dtype_name(rec.states.dtype), list(rec.states.shape[1:]))
                    != (entry.states_dtype, list(entry.states_tail or []))):
                self.bad(where, f"states {rec.states.dtype} {list(rec.states.shape[1:])} differ from the table's row "
                                f"{entry.states_dtype} {list(entry.states_tail or [])}")
            if rec.states is not None and (rec.states.dim() == 0 or rec.states.shape[0] != rec.ids.numel()):
                self.bad(where, f"{rec.ids.numel()} ids but states of shape {tuple(rec.states.shape)}")
            if log_start is not None and b < log_start:
                self.bad(where, f"below the log start {log_start} (left behind by a deletion)", "warning")
            if stamp_end is not None and b >= stamp_end:
                self.bad(where, f"stamped at or past snapshot_end {stamp_end}")
        return top

    def check_consumers(self, r: ReadTxn) -> None:
        for name, raw in r.iter_consumer_bytes():
            self.rc.consumers += 1
            where = f"consumer {name!r}"
            try:
                entry = ConsumerEntry.from_bytes(name, raw)
            except CorruptRecordError as exc:
                self.bad(where, str(exc))
                continue
            start, end = position_rules.bounds(r, entry.channel)
            status = position_rules.position_status(entry, start, end, position_rules.served_from(r, entry.channel))
            if status == position_rules.PAST_END:
                self.bad(where, f"offset {entry.offset} is past the {entry.channel} end {end}")


def _int(v: object) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def verify(root: PathLike, progress: Optional[ProgressFn] = None) -> VerifyReport:
    """Check every rank's log under ``root`` (read-only; never creates anything).

    Args:
        root: the log root (or a single log directory).
        progress: called with the number of records checked since its last call.

    Returns:
        A :class:`VerifyReport` listing every problem found.

    Raises:
        NotALogError: ``root`` holds no log at all.
    """
    report = VerifyReport(root=os.fspath(root), ranks=[])
    for rank, path in rank_paths(root).items():
        rc = RankCheck(rank=rank, path=path)
        report.ranks.append(rc)
        checker = _Checker(rc, progress)
        try:
            log = DeltaLog(path, readonly=True, check=True)  # the whole file's structure first
        except PersistentDeltaError as exc:
            checker.bad("open", f"{type(exc).__name__}: {exc}")
            continue
        with log:
            try:
                log.read(checker.run)
            except PersistentDeltaError as exc:
                checker.bad("read", f"{type(exc).__name__}: {exc}")
        logger.info("verified %s: %d records, %d problems", path, rc.records, len(rc.problems))
    return report
