"""The snapshots channel's stamps on a plain log: a publish's stamp stays open (stored, not
readable) until its batch ends, and the rule that finds a rank behind; the role a consumer's
entry records (reads or publishes) survives a reopen."""

from __future__ import annotations

from persistent_delta.log import position_rules
from persistent_delta.log.deltalog import DeltaLog
from persistent_delta.log.schema import LOOKUPS, ROLE_PUBLISHES, SNAPSHOTS, ConsumerEntry, Delivery
from persistent_delta.ops.health import Health, health


def test_an_open_stamp_is_not_readable_until_closed(tmp_path):
    with DeltaLog(str(tmp_path / "log"), create=True) as log:
        log.write(lambda w: position_rules.open_stamp(w, 4))
        assert log.read(lambda r: position_rules.bounds(r, SNAPSHOTS)[1]) == 0
        assert log.read(position_rules.snapshot_open) == 4
        log.write(lambda w: position_rules.open_stamp(w, 4))  # a second publish of the batch: the same stamp
        assert log.write(lambda w: position_rules.close_stamps(w, 4)) == 0  # the batch has not ended
        assert log.write(lambda w: position_rules.close_stamps(w, 5)) == 5  # the next step's commit closes it
        assert log.read(position_rules.snapshot_open) is None
        log.write(lambda w: position_rules.open_stamp(w, 7))
        log.write(lambda w: position_rules.open_stamp(w, 9))  # a later batch's publish closes the earlier stamp
        assert log.read(lambda r: position_rules.bounds(r, SNAPSHOTS)[1]) == 8
        assert log.write(position_rules.close_stamps) == 10  # flush() and close() close whatever is open
        try:
            log.write(lambda w: position_rules.open_stamp(w, 9))
        except ValueError as exc:
            assert "closed" in str(exc)
        else:
            raise AssertionError("a closed stamp was opened again")


def test_a_rank_is_behind_once_it_completed_a_batch_others_published_in():
    # rank -> (snapshots end, lookups end)
    assert position_rules.snapshots_behind({0: (6, 9), 1: (6, 9)}) == {}
    assert position_rules.snapshots_behind({0: (6, 9), 1: (0, 9)}) == {1: 5}  # rank 0 only published
    assert position_rules.snapshots_behind({0: (6, 6), 1: (0, 5)}) == {}  # rank 1 is still in batch 5
    assert position_rules.snapshots_behind({0: (6, 7), 1: (3, 7), 2: (1, 4)}) == {1: 5, 2: 2}
    # a remote view: rank 0's newest range was cut at 8 by the shipper, its newest publish is below 4
    assert position_rules.snapshots_behind({0: (8, 8), 1: (4, 9)}) == {1: 7}  # the cut read as a publish
    assert position_rules.snapshots_behind({0: (8, 8), 1: (4, 9)}, {0: 4}) == {}
    assert position_rules.snapshots_behind({0: (8, 8), 1: (4, 9)}, {0: 6}) == {1: 5}  # a publish at 5 it does hold
    note = position_rules.behind_note({1: 5})
    assert "rank 1 completed batch 5 without publishing" in note and "every rank at the same steps" in note


def test_a_snapshots_consumer_held_back_by_a_rank_behind_is_behind_not_stalled():
    assert health((), offset=2, end=6, now=1e9, last_commit=1.0, behind=True) is Health.BEHIND
    assert health((), offset=6, end=6, now=1e9, last_commit=1.0, behind=True) is Health.OK
    assert health((), offset=2, end=6, now=1e9, last_commit=1.0, stall_after_s=5) is Health.STALLED


def test_a_consumers_role_is_kept_by_every_commit_and_a_reopen(tmp_path):
    path = str(tmp_path / "log")
    with DeltaLog(path, create=True) as log:
        entry = ConsumerEntry.new(0, LOOKUPS, Delivery.IN_TRANSACTION)
        entry = entry.committed(3, 3, ROLE_PUBLISHES).committed(5, 5, "reads")  # the first role stays
        log.write(lambda w: w.set_consumer("serving", entry))
    with DeltaLog(path) as log:
        got = log.read(lambda r: r.consumer("serving"))
    assert got is not None and got.role == ROLE_PUBLISHES and got.offset == 5
