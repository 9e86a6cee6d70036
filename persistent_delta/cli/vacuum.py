"""``vacuum``: reclaim the disk space of deleted records with a compacting copy.

Owns: the compacting copy and its refusal while the log is open.

LMDB never shrinks its data file: pages freed by retention are reused, not returned. Vacuum
rewrites each rank's ``data.mdb`` compacted, and only while no other process has the log open
(a dry run unless ``execute``, ``--execute``: the checks of steps 1 and 2, nothing written):

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

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable, List, Optional

from persistent_delta.errors import LogLockedError
from persistent_delta.log.layout import DATA_FILE, PathLike, fsync_path, rank_paths
from persistent_delta.log.lmdbenv import acquire_writer_lock, mapping_pids, open_in_process, other_opener, release_lock
from persistent_delta.log.deltalog import DeltaLog

logger = logging.getLogger(__name__)


@dataclass
class VacuumResult:
    """One rank's vacuum: file size before and after."""

    rank: int
    path: str
    bytes_before: int
    bytes_after: Optional[int]  # None in a dry run (known once the copy is written)
    applied: bool = True


def _take_writer_lock(path: str) -> int:
    return acquire_writer_lock(path, action="vacuum it (stop the trainer or close the store first)")


def _refuse_if_open(path: str) -> None:
    if open_in_process(path):
        raise LogLockedError(f"{path}: this process has the log open; close those handles first")
    pid = other_opener(path)
    if pid is None:  # lock.mdb may be gone: look for processes that map the data file
        pid = next(iter(mapping_pids(path)), None)
    if pid is not None:
        raise LogLockedError(
            f"{path}: process {pid} has the log open (a consumer or tool); stop it and run vacuum again"
        )


def vacuum_log(path: str, rank: int = 0, execute: bool = True) -> VacuumResult:
    """Compact one log directory in place (see the module docs).

    Args:
        path: the rank's log directory.
        rank: its rank (for the result).
        execute: compact; False: a dry run -- the same refusals, nothing written.

    Raises:
        LogLockedError: a writer or another process has the log open, or it changed meanwhile.
        NotALogError: an LMDB file of another application (nothing is created there).
    """
    data = os.path.join(path, DATA_FILE)
    before = os.path.getsize(data)
    with DeltaLog(path, readonly=True):  # a file that is not ours is refused before writer.lock is created
        pass
    lock_fd = _take_writer_lock(path)
    try:
        _refuse_if_open(path)
        if not execute:
            return VacuumResult(rank=rank, path=path, bytes_before=before, bytes_after=None, applied=False)
        tmp = tempfile.mkdtemp(prefix=".vacuum-", dir=path)
        try:
            with DeltaLog(path, readonly=True) as log:
                txn_before = log.stat()["last_txnid"]
                log.copy_compacted(tmp)
                fsync_path(os.path.join(tmp, DATA_FILE))
                others = [p for p in log.reader_pids() if p != os.getpid()]
                if others:
                    raise LogLockedError(f"{path}: processes {others} opened the log during vacuum; run it again")
                if log.stat()["last_txnid"] != txn_before:
                    raise LogLockedError(f"{path}: the log was written during vacuum; run it again")
            _refuse_if_open(path)
            os.replace(os.path.join(tmp, DATA_FILE), data)
            fsync_path(path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        release_lock(lock_fd)
    after = os.path.getsize(data)
    logger.info("vacuum %s: %d -> %d bytes", path, before, after)
    return VacuumResult(rank=rank, path=path, bytes_before=before, bytes_after=after)


def vacuum(root: PathLike, progress: Optional[Callable[[int, int], None]] = None,
           execute: bool = False) -> List[VacuumResult]:
    """Compact every rank's log under ``root``; refuses (before touching a rank) while any
    process has that rank's log open.

    Args:
        root: the log root.
        progress: called with (ranks done, ranks) before the first rank and after each.
        execute: compact (default: a dry run: the same checks and refusals, nothing written).

    Raises:
        LogLockedError: see :func:`vacuum_log`.
        NotALogError: ``root`` holds no log.
    """
    paths = rank_paths(root)
    out: List[VacuumResult] = []
    for rank, path in paths.items():
        if progress is not None:
            progress(len(out), len(paths))
        out.append(vacuum_log(path, rank, execute))
    if progress is not None:
        progress(len(out), len(paths))
    return out
