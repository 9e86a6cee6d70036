"""A real trainer process for crash tests: a 1-rank gloo DMP with the tracker attached.

Usage: python crash_trainer.py ROOT STEPS [MODE]. Consumer "a" reads every 3 steps, "b" never
(so retention keeps everything); every 4 steps it flushes and prints
``FLUSHED <curr_batch_idx> <offset of a>``; at the end it prints ``DONE``.
"""

import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import build_sharded_model, init_gloo, make_batches, train_step  # noqa: E402
from torchrec.distributed.model_tracker.types import TrackingMode  # noqa: E402

from persistent_delta import PersistentTrackerConfig, attach


def main() -> None:
    root, steps = sys.argv[1], int(sys.argv[2])
    mode = TrackingMode[sys.argv[3]] if len(sys.argv) > 3 else TrackingMode.ID_ONLY
    init_gloo()
    dmp = build_sharded_model(0, 1, "ec", "row_wise", "EXACT_ROWWISE_ADAGRAD", rows=500)
    tracker = attach(dmp, PersistentTrackerConfig(tracking_mode=mode, consumers=["a", "b"], path=root))
    print("START", tracker.curr_batch_idx, flush=True)
    batches = make_batches("ec", 50, 64, seed=7, world_size=1, rank=0, rows=500)
    for step in range(steps):
        # the batch fed at index b is a function of b, so a restarted trainer feeds the same data
        train_step(dmp, batches[tracker.curr_batch_idx % 50])
        if step % 3 == 2:
            tracker.get_unique("a")
        if step % 4 == 3:
            tracker.flush()
            print("FLUSHED", tracker.curr_batch_idx, tracker.per_consumer_batch_idx["a"], flush=True)
    tracker.close()
    print("DONE", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
