"""Per-rank body of the tests of a replica's fresh base from the trainer's checkpoints (module
level, so spawned ranks can import it), and the replica process those tests kill."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Dict, Tuple

import torch.distributed as dist
from torchrec.distributed.model_tracker.types import TrackingMode

from harness import build_sharded_model, make_batches, table_shard_info, train_step
from persistent_delta import PersistentTrackerConfig, attach, save_local_shards
from persistent_delta.trainer.increments import Checkpoints

ROWS, STEPS, PAUSE_AFTER, EVERY = 60, 13, 7, 2  # the last increment at step 12, then one publish


def checkpointed_job_case(rank: int, world_size: int, root: str, ckpt: str, base0: str, go: str,
                          sharding: str = "row_wise") -> Dict[str, Any]:
    """A job (its 2 tables sharded by ``sharding``, as the harness reads it) on a ``delete_on_read`` log that publishes to ``"serving"`` after every
    step, takes a base at step 0 (and the batch-0 shard files ``base0``: the old way) and an
    increment every ``EVERY`` steps; after ``PAUSE_AFTER`` steps it waits for the file ``go``
    (the test kills its replica meanwhile). Returns this rank's shards at the end."""
    dmp = build_sharded_model(rank, world_size, "ec", sharding, "EXACT_ROWWISE_ADAGRAD", rows=ROWS)
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["serving"], path=root,
                                            delete_on_read=True))
    ckpts = Checkpoints(dmp, None, ckpt, every=EVERY)
    save_local_shards(t, base0)
    ckpts.save_base()
    for i, b in enumerate(make_batches("ec", STEPS, 8, seed=3, world_size=world_size, rank=rank, rows=ROWS)):
        train_step(dmp, b)
        t.publish("serving")
        t.flush()
        if i + 1 == PAUSE_AFTER:
            deadline = time.monotonic() + 120
            while not os.path.exists(go) and time.monotonic() < deadline:
                time.sleep(0.05)
            dist.barrier()
    ckpts.close()
    out = {"info": table_shard_info(dmp),
           "final_shards": {fqn: lt.weights().detach().clone() for fqn, lt in t.local_tables.items()}}
    dist.barrier()
    t.close()
    return out


def train_in_thread(root: str, ckpt: str, base0: str, go: str,
                    sharding: str) -> Tuple[threading.Thread, Dict[str, Any], threading.Event]:
    """Run :func:`checkpointed_job_case` on 2 spawned ranks from a thread of the test: returns
    the thread, the box its result goes into (``"ranks"``, or ``"error"``: re-raise it in the
    test) and the event set when it ended; plus ``env()`` for the test's child processes."""
    from harness import run_spawn

    result: Dict[str, Any] = {}
    done = threading.Event()

    def train() -> None:
        try:
            result["ranks"] = run_spawn(checkpointed_job_case, 2, root, ckpt, base0, go, sharding, timeout=240)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            result["error"] = exc
        finally:
            done.set()

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    return trainer, result, done


def child_env() -> Dict[str, str]:
    """The environment of a test's child process: the repo and the test support importable."""
    from procs import REPO, SUPPORT

    return dict(os.environ, PYTHONPATH=REPO + os.pathsep + SUPPORT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def replica_main(root: str, ckpt: str) -> None:
    """A replica process: follows the trainer (``serving.snapshots``) from its checkpoints,
    printing ``APPLIED <rank 0's end>`` after each poll that moved."""
    from persistent_delta import DeltaConsumer
    from persistent_delta.serve.fresh_base import Follower

    consumer = DeltaConsumer(root, "serving.snapshots", channel="snapshots", wait=60)
    follower = Follower(consumer, ckpt, wait=60)
    while True:
        applied = follower.step(timeout=0.5)
        if applied is not None and applied.ranges:
            print("APPLIED", applied.ranges[0][1], flush=True)


if __name__ == "__main__":
    replica_main(sys.argv[1], sys.argv[2])
