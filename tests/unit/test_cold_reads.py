"""Cold reads read what they use: a reopened log's last batch costs the pages it touches, not the
log behind it, and large records are read ahead whole (``LogOptions.readahead``)."""

from __future__ import annotations

import os

import pytest
import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta import LmdbDeltaStore
from persistent_delta.log.deltalog import DeltaLog
from persistent_delta.log.records import AppendRecord, read_unique

TABLES = ["t0", "t1", "t2"]
BIG_ROWS = 8192  # 8192 x (8 + 64 x 4) bytes: a 2.2 MB record
BATCHES = 6


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def _drop_cache(path: str) -> None:
    fd = os.open(os.path.join(path, "data.mdb"), os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _cold_reads_counted(path: str) -> bool:
    """Whether this filesystem's reads show in /proc/self/io after a cache drop (not tmpfs)."""
    _drop_cache(path)
    before = _read_bytes()
    with open(os.path.join(path, "data.mdb"), "rb") as f:
        f.read(1 << 16)
    return _read_bytes() > before


def _build(path: str) -> int:
    """A log of large records (every table, every batch) and a last batch of 10 rows a table;
    returns the last batch's index."""
    g = torch.Generator().manual_seed(0)
    with LmdbDeltaStore(path, UpdateMode.FIRST) as store:
        for b in range(BATCHES):
            ids = torch.randperm(200_000, generator=g)[:BIG_ROWS]
            store.append_many([AppendRecord(b, t, ids, torch.randn(BIG_ROWS, 64, generator=g)) for t in TABLES])
        store.append_many([AppendRecord(BATCHES, t, torch.arange(10), torch.ones(10, 64)) for t in TABLES])
        store.flush()
    return BATCHES


def test_a_cold_reopen_reads_only_the_last_batch_it_asks_for(tmp_path: "os.PathLike[str]") -> None:
    path = os.path.join(tmp_path, "log")
    last = _build(path)
    if not _cold_reads_counted(path):
        pytest.skip("this filesystem's reads do not show in /proc/self/io (tmpfs?)")
    _drop_cache(path)
    before = _read_bytes()
    with LmdbDeltaStore(path, UpdateMode.FIRST) as store:
        rows = store.get_unique(last)
    read = _read_bytes() - before
    assert {t: r.ids.tolist() for t, r in rows.items()} == {t: list(range(10)) for t in TABLES}
    # the B-tree pages it walks and three 2.6 KB records: tens of KB; never a neighbouring
    # 2.2 MB record, nor the OS's readahead window around each page touched
    assert read < 512 << 10, f"read {read} bytes from disk for a last batch of 3 x 10 rows"


def test_large_records_are_read_ahead_whole_and_read_right(tmp_path: "os.PathLike[str]") -> None:
    path = os.path.join(tmp_path, "log")
    _build(path)

    def everything(log: DeltaLog) -> dict:
        rows = log.read(lambda r: read_unique(r, UpdateMode.FIRST, 0, BATCHES))
        return {t: (u.ids, u.states) for t, u in rows.items()}

    with DeltaLog(path, readonly=True) as log:
        warm = everything(log)
    counted = _cold_reads_counted(path)
    _drop_cache(path)
    before = _read_bytes()
    with DeltaLog(path, readonly=True) as log:
        cold = everything(log)
        prefetch = log._shared.prefetch
        assert prefetch is not None and prefetch.enabled and prefetch.base is not None
    read = _read_bytes() - before
    assert all(torch.equal(warm[t][0], cold[t][0]) and torch.equal(warm[t][1], cold[t][1]) for t in TABLES)
    if counted:  # each record's pages once (the OS's readahead read about twice the records)
        stored = len(TABLES) * BATCHES * BIG_ROWS * (8 + 64 * 4)
        assert read < 1.25 * stored, f"read {read} bytes from disk for {stored} bytes of records"
