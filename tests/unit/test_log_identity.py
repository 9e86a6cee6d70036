"""A log's identity (log id + creation stamp): a start afresh gives a new, later one and a log
whose batch numbers start again at 0; a log written without a creation time gets one from its
next writer; shard files record the identity of the log they were taken from."""

from __future__ import annotations

import os

import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta import DeltaReader
from persistent_delta.log.deltalog import DeltaLog
from persistent_delta.log.schema import META_CREATED_TIME, LogIdentity, TrackerMeta
from persistent_delta.log.shard_files import shard_identities
from persistent_delta.trainer.restore import open_tracker_log
from persistent_delta.trainer.save_shards import save_local_shards
from logs import fill_store


def _records(b: int):
    return [("t", torch.arange(4) + b, torch.full((4, 2), float(b)))]


def _identity(path: str) -> LogIdentity:
    with DeltaLog(path, readonly=True, writer_lock=False) as log:
        return log.read(lambda r: r.identity())


def _start_afresh(path: str) -> None:
    want = TrackerMeta("embedding", UpdateMode.LAST.value, ["t"], rank=0, world_size=1)
    with DeltaLog(path) as log:
        log.write(lambda w: open_tracker_log(w, want, {}, [], fresh=True))


class _Source:
    """What save_local_shards reads of a tracker: its rank, batch, tables and log."""

    def __init__(self, log: DeltaLog) -> None:
        self.rank, self.curr_batch_idx, self.local_tables, self.log = 0, 5, {}, log


def test_a_fresh_start_gives_a_new_later_identity_and_batches_from_zero(tmp_path):
    path = str(tmp_path / "rank-0")
    fill_store(path, _records, batches=12, mode=UpdateMode.LAST)
    before = _identity(path)
    assert before.stamp > 0
    _start_afresh(path)
    after = _identity(path)
    assert after.log_id != before.log_id and before.older_than(after) and not after.older_than(before)
    fill_store(path, _records, batches=3, mode=UpdateMode.LAST)  # the new run, from batch 0
    with DeltaLog(path) as log:  # a tracker's log: complete below the batch being recorded
        log.write(lambda w: w.set_meta("curr_batch_idx", 3))
    with DeltaReader(str(tmp_path), start=0) as r:
        got = r.poll()
        assert got.ranges == {0: (0, 3)}  # not hidden below the old run's log start
        assert sorted(got.ranks[0].tables["t"].ids.tolist()) == list(range(6))


def test_a_log_without_a_creation_time_gets_one_from_its_writer(tmp_path):
    path = str(tmp_path / "rank-0")
    fill_store(path, _records, batches=2)
    with DeltaLog(path) as log:
        log.write(lambda w: w.delete_meta(META_CREATED_TIME))
    assert _identity(path).stamp == 0  # read-only: nothing written
    with DeltaLog(path) as log:
        assert log.read(lambda r: r.identity()).stamp > 0


def test_shard_files_record_the_identity_of_their_log(tmp_path):
    path = str(tmp_path / "log" / "rank-0")
    fill_store(path, _records, batches=2, mode=UpdateMode.LAST)
    with DeltaLog(path, readonly=True, writer_lock=False) as log:
        save_local_shards(_Source(log), str(tmp_path / "old"))
    _start_afresh(path)
    with DeltaLog(path, readonly=True, writer_lock=False) as log:
        save_local_shards(_Source(log), str(tmp_path / "new"))
    old, new = shard_identities(str(tmp_path / "old"))[0], shard_identities(str(tmp_path / "new"))[0]
    assert old is not None and new == _identity(path) and old.older_than(new)
