"""DeltaConsumer: positions, commits, at-least-once, out-of-range policies, rank merging, and an
external consumer process reading a real 2-rank trainer while it trains (SIGKILL included)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any, Dict, List

import pytest
import torch
from torchrec.distributed.model_tracker.types import TrackingMode, UniqueRows, UpdateMode

from logs import Record, fill_ranks
from persistent_delta.errors import (
    ConfigMismatchError,
    InvalidInputError,
    LogClosedError,
    NotALogError,
    UnknownConsumerError,
)
from persistent_delta import DeltaConsumer, LmdbDeltaStore, OffsetOutOfRangeError
from persistent_delta.read.results import TableDelta, merge_table
from persistent_delta.log.schema import ShardInfo
from persistent_delta.log import codec
from persistent_delta.log.deltalog import DeltaLog
from persistent_delta.log.schema import SNAPSHOTS, Delivery
from persistent_delta.log import position_rules
from procs import popen_python, run_python


def _two_ids(rank: int, b: int) -> List[Record]:
    """Batch b of rank r holds ids {b, b+1} (+100*r) of "t", each row's 3 states equal to its id."""
    ids = torch.tensor([b, b + 1]) + 100 * rank
    return [("t", ids, ids.float().unsqueeze(1).repeat(1, 3))]


def _ids(poll: Any) -> Dict[int, List[int]]:
    return {t.rank: t.global_ids.tolist() for t in poll}


def test_poll_commit_and_redelivery(tmp_path):
    root = str(tmp_path)
    fill_ranks(root, _two_ids, ranks=2, batches=6, mode=UpdateMode.FIRST)
    with DeltaConsumer(root, "c") as c:
        assert c.position() == {0: 0, 1: 0}
        p = c.poll(max_batches=2)
        assert p.ranges == {0: (0, 2), 1: (0, 2)}
        assert _ids(p) == {0: [0, 1, 2], 1: [100, 101, 102]}
        states = p.tables()["t"][0].states
        assert torch.equal(states, torch.tensor([[0.0] * 3, [1.0] * 3, [2.0] * 3]))  # FIRST per id
        assert c.position() == {0: 2, 1: 2}
        assert c.committed() == {0: 0, 1: 0}  # nothing durable before commit
    # no commit: a new consumer with the same name gets the same batches again
    with DeltaConsumer(root, "c") as c:
        p = c.poll(max_batches=2)
        assert _ids(p) == {0: [0, 1, 2], 1: [100, 101, 102]}
        assert c.commit() == {0: 2, 1: 2}
    with DeltaConsumer(root, "c") as c:
        assert c.position() == {0: 2, 1: 2}
        p = c.poll()
        assert p.ranges == {0: (2, 6), 1: (2, 6)} and p.num_rows == 10
        assert c.poll().empty
        c.seek(4, rank=1)
        assert c.poll().ranges == {0: (6, 6), 1: (4, 6)}
        merged = p.merged()["t"]
        assert merged.global_ids.tolist() == [2, 3, 4, 5, 6, 102, 103, 104, 105, 106]
        assert not merged.column_split


def test_registration_and_refusals(tmp_path):
    root = str(tmp_path)
    fill_ranks(root, _two_ids, ranks=1, batches=6, mode=UpdateMode.FIRST)
    with pytest.raises(UnknownConsumerError, match="--register"):
        DeltaConsumer(root, "x", register=False)
    with DeltaConsumer(root, "late", reset="latest") as c:
        assert c.position() == {0: 6}  # a new registration at the log end
    with pytest.raises(ConfigMismatchError, match="channel"):
        DeltaConsumer(root, "late", channel="snapshots")
    with pytest.raises(InvalidInputError, match="consumer name"):
        DeltaConsumer(root, "bad name")
    with pytest.raises(InvalidInputError, match="channel"):
        DeltaConsumer(root, "x", channel="nope")
    with pytest.raises(InvalidInputError, match="reset"):
        DeltaConsumer(root, "x", reset="middle")
    with pytest.raises(NotALogError):
        DeltaConsumer(str(tmp_path / "missing"), "x")
    assert not os.path.exists(tmp_path / "missing")
    c = DeltaConsumer(root, "x")
    with pytest.raises(InvalidInputError):
        c.poll(max_batches=0)
    with pytest.raises(InvalidInputError):
        c.seek(-1)
    c.close()
    c.close()
    with pytest.raises(LogClosedError):
        c.poll()
    # registration is durable: an external consumer entry a trainer would count
    with DeltaLog(os.path.join(root, "rank-0"), readonly=True) as log:
        entry = log.read(lambda r: r.consumer("x"))
    assert entry.offset == 0 and entry.registered_by == "external" and entry.channel == "lookups"
    assert entry.delivery == Delivery.POLL_COMMIT


