"""A consumer's health over its window of commits (Burrow's rules) and the bounded commit history
its stored entry keeps (old entries without one stay readable)."""

from __future__ import annotations

import pytest
import torch

from persistent_delta.errors import CorruptRecordError
from persistent_delta.log import codec
from persistent_delta.log.schema import COMMIT_HISTORY, CommitPoint, ConsumerEntry, Delivery
from persistent_delta.ops.health import Health, health

T0 = 1_000_000.0


def _points(*rows: tuple) -> tuple:
    """(seconds after T0, offset, end) -> commit points."""
    return tuple(CommitPoint(T0 + t, o, e) for t, o, e in rows)


def test_caught_up_is_ok_whatever_the_history():
    hist = _points((0, 0, 10), (10, 1, 20))
    assert health(hist, offset=30, end=30, now=T0 + 1000, stall_after_s=5) is Health.OK


def test_expired_wins():
    assert health((), offset=0, end=0, now=T0, expired=True) is Health.EXPIRED


def test_lag_growing_at_every_commit_is_lagging():
    hist = _points((0, 10, 12), (1, 12, 16), (2, 14, 20), (3, 16, 25))
    assert health(hist, offset=16, end=26, now=T0 + 3.5, stall_after_s=5) is Health.LAGGING


def test_behind_but_catching_up_is_ok():
    hist = _points((0, 10, 20), (1, 14, 22), (2, 18, 23))
    assert health(hist, offset=18, end=24, now=T0 + 2.5, stall_after_s=5) is Health.OK


def test_one_caught_up_commit_in_the_window_is_ok():
    hist = _points((0, 10, 10), (1, 12, 16), (2, 14, 20))
    assert health(hist, offset=14, end=21, now=T0 + 2.5, stall_after_s=5) is Health.OK


def test_silent_while_data_arrives_is_stalled():
    hist = _points((0, 10, 10), (1, 12, 12), (2, 14, 14))
    # data arrived since the last commit, and the silence (10 s) is longer than the window (2 s)
    assert health(hist, offset=14, end=30, now=T0 + 12, stall_after_s=5) is Health.STALLED
    # ... but not before the least silence
    assert health(hist, offset=14, end=30, now=T0 + 4, stall_after_s=5) is Health.OK
    # ... and not when no data arrived (an idle trainer does not stall its readers)
    assert health(hist, offset=10, end=14, now=T0 + 100, stall_after_s=5) is not Health.STALLED


def test_a_fresh_registration_that_never_commits_stalls_after_the_least_silence():
    assert health((), offset=0, end=5, now=T0 + 3, last_commit=T0, stall_after_s=5) is Health.OK
    assert health((), offset=0, end=5, now=T0 + 6, last_commit=T0, stall_after_s=5) is Health.STALLED


def test_committing_the_same_offset_while_lag_holds_is_stalled():
    hist = _points((0, 7, 9), (1, 7, 11), (2, 7, 12))
    assert health(hist, offset=7, end=12, now=T0 + 2.5, stall_after_s=5) is Health.STALLED


def test_history_is_bounded_and_survives_the_bytes():
    e = ConsumerEntry.new(0, "lookups", Delivery.POLL_COMMIT)
    for i in range(COMMIT_HISTORY + 5):
        e = e.committed(i + 1, i + 3)
    back = ConsumerEntry.from_bytes("c", e.to_bytes())
    assert len(back.history) == COMMIT_HISTORY
    assert [p.offset for p in back.history] == list(range(6, COMMIT_HISTORY + 6))
    assert back.history[-1].end == COMMIT_HISTORY + 7 and back.history[-1].lag == 2
    assert back == e


def test_an_entry_written_before_the_history_reads_back_with_none():
    old = codec.pack({"offset": 4, "channel": "lookups", "delivery": "poll_commit", "commit_time": T0,
                      "registered_by": "external", "expired": False})
    e = ConsumerEntry.from_bytes("c", old)
    assert e.offset == 4 and e.history == ()
    assert e.committed(5).history[-1].offset == 5


