"""One rank of a 2-rank trainer that publishes every step and survives SIGKILL (EC: table_0
row-wise, table_1 column-wise; ID_ONLY; consumer ``serving``), for the inference replica's
restore test.

Usage: python inference_trainer_ranks.py ROOT RANK PORT STEPS. After every publish the rank
saves its shards (weights and placement) as ``<root>/../pub/<stamp>.<rank>``; every 3 steps it
saves a checkpoint (shards and ``tracker.state_dict()``) as ``<root>/../ckpt/<batch>.<rank>``,
and when started again it restores the newest batch both ranks saved (as
``restore_trainer_ranks.py`` does). Prints ``START <curr_batch_idx>`` once attached and
restored, ``DONE`` at the end.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import build_sharded_model, init_gloo, make_batches, table_shard_info, train_step  # noqa: E402
from restore_trainer_ranks import restore_newest  # noqa: E402
from torchrec.distributed.model_tracker.types import TrackingMode  # noqa: E402

from persistent_delta import PersistentTrackerConfig, attach  # noqa: E402


def _save(obj: object, path: str) -> None:
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def main() -> None:
    root, rank, port, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    ckpt_dir, pub_dir = (os.path.join(os.path.dirname(root), d) for d in ("ckpt", "pub"))
    os.makedirs(ckpt_dir, exist_ok=True)
    os.makedirs(pub_dir, exist_ok=True)
    init_gloo(rank, 2, port, timeout=60)
    dmp = build_sharded_model(rank, 2, "ec", "row_wise,column_wise", "EXACT_SGD", rows=100)
    tracker = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, path=root, consumers=["serving"]))
    info = table_shard_info(dmp)
    restore_newest(tracker, ckpt_dir, rank)
    print("START", tracker.curr_batch_idx, flush=True)
    batches = make_batches("ec", 40, 16, seed=11, world_size=2, rank=rank, rows=100)
    for step in range(steps):
        train_step(dmp, batches[tracker.curr_batch_idx % 40])
        stamp = tracker.curr_batch_idx
        tracker.publish("serving")
        _save({f: (t.weights().detach().clone(), info[f]) for f, t in tracker.local_tables.items()},
              os.path.join(pub_dir, f"{stamp}.{rank}"))
        if step % 3 == 2:
            state = {"tables": {f: t.weights().detach().clone() for f, t in tracker.local_tables.items()},
                     "tracker": tracker.state_dict()}
            _save(state, os.path.join(ckpt_dir, f"{state['tracker']['curr_batch_idx']}.{rank}"))
    tracker.close()
    print("DONE", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
