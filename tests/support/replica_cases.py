"""Per-rank bodies of the serving-replica tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

from typing import Any, Dict

from torchrec.distributed.model_tracker.types import TrackingMode

from harness import build_sharded_model, make_batches, train_step
from persistent_delta import PersistentTrackerConfig, attach


def shard_files_case(rank: int, world_size: int, root: str, shard_dir: str, sharding: str) -> Dict[str, Any]:
    """Train a few steps, write the shard files, and return this rank's shards (weights and
    their place in the full table) for the test to assemble the expected tables."""
    from persistent_delta.trainer.save_shards import save_local_shards

    dmp = build_sharded_model(rank, world_size, "ec", sharding, "EXACT_SGD", rows=60)
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, path=root))
    for b in make_batches("ec", 3, 8, seed=3, world_size=world_size, rank=rank, rows=60):
        train_step(dmp, b)
    save_local_shards(t, shard_dir)
    out = {fqn: (lt.weights().detach().clone(), lt.row_offset, lt.col_offset, lt.global_rows, lt.global_cols)
           for fqn, lt in t.local_tables.items()}
    t.close()
    return out


# A replica process: the first name it tries is the one the trainer publishes to.
REPLICA = r"""
import sys
from persistent_delta import DeltaConsumer
from persistent_delta.errors import PersistentDeltaError
root, name = sys.argv[1], sys.argv[2]
try:
    with DeltaConsumer(root, name, channel="snapshots") as c:
        print("ROWS", c.poll().num_rows)
except PersistentDeltaError as exc:
    print("ERROR", type(exc).__name__, exc)
"""


def same_name_case(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """The trainer publishes to "serving"; a replica in another process asks for the snapshots
    as "serving", then under the name the error suggests."""
    from procs import run_python

    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_SGD")
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, path=root, consumers=["serving"]))
    for b in make_batches("ec", 2, 8, seed=3, world_size=world_size, rank=rank):
        train_step(dmp, b)
    t.publish("serving")
    t.flush()
    first = run_python(REPLICA, root, "serving").stdout.strip().splitlines()[-1]
    second = None
    if "DeltaConsumer(" in first:  # the error names the call to make: run it
        suggested = first.split("DeltaConsumer(", 1)[1].split(",")[1].strip().strip("'\"")
        second = run_python(REPLICA, root, suggested).stdout.strip().splitlines()[-1]
    t.close()
    return {"first": first, "second": second}
