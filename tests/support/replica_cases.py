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
