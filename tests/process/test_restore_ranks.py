"""A restart or restore changes the ranks' logs one rank after the other: a consumer polling in
between never gets a batch that one rank holds and another does not (a column-wise table with
one half). Rank 0 is killed between the two ranks' commits of a batch; rank 1's transaction of
the restart (or of the restore) is held back while an out-of-process consumer polls."""

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from harness import run_spawn
from persistent_delta import DeltaConsumer
from persistent_delta.testing import free_port
from procs import REPO, SUPPORT
from restore_cases import (behind_while_settling_case, dropped_publish_case, halves_missing, killed_between_commits_case,
                           model_state_case)

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("stage", ["restart", "restore"])
def test_no_column_half_while_ranks_settle(tmp_path, stage):
    r0, _ = run_spawn(killed_between_commits_case, 2, str(tmp_path / "log"), stage, timeout=240)
    during, after = r0["during"], r0["after"]
    assert not halves_missing(during), (stage, during)
    assert not halves_missing(after), (stage, after)
    assert during["ranges"]["0"] == during["ranges"]["1"], during["ranges"]
    assert after["ranges"]["0"] == after["ranges"]["1"], after["ranges"]


def test_no_rank_reads_as_behind_while_the_ranks_settle(tmp_path):
    """A restart that keeps a publish of a batch some rank never completed moves every rank's
    snapshots end up to it, one rank's transaction after the other's: while one rank has not
    committed yet, its end is the old one and it has ended that batch, which read as behind
    (a false RanksBehindWarning). A poll tells the ranks behind only once their restart
    generations agree."""
    r0, _ = run_spawn(behind_while_settling_case, 2, str(tmp_path / "log"), timeout=240)
    assert r0["during"] == {} and r0["after"] == {}, r0
    assert r0["warnings"] == [], r0


def _start(root: str, steps: int) -> list:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    port = free_port()
    return [subprocess.Popen([sys.executable, os.path.join(SUPPORT, "restore_trainer_ranks.py"), root, str(r), str(port),
                              str(steps)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for r in (0, 1)]


def _check(poll, seen: list) -> None:
    """No column-wise table of the poll has one half: both ranks hold the same ids."""
    for fqn, parts in poll.tables().items():
        ids = {p.rank: set(p.global_ids.tolist()) for p in parts}
        assert ids.get(0, set()) == ids.get(1, set()), (fqn, poll.ranges, seen[-3:])
    for fqn, m in poll.merged().items():
        assert m.states is not None, (fqn, poll.ranges)
    seen.append(poll.ranges)


@pytest.mark.slow
def test_sigkill_and_restore_at_random_instants(tmp_path):
    """Both ranks SIGKILLed at random instants after they started training (one first, the
    other a moment later), each run restoring the newest checkpoint; a consumer polls all
    along, before, during and after the restarts and restores, and never gets a column half."""
    root = str(tmp_path / "log")
    rng = random.Random(7)
    seen: list = []
    consumer = None
    trials = 8

    def poll_for(seconds: float) -> None:
        nonlocal consumer
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if consumer is None and os.path.isdir(os.path.join(root, "rank-1")):
                consumer = DeltaConsumer(root, "audit", wait=30)
            if consumer is not None:
                _check(consumer.poll(), seen)
                consumer.commit()
            time.sleep(0.05)

    for trial in range(trials + 1):
        procs = _start(root, 400 if trial < trials else 10)
        lines: list = [None, None]
        readers = [threading.Thread(target=lambda i=i: lines.__setitem__(i, procs[i].stdout.readline()), daemon=True)
                   for i in (0, 1)]
        for t in readers:
            t.start()
        while any(t.is_alive() for t in readers):  # attached and restored: polls meanwhile see the restore
            poll_for(0.2)
        assert all((ln or "").startswith("START") for ln in lines), (trial, lines, [p.stderr.read()[-3000:] for p in procs])
        if trial < trials:
            poll_for(rng.uniform(0.3, 3.0))
            first = rng.randrange(2)
            procs[first].send_signal(signal.SIGKILL)
            time.sleep(rng.uniform(0.0, 0.3))
            procs[1 - first].send_signal(signal.SIGKILL)
        while any(p.poll() is None for p in procs):
            poll_for(0.2)
        if trial == trials:
            assert all(p.returncode == 0 for p in procs), [p.stderr.read()[-3000:] for p in procs]
    assert consumer is not None
    _check(consumer.poll(), seen)
    consumer.close()
    assert sum(b - a for ranges in seen for a, b in ranges.values()) > 50  # it read along


def test_dmp_load_state_dict_restores_the_tracker(tmp_path):
    """``dmp.state_dict()`` carries the tracker's state and ``dmp.load_state_dict`` restores
    it at the first step: the lost batches' rows are re-delivered with the checkpoint's values
    and nothing warns; an untracked model still loads that checkpoint (strict)."""
    r0, r1 = run_spawn(model_state_case, 2, str(tmp_path / "log"), "dmp", timeout=240)
    for rank, r in enumerate((r0, r1)):
        assert r["key_saved"], r
        assert r["unexpected"] == [], r
        assert r["warnings"] == [], r
        assert r["after_step"] == r["last"] + 2, r  # the re-delivery batch, then the step
        assert r["redelivered_rows"] > 0 and r["redelivered_exact"], r
        assert r["plain_unexpected"] == [f"persistent_delta_tracker.rank_{rank}"], r


def test_forgotten_tracker_restore_warns(tmp_path):
    """Restoring the model but not the tracker warns at the first step, saying what to do."""
    r0, r1 = run_spawn(model_state_case, 2, str(tmp_path / "log"), "weights", timeout=240)
    for r in (r0, r1):
        assert r["after_step"] == r["last"] + 1, r
        assert len(r["warnings"]) == 1 and "dmp.load_state_dict" in r["warnings"][0], r


def test_publish_of_a_batch_the_restart_drops_is_kept_and_the_replica_ends_bit_exact(tmp_path):
    """A SIGKILL right after a publish that one rank committed and another had not: the restart
    drops the step of that batch (not complete on every rank) and keeps the publish, moving the
    other rank's snapshots end up to it; the rows it carried -- changed before the checkpoint
    too -- and the lost step's rows (re-delivered) reach the replica, which ends bit-exact."""
    r0, r1 = run_spawn(dropped_publish_case, 2, str(tmp_path / "log"), timeout=240)
    assert r0["dropped"], r0  # the restart did drop rank 0's step
    for r in (r0, r1):
        assert r["snapshots_end"] == r0["stamp"] + 1, (r0, r1)  # the publish kept; rank 1's end moved up to it
        assert all(r["matches"].values()), r
        assert r["behind"] == {}, r  # no rank reads as behind


def test_publish_read_by_a_one_rank_reader_before_the_restart_stays_served(tmp_path):
    """The same with the publish made in the checkpoint's own batch, right after the checkpoint,
    and the rank that committed it closed (its batch complete) while the other was killed. A
    reader of that rank alone (a shipper's) read the publish and committed before the restart:
    the restart keeps it, so that position is still served (a restart that dropped it moved the
    rank's snapshots end back below the position: the shipper's next read failed or reset, and
    the remote replica stalled). The replica ends bit-exact."""
    r0, r1 = run_spawn(dropped_publish_case, 2, str(tmp_path / "log"), True, timeout=240)
    assert r0["served"] is True, r0
    for r in (r0, r1):
        assert r["snapshots_end"] == r0["stamp"] + 1, (r0, r1)
        assert all(r["matches"].values()), r
        assert r["behind"] == {}, r
