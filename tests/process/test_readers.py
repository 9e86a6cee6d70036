"""Readers in other processes: the unregistered reader, the job's ranks from the world
size, consumers that start before the trainer, the blocking poll, one active user per name, and
handles left open."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta import DeltaConsumer, DeltaReader, LogLockedError, OffsetOutOfRangeError
from persistent_delta.errors import NotALogError
from persistent_delta.cli import main
from persistent_delta.log.deltalog import DeltaLog
from persistent_delta.log.lmdbenv import _DEAD_HOLDER_S
from persistent_delta.log.records import AppendRecord, delete_below
from persistent_delta.log.schema import LOOKUPS, META_CURR_BATCH, META_TRACKER, ConsumerEntry, Delivery, TrackerMeta
from persistent_delta.trainer.window import WindowFilter
from persistent_delta.trainer.operations import StepWrite
from persistent_delta.trainer.writer import commit_operations
from procs import REPO



def _ids(b: int, rank: int = 0) -> torch.Tensor:
    return torch.tensor(sorted({(b * 5 + k * 3 + rank) % 30 for k in range(8)}), dtype=torch.int64)


class Rank:
    """One rank's log written the way the tracker writes it (FIRST mode; the window filter on
    with ``filtered``, else off because a poll/commit consumer "ext" is registered)."""

    def __init__(self, root: str, rank: int, world_size: int, filtered: bool = False) -> None:
        self.log = DeltaLog(os.path.join(root, f"rank-{rank}"), update_mode=UpdateMode.FIRST.value)
        self.rank = rank
        meta = TrackerMeta("embedding", "first", ["t"], rank, world_size).to_value()
        self.log.write(lambda w: (w.set_meta(META_TRACKER, meta),
                                  w.set_consumer("trainer", ConsumerEntry.new(0, LOOKUPS, Delivery.IN_TRANSACTION))))
        if not filtered:
            self.log.write(lambda w: w.set_consumer("ext", ConsumerEntry.new(0, LOOKUPS, Delivery.POLL_COMMIT)))
        self.window = WindowFilter(UpdateMode.FIRST)
        self.batch = 0

    def step(self) -> None:
        self.batch += 1
        ids = _ids(self.batch, self.rank)
        rec = AppendRecord(self.batch, "t", ids, ids.float().unsqueeze(1) + 1000 * self.batch)
        commit_operations(self.log, UpdateMode.FIRST, [StepWrite(records=[rec], curr_batch_idx=self.batch + 1)],
                     self.window)


def test_an_unregistered_reader_leaves_no_trace(tmp_path):
    root = str(tmp_path / "log")
    r0 = Rank(root, 0, 1, filtered=True)
    for _ in range(5):
        r0.step()
    with DeltaReader(root) as reader:
        poll = reader.poll()
        assert poll.ranges == {0: (0, 6)} and poll.num_rows > 0
        r0.step()
        dropped = r0.window.rows_dropped
        r0.step()
        assert r0.window.rows_dropped > dropped  # the trainer still filters: the reader switched nothing
        assert set(r0.log.read(lambda r: r.consumers())) == {"trainer"}  # nothing registered
        # position 6 lies inside the trainer's filtered read window (started at 0): the poll reads
        # from the window start and says so (at-least-once, never a lost row)
        assert reader.poll().ranges == {0: (0, 8)}
        # retention is not held back by a reader: data deleted under it is out of range
        reader.seek(2)
        r0.log.write(lambda w: delete_below(w, 6))
        with pytest.raises(OffsetOutOfRangeError):
            reader.poll()
    with DeltaReader(root, start="latest") as reader:
        assert reader.position() == {0: 8} and reader.poll().empty
    with DeltaReader(root, start=7) as reader:
        assert reader.poll().ranges[0][1] == 8
    r0.log.close()


def test_the_job_s_ranks_come_from_the_world_size(tmp_path, caplog):
    root = str(tmp_path / "log")
    r0 = Rank(root, 0, 2)
    for _ in range(3):
        r0.step()
    stale = DeltaLog(os.path.join(root, "rank-2"), update_mode="first")  # left from a 3-rank run
    stale.close()
    with caplog.at_level("WARNING"):
        reader = DeltaReader(root)
    assert "ignoring rank-2" in caplog.text
    assert reader.missing_ranks() == [1] and reader.ranks == [0]
    first = reader.poll()
    assert first.empty and first.ranges == {0: (0, 0)}  # held until every rank has the batches
    r1 = Rank(root, 1, 2)
    for _ in range(2):
        r1.step()
    second = reader.poll()  # rank 1 picked up; both read up to the batch both completed
    assert second.ranges == {0: (0, 3), 1: (0, 3)}, second.ranges
    r1.step()
    r0.step()
    assert reader.poll().ranges == {0: (3, 4), 1: (3, 4)}
    reader.close()
    r0.log.close()
    r1.log.close()
    half = str(tmp_path / "half")  # a 2-rank job of which only rank 0 exists
    Rank(half, 0, 2).log.close()
    with pytest.raises(NotALogError, match=r"ranks \[1\]"):
        DeltaReader(half, wait=0.2)


def test_a_rank_s_directory_given_as_the_root_is_refused_at_once(tmp_path, capsys):
    """A job's ``rank-<r>`` directory passed where the root goes: readers, consumers (also with
    ``wait=``), the shipper and the tools that take a root refuse it at once with a typed error
    saying it is a rank's log and naming the parent as the root to pass."""
    from persistent_delta import Shipper
    from persistent_delta.errors import RankDirectoryError

    root = str(tmp_path / "deltas")
    ranks = [Rank(root, r, 2) for r in range(2)]
    for r in ranks:
        r.step()
        r.log.close()
    rank0 = os.path.join(root, "rank-0")
    want = re.escape(f" is the log of rank 0 of a job, not a job's log root: pass its parent, {root},")
    began = time.monotonic()
    for open_ in (lambda: DeltaConsumer(rank0, "c"), lambda: DeltaConsumer(rank0, "c", wait=30),
                  lambda: DeltaReader(rank0 + "/", wait=30), lambda: DeltaReader(rank0, ranks=[0]),
                  lambda: Shipper(rank0, "nats://127.0.0.1:1", "job", insecure=True)):
        with pytest.raises(RankDirectoryError, match=want) as info:
            open_()
        assert info.value.root == root and info.value.rank == 0
    assert time.monotonic() - began < 5  # nothing waited out its timeout
    for cmd in (["verify", rank0], ["offsets", rank0], ["replay", rank0, "--from-batch", "0", "--to-batch", "1",
                                                          "--dry-run"]):
        capsys.readouterr()
        assert main(cmd) == 1, cmd
        assert f"pass its parent, {root}," in capsys.readouterr().err, cmd
    with DeltaReader(root) as reader:  # the root itself reads both ranks
        assert reader.ranks == [0, 1]


