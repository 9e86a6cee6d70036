"""The position rules on plain logs (no DMP): bounds, read start, statuses, retention, compaction,
and that every caller (replay, pending rows, compaction, retention, settings, the CLI) answers
from the same rule."""

from __future__ import annotations

import dataclasses
import errno
import os

import lmdb
import pytest
import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta import (
    DeltaConsumer,
    Durability,
    OffsetOutOfRangeError,
    PersistentTrackerConfig,
    RetentionBound,
)
from persistent_delta.errors import InexactRangeError, LogFullError, NotALogError, ReadOnlyLogError
from persistent_delta.log import position_rules
from persistent_delta.trainer import consume
from persistent_delta.cli import main
from persistent_delta.cli.offsets import describe
from persistent_delta.serve.replay import replay
from persistent_delta.config import LogOptions
from persistent_delta.log.lmdbenv import translate
from persistent_delta.log.deltalog import DeltaLog
from persistent_delta.log.records import AppendRecord, log_start, pending_stats, read_unique
from persistent_delta.log.schema import (
    LOOKUPS,
    META_CURR_BATCH,
    META_LOG_START,
    META_TRACKER,
    ConsumerEntry,
    Delivery,
    TrackerMeta,
)
from persistent_delta.log import codec
from persistent_delta.trainer.window import WindowFilter
from persistent_delta.trainer.operations import StepWrite
from persistent_delta.trainer.writer import commit_operations


def _ids(b: int) -> torch.Tensor:
    return torch.tensor(sorted({(b * 7 + k * 3) % 40 for k in range(12)}), dtype=torch.int64)


def tracker_log(path: str, batches: int = 30, poller: bool = False) -> DeltaLog:
    """A log written the way the tracker writes it: FIRST mode, the window filter on (one
    in-transaction consumer at 0, unless ``poller`` registers a poll/commit one), batch b's
    records stamped b and the tracker's batch index persisted with them."""
    log = DeltaLog(path, update_mode=UpdateMode.FIRST.value)
    log.write(lambda w: (w.set_meta(META_TRACKER, TrackerMeta("embedding", "first", ["t"], 0).to_value()),
                         w.set_consumer("trainer", ConsumerEntry.new(0, LOOKUPS, Delivery.IN_TRANSACTION))))
    if poller:
        log.write(lambda w: w.set_consumer("ext", ConsumerEntry.new(0, LOOKUPS, Delivery.POLL_COMMIT)))
    window = WindowFilter(UpdateMode.FIRST)
    for b in range(1, batches + 1):
        ids = _ids(b)
        states = (ids.float() * 1000 + b).unsqueeze(1).repeat(1, 2)
        commit_operations(log, UpdateMode.FIRST, [StepWrite(records=[AppendRecord(b, "t", ids, states)],
                                                            curr_batch_idx=b + 1)], window)
    return log


def touched(a: int, b: int) -> set:
    return {int(i) for k in range(a, b) for i in _ids(k)}


def test_bounds_never_cross_and_the_open_batch_is_legal(tmp_path):
    log = tracker_log(str(tmp_path / "log"), batches=10)
    # the trainer read through its open batch 11 and retention deleted everything below 12
    log.write(lambda w: (w.set_consumer("trainer", ConsumerEntry.new(12, LOOKUPS, Delivery.IN_TRANSACTION)),
                         w.set_meta(META_LOG_START, 12)))
    start, end = log.read(lambda r: position_rules.bounds(r, LOOKUPS))
    assert start <= end, (start, end)  # was LOG-START 12 > LOG-END 11
    (rank,) = describe(str(tmp_path / "log"))
    assert rank.log_start <= rank.log_end
    entry = ConsumerEntry.new(end + 1, LOOKUPS, Delivery.IN_TRANSACTION)
    assert position_rules.position_status(entry, start, end) == position_rules.OPEN_BATCH
    entry = dataclasses.replace(entry, offset=end + 2)
    assert position_rules.position_status(entry, start, end) == position_rules.PAST_END
    log.close()


