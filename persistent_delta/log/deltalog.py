"""The log: typed access to one log directory's tables, records, consumers and meta.

Owns: the transaction discipline and what "a log" is. It stores the entries of
:mod:`persistent_delta.log.schema` and the records of :mod:`persistent_delta.log.codec`; what a
position or a batch range *means* is :mod:`persistent_delta.log.position_rules`'s, and what a record
operation does is :mod:`persistent_delta.log.records`'.

Design note
-----------
Every public mutation is exactly one write transaction, built by a function that receives a
:class:`WriteTxn` and run by :meth:`DeltaLog.write`. If LMDB's map is full the transaction is
aborted, the map doubled and the function run again, so it must not change in-memory state;
:class:`WriteTxn` stages its table-cache updates and applies them only after the commit.

What a directory is (one definition, used by every opener):

* **not a log yet** -- no directory, no ``data.mdb``, a 0-byte one, or an LMDB file whose
  main database is empty or holds only our databases without persistent_delta's meta (a
  creation that was killed). A writer creates the log (databases and meta in one
  transaction); a reader gets :class:`NotALogError` saying so.
* **not ours** -- an LMDB file whose main database names other databases: refused with
  :class:`NotALogError`, never written.
* **ours** -- our meta with a format version, which must be this release's
  (:class:`FormatMismatchError` otherwise).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, TypeVar, Union

import lmdb
import torch

from persistent_delta.log import codec, lmdbenv, schema
from persistent_delta.log.alloc import tune_malloc
from persistent_delta.config import LogOptions
from persistent_delta.errors import (
    CorruptRecordError,
    ConfigMismatchError,
    DamagedLogError,
    ForkedProcessError,
    FormatMismatchError,
    LogClosedError,
    NotALogError,
    PersistentDeltaError,
    ReadOnlyLogError,
)
from persistent_delta.log.layout import DATA_FILE, FileState, file_state, make_dirs
from persistent_delta.log.schema import (
    DB_CONSUMERS,
    DB_META,
    DB_NAMES,
    DB_OF_CHANNEL,
    DB_TABLES,
    LOOKUPS,
    META_CREATED_TIME,
    META_FORMAT_VERSION,
    META_LOG_ID,
    META_NEXT_TABLE_ID,
    META_TABLES_VERSION,
    META_UPDATE_MODE,
    ConsumerEntry,
    LogIdentity,
    TableEntry,
    check_fqn,
    created_stamp,
    next_created_time,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# every meta key the library writes: any other key in the meta database is a damaged name (a
# flipped byte would otherwise hide a key and read as its default)
KNOWN_META = frozenset(v for k, v in vars(schema).items() if k.startswith("META_") and isinstance(v, str))


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
    covers_end: Optional[int] = None
    format: str = codec.NATIVE  # the row format (snapshots; codec's header "f")


# ----------------------------------------------------------------------------- transactions



class ReadTxn:
    """Read access to the log inside one LMDB transaction.

    Tensors it returns may be views into the map: valid only until the transaction ends.
    """

    def __init__(self, log: "DeltaLog", txn: lmdb.Transaction) -> None:
        self._log = log
        self.txn = txn
        self._dbs = log._shared.dbs
        self._prefetch = log._shared.prefetch

    @property
    def path(self) -> str:
        return self._log.path

    # tables ---------------------------------------------------------------------------
    def tables(self) -> Dict[str, TableEntry]:
        """All tables (listed or not), by fqn, as of this transaction."""
        return self._log._tables

    def table(self, fqn: str) -> Optional[TableEntry]:
        return self.tables().get(fqn)

    # records --------------------------------------------------------------------------
    def _cursor_at(self, table_id: int, start_idx: int, channel: str) -> Optional[lmdb.Cursor]:
        cur = self.txn.cursor(db=self._dbs[DB_OF_CHANNEL[channel]])
        return cur if cur.set_range(codec.record_key(table_id, max(0, start_idx), 0)) else None

    def _value(self, cur: lmdb.Cursor, key: Optional[memoryview] = None) -> Union[bytes, memoryview]:
        """The value at ``cur`` (``key``: its key, as the cursor handed it out), a large record
        read ahead first (:class:`~persistent_delta.log.lmdbenv.Prefetch`)."""
        if self._prefetch is None:
            return cur.value()
        predicted = self._prefetch.before(cur.key() if key is None else key)
        value = cur.value()
        self._prefetch.after(predicted, value)
        return value

    def _walk(
        self, table_id: int, start_idx: int, end_idx: Optional[int], channel: str
    ) -> Iterator[Tuple[bytes, Union[bytes, memoryview]]]:
        """``(key, value)`` of the stored records of ``table_id`` with ``start_idx <= batch_idx
        < end_idx`` in a channel, in (batch_idx, seq) order: the one cursor walk behind every
        ``iter_record*``. ``value`` views the map. Keys are big-endian ``(table_id, batch_idx,
        seq)``, so the walk stops at the first key not below the range's end key (bytes order
        is key order), decoding none."""
        cur = self._cursor_at(table_id, start_idx, channel)
        if cur is None:
            return
        stop = codec.range_stop_key(table_id, end_idx)
        # Keys first: py-lmdb reads a value in whole (it touches every page) as the cursor hands
        # it out, so the record just past the range (the next table's oldest: possibly large,
        # and cold on a reopen) is never fetched.
        for key in cur.iternext(keys=True, values=False):
            kb = bytes(key)
            if kb >= stop:
                break
            if len(kb) != codec.KEY_SIZE:
                codec.decode_record_key(kb)  # (raises: a foreign key)
            yield kb, self._value(cur, key)

    def iter_records(
        self, table_id: int, start_idx: int = 0, end_idx: Optional[int] = None, verify: bool = True,
        channel: str = LOOKUPS,
    ) -> Iterator[StoredRecord]:
        """Records of ``table_id`` with ``start_idx <= batch_idx < end_idx`` (half-open) in a
        channel, in (batch_idx, seq) order, i.e. append order."""
        for key, value in self._walk(table_id, start_idx, end_idx, channel):
            t, b, s = codec.decode_record_key(key)
            try:
                rec = codec.decode_record(value, verify=verify, key=key)
            except CorruptRecordError as exc:
                raise self._damaged(key, channel, exc) from exc
            yield StoredRecord(t, b, s, rec.kind, rec.ids, rec.states, rec.nbytes, rec.window_start, rec.covers_end,
                               rec.format)

    def iter_record_rows(
        self, table_id: int, start_idx: int = 0, end_idx: Optional[int] = None, channel: str = LOOKUPS,
    ) -> Iterator[codec.RecordRows]:
        """The records of :meth:`iter_records` (checked the same way) as numpy views
        (:func:`~persistent_delta.log.codec.decode_record_rows`): the read path's form."""
        for key, value in self._walk(table_id, start_idx, end_idx, channel):
            try:
                rec = codec.decode_record_rows(value, key=key)
            except CorruptRecordError as exc:
                raise self._damaged(key, channel, exc) from exc
            yield rec

    def _damaged(self, key: bytes, channel: str, exc: CorruptRecordError) -> CorruptRecordError:
        """``exc`` (a record that fails its checks) naming the log's file and the record."""
        t, b, s = codec.decode_record_key(key)
        side = codec.is_side_table_id(t)
        base = t & ~codec.SIDE_TABLE_BIT if side else t
        name = next((fqn for fqn, e in self.tables().items() if e.table_id == base), t)
        return CorruptRecordError(
            f"{os.path.join(self.path, DATA_FILE)}: {codec.record_where(channel, name, side, b, s)}: {exc}")

    def iter_record_keys(
        self, table_id: int, start_idx: int = 0, end_idx: Optional[int] = None, channel: str = LOOKUPS
    ) -> Iterator[Tuple[int, int, int]]:
        """``(batch_idx, seq, value_bytes)`` of records in ``[start_idx, end_idx)``, undecoded."""
        for b, s, value in self.iter_record_views(table_id, start_idx, end_idx, channel):
            yield b, s, len(value)

    def iter_record_views(
        self, table_id: int, start_idx: int = 0, end_idx: Optional[int] = None, channel: str = LOOKUPS
    ) -> Iterator[Tuple[int, int, Union[bytes, memoryview]]]:
        """``(batch_idx, seq, value)`` of records in ``[start_idx, end_idx)``, undecoded; the
        value a view into the map (valid inside this transaction; nothing is copied)."""
        for key, value in self._walk(table_id, start_idx, end_idx, channel):
            _, b, s = codec.decode_record_key(key)
            yield b, s, value

    def first_record_at(
        self, table_id: int, start_idx: int, channel: str = LOOKUPS
    ) -> Optional[Tuple[int, Union[bytes, memoryview]]]:
        """``(batch_idx, value)`` of the table's first record at or after ``start_idx``, or None.
        The value is a view into the map (valid inside this transaction; nothing is copied)."""
        cur = self._cursor_at(table_id, start_idx, channel)
        if cur is None or cur.key()[:4] != codec.table_prefix(table_id):
            return None
        return codec.decode_record_key(cur.key())[1], self._value(cur)

    def last_record_before(
        self, table_id: int, position: int, channel: str = LOOKUPS
    ) -> Optional[Tuple[int, Union[bytes, memoryview]]]:
        """``(batch_idx, value)`` of the table's last record below ``position``, or None (the
        value a view, as :meth:`first_record_at`)."""
        cur = self.txn.cursor(db=self._dbs[DB_OF_CHANNEL[channel]])
        found = cur.prev() if cur.set_range(codec.record_key(table_id, max(0, position), 0)) else cur.last()
        if not found or cur.key()[:4] != codec.table_prefix(table_id):
            return None
        b = codec.decode_record_key(cur.key())[1]
        return (b, self._value(cur)) if b < position else None

    def iter_raw(self, channel: str = LOOKUPS) -> Iterator[Tuple[bytes, Union[bytes, memoryview]]]:
        """Every (key, value) of a channel, in key order, undecoded (for verify)."""
        for k, v in self.txn.cursor(db=self._dbs[DB_OF_CHANNEL[channel]]):
            yield bytes(k), v

    def first_batch_idx(self, table_id: int, channel: str = LOOKUPS) -> Optional[int]:
        """The lowest batch_idx stored for the table in a channel, or None (keys only)."""
        cur = self._cursor_at(table_id, 0, channel)
        if cur is None or cur.key()[:4] != codec.table_prefix(table_id):
            return None
        return codec.decode_record_key(cur.key())[1]

    # consumers & meta ----------------------------------------------------------------
    def consumers(self) -> Dict[str, ConsumerEntry]:
        """Every registered consumer, by name."""
        out = {}
        for k, v in self.txn.cursor(db=self._dbs[DB_CONSUMERS]):
            name = codec.key_name(k, DB_CONSUMERS)
            out[name] = ConsumerEntry.from_bytes(name, bytes(v))
        return out

    def iter_consumer_bytes(self) -> Iterator[Tuple[str, bytes]]:
        """Every consumer entry undecoded (for verify, which reports a bad one by name)."""
        for k, v in self.txn.cursor(db=self._dbs[DB_CONSUMERS]):
            yield bytes(k).decode(errors="replace"), bytes(v)

    def consumer(self, name: str) -> Optional[ConsumerEntry]:
        v = self.txn.get(name.encode(), db=self._dbs[DB_CONSUMERS])
        return None if v is None else ConsumerEntry.from_bytes(name, bytes(v))

    def meta(self, key: str, default: Any = None) -> Any:
        v = self.txn.get(key.encode(), db=self._dbs[DB_META])
        return default if v is None else codec.unpack(v, f"meta {key!r}")

    def identity(self) -> LogIdentity:
        """The log's identity (:class:`~persistent_delta.log.schema.LogIdentity`): its id and
        creation stamp."""
        return LogIdentity(str(self.meta(META_LOG_ID)), created_stamp(self.meta(META_CREATED_TIME)))

    def all_meta(self) -> Dict[str, Any]:
        return {codec.key_name(k, DB_META): codec.unpack(v, "meta") for k, v in self.txn.cursor(db=self._dbs[DB_META])}


