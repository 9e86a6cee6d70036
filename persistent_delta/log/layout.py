"""Where things live on disk: rank directories, file names, atomic writes.

Owns: the directory layout. A log root holds one log per rank, ``<root>/rank-<r>/``; a log
directory holds LMDB's ``data.mdb`` and ``lock.mdb`` plus persistent_delta's ``writer.lock``.
A root that is itself a log directory (a plain :class:`~persistent_delta.LmdbDeltaStore`) is
rank 0. Files written outside LMDB go through :func:`atomic_write_bytes`.

**Ownership and modes.** Directories the library creates get the mode it intends whatever the
umask (:func:`make_dirs`: each one it creates, the root included, is chmodded). A rank
directory, or its data file, owned by another uid than the log root is refused
(:func:`check_owner`): under a root writable by others, another user could otherwise rename a
rank away and plant a log of their own.
"""

from __future__ import annotations

import enum
import os
import re
import tempfile
import time
from typing import Dict, Optional, Sequence, Union

from persistent_delta.errors import DamagedLogError, LogAccessError, LogOwnershipError, NotALogError, RankDirectoryError

PathLike = Union[str, "os.PathLike[str]"]

DATA_FILE = "data.mdb"  # LMDB's data file
LMDB_LOCK_FILE = "lock.mdb"  # LMDB's reader table / lock file
WRITER_LOCK_FILE = "writer.lock"  # persistent_delta's one-writer flock, holding the writer's pid
CONSUMER_LOCK_DIR = "consumer-locks"  # one flock file per active consumer name, holding its user's pid
_RANK_DIR = re.compile(r"^rank-(\d+)$")


def rank_dir(root: PathLike, rank: int) -> str:
    """The log directory of ``rank`` under ``root``."""
    return os.path.join(os.fspath(root), f"rank-{rank}")


def rank_of_dir(path: PathLike) -> int | None:
    """The rank a ``rank-<r>`` directory name says, or None for another name."""
    m = _RANK_DIR.match(os.path.basename(os.path.normpath(os.fspath(path))))
    return int(m.group(1)) if m else None


def consumer_lock_file(path: PathLike, name: str) -> str:
    """The lock file of consumer ``name`` in the log directory ``path`` (the name hex-encoded:
    names may hold ``/`` and ``:``)."""
    return os.path.join(os.fspath(path), CONSUMER_LOCK_DIR, name.encode().hex() + ".lock")


class FileState(enum.Enum):
    """What a directory holds before anything is opened (see :func:`file_state`)."""

    MISSING = "missing"  # no directory, or no data.mdb: not a log yet
    EMPTY = "empty"  # a 0-byte data.mdb (a creation killed before LMDB's first write): not a log yet
    PRESENT = "present"  # a non-empty data.mdb: a log, a foreign LMDB file, or a damaged one


def file_state(path: PathLike) -> FileState:
    """Classify ``path`` by its files alone. Whether a present file is ours is decided when
    it is opened (:func:`persistent_delta.log.lmdbenv.probe`)."""
    try:
        size = os.path.getsize(os.path.join(os.fspath(path), DATA_FILE))
    except OSError:
        return FileState.MISSING
    return FileState.EMPTY if size == 0 else FileState.PRESENT


def check_root(root: PathLike) -> str:
    """``root`` as a string, refused when it is one rank's log directory of a job (a ``rank-<r>``
    directory holding a ``data.mdb``) rather than the job's root: the job's other ranks, and
    its world size, are read from the root, so a rank's directory would read as a job whose
    ranks never appear.

    Raises:
        RankDirectoryError: ``root`` is a rank's log directory (the message names its parent).
    """
    root = os.fspath(root)
    rank = rank_of_dir(root)
    if rank is not None and file_state(root) is not FileState.MISSING:
        parent = os.path.dirname(os.path.normpath(root)) or os.curdir
        raise RankDirectoryError(
            f"{root} is the log of rank {rank} of a job, not a job's log root: pass its parent, {parent}, "
            f"which holds every rank's log (rank-<r>/) (a reader, consumer or shipper reads that rank only "
            f"with ranks=[{rank}])",
            path=root, rank=rank, root=parent)
    return root


#: How long a live reader (a consumer, a shipper, the exporter) takes an empty data file beside other
#: ranks' logs for a creation in progress before it calls it damage (:func:`rank_paths`).
EMPTY_RANK_GRACE_S = 5.0


