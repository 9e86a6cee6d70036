"""``upgrade``: rewrite logs of an older format version in place.

Owns: the version-to-version record rewrite. Format 1 -> 2 (see :mod:`persistent_delta.log.codec`):
every record of both channels is checked with its format-1 checksum and sealed with the
format-2 one (covering its key), and the version is set, in one write transaction per rank, so a
crash leaves each rank at the old version or the new one, never between. Needs the writer lock:
stop the trainer first. A record that fails its format-1 checksum stops the upgrade of that rank
(nothing is changed there). Dry run by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional

from persistent_delta.log import codec
from persistent_delta.log.layout import PathLike, rank_paths
from persistent_delta.log.deltalog import DeltaLog, WriteTxn
from persistent_delta.log.schema import CHANNELS, DB_OF_CHANNEL, META_FORMAT_VERSION


@dataclass
class UpgradeResult:
    """One rank: the version found, the version now, records rewritten."""

    rank: int
    path: str
    from_version: int
    to_version: int
    records: int
    applied: bool


_PROGRESS_EVERY = 4096  # records between progress calls: a call per record would cost more than the bar shows


def _rewrite(w: WriteTxn, progress: Optional[Callable[[int], None]] = None) -> int:
    n = 0
    for channel in CHANNELS:
        cur = w.txn.cursor(db=w._dbs[DB_OF_CHANNEL[channel]])
        for key, value in cur:
            cur.put(bytes(key), codec.upgrade_v1_value(value, bytes(key)))
            n += 1
            if progress is not None and n % _PROGRESS_EVERY == 0:
                progress(_PROGRESS_EVERY)
    if progress is not None and n % _PROGRESS_EVERY:
        progress(n % _PROGRESS_EVERY)
    w.set_meta(META_FORMAT_VERSION, codec.FORMAT_VERSION)
    return n


def upgrade(root: PathLike, execute: bool = False, progress: Optional[Callable[[int], None]] = None
            ) -> List[UpgradeResult]:
    """Upgrade every rank's log under ``root`` to this release's format.

    Args:
        root: the log root.
        execute: rewrite (default: dry run, counting the records).
        progress: called with the number of records rewritten since its last call.

    Raises:
        LogLockedError: a writer (the trainer) has a log open.
        CorruptRecordError: a record fails its old checksum (that rank is left unchanged).
        FormatMismatchError: a version this release cannot upgrade.
        NotALogError: a rank directory holds an LMDB file of another application (nothing is
            created or changed there).
    """
    out = []
    for rank, path in rank_paths(root).items():
        # read-only first: a file that is not a persistent_delta log is refused before anything
        # (the writer lock file) is created in its directory
        with DeltaLog(path, readonly=True, writer_lock=False, formats=(1, codec.FORMAT_VERSION)):
            pass
        with DeltaLog(path, create=False, formats=(1, codec.FORMAT_VERSION)) as log:
            version = int(log.read(lambda r: r.meta(META_FORMAT_VERSION), refresh_tables=False))
            if version == codec.FORMAT_VERSION:
                out.append(UpgradeResult(rank, path, version, version, 0, False))
                continue
            if not execute:
                n = log.read(lambda r: sum(1 for c in CHANNELS for _ in r.iter_raw(c)), refresh_tables=False)
                out.append(UpgradeResult(rank, path, version, version, n, False))
                continue
            n = log.write(lambda w: _rewrite(w, progress))
            log.flush()
            out.append(UpgradeResult(rank, path, version, codec.FORMAT_VERSION, n, True))
    return out
