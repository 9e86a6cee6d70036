"""The delta log: one LMDB environment in one directory, and its transactions.

Design note
-----------
Named DBs of the environment:

* ``records``   record key (see :mod:`persistent_delta.codec`) -> record value
* ``snapshots`` same keys -> snapshot records (current row values written by ``publish``)
* ``tables``    fqn (utf-8) -> msgpack table entry: small table id, last appended batch_idx,
                dtypes, whether the table is listed, and free-form metadata (sharding)
* ``consumers`` name (utf-8) -> msgpack {offset, commit_time, ...}
* ``meta``      name -> msgpack value (format version, update mode, tracker state, ...)

Every public mutation is exactly one write transaction, built by a function that receives a
:class:`WriteTxn` and run by :meth:`DeltaLog.write`. If LMDB's map is full the transaction is
aborted, the map doubled and the function run again, so it must not change in-memory state;
:class:`WriteTxn` stages its cache updates and applies them only after the commit.

One writer process per log: a writable open takes an exclusive ``flock`` on ``writer.lock``
(released by the kernel when the process dies, SIGKILL included) and writes its pid there, so a
second writer is refused with a message that names the holder. Readers take no lock.

LMDB forbids opening one environment twice in a process (closing either breaks its locks), so
environments are shared per process through a small registry, and each handle records the pid
that opened it: a forked child that uses it gets :class:`ForkedProcessError`.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, TypeVar, Union

import lmdb
import torch

from persistent_delta import codec
from persistent_delta.alloc import tune_malloc
from persistent_delta.config import Durability, LogOptions
from persistent_delta.errors import (
    ConfigMismatchError,
    CorruptRecordError,
    ForkedProcessError,
    FormatMismatchError,
    InvalidInputError,
    LogClosedError,
    LogFullError,
    LogLockedError,
    NotALogError,
    PersistentDeltaError,
    ReadOnlyLogError,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

LOCK_FILE = "writer.lock"
DATA_FILE = "data.mdb"
_DB_NAMES = (b"records", b"snapshots", b"tables", b"consumers", b"meta")
RECORDS = "records"  # what batches looked up (ids, states): the delta log proper
SNAPSHOTS = "snapshots"  # current row values written by publish()
_MAX_FQN_BYTES = 400  # LMDB keys are limited to 511 bytes


@dataclass
class TableEntry:
    """One table of the log (an embedding table fqn on this rank)."""

    fqn: str
    table_id: int
    last_batch_idx: int = -1  # highest batch_idx ever appended; appends below it are refused
    listed: bool = True  # False after delete(None), until the next append (DeltaStoreTrec view)
    ids_dtype: str = "int64"
    states_dtype: Optional[str] = None
    states_tail: Optional[List[int]] = None  # states shape after the first dim
    meta: Dict[str, Any] = field(default_factory=dict)

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
            }
        )

    @staticmethod
    def from_bytes(fqn: str, buf: bytes) -> "TableEntry":
        d = codec.unpack(buf, f"table entry {fqn!r}")
        if not isinstance(d, dict):
            raise CorruptRecordError(f"table entry {fqn!r} is not a map")
        return TableEntry(
            fqn=fqn,
            table_id=int(d["id"]),
            last_batch_idx=int(d["last"]),
            listed=bool(d["listed"]),
            ids_dtype=str(d["ids_dtype"]),
            states_dtype=d.get("states_dtype"),
            states_tail=d.get("states_tail"),
            meta=dict(d.get("meta") or {}),
        )

    def copy(self) -> "TableEntry":
        return TableEntry.from_bytes(self.fqn, self.to_bytes())

    def empty_ids(self) -> torch.Tensor:
        return torch.empty(0, dtype=codec.dtype_from_name(self.ids_dtype))

    def empty_states(self) -> Optional[torch.Tensor]:
        if self.states_dtype is None:
            return None
        return torch.empty([0, *(self.states_tail or [])], dtype=codec.dtype_from_name(self.states_dtype))


@dataclass
class StoredRecord:
    """A record read from the log. Tensors are views valid only inside their transaction."""

    table_id: int
    batch_idx: int
    seq: int
    kind: int
    ids: torch.Tensor
    states: Optional[torch.Tensor]
    nbytes: int
    window_start: Optional[int] = None


# ------------------------------------------------------------------ per-process env registry


@dataclass
class _SharedEnv:
    env: lmdb.Environment
    dbs: Dict[bytes, Any]
    pid: int
    readonly: bool
    refs: int
    # One lock per environment serialises this process's transactions, so that the map can be
    # resized (which needs no open transaction in the process) and py-lmdb objects are never
    # used from two threads at once.
    lock: threading.RLock
    opts: LogOptions
    # Set after an I/O failure (disk full, EIO): LMDB may have flagged the environment as
    # fatally broken, so it is closed and reopened (at its last commit) before the next use.
    broken: bool = False


_REGISTRY: Dict[str, _SharedEnv] = {}
_REGISTRY_LOCK = threading.Lock()


def acquire_writer_lock(path: str, action: str = "open it for writing") -> int:
    """Take the log's exclusive writer lock (``flock`` on ``writer.lock``, released by the
    kernel when the process dies) and write our pid there; returns the descriptor.

    Raises:
        LogLockedError: another process (or another handle of this one) holds it; the message
            names the holder's pid.
    """
    try:
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise _translate(exc, path) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = ""
        try:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
        except OSError:
            pass
        os.close(fd)
        who = f"pid {holder}" if holder else "an unknown process"
        if holder == str(os.getpid()):
            who += " (this process: close the other handle first)"
        raise LogLockedError(
            f"{path}: another writer holds the writer lock: {who}, so this process cannot {action}. One writer "
            "process per log; open it read-only (DeltaConsumer, the tools) to read while it is written"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _lmdb_flags(opts: LogOptions) -> Dict[str, Any]:
    d = opts.durability
    return {
        "sync": d in (Durability.SYNC, Durability.NO_METASYNC),
        "metasync": d == Durability.SYNC,
    }


def _open_env(path: str, opts: LogOptions, readonly: bool) -> _SharedEnv:
    """Open (or share) the environment at ``path``. Caller holds ``_REGISTRY_LOCK``."""
    shared = _REGISTRY.get(path)
    if shared is not None and shared.pid != os.getpid():
        # Inherited through fork: never touch the parent's environment; forget it.
        del _REGISTRY[path]
        shared = None
    if shared is not None:
        if shared.readonly and not readonly:
            raise ReadOnlyLogError(
                f"{path} is open read-only in this process; close those handles before opening it for writing"
            )
        shared.refs += 1
        return shared
    env, dbs = _lmdb_open(path, opts, readonly)
    shared = _SharedEnv(env=env, dbs=dbs, pid=os.getpid(), readonly=readonly, refs=1, lock=threading.RLock(), opts=opts)
    _REGISTRY[path] = shared
    return shared


def _lmdb_open(path: str, opts: LogOptions, readonly: bool) -> Tuple[lmdb.Environment, Dict[bytes, Any]]:
    lock_ok = True
    if readonly:
        lock_ok = os.access(path, os.W_OK) or os.path.exists(os.path.join(path, "lock.mdb")) and os.access(
            os.path.join(path, "lock.mdb"), os.W_OK
        )
    try:
        env = lmdb.open(
            path,
            map_size=opts.map_size,
            max_dbs=len(_DB_NAMES) + 2,
            max_readers=opts.max_readers,
            readonly=readonly,
            lock=lock_ok,
            readahead=opts.readahead,
            subdir=True,
            create=not readonly,
            meminit=False,
            **_lmdb_flags(opts),
        )
    except lmdb.Error as exc:
        raise _translate(exc, path) from exc
    dbs: Dict[bytes, Any] = {}
    try:
        for name in _DB_NAMES:
            dbs[name] = env.open_db(name, create=not readonly)
    except lmdb.NotFoundError as exc:
        env.close()
        raise NotALogError(f"{path} is not a persistent_delta log (no {name.decode()} DB)") from exc
    except lmdb.Error as exc:
        env.close()
        raise _translate(exc, path) from exc
    return env, dbs


def _reopen(path: str, shared: _SharedEnv) -> None:
    """Close and reopen a broken environment in place (caller holds ``shared.lock``)."""
    try:
        shared.env.close()
    except lmdb.Error:
        pass
    shared.env, shared.dbs = _lmdb_open(path, shared.opts, shared.readonly)
    shared.broken = False
    logger.warning("reopened the LMDB environment of %s after an I/O failure", path)


def _release_env(path: str, shared: _SharedEnv) -> None:
    with _REGISTRY_LOCK:
        shared.refs -= 1
        if shared.refs > 0:
            return
        if _REGISTRY.get(path) is shared:
            del _REGISTRY[path]
    if shared.pid == os.getpid():
        with shared.lock:
            shared.env.close()


def _is_io_failure(exc: BaseException) -> bool:
    err = getattr(exc, "errno", None)
    text = str(exc)
    return (
        isinstance(exc, (lmdb.DiskError, lmdb.PanicError))
        or err in (errno.ENOSPC, errno.EIO, errno.EDQUOT)
        or "No space left" in text
        or "Input/output error" in text
    )


def _translate(exc: BaseException, path: str) -> PersistentDeltaError:
    """Map a py-lmdb / OS error to the error a caller can act on."""
    if isinstance(exc, lmdb.MapFullError):
        return LogFullError(f"{path}: the LMDB map is full and may not grow further: raise max_map_size")
    err = getattr(exc, "errno", None)
    text = str(exc)
    if err == errno.ENOSPC or "No space left" in text:
        return LogFullError(f"{path}: no space left on the device; free disk space and retry (nothing committed was lost)")
    if err in (errno.EACCES, errno.EROFS, errno.EPERM) or isinstance(exc, lmdb.ReadonlyError) or "Read-only" in text or "Permission denied" in text:
        return ReadOnlyLogError(f"{path}: not writable ({text}); open it read-only or fix the permissions")
    if isinstance(exc, lmdb.InvalidError) or "MDB_INVALID" in text or "MDB_VERSION_MISMATCH" in text:
        return NotALogError(f"{path}: not an LMDB environment ({text})")
    return PersistentDeltaError(f"{path}: LMDB error: {text}")


# ----------------------------------------------------------------------------- transactions


class ReadTxn:
    """Read access to the log inside one LMDB transaction.

    Tensors it returns may be views into the map: valid only until the transaction ends.
    """

    def __init__(self, log: "DeltaLog", txn: lmdb.Transaction) -> None:
        self._log = log
        self.txn = txn
        self._dbs = log._shared.dbs

    # tables ---------------------------------------------------------------------------
    def tables(self) -> Dict[str, TableEntry]:
        """All tables (listed or not), by fqn, as of this transaction."""
        return self._log._tables

    def table(self, fqn: str) -> Optional[TableEntry]:
        return self.tables().get(fqn)

    # records --------------------------------------------------------------------------
    def iter_records(
        self, table_id: int, start_idx: int = 0, end_idx: Optional[int] = None, verify: bool = True,
        db: str = RECORDS,
    ) -> Iterator[StoredRecord]:
        """Records of ``table_id`` with ``start_idx <= batch_idx < end_idx`` (half-open), in
        (batch_idx, seq) order, i.e. append order. ``db`` is ``RECORDS`` or ``SNAPSHOTS``."""
        prefix = codec.table_prefix(table_id)
        cur = self.txn.cursor(db=self._dbs[db.encode()])
        if not cur.set_range(codec.record_key(table_id, max(0, start_idx), 0)):
            return
        for key, value in cur:
            if key[:4] != prefix:
                break
            t, b, s = codec.decode_record_key(key)
            if end_idx is not None and b >= end_idx:
                break
            rec = codec.decode_record(value, verify=verify)
            yield StoredRecord(t, b, s, rec.kind, rec.ids, rec.states, rec.nbytes, rec.window_start)

    def iter_record_keys(
        self, table_id: int, start_idx: int = 0, end_idx: Optional[int] = None, db: str = RECORDS
    ) -> Iterator[Tuple[int, int, int]]:
        """``(batch_idx, seq, value_bytes)`` of records in ``[start_idx, end_idx)``, without decoding."""
        prefix = codec.table_prefix(table_id)
        cur = self.txn.cursor(db=self._dbs[db.encode()])
        if not cur.set_range(codec.record_key(table_id, max(0, start_idx), 0)):
            return
        for key, value in cur:
            if key[:4] != prefix:
                break
            _, b, s = codec.decode_record_key(key)
            if end_idx is not None and b >= end_idx:
                break
            yield b, s, len(value)

    def iter_raw(self, db: str = RECORDS) -> Iterator[Tuple[bytes, Union[bytes, memoryview]]]:
        """Every (key, value) of a records DB, in key order, undecoded (for verify)."""
        for k, v in self.txn.cursor(db=self._dbs[db.encode()]):
            yield bytes(k), v

    def first_batch_idx(self, table_id: int, db: str = RECORDS) -> Optional[int]:
        """The lowest batch_idx stored for the table, or None when it has no records."""
        cur = self.txn.cursor(db=self._dbs[db.encode()])
        if not cur.set_range(codec.table_prefix(table_id)):
            return None
        key = cur.key()
        if key[:4] != codec.table_prefix(table_id):
            return None
        return codec.decode_record_key(key)[1]

    # consumers & meta ----------------------------------------------------------------
    def consumers(self) -> Dict[str, Dict[str, Any]]:
        """Every registered consumer: name -> {"offset": int, "commit_time": float, ...}."""
        out: Dict[str, Dict[str, Any]] = {}
        for k, v in self.txn.cursor(db=self._dbs[b"consumers"]):
            name = bytes(k).decode()
            d = codec.unpack(v, f"consumer {name!r}")
            if not isinstance(d, dict):
                raise CorruptRecordError(f"consumer entry {name!r} is not a map")
            out[name] = d
        return out

    def consumer(self, name: str) -> Optional[Dict[str, Any]]:
        v = self.txn.get(name.encode(), db=self._dbs[b"consumers"])
        if v is None:
            return None
        d = codec.unpack(v, f"consumer {name!r}")
        return d if isinstance(d, dict) else None

    def meta(self, key: str, default: Any = None) -> Any:
        v = self.txn.get(key.encode(), db=self._dbs[b"meta"])
        return default if v is None else codec.unpack(v, f"meta {key!r}")

    def read_start(self, position: int, db: str = RECORDS) -> int:
        """Where a reader positioned at ``position`` must start reading to miss nothing.

        The writer's window filter omits ids already recorded since its window start; a
        position strictly inside such a window moves back to the window start (the rows of
        ``[window_start, position)`` are delivered again: at-least-once, never lost).
        """
        best = position
        cur = self.txn.cursor(db=self._dbs[db.encode()])
        for entry in self.tables().values():
            if not cur.set_range(codec.record_key(entry.table_id, max(0, position), 0)):
                continue
            key = cur.key()
            if key[:4] != codec.table_prefix(entry.table_id):
                continue
            w = codec.record_window_start(cur.value())
            if w is not None and w < best:
                best = w
        return max(min(best, position), min(self.log_start(), position))

    def log_start(self) -> int:
        """Batches below this were deleted (retention, ``clear``): a position below it cannot
        be served."""
        return int(self.meta("log_start", 0))

    def log_end(self) -> int:
        """One past the last *complete* batch: the tracker's persisted batch index (the batch
        it is recording is not complete yet); for a plain store, one past the last appended."""
        if self.meta("tracker") is not None:
            # the batch being recorded is complete once the trainer closed (closed_end)
            return max(int(self.meta("curr_batch_idx", 0)), int(self.meta("closed_end", 0)))
        return max((e.last_batch_idx for e in self.tables().values()), default=-1) + 1

    def all_meta(self) -> Dict[str, Any]:
        return {bytes(k).decode(): codec.unpack(v, "meta") for k, v in self.txn.cursor(db=self._dbs[b"meta"])}


class WriteTxn(ReadTxn):
    """Write access inside one LMDB write transaction (see :meth:`DeltaLog.write`).

    Table changes are staged and reach the log's cache only after the commit, so the
    transaction can be aborted and rerun (map growth) without leaving stale state behind.
    """

    def __init__(self, log: "DeltaLog", txn: lmdb.Transaction) -> None:
        super().__init__(log, txn)
        self._staged: Dict[str, TableEntry] = {}

    def tables(self) -> Dict[str, TableEntry]:
        if not self._staged:
            return self._log._tables
        merged = dict(self._log._tables)
        merged.update(self._staged)
        return merged

    def table(self, fqn: str) -> Optional[TableEntry]:
        return self._staged.get(fqn) or self._log._tables.get(fqn)

    def stage_table(self, entry: TableEntry) -> None:
        """Write a table entry (new or changed) in this transaction."""
        if not self.txn.put(entry.fqn.encode(), entry.to_bytes(), db=self._dbs[b"tables"]):
            raise PersistentDeltaError(f"could not write table entry {entry.fqn!r}")
        self._staged[entry.fqn] = entry

    def ensure_table(self, fqn: str) -> TableEntry:
        """The (staged, mutable) entry of ``fqn``, created with a fresh table id if new."""
        if fqn in self._staged:
            return self._staged[fqn]
        existing = self._log._tables.get(fqn)
        if existing is not None:
            return existing.copy()
        raw = fqn.encode()
        if not fqn or len(raw) > _MAX_FQN_BYTES:
            raise InvalidInputError(f"table fqn must be a non-empty string of at most {_MAX_FQN_BYTES} bytes, got {fqn!r}")
        next_id = int(self.meta("next_table_id", 0))
        self.set_meta("next_table_id", next_id + 1)
        return TableEntry(fqn=fqn, table_id=next_id)

    def put_record(self, table_id: int, batch_idx: int, value: bytes, db: str = RECORDS) -> int:
        """Store ``value`` as the next record of (table_id, batch_idx); returns its seq."""
        dbh = self._dbs[db.encode()]
        cur = self.txn.cursor(db=dbh)
        seq = 0
        # The last record of (table, batch) is just before (table, batch + 1, 0).
        if cur.set_range(codec.record_key(table_id, batch_idx + 1, 0)):
            found = cur.prev()
        else:
            found = cur.last()
        if found:
            t, b, s = codec.decode_record_key(cur.key())
            if t == table_id and b == batch_idx:
                seq = s + 1
        if seq > codec.MAX_SEQ:
            raise InvalidInputError(f"too many records for one (table, batch_idx={batch_idx})")
        # append=False on purpose: put(append=True) silently returns False out of order.
        if not self.txn.put(codec.record_key(table_id, batch_idx, seq), value, db=dbh, overwrite=False):
            raise PersistentDeltaError(f"record key (table {table_id}, batch {batch_idx}, seq {seq}) already exists")
        return seq

    def delete_records(
        self, table_id: int, start_idx: int = 0, end_idx: Optional[int] = None, db: str = RECORDS
    ) -> Tuple[int, int]:
        """Delete the table's records in ``[start_idx, end_idx)``; returns (records, bytes)."""
        prefix = codec.table_prefix(table_id)
        cur = self.txn.cursor(db=self._dbs[db.encode()])
        n = nbytes = 0
        if not cur.set_range(codec.record_key(table_id, max(0, start_idx), 0)):
            return 0, 0
        while True:
            key = cur.key()
            if not key or key[:4] != prefix:
                break
            if end_idx is not None and codec.decode_record_key(key)[1] >= end_idx:
                break
            nbytes += len(cur.value())
            n += 1
            if not cur.delete():  # moves to the next record
                break
        return n, nbytes

    def raise_log_start(self, start: int) -> None:
        """Record that batches below ``start`` are gone (never lowers it)."""
        if start > self.log_start():
            self.set_meta("log_start", start)

    def set_consumer(self, name: str, entry: Dict[str, Any]) -> None:
        if not self.txn.put(name.encode(), codec.pack(entry), db=self._dbs[b"consumers"]):
            raise PersistentDeltaError(f"could not write consumer {name!r}")

    def delete_consumer(self, name: str) -> bool:
        return bool(self.txn.delete(name.encode(), db=self._dbs[b"consumers"]))

    def set_meta(self, key: str, value: Any) -> None:
        if not self.txn.put(key.encode(), codec.pack(value), db=self._dbs[b"meta"]):
            raise PersistentDeltaError(f"could not write meta {key!r}")


