"""Faults: disk full, read-only filesystem, stale reader slots, corrupted records.

Disk-full and read-only cases mount a small tmpfs (needs root / CAP_SYS_ADMIN); they are
skipped with the reason when mounting is not permitted.
"""

import os
import re
import signal
import subprocess

import pytest
import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta.errors import CorruptRecordError, LogFullError, ReadOnlyLogError, WriterError
from persistent_delta import LmdbDeltaStore
from persistent_delta.config import LogOptions
from persistent_delta.log.deltalog import DeltaLog
from persistent_delta.log.records import AppendRecord
from persistent_delta.trainer.operations import StepWrite
from persistent_delta.trainer.writer import BackgroundWriter
from procs import fill_filesystem, popen_python


@pytest.fixture
def small_fs(tmp_path):
    """A 6 MiB tmpfs, unmounted afterwards."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode}): disk-full tests need root")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_disk_full_is_a_clear_error_and_loses_nothing(small_fs):
    log_dir = os.path.join(small_fs, "log")
    opts = LogOptions(map_size=64 << 20)
    store = LmdbDeltaStore(log_dir, UpdateMode.FIRST, options=opts)
    committed = 0
    for b in range(3):
        store.append(b, "t", torch.arange(1000) + b, torch.full((1000, 8), float(b)))
        committed += 1
    filler = fill_filesystem(small_fs)
    with pytest.raises(LogFullError, match="no space left"):
        for b in range(3, 200):
            store.append(b, "t", torch.arange(20000) + b, torch.full((20000, 8), float(b)))
            committed += 1
    # nothing committed was lost, and the failed append left nothing behind
    got = store.per_fqn_lookups["t"]
    assert [lk.batch_idx for lk in got] == list(range(committed))
    # once space returns, the log is usable again
    os.unlink(filler)
    store.append(committed, "t", torch.tensor([1, 2]), torch.zeros(2, 8))
    assert store.per_fqn_lookups["t"][-1].batch_idx == committed
    store.close()
    with LmdbDeltaStore(log_dir, UpdateMode.FIRST, options=opts) as again:
        assert [lk.batch_idx for lk in again.per_fqn_lookups["t"]] == list(range(committed + 1))


def test_writer_reports_disk_full_keeps_the_queue_and_resumes(small_fs):
    """The training loop chooses: fail (WriterError on the next submit) or wait (resume())."""
    log = DeltaLog(os.path.join(small_fs, "log"), update_mode="none", options=LogOptions(map_size=64 << 20))
    writer = BackgroundWriter(log, UpdateMode.NONE)
    writer.submit(StepWrite(records=[AppendRecord(0, "t", torch.arange(100))]))
    writer.barrier()
    filler = fill_filesystem(small_fs)
    writer.submit(StepWrite(records=[AppendRecord(1, "t", torch.arange(200_000))]))
    with pytest.raises(WriterError, match="No space|no space") as info:
        writer.barrier()
    assert isinstance(info.value.__cause__, LogFullError)
    assert isinstance(info.value, LogFullError)  # `except LogFullError` catches it too
    with pytest.raises(WriterError):
        writer.submit(StepWrite(records=[AppendRecord(2, "t", torch.arange(10))]))
    assert writer.stats()["queue_depth"] == 1  # the failed step is kept, not dropped
    os.unlink(filler)
    writer.resume()  # retries the kept step
    writer.submit(StepWrite(records=[AppendRecord(2, "t", torch.arange(10))]))
    writer.close()
    batches = log.read(lambda r: [b for b, _, _ in r.iter_record_keys(r.table("t").table_id)])
    assert batches == [0, 1, 2]
    log.close()


def test_read_only_filesystem(small_fs):
    log_dir = os.path.join(small_fs, "log")
    with LmdbDeltaStore(log_dir) as store:
        store.append(0, "t", torch.tensor([4, 2]))
    subprocess.run(["mount", "-o", "remount,ro", small_fs], check=True)
    with pytest.raises(ReadOnlyLogError, match="not writable"):
        LmdbDeltaStore(log_dir)
    with LmdbDeltaStore(log_dir, readonly=True) as ro:  # readers still work
        assert ro.get_unique()["t"].ids.tolist() == [2, 4]


def test_stale_reader_slots_of_a_killed_reader_are_cleared(log_dir):
    with LmdbDeltaStore(log_dir) as store:
        store.append(0, "t", torch.arange(10))
        reader = popen_python(
            """
            import sys, time
            from persistent_delta.log.deltalog import DeltaLog
            log = DeltaLog(sys.argv[1], readonly=True)
            def hold(r):
                print("HOLDING", flush=True)
                time.sleep(60)
            log.read(hold)
            """,
            log_dir,
        )
        assert reader.stdout.readline().strip() == "HOLDING"
        reader.send_signal(signal.SIGKILL)
        reader.wait()
        assert store.log.reader_check() >= 1
        for b in range(1, 20):  # the writer is not held back by the dead reader
            store.append(b, "t", torch.arange(10) + b)
        assert len(store.per_fqn_lookups["t"]) == 20


def test_corrupted_record_is_reported_not_returned(log_dir):
    marker = torch.full((64,), 1234.5678, dtype=torch.float64)
    with LmdbDeltaStore(log_dir, UpdateMode.LAST) as store:
        store.append(0, "t", torch.arange(64), marker.reshape(64, 1))
        store.append(1, "u", torch.arange(3), torch.zeros(3, 1, dtype=torch.float64))
    data = os.path.join(log_dir, "data.mdb")
    raw = bytearray(open(data, "rb").read())
    pattern = marker.numpy().tobytes()[:16]
    pos = raw.find(pattern)
    assert pos > 0
    while pos >= 0:  # every copy (LMDB's copy-on-write leaves stale page versions around)
        raw[pos + 5] ^= 0x01
        pos = raw.find(pattern, pos + 16)
    open(data, "wb").write(bytes(raw))
    with LmdbDeltaStore(log_dir, UpdateMode.LAST) as store:
        # the error names the file and the record, on both read paths (rows, and whole records)
        where = re.escape(f"{data}: lookups record (table 't', batch 0, seq 0): record checksum mismatch")
        with pytest.raises(CorruptRecordError, match=where):
            store.get_unique()
        with pytest.raises(CorruptRecordError, match=where):
            store.per_fqn_lookups
        # the undamaged table still reads
        rows = store.log.read(lambda r: [rec.ids.tolist() for rec in r.iter_records(r.table("u").table_id)])
        assert rows == [[0, 1, 2]]


@pytest.mark.dist
def test_a_tracker_recovers_from_a_full_disk_with_resume(small_fs):
    from harness import run_spawn
    from tracker_cases import disk_full_resume_case

    (r,) = run_spawn(disk_full_resume_case, 1, os.path.join(small_fs, "log"), small_fs)
    assert r["failed_at"] is not None and r["full"], r  # a WriterError caused by LogFullError
    # every batch trained is in the log: the failed one was kept and committed by resume()
    assert r["stored"] == list(range(1, r["curr"] + 1)), r
