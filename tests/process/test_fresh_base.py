"""Any replica gets a fresh base from the trainer's checkpoints (``persistent_delta.serve.fresh_base``):
one real two-rank job (a TorchRec model row-wise, or one table column-wise and one table-wise; ``delete_on_read``, a base at step 0 and an
increment every 2 steps through ``Checkpoints``) publishes after every step. A replica process
following it is SIGKILLed mid-training and started again with no state of its own; another is
added after the job ended, when ``delete_on_read`` has dropped the early snapshots. Both end
bit-equal to the trainer's tables after its last publish, where the batch-0 shard files are
refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import List

import pytest

from fresh_base_cases import child_env, train_in_thread
from persistent_delta import DeltaConsumer, apply_poll, load_base
from persistent_delta.checkpoint.chain import latest_chain
from persistent_delta.errors import IncompleteBaseError, IncrementChainError, StaleBaseError
from persistent_delta.serve.fresh_base import Follower, load_checkpoint_base
from procs import SUPPORT
from stale_base_cases import full, tables_diff

pytestmark = pytest.mark.dist


def _follow(follower: Follower, done: threading.Event, deadline: float) -> None:
    """Step until the trainer is done and the tables reached the channel's end on every rank."""
    while time.monotonic() < deadline:
        follower.step(timeout=0.2)
        positions, ends = follower.positions()
        if done.is_set() and positions == ends:
            return
    raise AssertionError(f"the replica did not catch up: {follower.positions()}")


@pytest.fixture(scope="module", params=["row_wise", "column_wise,table_wise"])
def job(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    d = tmp_path_factory.mktemp("fresh-base")
    root, ckpt, base0, go = str(d / "log"), str(d / "ckpt"), str(d / "base0"), str(d / "go")
    trainer, result, done = train_in_thread(root, ckpt, base0, go, request.param)
    env = child_env()
    replica = subprocess.Popen([sys.executable, os.path.join(SUPPORT, "fresh_base_cases.py"), root, ckpt],
                               stdout=subprocess.PIPE, stderr=open(str(d / "replica.err"), "w"), text=True, env=env)
    applied: List[int] = []
    for line in replica.stdout:  # type: ignore[union-attr]
        applied.append(int(line.split()[1]))
        if applied[-1] >= 5:
            break
    replica.send_signal(signal.SIGKILL)  # mid-training, with no goodbye
    replica.wait(timeout=30)
    with DeltaConsumer(root, "serving.snapshots", channel="snapshots") as probe:
        killed_at = probe.committed()
        try:  # the old way: the batch-0 shard files and the committed position (nothing committed)
            apply_poll(load_base(base0), probe.poll(timeout=1.0), complete_only=True)
            old_way = "applied"
        except StaleBaseError as exc:
            old_way = str(exc)
    # the trainer pauses after step 7, where the increment of step 6 is its newest: a slow
    # trainer (a loaded machine) may not be there yet when the replica was killed
    deadline = time.monotonic() + 120
    while _chain_step(ckpt) < 6 and time.monotonic() < deadline and not done.is_set():
        time.sleep(0.05)
    open(go, "w").close()
    # started again with no state of its own: the same consumer name, its committed position
    consumer = DeltaConsumer(root, "serving.snapshots", channel="snapshots")
    follower = Follower(consumer, ckpt)
    started = dict(follower.tables.batches), consumer.position()
    _follow(follower, done, time.monotonic() + 240)
    trainer.join(timeout=60)
    if "error" in result:
        raise result["error"]
    tables = {k: v.clone() for k, v in follower.tables.items()}
    consumer.close()
    return root, ckpt, base0, result["ranks"], tables, killed_at, (old_way, started)


def _chain_step(ckpt: str) -> int:
    """The step the newest complete chain under ``ckpt`` restores to (-1: none yet)."""
    try:
        return latest_chain(ckpt).step
    except (IncompleteBaseError, IncrementChainError, OSError):
        return -1



def test_a_replica_killed_and_started_with_no_state_ends_bit_exact(job):  # type: ignore[no-untyped-def]
    root, ckpt, base0, ranks, tables, killed_at, (old_way, started) = job
    assert min(killed_at.values()) >= 5, killed_at
    # started from the base and the increments to step 6 (the trainer paused after step 7),
    # its consumer moved to the batch after them
    assert started == ({0: 6, 1: 6}, {0: 7, 1: 7}), started
    assert "continues from batch 1" in old_way, old_way  # the batch-0 shard files: refused
    assert not (d := tables_diff(tables, full(ranks, "final_shards"))), d


def test_a_replica_added_after_delete_on_read_ends_bit_exact(job):  # type: ignore[no-untyped-def]
    root, ckpt, base0, ranks, _, _, _ = job
    with DeltaConsumer(root, "late.snapshots", channel="snapshots") as consumer:
        registered = consumer.position()
        assert min(registered.values()) > 1, registered  # the early snapshots were dropped
        follower = Follower(consumer, ckpt)
        done = threading.Event()
        done.set()
        _follow(follower, done, time.monotonic() + 60)
        assert not (d := tables_diff(dict(follower.tables), full(ranks, "final_shards"))), d
        consumer.seek(min(registered.values()))
        with pytest.raises(StaleBaseError):  # the batch-0 shard files: refused
            apply_poll(load_base(base0), consumer.poll(timeout=1.0), complete_only=True)


def test_a_poll_past_the_checkpoint_base_is_refused_and_says_how_to_get_a_fresh_one(job):  # type: ignore[no-untyped-def]
    """The tables continue from one past the batch of the chain's last increment, on each rank
    of the logs the base recorded: a consumer moved past it is refused, nothing applied."""
    root, ckpt, _, _, _, _, _ = job
    base = load_checkpoint_base(ckpt)
    assert set(base.logs) == {0, 1} and base.positions == {r: b + 1 for r, b in base.batches.items()}
    before = {k: v.clone() for k, v in base.items()}
    with DeltaConsumer(root, "probe.snapshots", channel="snapshots") as consumer:
        for rank, position in base.positions.items():
            consumer.seek(position + 1, rank=rank)
        with pytest.raises(StaleBaseError, match="checkpoint base.*serve.Follower"):
            apply_poll(base, consumer.poll(timeout=1.0), complete_only=True)
    assert not (d := tables_diff(dict(base), before)), d
