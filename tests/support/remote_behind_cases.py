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


def cut_range_case(rank: int, world_size: int, root: str, url: str, job: str) -> Dict[str, Any]:
    """Both ranks publish at the same steps; a shipper with ``max_batches=4`` ships both ranks
    after the first publish (each rank's range ends at its snapshots end, and the ranks have
    ended batches past the next cut), then, after the second publish, ships one range of rank 0
    alone: a range cut at batch 8, holding no publish. Rank 0 ships it; every rank closes."""
    from persistent_delta import Shipper

    dmp = build_sharded_model(rank, world_size, "ec", "row_wise,column_wise", "EXACT_SGD")
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["serving"], path=root,
                                            async_writes=False))
    batches = iter(make_batches("ec", 12, 8, seed=9, world_size=world_size, rank=rank))
    stamps = []

    def train(steps: int) -> None:
        for _ in range(steps):
            train_step(dmp, next(batches))

    # (steps before the publish, steps after it, ranks shipped, one range each or all)
    for before, after, ranks, once in ((3, 6, None, False), (2, 1, [0], True)):
        train(before)
        stamps.append(t.next_stamp)
        t.publish("serving")
        train(after)
        t.flush()
        dist.barrier()
        if rank == 0:
            with Shipper(root, url, job=job, channels=["snapshots"], ranks=ranks, max_batches=4) as shipper:
                shipper.run_once() if once else shipper.run(idle_exit_s=1.0)
        dist.barrier()
    t.close()
    return {"stamps": stamps}