def test_a_consumer_waits_for_a_trainer_that_starts_later(tmp_path):
    root = str(tmp_path / "log")
    with pytest.raises(NotALogError):
        DeltaConsumer(root, "early")
    made = []

    def start_later() -> None:
        time.sleep(0.3)
        r = Rank(root, 0, 1)
        r.step()
        made.append(r)

    t = threading.Thread(target=start_later)
    t.start()
    with DeltaConsumer(root, "early", wait=10) as c:
        t.join()
        poll = c.poll(timeout=5)
        assert poll.ranges == {0: (0, 2)} and poll.num_rows == len(_ids(1))
    made[0].log.close()


def test_poll_waits_for_the_commit_that_completes_a_batch(tmp_path):
    root = str(tmp_path / "log")
    r0 = Rank(root, 0, 1)
    r0.step()
    with DeltaReader(root) as reader:
        reader.poll()
        t0 = time.monotonic()
        empty = reader.poll(timeout=0.2)
        assert empty.empty and empty.ranges == {0: (2, 2)} and time.monotonic() - t0 >= 0.2

        committing: list = []

        def commit_soon() -> None:
            time.sleep(0.2)
            committing.append(time.monotonic())
            r0.step()

        t0 = time.monotonic()
        t = threading.Thread(target=commit_soon)
        t.start()
        got = reader.poll(timeout=10)
        returned = time.monotonic()
        t.join()
        # it waited for the commit (a loaded machine may delay either thread: no fixed lower bound),
        # and returned on it, not at its timeout
        assert got.ranges == {0: (2, 3)} and committing[0] <= returned < t0 + 5, (t0, committing, returned)
    r0.log.close()


HOLDER = """
import sys, time
from persistent_delta import DeltaConsumer
c = DeltaConsumer(sys.argv[1], "shared")
print("HOLDING", flush=True)
time.sleep(60)
"""


