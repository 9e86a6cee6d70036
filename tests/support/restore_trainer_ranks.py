"""One rank of a 2-rank trainer that checkpoints and, when started again, restores (EC,
column-wise: every table's columns are split over both ranks; EMBEDDING mode).

Usage: python restore_trainer_ranks.py ROOT RANK PORT STEPS. Every 7 steps both ranks save a
checkpoint (their table shards and ``tracker.state_dict()``) as ``ckpt/<batch>.<rank>``; at
start, the newest batch both ranks saved is restored (weights, then ``load_state_dict``).
Prints ``START <curr_batch_idx>`` once attached and restored, ``DONE`` at the end.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import build_sharded_model, init_gloo, make_batches, train_step  # noqa: E402
from torchrec.distributed.model_tracker.types import TrackingMode  # noqa: E402

from persistent_delta import PersistentTrackerConfig, attach  # noqa: E402


def newest_common(ckpt_dir: str) -> int:
    saved = [f.split(".") for f in os.listdir(ckpt_dir) if not f.endswith(".tmp")]
    by_rank = {r: {int(b) for b, rr in saved if rr == str(r)} for r in (0, 1)}
    common = by_rank[0] & by_rank[1]
    return max(common) if common else -1


def restore_newest(tracker, ckpt_dir: str, rank: int) -> None:  # type: ignore[no-untyped-def]
    """Restore the tables and the tracker from the newest checkpoint both ranks saved (if any); a collective."""
    batch = newest_common(ckpt_dir)
    dist.barrier()  # both ranks chose before either saves again
    if batch >= 0:
        saved = torch.load(os.path.join(ckpt_dir, f"{batch}.{rank}"), weights_only=False)
        with torch.no_grad():
            for fqn, w in saved["tables"].items():
                tracker.local_tables[fqn].weights().copy_(w)
        tracker.load_state_dict(saved["tracker"])


def main() -> None:
    root, rank, port, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    ckpt_dir = os.path.join(os.path.dirname(root), "ckpt")
    os.makedirs(ckpt_dir, exist_ok=True)
    init_gloo(rank, 2, port, timeout=60)
    dmp = build_sharded_model(rank, 2, "ec", "column_wise", "EXACT_SGD", rows=300)
    tracker = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.EMBEDDING, path=root, linger_steps=1))
    restore_newest(tracker, ckpt_dir, rank)
    print("START", tracker.curr_batch_idx, flush=True)
    batches = make_batches("ec", 40, 32, seed=11, world_size=2, rank=rank, rows=300)
    for step in range(steps):
        train_step(dmp, batches[tracker.curr_batch_idx % 40])
        if step % 7 == 6:
            state = {"tables": {f: t.weights().detach().clone() for f, t in tracker.local_tables.items()},
                     "tracker": tracker.state_dict()}
            path = os.path.join(ckpt_dir, f"{state['tracker']['curr_batch_idx']}.{rank}")
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)
    tracker.close()
    print("DONE", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
