"""One rank of a 2-rank trainer that checkpoints with torch.distributed.checkpoint (DCP) and,
when started again, restores the newest checkpoint with DCP (EC, EMBEDDING mode, every table
sharded ``SHARDING``: row_wise or column_wise; a publish to "serving" after every step).

Usage: python dcp_trainer_ranks.py ROOT RANK PORT STEPS SHARDING OUT.

Every 5 steps the ranks save ``{"model": dmp.state_dict()}`` with ``dcp.save`` to
``<ROOT>/../dcp/batch-<b>`` (the fused EXACT_SGD optimizer has no state to save: DCP's load
refuses its empty state as a missing key), then rank 0 names it in ``dcp/LATEST``. At start,
the newest one is loaded as DCP users do: ``sd = {"model": dmp.state_dict()}`` as the target,
``dcp.load(sd)``, ``dmp.load_state_dict(sd["model"])``; the tracker restores at the first step.

Prints ``START <batch after the first step> <floor> <floor after the load target>`` (the log's
checkpoint floor before and after building the target and loading into it), ``SAVED <b>``
after each checkpoint, ``DONE`` at the end (after saving this rank's final tables to
``OUT/rank-<r>.pt`` as {fqn: (local shard, shard info)}). Exits 3 if a save did not mark its
checkpoint.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import build_sharded_model, init_gloo, make_batches, table_shard_info, train_step  # noqa: E402
from torchrec.distributed.model_tracker.types import TrackingMode  # noqa: E402

from persistent_delta import DeltaConsumer, PersistentTrackerConfig, attach  # noqa: E402
from persistent_delta.log import position_rules  # noqa: E402

ROWS = 300


def floor(tracker) -> int:  # type: ignore[no-untyped-def]
    """The log's checkpoint floor (-1: none marked)."""
    value = tracker.log.read(position_rules.checkpoint_floor)
    return -1 if value is None else int(value)


def main() -> None:
    root, rank, port, steps, sharding, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
        sys.argv[5], sys.argv[6]
    ckpt_dir = os.path.join(os.path.dirname(root), "dcp")
    latest = os.path.join(ckpt_dir, "LATEST")
    os.makedirs(ckpt_dir, exist_ok=True)
    init_gloo(rank, 2, port, timeout=60)
    dmp = build_sharded_model(rank, 2, "ec", sharding, "EXACT_SGD", rows=ROWS)
    tracker = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.EMBEDDING, path=root,
                                                  consumers=["serving"], linger_steps=1))
    dist.barrier()
    if rank == 0:  # the replica, registered before the first publish: every snapshot stays for it
        DeltaConsumer(root, "replica", channel="snapshots").close()
    before = after = floor(tracker)
    if os.path.exists(latest):
        target = {"model": dmp.state_dict()}  # the load target: must change nothing in the log
        dcp.load(target, checkpoint_id=os.path.join(ckpt_dir, open(latest).read().strip()))
        after = floor(tracker)
        dmp.load_state_dict(target["model"])  # the tracker restores at the first step
    batches = make_batches("ec", 40, 32, seed=11, world_size=2, rank=rank, rows=ROWS)
    for step in range(steps):
        train_step(dmp, batches[tracker.curr_batch_idx % 40])
        tracker.publish("serving")
        if step == 0:
            print("START", tracker.curr_batch_idx, before, after, flush=True)
        if step % 5 == 4:
            batch = tracker.curr_batch_idx
            name = f"batch-{batch}"
            dcp.save({"model": dmp.state_dict()}, checkpoint_id=os.path.join(ckpt_dir, name))
            if floor(tracker) != batch + 1:
                print("UNMARKED", batch, floor(tracker), flush=True)
                sys.exit(3)
            dist.barrier()  # every rank saved before the checkpoint is named
            if rank == 0:
                with open(latest + ".tmp", "w") as f:
                    f.write(name)
                os.replace(latest + ".tmp", latest)
            print("SAVED", batch, flush=True)
    tracker.flush()
    torch.save({fqn: (lt.weights().detach().clone(), table_shard_info(dmp)[fqn])
                for fqn, lt in tracker.local_tables.items()}, os.path.join(out, f"rank-{rank}.pt"))
    tracker.close()
    dist.barrier()
    print("DONE", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