def test_offset_out_of_range_and_reset_policies(tmp_path):
    root = str(tmp_path)
    fill_ranks(root, _two_ids, ranks=1, batches=6, mode=UpdateMode.FIRST)
    with DeltaConsumer(root, "c") as c:
        c.commit()  # registered at 0
    with LmdbDeltaStore(os.path.join(root, "rank-0"), UpdateMode.FIRST) as s:
        s.delete(3)  # a store has no consumer rules: batches 0..2 are gone
    with DeltaConsumer(root, "c") as c:
        with pytest.raises(OffsetOutOfRangeError, match="below the log start 3"):
            c.poll()
    with DeltaConsumer(root, "c", reset="earliest") as c:
        p = c.poll()
        assert p.ranges == {0: (3, 6)} and _ids(p) == {0: [3, 4, 5, 6]}
    with DeltaConsumer(root, "c", reset="latest") as c:
        assert c.poll().ranges == {0: (6, 6)}
        c.seek(50)
        assert c.poll().ranges == {0: (6, 6)}  # past the end: reset to latest
    with DeltaConsumer(root, "c") as c:
        c.seek(50)
        with pytest.raises(OffsetOutOfRangeError, match="past the log end"):
            c.poll()


def test_commit_after_delete_refused(tmp_path):
    root = str(tmp_path)
    fill_ranks(root, _two_ids, ranks=1, batches=6, mode=UpdateMode.FIRST)
    with DeltaConsumer(root, "c") as c:
        c.poll()
        with DeltaLog(os.path.join(root, "rank-0"), writer_lock=False) as log:
            assert log.write(lambda w: w.delete_consumer("c"))
        with pytest.raises(UnknownConsumerError, match="deleted"):
            c.commit()


def test_snapshots_channel(tmp_path):
    """channel="snapshots" reads published row values (newest value per row wins) up to
    snapshot_end, starting at the first stored stamp; its entry carries the channel."""
    root = str(tmp_path)
    with LmdbDeltaStore(os.path.join(root, "rank-0"), UpdateMode.NONE) as s:
        s.append(0, "t", torch.tensor([1, 2]))

        def publish(stamp: int, ids: List[int], values: List[float]) -> None:
            def write(w: Any) -> None:
                rec = codec.encode_record(torch.tensor(ids), torch.tensor(values).unsqueeze(1), codec.KIND_SNAPSHOT)
                w.put_record(w.tables()["t"].table_id, stamp, rec, channel=SNAPSHOTS)
                w.set_meta("snapshot_end", stamp + 1)
            s.log.write(write)

        publish(3, [1, 2], [1.0, 2.0])
        publish(5, [2, 7], [20.0, 70.0])
        with DeltaConsumer(root, "replica", channel="snapshots") as c:
            assert c.position() == {0: 3} and c.end_offsets() == {0: 6}
            p = c.poll(max_batches=1)
            assert p.ranges == {0: (3, 4)} and p.merged()["t"].states.flatten().tolist() == [1.0, 2.0]
            p = c.poll()
            assert p.ranges == {0: (4, 6)}
            m = p.merged()["t"]
            assert m.global_ids.tolist() == [2, 7] and m.states.flatten().tolist() == [20.0, 70.0]
            c.commit()
        publish(6, [2], [200.0])
        with DeltaConsumer(root, "replica", channel="snapshots") as c:
            assert c.poll().merged()["t"].states.flatten().tolist() == [200.0]
        entry = s.log.read(lambda r: r.consumer("replica"))
        assert entry.channel == "snapshots" and entry.offset == 6


def _part(rank: int, ids: List[int], col: int, width: int, rows: int = 10, row_offset: int = 0) -> TableDelta:
    local = torch.tensor(ids)
    states = torch.stack([torch.arange(col, col + width, dtype=torch.float32) + 100 * (i + row_offset) for i in ids])
    shard = ShardInfo(row_offset=row_offset, col_offset=col, local_rows=rows, local_cols=width,
                      global_rows=20, global_cols=8)
    return TableDelta("t", rank, 0, 1, UniqueRows(local, states), local + row_offset, shard)


