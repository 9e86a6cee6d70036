"""One rank of a 2-rank trainer for the multi-rank crash test (EC, column-wise: every table's
columns are split over both ranks; EMBEDDING mode).

Usage: python crash_trainer_ranks.py ROOT RANK PORT STEPS. Prints ``START <curr_batch_idx>`` after
attach, then trains; ``DONE`` at the end. The batch fed at index b is a function of b.
"""

import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import build_sharded_model, init_gloo, make_batches, train_step  # noqa: E402
from torchrec.distributed.model_tracker.types import TrackingMode  # noqa: E402

from persistent_delta import PersistentTrackerConfig, attach


def main() -> None:
    root, rank, port, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    init_gloo(rank, 2, port, timeout=60)
    dmp = build_sharded_model(rank, 2, "ec", "column_wise", "EXACT_SGD", rows=300)
    tracker = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.EMBEDDING, path=root, linger_steps=1))
    print("START", tracker.curr_batch_idx, flush=True)
    batches = make_batches("ec", 40, 32, seed=11, world_size=2, rank=rank, rows=300)
    for _ in range(steps):
        train_step(dmp, batches[tracker.curr_batch_idx % 40])
    tracker.close()
    print("DONE", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
