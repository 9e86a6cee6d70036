"""``vacuum``: reclaim the disk space of deleted records with a compacting copy.

LMDB never shrinks its data file: pages freed by retention are reused, not returned. Vacuum
rewrites each rank's ``data.mdb`` compacted, and only while no other process has the log open:

1. take the writer lock (non-blocking ``flock`` on ``writer.lock``): refused while a trainer or
   store writes the log, and no writer can start until vacuum is done;
2. refuse while any other process has the LMDB environment open (consumers, tools, idle or
   not): every opener holds a shared ``fcntl`` lock on byte 0 of ``lock.mdb`` for as long as
   the environment is open, which ``F_GETLK`` reports (with the holder's pid) without taking
   it; and refuse while this process has the log open itself;
3. open the log read-only, ``DeltaLog.copy_compacted`` into a temp directory inside the log
   directory (same file system), fsync; check that no reader slot of another process appeared
   and no transaction was committed during the copy (a consumer-role offset commit); close;
   check step 2 again; then ``rename`` the copy over ``data.mdb`` (atomic) and fsync the
   directory. The next opener of the environment re-initialises ``lock.mdb`` from the new file.

A process that opens the log between the last check and the rename would keep reading the old
file; the window is the few microseconds of a lock test and a rename.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from typing import List, Optional

from persistent_delta.consumer import PathLike, rank_paths
from persistent_delta.errors import LogLockedError
from persistent_delta.log import DATA_FILE, DeltaLog, acquire_writer_lock, open_in_process

logger = logging.getLogger(__name__)


@dataclass
class VacuumResult:
    """One rank's vacuum: file size before and after."""

    rank: int
    path: str
    bytes_before: int
    bytes_after: int


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _take_writer_lock(path: str) -> int:
    return acquire_writer_lock(path, action="vacuum it (stop the trainer or close the store first)")


_LMDB_LOCK_FILE = "lock.mdb"
# struct flock on Linux: short l_type, short l_whence, off_t l_start, off_t l_len, pid_t l_pid
# (32 bytes with padding).
_FLOCK = struct.Struct("hhqqi4x")


def other_opener(path: str) -> Optional[int]:
    """The pid of another process that has the LMDB environment at ``path`` open, or None.

    Must not be called while this process has it open: closing the descriptor used here
    would drop this process's own LMDB locks on ``lock.mdb`` (POSIX lock semantics).
    """
    lock = os.path.join(path, _LMDB_LOCK_FILE)
    if not os.path.exists(lock):
        return None
    fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
    try:
        probe = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
        l_type, _, _, _, pid = _FLOCK.unpack(fcntl.fcntl(fd, fcntl.F_GETLK, probe))
    finally:
        os.close(fd)
    return None if l_type == fcntl.F_UNLCK else int(pid)


def _refuse_if_open(path: str) -> None:
    if open_in_process(path):
        raise LogLockedError(f"{path}: this process has the log open; close those handles first")
    pid = other_opener(path)
    if pid is not None:
        raise LogLockedError(
            f"{path}: process {pid} has the log open (a consumer or tool); stop it and run vacuum again"
        )


def vacuum_log(path: str, rank: int = 0) -> VacuumResult:
    """Compact one log directory in place (see the module docs).

    Raises:
        LogLockedError: a writer or another process has the log open, or it changed meanwhile.
    """
    data = os.path.join(path, DATA_FILE)
    before = os.path.getsize(data)
    lock_fd = _take_writer_lock(path)
    try:
        _refuse_if_open(path)
        tmp = tempfile.mkdtemp(prefix=".vacuum-", dir=path)
        try:
            with DeltaLog(path, readonly=True) as log:
                txn_before = log.stat()["last_txnid"]
                log.copy_compacted(tmp)
                _fsync_path(os.path.join(tmp, DATA_FILE))
                others = [p for p in log.reader_pids() if p != os.getpid()]
                if others:
                    raise LogLockedError(f"{path}: processes {others} opened the log during vacuum; run it again")
                if log.stat()["last_txnid"] != txn_before:
                    raise LogLockedError(f"{path}: the log was written during vacuum; run it again")
            _refuse_if_open(path)
            os.replace(os.path.join(tmp, DATA_FILE), data)
            _fsync_path(path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        os.ftruncate(lock_fd, 0)
        os.close(lock_fd)
    after = os.path.getsize(data)
    logger.info("vacuum %s: %d -> %d bytes", path, before, after)
    return VacuumResult(rank=rank, path=path, bytes_before=before, bytes_after=after)


def vacuum(root: PathLike) -> List[VacuumResult]:
    """Compact every rank's log under ``root``; refuses (before touching a rank) while any
    process has that rank's log open.

    Raises:
        LogLockedError: see :func:`vacuum_log`.
        NotALogError: ``root`` holds no log.
    """
    return [vacuum_log(path, rank) for rank, path in rank_paths(root).items()]