def test_merge_ranks_row_and_column_wise():
    # row-wise: disjoint global ids, concatenated in order
    m = merge_table("t", [_part(1, [0, 3], 0, 8, row_offset=10), _part(0, [2, 5], 0, 8)])
    assert m.global_ids.tolist() == [2, 5, 10, 13] and not m.column_split
    assert torch.equal(m.states[:, 0], torch.tensor([200.0, 500.0, 1000.0, 1300.0]))
    # column-wise: the same ids on two ranks, slices assembled into full rows
    m = merge_table("t", [_part(1, [1, 4], 4, 4), _part(0, [1, 4], 0, 4)])
    assert m.column_split and m.states is not None and m.states.shape == (2, 8)
    assert torch.equal(m.states[1], torch.arange(8, dtype=torch.float32) + 400)
    # different ids per column shard: no assembly, per-shard parts with their col_offset
    m = merge_table("t", [_part(0, [1, 4], 0, 4), _part(1, [1], 4, 4)])
    assert m.states is None and m.global_ids.tolist() == [1, 4]
    assert sorted(m.column_parts) == [0, 4] and m.column_parts[4].ids.tolist() == [1]


# ------------------------------------------------------------ an external consumer process


def _fast_writer_code() -> str:
    return """
    import os, sys, time, torch
    from torchrec.distributed.model_tracker.types import UpdateMode
    from persistent_delta import LmdbDeltaStore
    from persistent_delta.log.records import AppendRecord
    s = LmdbDeltaStore(os.path.join(sys.argv[1], "rank-0"), UpdateMode.NONE)
    print("READY", flush=True)
    for b in range(int(sys.argv[2])):
        s.append_many([AppendRecord(b, "t", torch.tensor([b, b + 1000])), AppendRecord(b, "u", torch.tensor([b]))])
        time.sleep(0.01)
    s.close()
    """


def test_consumer_reads_while_a_writer_process_appends(tmp_path):
    """A writer process appends; this process polls and commits meanwhile: every batch once,
    in order, nothing missing."""
    root = str(tmp_path)
    writer = popen_python(_fast_writer_code(), root, "150")
    assert writer.stdout.readline().strip() == "READY", writer.stderr.read()
    seen: List[int] = []
    ranges = []
    with DeltaConsumer(root, "c") as c:
        deadline = time.time() + 60
        while time.time() < deadline:
            done = writer.poll() is not None
            p = c.poll(max_batches=7)
            if not p.empty:
                ranges.append(p.ranges[0])
                seen.extend(x for x in p.merged()["u"].global_ids.tolist())
                c.commit()
            elif done:
                break
    assert writer.wait() == 0
    assert len(ranges) > 3  # several polls, interleaved with the writer
    assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])) and ranges[-1][1] == 150
    assert seen == list(range(150))


# ------------------------------------------------- a real 2-rank trainer, consumer SIGKILL

CONSUMER = """
import json, os, sys, time
root, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
from persistent_delta import DeltaConsumer
c = DeltaConsumer(root, "ext")
open(out + ".started", "w").close()
f = open(out, "a")
polls = 0
while True:
    done = os.path.exists(root + ".DONE")
    p = c.poll(max_batches=2)
    if p.empty:
        if done:
            break
        time.sleep(0.02)
        continue
    polls += 1
    entry = {"ranges": {str(r): list(v) for r, v in p.ranges.items()},
             "ids": {f"{t.rank}/{t.fqn}": t.global_ids.tolist() for t in p}}
    if mode == "crash" and polls == 4:
        f.write(json.dumps(dict(entry, committed=False)) + "\\n"); f.flush(); os.fsync(f.fileno())
        open(out + ".ready", "w").close()
        time.sleep(600)
    c.commit()
    f.write(json.dumps(dict(entry, committed=True)) + "\\n"); f.flush(); os.fsync(f.fileno())
c.close()
"""


def paced_trainer(rank: int, world_size: int, root: str, go: str, steps: int) -> int:
    """ID_ONLY tracker on a row-wise EC; waits for ``go``, trains slowly, never reads (no
    compaction, no retention). Returns the final log end."""
    from harness import build_sharded_model, make_batches, train_step

    from persistent_delta import PersistentTrackerConfig, attach

    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_SGD", rows=64)
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, path=root, consumers=["trainer"]))
    t.flush()
    deadline = time.time() + 120
    while not os.path.exists(go) and time.time() < deadline:
        time.sleep(0.02)
    for b in make_batches("ec", steps, 8, seed=7, world_size=world_size, rank=rank, rows=64):
        train_step(dmp, b)
        time.sleep(0.08)
    t.step()  # no more lookups of the last batch: make it complete for external readers
    t.close()
    with DeltaLog(t.path, readonly=True) as log:
        return int(log.read(position_rules.lookups_end))