def rank_paths(root: PathLike, empty_grace_s: float = 0.0) -> Dict[int, str]:
    """The log directory of every rank under ``root``, by rank (ascending).

    A ``root`` that is itself a log directory (a plain store's) is rank 0; a rank's directory of
    a job (``rank-<r>``) is refused (:func:`check_root`). A rank whose ``data.mdb`` is empty
    (0 bytes) while other ranks hold logs is a wiped file or a creation killed midway, and the job
    is refused rather than read without that rank -- except, for ``empty_grace_s`` seconds after
    the file last changed, by a live reader that looks again later (pass
    :data:`EMPTY_RANK_GRACE_S`): LMDB writes a new file's first pages as it creates it, so a
    rank starting up shows an empty file for a moment. A one-shot tool (verify, offsets) keeps
    the default 0: it must never report a job with a missing rank as healthy.

    Args:
        root: the log root.
        empty_grace_s: how long an empty data file is skipped as a creation in progress.

    Raises:
        NotALogError: ``root`` holds no log.
        DamagedLogError: a rank's data file is empty while other ranks hold logs.
        RankDirectoryError: ``root`` is a rank's log directory, not the job's root.
    """
    root = check_root(root)
    if file_state(root) is FileState.PRESENT:
        return {0: root}
    try:
        root_uid = os.stat(root).st_uid
        names = os.listdir(root) if os.path.isdir(root) else None
    except PermissionError as exc:
        raise LogAccessError(_denied(root, exc)) from exc
    except OSError:
        names = None
    if names is None:
        raise NotALogError(f"{root}: no such directory; pass the log root (the directory holding rank-<r>/)")
    found = {}
    empty = []
    for name in names:
        m = _RANK_DIR.match(name)
        if m and not os.access(os.path.join(root, name), os.R_OK | os.X_OK):
            raise LogAccessError(_denied(os.path.join(root, name), None))
        state = file_state(os.path.join(root, name)) if m else None
        if state is FileState.PRESENT:
            check_owner(os.path.join(root, name), root_uid)
            found[int(m.group(1))] = os.path.join(root, name)  # type: ignore[union-attr]
        elif state is FileState.EMPTY:
            empty.append(os.path.join(root, name))
    for path in empty:
        data = os.path.join(path, DATA_FILE)
        try:
            age = time.time() - os.stat(data).st_mtime
        except OSError:
            continue  # gone meanwhile
        if found and (empty_grace_s <= 0 or age >= empty_grace_s):
            young = f" (or, changed {max(0.0, age):.1f} s ago, a creation still in progress: look again in a few seconds)"
            raise DamagedLogError(
                f"{data}: empty (0 bytes) while other ranks of the job hold logs: a wiped file or a creation killed "
                f"midway{young if age < EMPTY_RANK_GRACE_S else ''}; this rank's data is lost. Restore it from a copy, "
                "or move the job's logs away and start afresh")
    if not found:
        raise NotALogError(
            f"{root} holds no persistent_delta log (expected {root}/rank-<r>/data.mdb); check the path, "
            "or start the trainer first"
        )
    return dict(sorted(found.items()))


def _denied(path: str, exc: Optional[OSError]) -> str:
    return (f"{path}: permission denied{f' ({exc.strerror})' if exc is not None else ''}: this user (uid {os.geteuid()}) "
            "may not read the log. Run as its owner, or have it created with group access "
            "(PERSISTENT_DELTA_GROUP_ACCESS=1) and join its group")


def check_owner(path: PathLike, uid: int) -> None:
    """Refuse a rank directory (or its data file) that another uid than ``uid`` (the log
    root's owner) owns, or that is a symbolic link.

    Raises:
        LogOwnershipError: it is.
    """
    p = os.fspath(path)
    for q in (p, os.path.join(p, DATA_FILE)):
        try:
            st = os.lstat(q)
        except FileNotFoundError:
            continue
        if os.path.islink(q) or st.st_uid != uid:
            what = "a symbolic link" if os.path.islink(q) else f"owned by uid {st.st_uid}"
            raise LogOwnershipError(
                f"{q} is {what}, but its log root is owned by uid {uid}: another user may have planted it; it was "
                "not read. Check who wrote it, remove it, and keep the log root writable by its owner only")


def make_dirs(path: PathLike, mode: int) -> None:
    """Create ``path`` and its missing parents, each with exactly ``mode`` (not narrowed or
    widened by the umask); directories that exist are left as they are."""
    p = os.path.abspath(os.fspath(path))
    missing = []
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            if not os.path.isdir(d):
                raise
            continue  # another process made it: its mode is its creator's
        os.chmod(d, mode)


def fsync_path(path: str) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temp file in the same directory, fsync, rename,
    fsync of the directory. A crash never leaves a partial file under the final name."""
    atomic_write_chunks(path, [data])


def atomic_write_chunks(path: str, chunks: Sequence[Union[bytes, memoryview]]) -> None:
    """Write the buffers ``chunks``, one after another, to ``path`` atomically, as
    :func:`atomic_write_bytes` does: each is written from where it lies (no concatenation)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                while view:
                    view = view[f.write(view):]
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_path(directory)
