"""The remote replica process of tests/fleet/test_remote_fresh_base.py: it follows a job from
the stream only (a ``RemoteConsumer`` and a ``Follower`` without checkpoints), unable to read
the trainer's log or checkpoint directories (an audit hook fails every open under them), and
prints ``APPLIED <rank 0's end>`` after each poll that moved."""

from __future__ import annotations

import sys
import time
from typing import Any, Dict

from ship_replica import forbid


def replica_main(url: str, job: str, name: str, *forbidden: str) -> None:
    from persistent_delta import RemoteConsumer
    from persistent_delta.serve import Follower

    for path in forbidden:
        forbid(path)
    consumer = RemoteConsumer(url, job, name, channel="snapshots", wait=60)
    follower = Follower(consumer, wait=60)
    print("STARTED", " ".join(f"{r}:{b}" for r, b in sorted(follower.tables.batches.items())), flush=True)
    while True:
        applied = follower.step(timeout=0.5)
        if applied is not None and applied.ranges:
            print("APPLIED", applied.ranges[0][1], flush=True)


if __name__ == "__main__":
    replica_main(*sys.argv[1:])


def retention_case(rank: int, world_size: int, root: str, ckpt: str) -> Dict[str, Any]:
    """One rank, in one process: the trainer (an increment every 2 steps, a publish after every
    step), its shipper and a remote replica on the in-process memory transport, whose clock the
    case moves. The replica follows, then stops stepping while the trainer goes on; the clock
    moves past the stream's age limit, so the publishes after the replica's position expire;
    its next step loads the newest base from the stream and it catches up. Returns what each
    phase saw (run by tests/fleet/test_remote_fresh_base.py)."""
    import torch
    from torchrec.distributed.model_tracker.types import TrackingMode

    from harness import build_sharded_model, make_batches, train_step
    from persistent_delta import PersistentTrackerConfig, RemoteConsumer, Shipper, attach
    from persistent_delta.errors import OffsetOutOfRangeError
    from persistent_delta.fleet.memory import MemoryBroker
    from persistent_delta.fleet.transport import StreamOptions
    from persistent_delta.serve import Follower
    from persistent_delta.trainer import Checkpoints

    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_ROWWISE_ADAGRAD", rows=60)
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["serving"], path=root))
    ckpts = Checkpoints(dmp, None, ckpt, every=2)
    ckpts.save_base()
    now = [0.0]
    broker = MemoryBroker(clock=lambda: now[0])
    shipper = Shipper(root, None, "ret", channels=["snapshots"], transport=broker.connect("shipper"),
                      stream=StreamOptions(max_age_s=10.0), checkpoints=ckpt)
    batches = iter(make_batches("ec", 9, 8, seed=5, world_size=world_size, rank=rank, rows=60))

    def train(n: int) -> None:
        for _ in range(n):
            train_step(dmp, next(batches))
            t.publish("serving")
        t.flush()
        shipper.run(idle_exit_s=1.2)  # past the shipper's look at the chain (every second)

    def same() -> bool:
        return all(torch.equal(follower.tables[fqn], lt.weights()) for fqn, lt in t.local_tables.items())

    def catch_up() -> None:
        deadline = time.monotonic() + 30
        while follower.positions()[0] != follower.positions()[1]:
            assert time.monotonic() < deadline, follower.positions()
            follower.step(timeout=0.2)

    out: Dict[str, Any] = {}
    train(3)
    consumer = RemoteConsumer(None, "ret", "replica", channel="snapshots", wait=5, transport=broker.connect())
    follower = Follower(consumer, wait=5, rebase_every=0.0)
    out["first"] = dict(follower.tables.batches)
    catch_up()
    out["first_same"], out["first_at"] = same(), follower.tables.positions
    consumer.commit()
    train(4)  # the replica does not step meanwhile
    now[0] = 100.0  # the stream's age limit passes: what it has not read expires at the next store
    train(2)  # the increment of step 8 is taken at step 9's forward
    try:
        consumer.poll(timeout=0.2)
        out["expired"] = None
    except OffsetOutOfRangeError as exc:
        out["expired"] = type(exc).__name__
    for r, p in out["first_at"].items():
        consumer.seek(p, rank=r)  # back where the follower's tables continue from
    reloads = follower.reloads
    catch_up()
    out["reloads"], out["second"] = follower.reloads - reloads, dict(follower.tables.batches)
    out["second_same"] = same()
    consumer.close()
    shipper.close()
    ckpts.close()
    t.close()
    return out