def test_a_damaged_history_is_refused():
    bad = codec.pack({"offset": 4, "history": [[T0, "x", 3]]})
    with pytest.raises(CorruptRecordError, match="history point"):
        ConsumerEntry.from_bytes("c", bad)


def test_decoded_entries_are_reused_immutable_and_still_checked():
    """A writer's transaction decodes every consumer several times: decodes of the same bytes
    are reused, so an entry cannot be changed in place, other bytes decode anew, and damaged
    bytes are refused on every read (a refusal is not remembered as an entry)."""
    import dataclasses

    e = ConsumerEntry.new(3, "snapshots", Delivery.POLL_COMMIT).committed(4, 9)
    raw = e.to_bytes()
    first, again = ConsumerEntry.from_bytes("c", raw), ConsumerEntry.from_bytes("c", bytearray(raw))
    assert first == e and again is first
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.offset = 7  # type: ignore[misc]
    moved = ConsumerEntry.from_bytes("c", e.committed(5).to_bytes())
    assert moved.offset == 5 and first.offset == 4
    assert ConsumerEntry.from_bytes("other", raw) is not first  # a name is part of what is decoded
    every = dataclasses.replace(first, expired=True, registered_by="external", format="int8", role="publishes")
    assert ConsumerEntry.from_bytes("c", every.to_bytes()) == every  # every field is stored
    bad = codec.pack({"offset": -1})
    for _ in range(2):
        with pytest.raises(CorruptRecordError, match="offset"):
            ConsumerEntry.from_bytes("c", bad)


def test_a_real_consumer_that_stops_committing_while_data_arrives_is_stalled(tmp_path):
    """Two consumers of a log being written: the one that keeps committing is ok, the one that
    stopped is stalled once its silence outlasts its window, in ``describe`` and ``offsets``."""
    import io
    import time

    from torchrec.distributed.model_tracker.types import UpdateMode

    from persistent_delta import DeltaConsumer, LmdbDeltaStore
    from persistent_delta.cli import main
    from persistent_delta.ops.positions import describe

    root = str(tmp_path / "job")
    with LmdbDeltaStore(f"{root}/rank-0", UpdateMode.NONE) as store:
        store.append(0, "t", torch.tensor([0]))
        with DeltaConsumer(root, "live") as live, DeltaConsumer(root, "gone") as gone:
            for c in (live, gone):
                c.poll()
                c.commit()
            for b in range(1, 12):
                store.append(b, "t", torch.tensor([b]))
                live.poll()
                live.commit()
                time.sleep(0.05)
            health = {c.name: c.health for c in describe(root, stall_after_s=0.3)[0].consumers}
    assert health == {"live": "ok", "gone": "stalled"}
    buf = io.StringIO()
    assert main(["offsets", root], stdout=buf) == 0  # the default least silence (30 s) has not passed
    assert "HEALTH" in buf.getvalue() and "stalled" not in buf.getvalue()


def test_the_least_silence_comes_from_the_argument_then_the_environment(monkeypatch):
    from persistent_delta.config import STALL_AFTER_S, stall_after_s
    from persistent_delta.errors import InvalidInputError

    assert stall_after_s() == STALL_AFTER_S
    monkeypatch.setenv("PERSISTENT_DELTA_STALL_AFTER_S", "2.5")
    assert stall_after_s() == 2.5 and stall_after_s(1.0) == 1.0
    # the rule reads it: 3 s of silence while data arrives is stalled under 2.5 s, not under 30 s
    assert health((), offset=0, end=5, now=T0 + 3, last_commit=T0) is Health.STALLED
    monkeypatch.setenv("PERSISTENT_DELTA_STALL_AFTER_S", "soon")
    with pytest.raises(InvalidInputError, match="PERSISTENT_DELTA_STALL_AFTER_S"):
        stall_after_s()
