"""py-lmdb's process rules, in one place.

Owns: how this process holds LMDB environments. Nothing here knows what is stored.

* **One environment per path per process.** LMDB forbids opening one environment twice in a
  process (closing either breaks the other's locks), so environments are shared through a
  registry with a reference count (:func:`acquire` / :func:`release`).
* **Fork guard.** Each shared environment records the pid that opened it; a forked child never
  uses its parent's (the registry forgets it, and :class:`~persistent_delta.log.deltalog.DeltaLog`
  raises :class:`ForkedProcessError` for a handle carried across fork).
* **One lock per environment** serialises this process's transactions: the map can then be
  resized (which needs no open transaction in the process) and py-lmdb objects are never used
  from two threads at once.
* **One writer process per log**: :func:`acquire_writer_lock` takes an exclusive ``flock`` on
  ``writer.lock`` (released by the kernel when the process dies, SIGKILL included) and writes
  the holder's pid into it; :func:`other_opener` probes LMDB's own ``lock.mdb`` for any other
  process that has the environment open.
* **Errors** are mapped from py-lmdb's exception classes and error codes (``exc.code``, an
  errno or an ``MDB_*`` code), never from message text (:func:`translate`).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import lmdb
import numpy as np
from lmdb import verify as _lmdb_verify

from persistent_delta.config import Durability, LogOptions
from persistent_delta.errors import (
    CorruptRecordError,
    DamagedLogError,
    LogFullError,
    LogIOError,
    LogLockedError,
    NotALogError,
    PersistentDeltaError,
    ReadOnlyLogError,
)
from persistent_delta.log.layout import DATA_FILE, LMDB_LOCK_FILE, WRITER_LOCK_FILE, consumer_lock_file
from persistent_delta.log.libc import libc

logger = logging.getLogger(__name__)

_FULL_CODES = (errno.ENOSPC, errno.EDQUOT)
_READONLY_CODES = (errno.EACCES, errno.EROFS, errno.EPERM)
_IO_CODES = _FULL_CODES + (errno.EIO,)
_DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.BadChecksumError)


def _code(exc: BaseException) -> Optional[int]:
    if isinstance(exc, lmdb.Error):
        return getattr(exc, "code", None)
    return getattr(exc, "errno", None)


def translate(exc: BaseException, path: str) -> PersistentDeltaError:
    """The error a caller can act on for a py-lmdb or OS error ``exc`` raised on ``path``."""
    code = _code(exc)
    if isinstance(exc, lmdb.MapFullError):
        return LogFullError(f"{path}: the LMDB map is full and may not grow further: raise max_map_size")
    if isinstance(exc, lmdb.DiskError) or code in _FULL_CODES or (code == errno.EIO and _out_of_space(path)):
        # (some filesystems report a full disk to LMDB's commit as EIO: the free space decides)
        return LogFullError(f"{path}: no space left on the device; free disk space and retry (nothing committed was lost)")
    if code == errno.EIO:
        return LogIOError(f"{path}: I/O error from the device with space left ({exc}); nothing committed was lost")
    if isinstance(exc, lmdb.ReadonlyError) or code in _READONLY_CODES:
        return ReadOnlyLogError(f"{path}: not writable ({exc}); open it read-only or fix the permissions")
    if isinstance(exc, (lmdb.InvalidError, lmdb.VersionMismatchError)):
        return NotALogError(f"{path}: not an LMDB environment of this version ({exc})")
    if isinstance(exc, _DAMAGE):
        return CorruptRecordError(f"{path}: the LMDB file is damaged ({exc}); run `persistent-delta verify`")
    return PersistentDeltaError(f"{path}: LMDB error: {exc}")


_LOW_SPACE = 1 << 20  # below this many free bytes an EIO at commit is taken as a full disk


def _out_of_space(path: str) -> bool:
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < _LOW_SPACE


def is_io_failure(exc: BaseException) -> bool:
    """Whether ``exc`` may have left the environment unusable (LMDB flags it fatal after an
    I/O error during commit): it is then closed and reopened before the next use."""
    return isinstance(exc, (lmdb.DiskError, lmdb.PanicError)) or _code(exc) in _IO_CODES


# ------------------------------------------------------------------------ file checks


_META_READS = 20  # reads of the meta pages before a changing file is judged on its last one
_META_RETRY_S = 0.002


def _read_metas(data: str) -> Tuple[Tuple[int, int], List[str]]:
    """One read of ``data``'s meta pages: (their transaction ids, the problems found).

    The file's size is taken *after* the meta pages are read, from the open file: a writer
    writes a commit's pages before its meta page and LMDB never shrinks the file, so a size read
    later is at least what the meta page read earlier needs, however a live writer races this
    reader (a size taken first could be older than the meta page, and look truncated)."""
    with open(data, "rb") as f:
        v = _lmdb_verify._Verifier(f, os.fstat(f.fileno()).st_size)  # py-lmdb's meta parser (pinned py-lmdb 3.0)
        try:
            v.detect_engine()
        except _lmdb_verify.VerifyError as exc:
            raise NotALogError(f"{data}: not an LMDB file ({exc})") from exc
        v.load_metas()
        m0, m1 = v._read_meta(0, 1), v._read_meta(1, v.psize)
        size = os.fstat(f.fileno()).st_size
        problems = list(v.errors)
        if m0.txnid and m1.txnid and abs(int(m0.txnid) - int(m1.txnid)) != 1:
            problems.append(f"the meta pages' transaction ids {m0.txnid} and {m1.txnid} are not consecutive")
        need = v.next_pgno * v.psize
        if size < need and not problems and not _free_tail(v, size // v.psize):
            problems.append(f"the file is truncated: {size} bytes, but its committed meta page needs {need}")
    return (int(m0.txnid), int(m1.txnid)), problems


def _free_tail(v: Any, pages: int) -> bool:
    """Whether every page from ``pages`` (the file's end) to the committed meta's next page is
    free: LMDB does not write a page a transaction allocated and freed again (a loose page), so
    a healthy file may end a few free pages short of ``next_pgno``. Walks only the free-page
    database, with reads (never a map); ``next_pgno`` is bounded by the parser."""
    v.live = bytearray(v.next_pgno)
    v.free = bytearray(v.next_pgno)
    try:
        v._verify_tree("freeDB", v.meta.free, _lmdb_verify._cmp_int, None, is_free=True)
        for txnid, data in v.free_records:
            v._decode_idl(txnid, data)
    except (_lmdb_verify.VerifyError, IndexError, ValueError):
        return False
    return not v.errors and all(v.free[pages:v.next_pgno])


def check_file(path: str, full: bool = False) -> None:
    """Check ``<path>/data.mdb`` against LMDB's own metadata before anything maps it.

    Constant time (two meta pages read with ``read``, never mapped): both meta pages parse,
    agree on the page size, have sane transaction ids (the two differ by one; a flipped high
    byte would silently roll back to the older one), and the file holds every page the
    committed meta page claims (a truncated file would kill every process that maps it with
    SIGBUS at the first access to a missing page). With ``full``, py-lmdb's offline structural
    verifier walks every reachable page too (``lmdb.verify``; time linear in the file).

    Safe against a live writer: the meta pages are read with separate reads, so a commit in
    between can pair an old page with a new one. A problem is reported only when two reads in a
    row saw the same transaction ids (a file at rest: the problem is in the file), or after
    ``_META_READS`` reads of a file that kept changing (a few milliseconds).

    Raises:
        NotALogError: the file is not an LMDB file at all (no LMDB magic).
        DamagedLogError: any of the checks fails; the message names the file.
    """
    data = os.path.join(path, DATA_FILE)
    seen: Optional[Tuple[int, int]] = None
    for _ in range(_META_READS):
        try:
            txnids, problems = _read_metas(data)
        except _lmdb_verify.VerifyError as exc:
            raise DamagedLogError(f"{data}: damaged LMDB file: {exc}") from exc
        except OSError as exc:
            raise translate(exc, path) from exc
        if not problems or txnids == seen:
            break
        seen = txnids
        time.sleep(_META_RETRY_S)
    if not problems and full:
        problems = _lmdb_verify.verify(data)
    if problems:
        raise DamagedLogError(
            f"{data}: damaged LMDB file ({'; '.join(problems[:3])}); it was not opened. Restore it from a copy, "
            "or move it away and start afresh"
        )


def set_modes(path: str, file_mode: int) -> None:
    """Give the log's files the configured permissions (the umask narrows what LMDB creates).
    Only files this process owns are changed."""
    for name in (DATA_FILE, LMDB_LOCK_FILE, WRITER_LOCK_FILE):
        p = os.path.join(path, name)
        try:
            if os.stat(p).st_uid == os.geteuid() and (os.stat(p).st_mode & 0o777) != file_mode:
                os.chmod(p, file_mode)
        except OSError:
            pass


# ------------------------------------------------------------------------ writer lock


def _flock_file(lock_path: str, path: str) -> Tuple[int, Optional[str]]:
    """Open ``lock_path`` and take its exclusive flock: ``(fd, None)`` when taken (our pid
    written into it), else ``(-1, holder)`` naming the holder ("pid N", "this process").

    A holder no longer running still holds the lock while another process keeps a copy of its
    descriptor (passed on to a program it started, or forked by C code: ``os.fork`` children
    close theirs, :func:`_forget_locks_in_child`): that is waited for, up to
    ``_DEAD_HOLDER_S``, then said."""
    deadline = time.monotonic() + _DEAD_HOLDER_S
    while True:
        fd, who, gone = _try_flock_file(lock_path, path)
        if not gone or time.monotonic() >= deadline:
            return fd, who
        time.sleep(0.02)


_DEAD_HOLDER_S = 2.0
_HELD: Dict[int, int] = {}  # lock descriptor -> the pid that took it (the process that holds the claim)


def _forget_locks_in_child() -> None:
    """After ``os.fork``: the child holds none of its parent's claims. Its copies of their
    descriptors are closed, so that a claim goes with the process that took it (a worker forked
    by a trainer or a replica, outliving it, kept its claim). :func:`release_lock` in the child
    then leaves them alone."""
    for fd in list(_HELD):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_locks_in_child)


def _try_flock_file(lock_path: str, path: str) -> Tuple[int, Optional[str], bool]:
    """One try of :func:`_flock_file`: also whether the holder named is no longer running."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o660)
    except OSError as exc:
        raise translate(exc, path) from exc
    try:  # the log directory's access, not the umask's: group members open it too (group_access)
        want = os.stat(path).st_mode & 0o660
        st = os.fstat(fd)
        if st.st_uid == os.geteuid() and st.st_mode & 0o777 != want:
            os.fchmod(fd, want)
    except OSError:
        pass
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
        gone = False
        if holder == str(os.getpid()):
            who += " (this process: close the other handle first)"
        elif holder.isdigit() and len(holder) <= 9 and not _running(int(holder)):
            gone = True
            who += (" (no process here has that pid now: another process still holds a copy of its lock descriptor, "
                    "one it started or passed it to, until that one exits; or it runs in another pid namespace)")
        return -1, who, gone
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _HELD[fd] = os.getpid()
    return fd, None, False


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists in this pid namespace."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process
        return True
    return True


def acquire_writer_lock(path: str, action: str = "open it for writing") -> int:
    """Take the log's exclusive writer lock and write our pid into it; returns the descriptor
    (close it, or :func:`release_lock`, to release). The kernel releases it when the
    process dies (SIGKILL included).

    Raises:
        LogLockedError: another process (or another handle of this one) holds it; the message
            names the holder's pid.
    """
    fd, who = _flock_file(os.path.join(path, WRITER_LOCK_FILE), path)
    if who is not None:
        raise LogLockedError(
            f"{path}: another writer holds the writer lock: {who}, so this process cannot {action}. One writer "
            "process per log; open it read-only (DeltaConsumer, the tools) to read while it is written"
        )
    return fd


def acquire_consumer_lock(path: str, name: str, action: str) -> int:
    """Claim consumer ``name`` of the log at ``path`` for this process (one active user per
    name: the tracker for its consumers, a ``DeltaConsumer``, or the offsets tool while it
    changes the entry). A dead holder's claim is released by the kernel.

    Raises:
        LogLockedError: another user holds it; the message names its pid.
    """
    lock = consumer_lock_file(path, name)
    try:
        if not os.path.isdir(os.path.dirname(lock)):
            os.makedirs(os.path.dirname(lock), exist_ok=True)
            os.chmod(os.path.dirname(lock), os.stat(path).st_mode & 0o777)  # the log directory's access
    except OSError as exc:
        raise translate(exc, path) from exc
    fd, who = _flock_file(lock, path)
    if who is not None:
        raise LogLockedError(
            f"{path}: consumer {name!r} is in use by {who}, so this process cannot {action}. One active user per "
            "consumer name: stop the other one first, or use another name"
        )
    return fd


def release_lock(fd: int) -> None:
    """Clear the holder's pid and release the lock (closing the descriptor drops the flock).
    A no-op in a forked child: the lock is its parent's (the child's copy was closed at fork)."""
    if _HELD.pop(fd, None) != os.getpid():
        return
    try:
        os.ftruncate(fd, 0)
    except OSError:
        pass
    os.close(fd)


# struct flock on Linux: short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid
_FLOCK = struct.Struct("hhqqi4x")


def other_opener(path: str) -> Optional[int]:
    """The pid of another process that has the LMDB environment at ``path`` open, or None.

    Must not be called while this process has it open: closing the descriptor used here would
    drop this process's own LMDB locks on ``lock.mdb`` (POSIX lock semantics).
    """
    lock = os.path.join(path, LMDB_LOCK_FILE)
    if not os.path.exists(lock):
        return None
    fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    try:
        probe = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
        l_type, _, _, _, pid = _FLOCK.unpack(fcntl.fcntl(fd, fcntl.F_GETLK, probe))
    finally:
        os.close(fd)
    return None if l_type == fcntl.F_UNLCK else int(pid)


# ------------------------------------------------------------------------ shared environments


@dataclass
class SharedEnv:
    """One open environment of this process and the named databases opened in it."""

    env: lmdb.Environment
    dbs: Dict[str, Any]  # name -> py-lmdb database handle
    pid: int
    readonly: bool
    refs: int
    lock: threading.RLock
    opts: LogOptions
    db_names: Tuple[str, ...]
    # Set after an I/O failure: the environment is reopened (at its last commit) before next use.
    broken: bool = False
    lock_ino: Optional[Tuple[int, int]] = None  # (dev, ino) of lock.mdb at open
    prefetch: Optional["Prefetch"] = None  # records read ahead whole (LogOptions.readahead)


_REGISTRY: Dict[str, SharedEnv] = {}
_REGISTRY_LOCK = threading.Lock()


def _flags(opts: LogOptions) -> Dict[str, Any]:
    d = opts.durability
    return {"sync": d in (Durability.SYNC, Durability.NO_METASYNC), "metasync": d == Durability.SYNC}


def _open(path: str, opts: LogOptions, readonly: bool) -> lmdb.Environment:
    lock_ok = True
    if readonly:
        # A reader of a directory it may not write uses no lock file (LMDB would create one).
        lock_file = os.path.join(path, LMDB_LOCK_FILE)
        lock_ok = os.access(path, os.W_OK) or (os.path.exists(lock_file) and os.access(lock_file, os.W_OK))
    try:
        return lmdb.open(
            path,
            map_size=opts.map_size,
            max_dbs=8,
            max_readers=opts.max_readers,
            readonly=readonly,
            lock=lock_ok,
            readahead=False,  # MADV_RANDOM: one page per B-tree page touched (see Prefetch)
            subdir=True,
            create=not readonly,
            mode=opts.file_mode,
            meminit=False,
            **_flags(opts),
        )
    except lmdb.Error as exc:
        raise translate(exc, path) from exc


class Prefetch:
    """Reads a record ahead, whole, before py-lmdb touches it (``LogOptions.readahead``).

    Why: the map is opened with ``MADV_RANDOM`` (LMDB's ``MDB_NORDAHEAD``), so that each
    B-tree page a cold open or a short read touches costs one page from disk, not the
    device's readahead window around it (8 MiB on this kind of VM): a reopen then reads
    what it uses, whatever the log's size. But py-lmdb touches every page of a value as it
    hands it out (its ``preload``), which without readahead is one synchronous read per
    page: a large record is read ahead first, with ``MADV_WILLNEED`` over its pages.

    Where its pages are: a record is an overflow value (LMDB's ``F_BIGDATA`` leaf node). Its
    key, which a read transaction hands out as a view into the leaf page, is preceded by the
    node's header (data size, flags, key size) and followed by the first overflow page's
    number; the value starts one page header past that page in the map. Only addresses are
    computed and a hint is given: nothing is read from them. Every prediction is checked
    against the value py-lmdb then returns (the map's base is learned or corrected from it),
    and a layout that does not match turns the prefetch off for the environment.
    """

    _F_BIGDATA = 0x01
    _PAGE_HEADER = 16
    _MADV_WILLNEED = 3
    MIN_BYTES = 4 * 4096  # smaller values: a few page faults
    _STEP = 1 << 21

    def __init__(self, env: lmdb.Environment, path: str) -> None:
        self.psize = int(env.stat()["psize"])
        self._vec = ctypes.create_string_buffer(1)  # mincore's answer for one page
        self._data_file = os.path.join(path, DATA_FILE)
        self.base: Optional[int] = None  # the map's address: found at the first large value, corrected by after()
        self._looked = False
        self.enabled = _madvise() is not None and _mincore() is not None
        self._misses = 0

    def before(self, key: Any) -> Optional[int]:
        """Read ahead the value of the leaf node whose key view is ``key`` (unless its first and
        last pages are in memory already); returns the value's predicted offset in the map
        (for :meth:`after`), or None."""
        if not self.enabled or not isinstance(key, memoryview):
            return None
        at = np.frombuffer(key, dtype=np.uint8).__array_interface__["data"][0]
        lo, hi, flags, ksize = _NODE.unpack(ctypes.string_at(at - 8, 8))
        if ksize != len(key):
            self.enabled = False  # not the node layout this expects
            return None
        size = lo | hi << 16
        if not flags & self._F_BIGDATA or size < self.MIN_BYTES:
            return None
        (pgno,) = _PGNO.unpack(ctypes.string_at(at + ksize, 8))
        offset = pgno * self.psize + self._PAGE_HEADER
        if self.base is None and not self._looked:
            self._looked = True
            self.base = _map_address(self._data_file)
        if self.base is not None:
            start, end = self.base + pgno * self.psize, self.base + offset + size
            last = end - 1 - (end - 1) % self.psize
            if not (_resident(start, self._vec) and _resident(last, self._vec)):
                madvise = _madvise()
                # in steps: the kernel reads at most its readahead window per call
                for at in range(start, end, self._STEP):
                    madvise(at, min(self._STEP, end - at), self._MADV_WILLNEED)
        return offset

    def after(self, offset: Optional[int], value: Any) -> None:
        """Check :meth:`before`'s prediction against the value handed out."""
        if offset is None:
            return
        at = np.frombuffer(value, dtype=np.uint8).__array_interface__["data"][0]
        if self.base is not None and self.base + offset == at:
            return
        self.base = at - offset  # first use, or the map was moved (resized)
        self._misses += 1
        if self._misses > 8:
            self.enabled = False
            logger.debug("record prefetch off: its predictions missed %d times", self._misses)


_MADVISE: Any = None
_MINCORE: Any = None
_NODE = struct.Struct("<HHHH")  # an LMDB node's header: data size (low, high), flags, key size
_PGNO = struct.Struct("<Q")


def _libc(name: str, argtypes: List[Any]) -> Any:
    """libc's function ``name`` returning an int, or False where it is missing."""
    found = libc()
    fn = getattr(found, name, None) if found is not None else None
    if fn is None:
        return False
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


def _mincore() -> Any:
    """libc's ``mincore`` (None where it is missing)."""
    global _MINCORE
    if _MINCORE is None:
        _MINCORE = _libc("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p])
    return _MINCORE or None


def _resident(page: int, vec: Any) -> bool:
    """Whether the map's page at address ``page`` is in memory."""
    return _mincore()(page, 1, vec) == 0 and vec.raw[0] & 1 == 1


def _map_address(data_file: str) -> Optional[int]:
    """Where this process maps ``data_file`` from its start (``/proc/self/maps``), or None."""
    try:
        st = os.stat(data_file)
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(None, 5)
                if len(fields) == 6 and int(fields[2], 16) == 0 and int(fields[4]) == st.st_ino \
                        and os.path.realpath(fields[5].rstrip("\n")) == os.path.realpath(data_file):
                    return int(fields[0].split("-")[0], 16)
    except (OSError, ValueError):
        pass
    return None


def _madvise() -> Any:
    """libc's ``madvise`` (None where it is missing)."""
    global _MADVISE
    if _MADVISE is None:
        _MADVISE = _libc("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
    return _MADVISE or None


def open_dbs(env: lmdb.Environment, names: Sequence[str], txn: Optional[lmdb.Transaction] = None,
             create: bool = False) -> Dict[str, Any]:
    """Open the named databases (inside ``txn`` when given: creation then commits with it).

    Raises:
        lmdb.NotFoundError: one is missing and ``create`` is False.
    """
    return {name: env.open_db(name.encode(), txn=txn, create=create) for name in names}


def acquire(path: str, opts: LogOptions, readonly: bool) -> SharedEnv:
    """This process's environment at ``path``: shared if open already, else opened. The named
    databases are opened by the caller (:func:`open_dbs`) into ``SharedEnv.dbs``.

    Raises:
        ReadOnlyLogError: it is open read-only here and a writable handle was asked for.
    """
    with _REGISTRY_LOCK:
        shared = _REGISTRY.get(path)
        if shared is not None and shared.pid != os.getpid():
            del _REGISTRY[path]  # inherited through fork: never touch the parent's environment
            shared = None
        if shared is not None:
            if shared.readonly and not readonly:
                raise ReadOnlyLogError(
                    f"{path} is open read-only in this process; close those handles before opening it for writing"
                )
            shared.refs += 1
            return shared
        env = _open(path, opts, readonly)
        shared = SharedEnv(env=env, dbs={}, pid=os.getpid(), readonly=readonly, refs=1, lock=threading.RLock(),
                           opts=opts, db_names=(), lock_ino=_lock_identity(path),
                           prefetch=Prefetch(env, path) if opts.readahead else None)
        _REGISTRY[path] = shared
        return shared


def release(path: str, shared: SharedEnv) -> None:
    """Drop one reference; the last one closes the environment (in the opening process)."""
    with _REGISTRY_LOCK:
        shared.refs -= 1
        if shared.refs > 0:
            return
        if _REGISTRY.get(path) is shared:
            del _REGISTRY[path]
    if shared.pid == os.getpid():
        with shared.lock:
            shared.env.close()


def reopen(path: str, shared: SharedEnv) -> None:
    """Close and reopen a broken environment in place (caller holds ``shared.lock``)."""
    try:
        shared.env.close()
    except lmdb.Error:
        pass
    shared.env = _open(path, shared.opts, shared.readonly)
    try:
        shared.dbs = open_dbs(shared.env, shared.db_names)
    except lmdb.Error as exc:
        raise translate(exc, path) from exc
    shared.broken = False
    logger.warning("reopened the LMDB environment of %s after an I/O failure", path)


def grow(path: str, shared: SharedEnv, max_map_size: int) -> None:
    """Double the map (up to ``max_map_size``). Caller holds ``shared.lock``, no open txn.

    Raises:
        LogFullError: the map is at ``max_map_size`` already.
    """
    cur = int(shared.env.info()["map_size"])
    new = min(cur * 2, max_map_size)
    if new <= cur:
        raise LogFullError(f"{path}: the map is full at {cur} bytes and max_map_size is {max_map_size}: raise max_map_size")
    logger.info("growing the LMDB map of %s from %d to %d bytes", path, cur, new)
    try:
        shared.env.set_mapsize(new)
    except lmdb.Error as exc:
        raise translate(exc, path) from exc


def _lock_identity(path: str) -> Optional[Tuple[int, int]]:
    try:
        st = os.stat(os.path.join(path, LMDB_LOCK_FILE))
    except OSError:
        return None
    return st.st_dev, st.st_ino


def check_lock_file(path: str, shared: SharedEnv) -> None:
    """Before a write: LMDB's ``lock.mdb`` must still be the file this process opened. Deleted
    or replaced, processes that open the log afterwards get a lock table of their own and
    LMDB no longer serialises their writes with ours (that corrupted the consumers database).

    Raises:
        LogLockedError: it was deleted or replaced.
    """
    if shared.lock_ino is not None and _lock_identity(path) != shared.lock_ino:
        raise LogLockedError(
            f"{path}: LMDB's {LMDB_LOCK_FILE} was deleted or replaced while this process had the log open, so "
            "writers are no longer serialised: stop every process that has the log open, then open it again. "
            "Never delete lock.mdb of a log in use"
        )


def mapping_pids(path: str) -> List[int]:
    """Pids of the other processes that map ``<path>/data.mdb`` (Linux ``/proc``), found
    without relying on ``lock.mdb`` (which may have been deleted)."""
    try:
        st = os.stat(os.path.join(path, DATA_FILE))
    except OSError:
        return []
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x} {st.st_ino} "
    out = []
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                if any(want in line for line in f):
                    out.append(int(pid))
        except OSError:
            continue
    return sorted(out)


def open_in_process(path: str) -> bool:
    """Whether this process has the environment at ``path`` open."""
    with _REGISTRY_LOCK:
        shared = _REGISTRY.get(os.path.realpath(os.fspath(path)))
        return shared is not None and shared.pid == os.getpid()


class ConsumerClaims:
    """The consumer names this process uses in one log (:func:`acquire_consumer_lock`)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fds: Dict[str, int] = {}

    def claim(self, name: str, action: str) -> None:
        """Claim ``name`` (a no-op when held already).

        Raises:
            LogLockedError: another user holds it.
        """
        if name not in self._fds:
            self._fds[name] = acquire_consumer_lock(self.path, name, action)

    def release(self, name: str) -> None:
        fd = self._fds.pop(name, None)
        if fd is not None:
            release_lock(fd)

    def release_all(self) -> None:
        for name in list(self._fds):
            self.release(name)