def test_a_filtered_range_is_refused_by_replay_not_mislabelled(tmp_path, capsys):
    root = str(tmp_path / "log")
    tracker_log(root, batches=30).close()
    with pytest.raises(InexactRangeError, match="started at batch 0"):
        replay(root, dry_run=True, from_batch=20, to_batch=21)
    assert main(["replay", root, "--from-batch", "20", "--to-batch", "21", "--dry-run"]) == 1
    assert "cannot be answered exactly" in capsys.readouterr().err
    # from the window start, the range is exact: every row of [1, 21), nothing else
    report = replay(root, dry_run=True, from_batch=0, to_batch=21)
    assert report.ranges == {0: (0, 21)}
    assert report.files[0].rows == len(touched(1, 21))
    # windows after the first would start inside the filtered window: refused too
    with pytest.raises(InexactRangeError):
        replay(root, dry_run=True, from_batch=0, to_batch=21, span=5)


def test_an_unfiltered_log_answers_any_range_exactly(tmp_path):
    root = str(tmp_path / "log")
    tracker_log(root, batches=30, poller=True).close()
    report = replay(root, dry_run=True, from_batch=20, to_batch=21)
    assert report.ranges == {0: (20, 21)} and report.files[0].rows == len(touched(20, 21))
    report = replay(root, dry_run=True, from_batch=1, to_batch=21, span=5)
    assert [f.rows for f in report.files] == [len(touched(a, a + 5)) for a in (1, 6, 11, 16)]


def test_a_consumer_replay_reports_the_range_it_read(tmp_path):
    root = str(tmp_path / "log")
    log = tracker_log(root, batches=30)
    log.write(lambda w: w.set_consumer("late", ConsumerEntry.new(20, LOOKUPS, Delivery.IN_TRANSACTION)))
    log.close()
    report = replay(root, dry_run=True, consumer="late")
    (a, b), = report.ranges.values()
    assert a == 0 and b == 31, report.ranges  # moved back to the window start, and said so
    assert any("inside a read window" in n for n in report.notes)
    assert report.files[0].rows == len(touched(1, 31))


def test_pending_rows_use_the_consumers_read_start(tmp_path):
    root = str(tmp_path / "log")
    log = tracker_log(root, batches=30)
    log.write(lambda w: w.set_consumer("late", ConsumerEntry.new(20, LOOKUPS, Delivery.POLL_COMMIT)))
    want = log.read(lambda r: pending_stats(r, LOOKUPS, position_rules.read_start(r, 20), position_rules.lookups_end(r)))
    naive = log.read(lambda r: pending_stats(r, LOOKUPS, 20, position_rules.lookups_end(r)))
    log.close()
    assert want[1] > naive[1]  # the window's earlier records are pending too
    (rank,) = describe(root)
    late = next(c for c in rank.consumers if c.name == "late")
    assert (late.pending_records, late.pending_rows, late.pending_bytes) == want
    with DeltaConsumer(root, "late", register=False) as c:
        poll = c.poll()
    assert poll.ranges == {0: (0, 31)} and poll.num_rows == len(touched(1, 31))


def test_compaction_is_split_at_positions_and_stops_below_a_poller(tmp_path):
    log = DeltaLog(str(tmp_path / "log"), update_mode=UpdateMode.LAST.value)
    for b in range(10):
        commit_operations(log, UpdateMode.LAST, [StepWrite(records=[
            AppendRecord(b, "t", _ids(b), (_ids(b).float() + b).unsqueeze(1))])])
    log.write(lambda w: w.set_consumer("a", ConsumerEntry.new(4, LOOKUPS, Delivery.IN_TRANSACTION)))
    log.write(lambda w: w.set_consumer("p", ConsumerEntry.new(7, LOOKUPS, Delivery.POLL_COMMIT)))
    assert log.read(lambda r: position_rules.safe_pieces(r, 0, 10)) == [(0, 4), (4, 7)]

    def reads(r):
        return {p: read_unique(r, UpdateMode.LAST, p) for p in range(0, 11)}

    before = log.read(reads)
    log.write(lambda w: position_rules.safe_compact(w, UpdateMode.LAST, 0, 10))
    after = log.read(reads)
    stamps = log.read(lambda r: sorted({b for b, _, _ in r.iter_record_keys(r.table("t").table_id)}))
    assert stamps == [0, 4, 7, 8, 9]
    for p in (0, 4, 7, 8, 9, 10):  # every position a reader can hold reads the same
        assert torch.equal(before[p]["t"].ids, after[p]["t"].ids) and torch.equal(before[p]["t"].states,
                                                                                    after[p]["t"].states), p
    log.close()