class WriteTxn(ReadTxn):
    """Write access inside one LMDB write transaction (see :meth:`DeltaLog.write`).

    Table changes are staged and reach the log's cache only after the commit, so the
    transaction can be aborted and rerun (map growth) without leaving stale state behind.
    """

    def __init__(self, log: "DeltaLog", txn: lmdb.Transaction) -> None:
        super().__init__(log, txn)
        self._prefetch = None  # (its values may be its own dirty pages, not the map's)
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
        if not self.txn.put(entry.fqn.encode(), entry.to_bytes(), db=self._dbs[DB_TABLES]):
            raise PersistentDeltaError(f"could not write table entry {entry.fqn!r}")
        self._staged[entry.fqn] = entry

    def ensure_table(self, fqn: str) -> TableEntry:
        """The (staged, mutable) entry of ``fqn``, created with a fresh table id if new."""
        if fqn in self._staged:
            return self._staged[fqn]
        existing = self._log._tables.get(fqn)
        if existing is not None:
            return existing.copy()
        check_fqn(fqn)
        next_id = int(self.meta(META_NEXT_TABLE_ID, 0))
        self.set_meta(META_NEXT_TABLE_ID, next_id + 1)
        return TableEntry(fqn=fqn, table_id=next_id)

    def put_record(self, table_id: int, batch_idx: int, value: Union[bytes, bytearray, memoryview],
                   channel: str = LOOKUPS) -> int:
        """Store an encoded record ``value`` (:func:`codec.encode_record`) as the next record of
        (table_id, batch_idx), sealed with its key; returns its seq."""
        dbh = self._dbs[DB_OF_CHANNEL[channel]]
        cur = self.txn.cursor(db=dbh)
        seq = 0
        # The last record of (table, batch) is just before (table, batch + 1, 0).
        found = cur.prev() if cur.set_range(codec.record_key(table_id, batch_idx + 1, 0)) else cur.last()
        if found:
            t, b, s = codec.decode_record_key(cur.key())
            if t == table_id and b == batch_idx:
                seq = s + 1
        if seq > codec.MAX_SEQ:
            raise PersistentDeltaError(f"too many records for one (table, batch_idx={batch_idx})")
        key = codec.record_key(table_id, batch_idx, seq)
        writable = isinstance(value, bytearray) or (isinstance(value, memoryview) and not value.readonly)
        buf = value if writable else bytearray(value)
        # Seal in place for the put (LMDB copies the value), then unseal: a transaction rerun
        # after map growth puts the same value again.
        codec.seal_record(buf, key)
        try:
            # append=False on purpose: put(append=True) silently returns False out of order.
            stored = self.txn.put(key, buf, db=dbh, overwrite=False)
        finally:
            codec.seal_record(buf, key)
        if not stored:
            raise PersistentDeltaError(f"record key (table {table_id}, batch {batch_idx}, seq {seq}) already exists")
        return seq

    def delete_records(
        self, table_id: int, start_idx: int = 0, end_idx: Optional[int] = None, channel: str = LOOKUPS
    ) -> Tuple[int, int]:
        """Delete the table's records in ``[start_idx, end_idx)``; returns (records, bytes)."""
        cur = self._cursor_at(table_id, start_idx, channel)
        if cur is None:
            return 0, 0
        prefix = codec.table_prefix(table_id)
        n = nbytes = 0
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

    def set_consumer(self, name: str, entry: ConsumerEntry) -> None:
        if not self.txn.put(name.encode(), entry.to_bytes(), db=self._dbs[DB_CONSUMERS]):
            raise PersistentDeltaError(f"could not write consumer {name!r}")

    def delete_consumer(self, name: str) -> bool:
        return bool(self.txn.delete(name.encode(), db=self._dbs[DB_CONSUMERS]))

    def set_meta(self, key: str, value: Any) -> None:
        if not self.txn.put(key.encode(), codec.pack(value), db=self._dbs[DB_META]):
            raise PersistentDeltaError(f"could not write meta {key!r}")

    def delete_meta(self, key: str) -> None:
        """Remove a meta key (reads of it get their default again)."""
        self.txn.delete(key.encode(), db=self._dbs[DB_META])


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
        readonly: open for reading only; never creates or writes anything.
        create: with a writable open, create the log when the directory holds none yet.
        writer_lock: with a writable open, take the writer lock (the trainer, a store). Without
            it (``DeltaConsumer``, the offsets tool), the handle may only commit consumer
            offsets and must not append, compact or delete: the writer owns those.
        update_mode: the :class:`UpdateMode` value (string) of the lookups channel. On create
            it is stored; on open it must match the stored one (:class:`ConfigMismatchError`).
        options: :class:`LogOptions` (durability, map size, readers).
        check: walk the whole file's structure before opening it (``lmdb.verify``; linear in
            the file). Every open makes the constant-time checks of
            :func:`persistent_delta.log.lmdbenv.check_file` anyway.

    Raises:
        DamagedLogError: the file fails those checks (it is not opened).
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
        formats: Tuple[int, ...] = (codec.FORMAT_VERSION,),
        check: bool = False,
    ) -> None:
        self.path = os.path.realpath(os.fspath(path))
        self._formats = formats  # (the upgrade tool opens older versions)
        self.readonly = readonly
        # Only the lock holder's table cache is authoritative; other handles reload it.
        self.owns_tables = not readonly and writer_lock
        self.options = options or LogOptions.resolve()
        self._pid = os.getpid()
        self._closed = True
        self._lock_fd: Optional[int] = None
        self._tables: Dict[str, TableEntry] = {}
        self._tables_seen_version = -1
        may_create = self.owns_tables and create
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise NotALogError(f"{self.path} is a file, not a log directory; pass the directory that holds data.mdb")
        if file_state(self.path) is not FileState.PRESENT and not may_create:
            raise NotALogError(self._not_yet("no data"))
        if self.owns_tables:
            try:
                make_dirs(self.path, self.options.dir_mode)  # the root too: never the umask's mode
            except OSError as exc:
                raise lmdbenv.translate(exc, self.path) from exc
            self._lock_fd = lmdbenv.acquire_writer_lock(self.path)
        if self.options.tune_malloc:  # writers (LMDB's commit buffers) and readers (poll results) alike
            tune_malloc()
        if file_state(self.path) is FileState.PRESENT and not lmdbenv.open_in_process(self.path):
            try:
                lmdbenv.check_file(self.path, full=check)
            except BaseException:
                self._release_writer_lock()
                raise
        try:
            self._shared = lmdbenv.acquire(self.path, self.options, readonly)
        except BaseException:
            self._release_writer_lock()
            raise
        self._closed = False
        try:
            with self._shared.lock:
                if not self._shared.dbs:
                    self._open_dbs(may_create, update_mode)
            self._check_meta(update_mode)
            self._reload_tables()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ opening
    def _not_yet(self, why: str) -> str:
        return (
            f"{self.path} is not a persistent_delta log yet ({why}): start the trainer (or open a store) there "
            "first, or check the path"
        )

    def _open_dbs(self, may_create: bool, update_mode: Optional[str]) -> None:
        """Classify the file (see the module docs) and open our databases; a writer creates
        the log in one transaction."""
        env = self._shared.env
        try:
            with env.begin(write=False) as txn:
                names = {bytes(k).decode(errors="replace") for k in txn.cursor().iternext(keys=True, values=False)}
            if names - set(DB_NAMES):
                raise NotALogError(
                    f"{self.path} is an LMDB file of another application (databases {sorted(names)[:8]}), not a "
                    "persistent_delta log; it was not changed"
                )
            ours = set(DB_NAMES) <= names
            if ours:
                self._shared.dbs = lmdbenv.open_dbs(env, DB_NAMES)
                with env.begin(write=False) as txn:
                    ours = txn.get(META_FORMAT_VERSION.encode(), db=self._shared.dbs[DB_META]) is not None
            if not ours:
                if not may_create:
                    self._shared.dbs = {}
                    raise NotALogError(self._not_yet("its creation has not committed"))
                with env.begin(write=True) as txn:
                    self._shared.dbs = lmdbenv.open_dbs(env, DB_NAMES, txn=txn, create=True)
                    for key, value in self._initial_meta(update_mode).items():
                        txn.put(key.encode(), codec.pack(value), db=self._shared.dbs[DB_META])
                lmdbenv.set_modes(self.path, self.options.file_mode)
                logger.info("created the log %s", self.path)
        except lmdb.Error as exc:
            self._shared.dbs = {}
            raise lmdbenv.translate(exc, self.path) from exc
        self._shared.db_names = DB_NAMES

    @staticmethod
    def _initial_meta(update_mode: Optional[str]) -> Dict[str, Any]:
        meta: Dict[str, Any] = {
            META_FORMAT_VERSION: codec.FORMAT_VERSION,
            META_LOG_ID: uuid.uuid4().hex,
            META_CREATED_TIME: time.time(),
            META_NEXT_TABLE_ID: 0,
            META_TABLES_VERSION: 0,
        }
        if update_mode is not None:
            meta[META_UPDATE_MODE] = update_mode
        return meta

    def _check_meta(self, update_mode: Optional[str]) -> None:
        def read(r: ReadTxn) -> Tuple[Any, Any, List[str], Any]:
            keys = [codec.key_name(k, DB_META) for k in r.txn.cursor(db=r._dbs[DB_META]).iternext(keys=True, values=False)]
            return r.meta(META_FORMAT_VERSION), r.meta(META_UPDATE_MODE), keys, r.meta(META_CREATED_TIME)

        version, stored, keys, created = self.read(read, refresh_tables=False)
        if version not in self._formats:
            how = ("upgrade it in place with `persistent-delta upgrade ROOT --execute` (stop the trainer first)"
                   if version == 1 else "use the matching persistent_delta release, or start a fresh log")
            raise FormatMismatchError(
                f"{self.path} was written with log format version {version}; this persistent_delta reads "
                f"version {codec.FORMAT_VERSION}: {how}"
            )
        unknown = sorted(k for k in keys if k not in KNOWN_META)
        if unknown and version == codec.FORMAT_VERSION:
            raise DamagedLogError(
                f"{self.path}: the meta database holds keys this library never writes ({[k[:40] for k in unknown[:5]]}): "
                "a damaged key name, which would read as a missing setting. Restore the log from a copy, or move it "
                "away and start afresh")
        if not self.readonly and self.owns_tables and created_stamp(created) == 0:
            # a log written before its creation time was stored (or with a damaged one): the
            # writer gives its identity a stamp, so readers can order it against later ones
            self.write(lambda w: w.set_meta(META_CREATED_TIME, next_created_time(None)))
        if update_mode is None:
            return
        if stored is None and not self.readonly:
            self.write(lambda w: w.set_meta(META_UPDATE_MODE, update_mode))
        elif stored is not None and stored != update_mode:
            raise ConfigMismatchError(
                f"{self.path} holds records with update mode {stored!r}, not {update_mode!r}: open it with "
                f"updateMode={stored!r}, or use another path for a fresh log"
            )

    def _release_writer_lock(self) -> None:
        if self._lock_fd is not None:
            lmdbenv.release_lock(self._lock_fd)
            self._lock_fd = None

    def _reload_tables(self, txn: Optional[lmdb.Transaction] = None) -> None:
        def load(r: ReadTxn) -> None:
            version = r.meta(META_TABLES_VERSION, 0)
            if version == self._tables_seen_version:
                return
            tables: Dict[str, TableEntry] = {}
            for k, v in r.txn.cursor(db=self._shared.dbs[DB_TABLES]):
                fqn = codec.key_name(k, DB_TABLES)
                tables[fqn] = TableEntry.from_bytes(fqn, bytes(v))
            self._tables = tables
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
            lmdbenv.release(self.path, self._shared)
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
        for _ in range(8):
            try:
                with self._reading(refresh_tables) as r:
                    return fn(r)
            except lmdb.MapResizedError:
                self._adopt_map_size()
        raise PersistentDeltaError(f"{self.path}: the map kept being resized under a reader")

    @contextlib.contextmanager
    def _reading(self, refresh_tables: bool = True) -> Iterator[ReadTxn]:
        """One read transaction as a context (:meth:`read`, :func:`read_all`). Raises
        ``lmdb.MapResizedError`` (untranslated) when another process grew the map: adopt its
        size (:meth:`_adopt_map_size`) and read again."""
        self._check()
        shared = self._shared
        with shared.lock:
            if shared.broken:
                self._recover()
            try:
                with shared.env.begin(write=False, buffers=True) as txn:
                    if refresh_tables and not self.owns_tables:
                        self._reload_tables(txn)
                    yield ReadTxn(self, txn)
            except lmdb.MapResizedError:
                raise
            except lmdb.Error as exc:
                raise lmdbenv.translate(exc, self.path) from exc

    def _adopt_map_size(self) -> None:
        with self._shared.lock:
            self._shared.env.set_mapsize(0)  # another process grew the map: adopt its size

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
        lmdbenv.check_lock_file(self.path, shared)
        with shared.lock:
            while True:
                if shared.broken:
                    self._recover()
                try:
                    txn = shared.env.begin(write=True, buffers=True)
                except lmdb.Error as exc:
                    shared.broken = lmdbenv.is_io_failure(exc)
                    raise lmdbenv.translate(exc, self.path) from exc
                if not self.owns_tables:
                    self._reload_tables(txn)
                w = WriteTxn(self, txn)
                try:
                    result = fn(w)
                    if w._staged:
                        w.set_meta(META_TABLES_VERSION, int(w.meta(META_TABLES_VERSION, 0)) + 1)
                    txn.commit()
                except lmdb.MapFullError:
                    txn.abort()
                    lmdbenv.grow(self.path, shared, self.options.max_map_size)
                    continue
                except lmdb.MapResizedError:
                    txn.abort()
                    shared.env.set_mapsize(0)
                    continue
                except lmdb.Error as exc:
                    txn.abort()
                    shared.broken = lmdbenv.is_io_failure(exc)
                    raise lmdbenv.translate(exc, self.path) from exc
                except BaseException:
                    txn.abort()
                    raise
                if w._staged:
                    for entry in w._staged.values():
                        self._tables[entry.fqn] = entry
                    self._tables_seen_version += 1
                return result

    def _recover(self) -> None:
        """Reopen the environment after an I/O failure; caches reload from the log."""
        lmdbenv.reopen(self.path, self._shared)
        self._tables_seen_version = -1
        self._reload_tables()

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
                raise lmdbenv.translate(exc, self.path) from exc

    def tables(self) -> Dict[str, TableEntry]:
        """A snapshot of the table entries, by fqn."""
        self._check()
        if not self.owns_tables:
            self._reload_tables()
        return dict(self._tables)

    def last_txnid(self) -> int:
        """The id of the last transaction written to the meta page. A writer publishes it to
        new read transactions a moment later (LMDB updates its lock file after the meta page):
        :meth:`visible_txnid` is what a read sees."""
        self._check()
        with self._shared.lock:
            return int(self._shared.env.info()["last_txnid"])

    def visible_txnid(self) -> int:
        """The id of the snapshot a read transaction begun now sees."""
        return int(self.read(lambda r: r.txn.id(), refresh_tables=False))

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
        """Pids of the processes holding a reader slot of the environment (this one included).
        Slots of dead processes are cleared first."""
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


def read_all(logs: List[DeltaLog], fn: Callable[[List[ReadTxn]], T]) -> T:
    """Run ``fn`` with a read transaction open on each of ``logs`` at once (a poll over every
    rank's log, copying their rows into one buffer) and return its result; as
    :meth:`DeltaLog.read` for each log, without nesting calls (any number of logs).

    ``fn`` must not keep tensors it read past its return (they may view the maps).
    """
    for _ in range(8):
        resized: Optional[DeltaLog] = None
        with contextlib.ExitStack() as stack:
            txns: List[ReadTxn] = []
            for log in logs:
                try:
                    txns.append(stack.enter_context(log._reading()))
                except lmdb.MapResizedError:
                    resized = log
                    break
            if resized is None:
                return fn(txns)
        resized._adopt_map_size()  # (every transaction closed first)
    raise PersistentDeltaError(f"{[log.path for log in logs]}: the maps kept being resized under a reader")