def _wait(path: str, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while not os.path.exists(path):
        assert time.time() < deadline, f"timed out waiting for {path}"
        time.sleep(0.05)


def _wait_tracker(path: str, timeout: float = 60.0) -> None:
    """Wait until the tracker has written its settings into the log at ``path``."""
    deadline = time.time() + timeout
    while True:
        try:
            with DeltaLog(path, readonly=True) as log:
                if log.read(lambda r: r.meta("tracker")) is not None:
                    return
        except NotALogError:
            pass  # data.mdb exists before the writer's creating transaction commits
        assert time.time() < deadline, f"no tracker settings in {path}"
        time.sleep(0.05)


def _truth(root: str, rank: int, start: int, end: int) -> Dict[str, List[int]]:
    with DeltaLog(os.path.join(root, f"rank-{rank}"), readonly=True) as log:
        def read(r: Any) -> Dict[str, List[int]]:
            out = {}
            for fqn, e in r.tables().items():
                ids = [rec.ids.clone() for rec in r.iter_records(e.table_id, start, end)]
                off = e.meta["shard"]["row_offset"]
                out[f"{rank}/{fqn}"] = (torch.unique(torch.cat(ids)) + off).tolist() if ids else []
            return out
        return log.read(read)


@pytest.mark.dist
def test_external_consumer_process_with_trainer_and_sigkill(tmp_path):
    """A consumer process polls and commits while a 2-rank trainer trains; it is SIGKILLed
    between a poll and its commit; a new process with the same name resumes from the last
    commit. Every batch is delivered once and in order across commits, with the right rows."""
    from harness import run_spawn

    root, go, out = str(tmp_path / "log"), str(tmp_path / "go"), str(tmp_path / "polls")
    result: Dict[str, Any] = {}
    trainer = threading.Thread(target=lambda: result.update(ends=run_spawn(paced_trainer, 2, root, go, 40)))
    trainer.start()
    a = None
    try:
        for r in range(2):
            _wait(os.path.join(root, f"rank-{r}", "data.mdb"))
        for r in range(2):
            _wait_tracker(os.path.join(root, f"rank-{r}"))
        a = popen_python(CONSUMER, root, out + ".a", "crash")
        _wait(out + ".a.started")
        open(go, "w").close()
        _wait(out + ".a.ready")
        a.send_signal(signal.SIGKILL)
        assert a.wait() == -signal.SIGKILL
        trainer.join(180)
        assert not trainer.is_alive()
        open(root + ".DONE", "w").close()
        run_python(CONSUMER, root, out + ".b", "finish")
    finally:
        if a is not None and a.poll() is None:
            a.kill()
        open(root + ".DONE", "w").close()
        trainer.join(30)
    ends = result["ends"]
    polls_a = [json.loads(x) for x in open(out + ".a")]
    polls_b = [json.loads(x) for x in open(out + ".b")]
    assert [p["committed"] for p in polls_a] == [True, True, True, False]
    # the consumer read while the trainer was still writing
    assert any(p["ranges"]["0"][1] < ends[0] for p in polls_a)
    for rank in range(2):
        key = str(rank)
        committed = [p["ranges"][key] for p in polls_a if p["committed"]] + [p["ranges"][key] for p in polls_b]
        # once and in order: contiguous from the first batch to the log end
        assert committed[0][0] == 0 and committed[-1][1] == ends[rank]
        assert all(x[1] == y[0] for x, y in zip(committed, committed[1:])), committed
        # the uncommitted poll is delivered again after the crash
        assert polls_b[0]["ranges"][key][0] == polls_a[-1]["ranges"][key][0]
    # every delivery holds exactly the rows the trainer recorded for that range
    for p in polls_a + polls_b:
        for key, (s, e) in p["ranges"].items():
            want = _truth(root, int(key), s, e)
            got = {k: v for k, v in p["ids"].items() if k.startswith(key + "/")}
            assert got == want, (key, s, e)
    assert sum(len(v) for p in polls_a + polls_b for v in p["ids"].values()) > 0
