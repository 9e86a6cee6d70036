"""A remote replica gets a fresh base from the trainer's checkpoints, through the stream: one
real two-rank job (``fresh_base_cases``: a base at step 0 and an increment every 2 steps through
``Checkpoints``, a publish after every step, ``delete_on_read``) shipped to a real nats-server
by ``persistent-delta ship --checkpoints``, which uploads each rank's base whenever the chain
moves. A replica process that cannot read the trainer's disk follows it with a
``RemoteConsumer`` and a ``Follower`` without checkpoints; it is SIGKILLed mid-training and
started again with no state of its own (the same name), and another one is added after the job
ended. Both end bit-equal to the trainer's tables after its last publish."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List

import pytest

from fresh_base_cases import child_env, train_in_thread
from harness import run_spawn
from persistent_delta import RemoteConsumer
from persistent_delta.errors import LogLockedError, NotALogError
from persistent_delta.log import position_rules
from persistent_delta.log.deltalog import DeltaLog
from persistent_delta.log.schema import SNAPSHOTS
from persistent_delta.serve import Follower
from procs import SUPPORT
from stale_base_cases import full, tables_diff

pytestmark = pytest.mark.dist

JOB = "fresh-remote"


def _ends(root: str) -> Dict[int, int]:
    """rank -> the snapshots end of the rank's log (what the shipper must reach)."""
    out = {}
    for rank in (0, 1):
        with DeltaLog(os.path.join(root, f"rank-{rank}"), readonly=True) as log:
            out[rank] = log.read(lambda r: position_rules.bounds(r, SNAPSHOTS)[1])
    return out


def _follow(follower: Follower, done: threading.Event, root: str, deadline: float) -> None:
    """Step until the trainer is done and the tables reached its logs' snapshots ends."""
    while time.monotonic() < deadline:
        follower.step(timeout=0.2)
        if done.is_set() and follower.tables.positions == _ends(root):
            return
    raise AssertionError(f"the replica did not catch up: {follower.positions()} (logs end at {_ends(root)})")


def _claim(url: str, name: str, timeout: float = 30.0) -> RemoteConsumer:
    """The name's consumer, once the killed holder's claim expired."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return RemoteConsumer(url, JOB, name, channel="snapshots", wait=30)
        except LogLockedError:
            assert time.monotonic() < deadline, f"the claim on {name} never expired"
            time.sleep(0.5)



def test_a_remote_replica_killed_or_added_late_starts_from_the_newest_increment_and_ends_bit_exact(tmp_path, nats_server):
    d = tmp_path
    root, ckpt, base0, go = str(d / "log"), str(d / "ckpt"), str(d / "base0"), str(d / "go")
    trainer, result, done = train_in_thread(root, ckpt, base0, go, "row_wise")
    env = child_env()
    procs: List[subprocess.Popen] = []
    try:
        while not all(os.path.exists(os.path.join(root, f"rank-{r}", "data.mdb")) for r in (0, 1)):
            assert not done.is_set(), result
            time.sleep(0.05)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "persistent_delta", "ship", root, "--server", nats_server.url, "--job", JOB,
             "--channels", "snapshots", "--checkpoints", ckpt],
            stdout=open(str(d / "shipper.log"), "w"), stderr=subprocess.STDOUT, env=env))
        replica = subprocess.Popen(
            [sys.executable, os.path.join(SUPPORT, "remote_fresh_base_cases.py"), nats_server.url, JOB, "replica",
             root, ckpt], stdout=subprocess.PIPE, stderr=open(str(d / "replica.err"), "w"), text=True, env=env)
        procs.append(replica)
        lines: List[str] = []
        for line in replica.stdout:  # type: ignore[union-attr]
            lines.append(line.split()[0])
            if line.startswith("APPLIED") and int(line.split()[1]) >= 5:
                break
        assert lines and lines[0] == "STARTED", (lines, open(str(d / "replica.err")).read()[-3000:])
        replica.send_signal(signal.SIGKILL)  # mid-training, with no goodbye
        replica.wait(timeout=30)
        open(go, "w").close()
        # started again with no state of its own: the same name, on the stream only
        with _claim(nats_server.url, "replica") as consumer:
            follower = Follower(consumer)
            started = dict(follower.tables.batches)
            assert "bootstrap" in follower.tables.source, follower.tables.source
            # the tables of the newest increment the shipper had uploaded: past the step-0 base (the
            # replica applied up to batch 5 before it was killed, increments come every 2 steps)
            assert min(started.values()) >= 2 and len(set(started.values())) == 1, started
            _follow(follower, done, root, time.monotonic() + 240)
            restarted = {k: v.clone() for k, v in follower.tables.items()}
        trainer.join(timeout=60)
        if "error" in result:
            raise result["error"]
        final = full(result["ranks"], "final_shards")
        assert not (d := tables_diff(restarted, final)), d
        # added after the job ended: a new name, no stored position; the bases of the last increment
        deadline = time.monotonic() + 30
        with RemoteConsumer(nats_server.url, JOB, "late", channel="snapshots", wait=30) as late:
            while True:
                follower = Follower(late)
                if min(follower.tables.batches.values()) >= 12 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)  # the shipper looks at the chain every second
            assert follower.tables.batches == {0: 12, 1: 12}, follower.tables.batches
            _follow(follower, done, root, time.monotonic() + 60)
            assert not (d := tables_diff(dict(follower.tables), final)), d
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_a_follower_without_checkpoints_needs_a_base_on_the_stream(tmp_path, nats_server):
    """No shipper uploaded a base (no ``--checkpoints``, no ``upload_base``): the remote Follower
    says so with a typed error naming the rank, after its ``wait``; a local consumer without
    checkpoints is refused at once."""
    from harness import run_spawn as spawn
    from persistent_delta import DeltaConsumer, Shipper
    from persistent_delta.errors import InvalidInputError
    from remote_behind_cases import publish_on_case

    root = str(tmp_path / "log")
    spawn(publish_on_case, 2, root, [0, 1], timeout=180)
    with Shipper(root, nats_server.url, job="nobase", channels=["snapshots"]) as shipper:
        shipper.run(idle_exit_s=1.0)
    with RemoteConsumer(nats_server.url, "nobase", "replica", channel="snapshots", wait=30) as consumer:
        with pytest.raises(NotALogError, match="rank 0 has no base"):
            Follower(consumer, wait=0.5)
    with DeltaConsumer(root, "serving.snapshots", channel="snapshots") as local:
        with pytest.raises(InvalidInputError, match="checkpoints="):
            Follower(local)


def test_a_remote_replica_behind_the_streams_retention_loads_the_newest_base_and_catches_up(tmp_path):
    """The in-process memory transport with a clock the case moves past the stream's age limit:
    the publishes after the replica's position expire (``OffsetOutOfRangeError`` for a plain
    poll); the Follower's next steps load the base of the newest increment from the stream and
    end bit-equal to the trainer."""
    from remote_fresh_base_cases import retention_case

    out = run_spawn(retention_case, 1, str(tmp_path / "log"), str(tmp_path / "ckpt"), timeout=180)[0]
    assert out["first"] == {0: 2} and out["first_same"], out  # the increment of step 2, then caught up
    assert out["expired"] == "OffsetOutOfRangeError", out  # a plain poll: the publishes after it are gone
    assert out["reloads"] == 1 and out["second"] == {0: 8} and out["second_same"], out
