"""Eval forwards and the tracker: recorded by default (as TorchRec's tracker), skipped with
``track_eval=False``."""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from torchrec.distributed.model_tracker.types import TrackingMode

from harness import build_sharded_model, make_batches, train_step
from persistent_delta import PersistentTrackerConfig, attach


def eval_forward_case(rank: int, world_size: int, root: str, mode_name: str, track_eval: bool) -> Dict[str, Any]:
    """Train 3 batches, run 2 eval forwards on batches of other ids, train 1 more; return the
    ids get_unique reports, the ids the training batches and the eval batches looked up (per
    global table name), and the batch index."""
    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_ROWWISE_ADAGRAD", rows=200)
    tracker = attach(dmp, PersistentTrackerConfig(path=root, tracking_mode=TrackingMode[mode_name],
                                                  consumers=["c"], track_eval=track_eval))
    train = make_batches("ec", 4, 8, seed=1, world_size=world_size, rank=rank, rows=200)
    evals = make_batches("ec", 2, 8, seed=2, world_size=world_size, rank=rank, rows=200)
    for b in train[:3]:
        train_step(dmp, b)
    dmp.eval()
    with torch.no_grad():
        for b in evals:
            dmp(b.dense, b.sparse)
    dmp.train()
    train_step(dmp, train[3])
    rows = tracker.get_unique("c")
    out = {"ids": {f.rsplit(".", 1)[1]: sorted(r.ids.tolist()) for f, r in rows.items()},
           "batch": tracker.curr_batch_idx}
    tracker.close()
    return out


def looked_up(batches: List[Any]) -> List[int]:
    return sorted({int(x) for b in batches for x in b.sparse.values().tolist()})