def test_the_retention_bound_expires_a_dead_consumer_loudly(tmp_path, caplog):
    root = str(tmp_path / "log")
    log = tracker_log(root, batches=30, poller=True)  # "ext" polls and never commits: pins the log
    bound = RetentionBound(max_batches=10)

    def read_and_retain(w):
        return consume.consume(w, "trainer", 31, UpdateMode.FIRST, compact=False, delete_on_read=True, bound=bound)

    log.write(lambda w: consume.consume(w, "trainer", 31, UpdateMode.FIRST, compact=False, delete_on_read=True))
    assert log.read(log_start) == 0  # held back without a bound
    with caplog.at_level("WARNING"):
        log.write(read_and_retain)
    assert "EXPIRED consumer 'ext'" in caplog.text
    assert log.read(log_start) == 31
    assert log.read(lambda r: r.consumer("ext")).expired
    log.close()
    (rank,) = describe(root)
    assert {c.name: c.status for c in rank.consumers}["ext"] == position_rules.EXPIRED
    with DeltaConsumer(root, "ext", register=False) as c:
        with pytest.raises(OffsetOutOfRangeError, match="below the log start"):
            c.poll()
    with DeltaConsumer(root, "ext", register=False, reset="earliest") as c:
        assert c.poll().ranges == {0: (31, 31)}
        c.commit()
    with DeltaLog(os.path.join(root), readonly=True) as log:
        assert not log.read(lambda r: r.consumer("ext")).expired  # a commit re-arms it


def test_retention_that_passes_a_position_during_a_poll_is_told_not_skipped(tmp_path, monkeypatch):
    """A poll checks its position against the channel's bounds in one read transaction and
    reads the records in the next: retention committed between the two (here: the trainer's
    consume, deleting below the consumer's committed position while the reader sits behind
    it) must raise, not return the batches after the deleted ones labelled as read from the
    position."""
    from persistent_delta.read import fetch

    root = str(tmp_path / "log")
    log = tracker_log(root, batches=30, poller=True)
    log.write(lambda w: w.set_consumer("ext", ConsumerEntry.new(20, LOOKUPS, Delivery.POLL_COMMIT)))
    real = fetch.fetch_ranks

    def retention_first(*args, **kwargs):  # the trainer commits between the reader's bounds and its records
        monkeypatch.setattr(fetch, "fetch_ranks", real)
        log.write(lambda w: consume.consume(w, "trainer", 31, UpdateMode.FIRST, compact=False, delete_on_read=True))
        assert log.read(log_start) == 20
        return real(*args, **kwargs)

    with DeltaConsumer(root, "ext", register=False) as c:
        c.seek(10)  # behind its committed position (a restarted reader at its base's batch)
        monkeypatch.setattr(fetch, "fetch_ranks", retention_first)
        with pytest.raises(OffsetOutOfRangeError, match="at batch 10, below the log start 20"):
            c.poll()
        assert c.position() == {0: 10}  # nothing read: the position did not move
    log.close()


def test_retention_bound_from_the_environment(monkeypatch):
    monkeypatch.setenv("PERSISTENT_DELTA_RETENTION_MAX_BATCHES", "50")
    assert RetentionBound.resolve() == RetentionBound(max_batches=50)
    assert RetentionBound.resolve(max_batches=3) == RetentionBound(max_batches=3)
    monkeypatch.delenv("PERSISTENT_DELTA_RETENTION_MAX_BATCHES")
    assert not RetentionBound.resolve().enabled


