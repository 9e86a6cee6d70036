"""Per-rank body of the remote ranks-behind tests (tests/fleet/test_remote_behind.py): two
ranks train and publish on the ranks the test names, then close (module level, so spawned
ranks can import it)."""

from __future__ import annotations

from typing import Any, Dict, Sequence

import torch.distributed as dist
from torchrec.distributed.model_tracker.types import TrackingMode

from harness import build_sharded_model, make_batches, train_step
from persistent_delta import PersistentTrackerConfig, attach


def publish_on_case(rank: int, world_size: int, root: str, publishers: Sequence[int]) -> Dict[str, Any]:
    """Six steps; the ranks in ``publishers`` publish after steps 2 and 4; every rank closes."""
    dmp = build_sharded_model(rank, world_size, "ec", "row_wise,column_wise", "EXACT_SGD")
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["serving"], path=root))
    for i, b in enumerate(make_batches("ec", 6, 8, seed=9, world_size=world_size, rank=rank)):
        train_step(dmp, b)
        if rank in publishers and i in (2, 4):
            t.publish("serving")
    dist.barrier()
    out = {"curr": t.curr_batch_idx}
    t.close()
    return out
