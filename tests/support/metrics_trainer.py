"""A real trainer that serves its own metrics: a 1-rank gloo DMP, the tracker attached and
``serve_metrics(tracker=...)``.

Usage: python metrics_trainer.py ROOT STEPS STOPFILE. Prints ``PORT <port>`` once serving, trains
STEPS steps (its consumer "a" reads every 3 steps, "b" is published to every 5), flushes and prints ``DONE <curr_batch_idx>``, then
keeps serving until STOPFILE exists, and closes.
"""

import os
import sys
import time

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import build_sharded_model, init_gloo, make_batches, train_step  # noqa: E402
from torchrec.distributed.model_tracker.types import TrackingMode  # noqa: E402

from persistent_delta import PersistentTrackerConfig, attach  # noqa: E402
from persistent_delta.ops.metrics import serve_metrics  # noqa: E402


def main() -> None:
    root, steps, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    init_gloo()
    dmp = build_sharded_model(0, 1, "ec", "row_wise", "EXACT_ROWWISE_ADAGRAD", rows=500)
    tracker = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["a", "b"], path=root))
    srv = serve_metrics(tracker=tracker, job="metrics-test", port=0)
    print("PORT", srv.port, flush=True)
    batches = make_batches("ec", 20, 32, seed=7, world_size=1, rank=0, rows=500)
    for step in range(steps):
        train_step(dmp, batches[step % 20])
        if step % 3 == 2:
            tracker.get_unique("a")
        if step % 5 == 4:
            tracker.publish("b")
        time.sleep(0.05)  # a job that lasts a few scrapes
    tracker.flush()
    print("DONE", tracker.curr_batch_idx, flush=True)
    while not os.path.exists(stop):
        time.sleep(0.1)
    srv.close()
    tracker.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