def test_settings_resolve_the_same_way_everywhere(tmp_path, monkeypatch):
    monkeypatch.setenv("PERSISTENT_DELTA_DURABILITY", "sync")
    assert LogOptions.resolve().durability == Durability.SYNC
    assert LogOptions.resolve(durability="no_metasync").durability == Durability.NO_METASYNC  # explicit wins
    assert PersistentTrackerConfig(path="x").log_options().durability == Durability.SYNC  # was ON_FLUSH
    assert PersistentTrackerConfig(path="x", durability=Durability.ON_FLUSH).log_options().durability == \
        Durability.ON_FLUSH
    tracker_log(str(tmp_path / "log")).close()
    with DeltaConsumer(str(tmp_path / "log"), "c") as c:
        assert c._logs[0].options.durability == Durability.SYNC


def test_one_consumer_entry_type_reads_every_older_spelling():
    legacy = {
        b"trainer": ({"offset": 3, "commit_time": 1.0, "registered_by": "trainer", "channel": "lookups"},
                     Delivery.IN_TRANSACTION),
        b"poller": ({"offset": 3, "commit_time": 1.0, "registered_by": "external", "channel": "lookups"},
                    Delivery.POLL_COMMIT),
        b"bare": ({"offset": 3}, Delivery.IN_TRANSACTION),
    }
    for name, (d, want) in legacy.items():
        e = ConsumerEntry.from_bytes(name.decode(), codec.pack(d))
        assert e.delivery == want and e.offset == 3 and e.channel == LOOKUPS
    e = ConsumerEntry.new(5, "snapshots", Delivery.POLL_COMMIT)
    assert ConsumerEntry.from_bytes("x", e.to_bytes()) == e


def test_lmdb_errors_map_by_class_and_code_not_text():
    def err(cls, text, code):
        e = cls(text)
        e.code = code
        return e

    assert isinstance(translate(err(lmdb.Error, "something odd", errno.ENOSPC), "p"), LogFullError)
    assert isinstance(translate(lmdb.DiskError("x"), "p"), LogFullError)
    assert isinstance(translate(err(lmdb.Error, "weird", errno.EROFS), "p"), ReadOnlyLogError)
    assert isinstance(translate(OSError(errno.EACCES, "denied"), "p"), ReadOnlyLogError)
    # a message that merely mentions a condition is not that condition
    assert not isinstance(translate(err(lmdb.Error, "No space left on device", 0), "p"), LogFullError)
    assert not isinstance(translate(err(lmdb.Error, "Read-only file system", 0), "p"), ReadOnlyLogError)


def test_not_a_log_yet_versus_not_ours(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "data.mdb").write_bytes(b"")
    with pytest.raises(NotALogError, match="not a persistent_delta log yet"):
        DeltaLog(str(empty), readonly=True)
    with pytest.raises(NotALogError, match="not a persistent_delta log yet"):
        DeltaLog(str(tmp_path / "missing"), readonly=True)
    # a foreign LMDB file: refused by readers and writers alike, and never written
    foreign = tmp_path / "foreign"
    env = lmdb.open(str(foreign), max_dbs=2)
    env.open_db(b"theirs")
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v")
    env.close()
    data = (foreign / "data.mdb").read_bytes()
    for kwargs in ({"readonly": True}, {}, {"writer_lock": False}):
        with pytest.raises(NotALogError, match="another application"):
            DeltaLog(str(foreign), **kwargs)
    assert (foreign / "data.mdb").read_bytes() == data
    # an LMDB environment whose creation never committed anything is not a log yet: a writer
    # creates the log there
    fresh = tmp_path / "fresh"
    lmdb.open(str(fresh)).close()
    with pytest.raises(NotALogError, match="yet"):
        DeltaLog(str(fresh), readonly=True)
    with DeltaLog(str(fresh), update_mode="none") as log:
        assert log.read(lambda r: r.meta("format_version")) == codec.FORMAT_VERSION