# -------------------------------------------------------------------------------- the log


class DeltaLog:
    """One log directory: an LMDB environment with records, tables, consumers and meta.

    Thread-safety: every method may be called from any thread of the process that opened the
    log (transactions are serialised per process). Process rules: only the process that opened
    the handle may use it (a forked child gets :class:`ForkedProcessError`); one process may
    open a log for writing at a time (:class:`LogLockedError` for the next); any number of
    processes may open it read-only, while it is written.

    Args:
        path: the log directory (created for a writable open).
        readonly: open for reading only; never creates anything.
        create: with a writable open, create the log when the directory holds none.
        writer_lock: with a writable open, take the writer lock (the trainer, a store). Without
            it (``DeltaConsumer``, the offsets tool), the handle may only commit consumer
            offsets and must not append, compact or delete: the trainer owns those.
        update_mode: the :class:`UpdateMode` value (string) of the records. On create it is
            stored; on open it must match the stored one (:class:`ConfigMismatchError`).
        options: :class:`LogOptions` (durability, map size, readers).
    """

    def __init__(
        self,
        path: str,
        *,
        readonly: bool = False,
        create: bool = True,
        update_mode: Optional[str] = None,
        options: Optional[LogOptions] = None,
        writer_lock: bool = True,
    ) -> None:
        self.path = os.path.realpath(os.fspath(path))
        self.readonly = readonly
        # Only the lock holder's table cache is authoritative; other handles reload it.
        self.owns_tables = not readonly and writer_lock
        self.options = options or LogOptions.from_env()
        self._pid = os.getpid()
        self._closed = True
        self._lock_fd: Optional[int] = None
        self._tables: Dict[str, TableEntry] = {}
        self._tables_by_id: Dict[int, TableEntry] = {}
        self._tables_seen_version = -1
        if readonly or not writer_lock:
            if not os.path.isfile(os.path.join(self.path, DATA_FILE)):
                raise NotALogError(f"{self.path} is not a persistent_delta log (no {DATA_FILE})")
        if not readonly and writer_lock:
            exists = os.path.isfile(os.path.join(self.path, DATA_FILE))
            if not exists and not create:
                raise NotALogError(f"{self.path} is not a persistent_delta log and create=False")
            try:
                os.makedirs(self.path, exist_ok=True)
            except OSError as exc:
                raise _translate(exc, self.path) from exc
            self._acquire_writer_lock()
            if self.options.tune_malloc:
                tune_malloc()
        try:
            with _REGISTRY_LOCK:
                self._shared = _open_env(self.path, self.options, readonly)
        except BaseException:
            self._release_writer_lock()
            raise
        self._closed = False
        try:
            self._init_meta(update_mode)
            self._reload_tables()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ lifecycle
    def _acquire_writer_lock(self) -> None:
        self._lock_fd = acquire_writer_lock(self.path)

    def _release_writer_lock(self) -> None:
        if self._lock_fd is not None:
            try:
                os.ftruncate(self._lock_fd, 0)
            except OSError:
                pass
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def _init_meta(self, update_mode: Optional[str]) -> None:
        def check(r: ReadTxn) -> Dict[str, Any]:
            return r.all_meta()

        meta = self.read(check)
        if "format_version" not in meta:
            if self.readonly:
                raise NotALogError(f"{self.path} is not a persistent_delta log (no format version)")

            def init(w: WriteTxn) -> None:
                if w.meta("format_version") is not None:
                    return
                w.set_meta("format_version", codec.FORMAT_VERSION)
                w.set_meta("log_id", uuid.uuid4().hex)
                w.set_meta("created_time", time.time())
                w.set_meta("next_table_id", 0)
                w.set_meta("tables_version", 0)
                if update_mode is not None:
                    w.set_meta("update_mode", update_mode)

            self.write(init)
            meta = self.read(check)
        version = meta.get("format_version")
        if version != codec.FORMAT_VERSION:
            raise FormatMismatchError(
                f"{self.path} was written with log format version {version}; this persistent_delta reads "
                f"version {codec.FORMAT_VERSION}. Use the matching persistent_delta release, or start a fresh log"
            )
        stored = meta.get("update_mode")
        if update_mode is not None:
            if stored is None and not self.readonly:
                self.write(lambda w: w.set_meta("update_mode", update_mode))
            elif stored is not None and stored != update_mode:
                raise ConfigMismatchError(
                    f"{self.path} holds records with update mode {stored!r}, not {update_mode!r}: open it with "
                    f"updateMode={stored!r}, or use another path for a fresh log"
                )

    def _reload_tables(self, txn: Optional[lmdb.Transaction] = None) -> None:
        def load(r: ReadTxn) -> None:
            version = r.meta("tables_version", 0)
            if version == self._tables_seen_version:
                return
            tables: Dict[str, TableEntry] = {}
            for k, v in r.txn.cursor(db=self._shared.dbs[b"tables"]):
                fqn = bytes(k).decode()
                tables[fqn] = TableEntry.from_bytes(fqn, bytes(v))
            self._tables = tables
            self._tables_by_id = {e.table_id: e for e in tables.values()}
            self._tables_seen_version = version

        if txn is not None:
            load(ReadTxn(self, txn))
        else:
            self.read(load, refresh_tables=False)

    def close(self) -> None:
        """Release the environment and the writer lock. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() == self._pid:
            _release_env(self.path, self._shared)
            self._release_writer_lock()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "DeltaLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check(self) -> None:
        if self._closed:
            raise LogClosedError(f"{self.path}: the log is closed")
        if os.getpid() != self._pid:
            raise ForkedProcessError(
                f"{self.path}: this log handle was opened in pid {self._pid} and used in pid {os.getpid()} "
                "(after fork). Open the log in the process that uses it"
            )

    # ------------------------------------------------------------------ transactions
    def read(self, fn: Callable[[ReadTxn], T], refresh_tables: bool = True) -> T:
        """Run ``fn`` in one read transaction and return its result.

        ``fn`` must not keep tensors it read past its return (they may view the map).
        """
        self._check()
        shared = self._shared
        for _ in range(8):
            with shared.lock:
                if shared.broken:
                    self._recover()
                try:
                    with shared.env.begin(write=False, buffers=True) as txn:
                        if refresh_tables and not self.owns_tables:
                            self._reload_tables(txn)
                        return fn(ReadTxn(self, txn))
                except lmdb.MapResizedError:
                    # Another process grew the map: adopt its size, then retry.
                    shared.env.set_mapsize(0)
                except lmdb.Error as exc:
                    raise _translate(exc, self.path) from exc
        raise PersistentDeltaError(f"{self.path}: the map kept being resized under a reader")

    def write(self, fn: Callable[[WriteTxn], T]) -> T:
        """Run ``fn`` in one write transaction, commit, and return its result.

        If the map is full, the transaction is aborted, the map grown and ``fn`` run again:
        ``fn`` must only act through the :class:`WriteTxn` it receives.

        Raises:
            ReadOnlyLogError: the log was opened read-only.
            LogFullError: the disk is full or the map may not grow; nothing committed is lost.
        """
        self._check()
        if self.readonly:
            raise ReadOnlyLogError(f"{self.path}: opened read-only")
        shared = self._shared
        with shared.lock:
            while True:
                if shared.broken:
                    self._recover()
                try:
                    txn = shared.env.begin(write=True, buffers=True)
                except lmdb.Error as exc:
                    shared.broken = _is_io_failure(exc)
                    raise _translate(exc, self.path) from exc
                if not self.owns_tables:
                    self._reload_tables(txn)
                w = WriteTxn(self, txn)
                try:
                    result = fn(w)
                    if w._staged:
                        w.set_meta("tables_version", int(w.meta("tables_version", 0)) + 1)
                    txn.commit()
                except lmdb.MapFullError:
                    txn.abort()
                    self._grow()
                    continue
                except lmdb.MapResizedError:
                    txn.abort()
                    shared.env.set_mapsize(0)
                    continue
                except lmdb.Error as exc:
                    txn.abort()
                    shared.broken = _is_io_failure(exc)
                    raise _translate(exc, self.path) from exc
                except BaseException:
                    txn.abort()
                    raise
                if w._staged:
                    for entry in w._staged.values():
                        self._tables[entry.fqn] = entry
                        self._tables_by_id[entry.table_id] = entry
                    self._tables_seen_version += 1
                return result

    def _recover(self) -> None:
        """Reopen the environment after an I/O failure; caches reload from the log."""
        _reopen(self.path, self._shared)
        self._tables_seen_version = -1
        self._reload_tables()

    def _grow(self) -> None:
        info = self._shared.env.info()
        cur = int(info["map_size"])
        new = min(cur * 2, self.options.max_map_size)
        if new <= cur:
            raise LogFullError(
                f"{self.path}: the map is full at {cur} bytes and max_map_size is {self.options.max_map_size}: raise max_map_size"
            )
        logger.info("growing the LMDB map of %s from %d to %d bytes", self.path, cur, new)
        try:
            self._shared.env.set_mapsize(new)
        except lmdb.Error as exc:
            raise _translate(exc, self.path) from exc

    # ------------------------------------------------------------------ helpers
    def flush(self) -> None:
        """Make every committed transaction durable against an OS crash (fsync)."""
        self._check()
        if self.readonly:
            return
        with self._shared.lock:
            try:
                self._shared.env.sync(True)
            except lmdb.Error as exc:
                raise _translate(exc, self.path) from exc

    def tables(self) -> Dict[str, TableEntry]:
        """A snapshot of the table entries, by fqn."""
        self._check()
        if not self.owns_tables:
            self._reload_tables()
        return dict(self._tables)

    def table_by_id(self, table_id: int) -> Optional[TableEntry]:
        return self._tables_by_id.get(table_id)

    def stat(self) -> Dict[str, int]:
        """File size, map size, and last transaction id."""
        self._check()
        with self._shared.lock:
            info = self._shared.env.info()
        try:
            file_size = os.path.getsize(os.path.join(self.path, DATA_FILE))
        except OSError:
            file_size = 0
        return {"file_size": file_size, "map_size": int(info["map_size"]), "last_txnid": int(info["last_txnid"])}

    def reader_check(self) -> int:
        """Clear reader slots left by dead processes; returns how many were cleared."""
        self._check()
        with self._shared.lock:
            return int(self._shared.env.reader_check())

    def reader_pids(self) -> List[int]:
        """Pids of the processes holding a reader slot of the environment (this one included):
        every process with the log open that has read it. Slots of dead processes are cleared
        first. Used by ``vacuum`` to refuse while another process has the log open."""
        self._check()
        with self._shared.lock:
            self._shared.env.reader_check()
            table = self._shared.env.readers()
        pids = set()
        for line in table.splitlines()[1:]:  # "pid thread txnid" header, then one slot a line
            fields = line.split()
            if fields and fields[0].isdigit():
                pids.add(int(fields[0]))
        return sorted(pids)

    def copy_compacted(self, dest: str) -> None:
        """Write a compacted copy of the environment into the empty directory ``dest``."""
        self._check()
        with self._shared.lock:
            self._shared.env.copy(dest, compact=True)


def open_in_process(path: str) -> bool:
    """Whether this process has the log at ``path`` open (through any :class:`DeltaLog`)."""
    with _REGISTRY_LOCK:
        shared = _REGISTRY.get(os.path.realpath(os.fspath(path)))
        return shared is not None and shared.pid == os.getpid()


def is_log(path: str) -> bool:
    """Whether ``path`` looks like a log directory (has an LMDB data file)."""
    return os.path.isfile(os.path.join(os.fspath(path), DATA_FILE))