FORKING_HOLDER = """
import os, subprocess, sys, time
from persistent_delta.log.lmdbenv import acquire_consumer_lock
fd = acquire_consumer_lock(os.path.join(sys.argv[1], "rank-0"), "shared", "hold it")
how, lives = sys.argv[2], sys.argv[3]
if how == "fork":  # a worker forked by a replica or a trainer: a copy of every descriptor
    child = os.fork()
    if child == 0:
        time.sleep(float(lives))
        os._exit(0)
else:  # the claim's descriptor passed on to a program it starts
    child = subprocess.Popen(["sleep", lives], pass_fds=[fd]).pid
print("HOLDING", child, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("how,child_lives_s", [("fork", 30.0), ("pass", 0.5), ("pass", 30.0)])
def test_a_killed_holders_children_do_not_keep_its_claim(tmp_path, how, child_lives_s):
    """The holder is SIGKILLed while a process it started still runs. A child of ``os.fork``
    closed its copy of the claim's descriptor at fork: the claim is free at once. A descriptor
    passed on keeps it: the claim waits a moment for that process to go, then says the pid it
    names is gone (the library itself starts no process)."""
    root = str(tmp_path / "log")
    r0 = Rank(root, 0, 1)
    r0.step()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", FORKING_HOLDER, root, how, str(child_lives_s)],
                            stdout=subprocess.PIPE, text=True, env=env)
    child = 0
    try:
        word, child_pid = proc.stdout.readline().split()
        assert word == "HOLDING"
        child = int(child_pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        if how == "fork" or child_lives_s < 1:
            with DeltaConsumer(root, "shared") as c:
                c.poll()
            if how == "fork":
                assert time.monotonic() - t0 < _DEAD_HOLDER_S, "it waited for a forked child that let go at fork"
                os.kill(child, 0)  # which is still running
        else:
            with pytest.raises(LogLockedError, match=f"pid {proc.pid} \\(no process here has that pid now: another "
                                                      "process still holds a copy of its lock descriptor"):
                DeltaConsumer(root, "shared")
            assert time.monotonic() - t0 >= _DEAD_HOLDER_S  # it waited for that process first
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if child:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
    r0.log.close()


def test_one_active_user_per_consumer_name(tmp_path, capsys):
    root = str(tmp_path / "log")
    r0 = Rank(root, 0, 1)
    r0.step()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, root], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "HOLDING"
        with pytest.raises(LogLockedError, match=f"pid {proc.pid}"):
            DeltaConsumer(root, "shared")
        assert main(["offsets", root, "--reset", "shared", "--to-earliest", "--execute"]) == 1
        assert f"in use by pid {proc.pid}" in capsys.readouterr().err
        assert main(["offsets", root, "--reset", "shared", "--to-earliest"]) == 0  # a dry run only looks
        with DeltaConsumer(root, "other"):  # other names are free
            pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # a dead holder's claim is released by the kernel
    with DeltaConsumer(root, "shared") as c:
        with pytest.raises(LogLockedError, match="this process"):
            DeltaConsumer(root, "shared")  # one user per name within a process too
        c.poll()
        c.commit()
    assert main(["offsets", root, "--reset", "shared", "--to-earliest", "--execute"]) == 0
    r0.log.close()


def test_handles_left_open_warn_and_consumers_never_commit_implicitly(tmp_path):
    root = str(tmp_path / "log")
    r0 = Rank(root, 0, 1)
    for _ in range(3):
        r0.step()
    c = DeltaConsumer(root, "forgetful")
    c.poll()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del c
        import gc
        gc.collect()
    assert any(issubclass(w.category, ResourceWarning) and "forgetful" in str(w.message) for w in caught)
    assert r0.log.read(lambda r: r.consumer("forgetful")).offset == 0  # polled, never committed
    r0.log.close()


TRAINER_WITHOUT_CLOSE = """
import os, sys
sys.path.insert(0, os.path.join(sys.argv[2], "tests", "support"))
from harness import build_sharded_model, init_gloo, make_batches, train_step
from torchrec.distributed.model_tracker.types import TrackingMode
from persistent_delta import PersistentTrackerConfig, attach
init_gloo()
dmp = build_sharded_model(0, 1, "ec", "row_wise", "EXACT_SGD", rows=200)
tracker = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, path=sys.argv[1],
                                              linger_steps=100, linger_s=60.0))
for b in make_batches("ec", 5, 16, seed=3, world_size=1, rank=0, rows=200):
    train_step(dmp, b)
print("TRAINED", tracker.curr_batch_idx, flush=True)
# no close(): the interpreter exits with the last steps still lingering in the writer
"""


def test_a_forgotten_close_loses_nothing_at_interpreter_exit(tmp_path):
    root = str(tmp_path / "log")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", TRAINER_WITHOUT_CLOSE, root, REPO], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TRAINED 5" in proc.stdout
    with DeltaLog(os.path.join(root, "rank-0"), readonly=True) as log:
        batches = log.read(lambda r: sorted({rec.batch_idx for e in r.tables().values()
                                             for rec in r.iter_records(e.table_id)}))
        assert batches and batches[-1] == 5, batches  # the lingering steps were committed at exit
        assert log.read(lambda r: r.meta("closed_end")) == 6
