"""Per-rank body of the remote-restore test (tests/fleet/test_remote_restore.py): a trainer
restored from a checkpoint after a SIGKILL while a shipper ships its logs to the stream.

Two ranks, column-wise tables (every table's columns split over both ranks), ID_ONLY, a publish
after every step. Rank 1 commits the last batch before the kill and rank 0 does not (as a
SIGKILL between the two ranks' commits leaves them); the shipper ships both ranks' logs at that
moment, so the stream holds rank 1's publish of a batch that rank 0 never completed. The ranks
restart, restore the checkpoint (``tracker.load_state_dict``), publish, and the shipper ships
again. The parent then reads only the stream and compares a replica with the trainer's tables.
"""

from __future__ import annotations

import os
from typing import Any, Dict

import torch
import torch.distributed as dist
from torchrec.distributed.model_tracker.types import TrackingMode

from harness import build_sharded_model, make_batches, table_shard_info, train_step
from persistent_delta import PersistentTrackerConfig, Shipper, attach, upload_base
from restore_cases import _rewind

JOB = "restore"


def _ship(root: str, url: str) -> None:
    shipper = Shipper(root, url, job=JOB, channels=["snapshots"])
    shipper.run(idle_exit_s=1.5)
    shipper.close()


def killed_between_commits_shipped_case(rank: int, world_size: int, root: str, url: str, out: str) -> Dict[str, Any]:
    """See the module docs. Saves ``out/rank-<r>.pt``: {fqn: (final local shard, shard info)}."""
    cfg = PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, path=root, consumers=["serving"])
    dmp = build_sharded_model(rank, world_size, "ec", "column_wise", "EXACT_SGD")
    batches = make_batches("ec", 12, 8, seed=9, world_size=world_size, rank=rank)
    t = attach(dmp, cfg)
    t.publish("serving")
    upload_base(url, JOB, rank, t.curr_batch_idx, {fqn: lt.weights() for fqn, lt in t.local_tables.items()})
    for b in batches[:3]:
        train_step(dmp, b)
        t.publish("serving")
    ckpt = {fqn: lt.weights().detach().clone() for fqn, lt in t.local_tables.items()}
    tstate = t.state_dict()
    for b in batches[3:8]:
        train_step(dmp, b)
        t.publish("serving")
    last = t.curr_batch_idx
    t.close()
    dist.barrier()
    if rank == 0:  # killed before committing its last batch; rank 1 committed it
        _rewind(os.path.join(root, "rank-0"), last - 1)
        _ship(root, url)  # the shipper ships what each rank's log holds now
    dist.barrier()
    t = attach(dmp, cfg)  # the restart: the ranks agree to drop what not every rank completed
    with torch.no_grad():
        for fqn, w in ckpt.items():
            t.local_tables[fqn].weights().copy_(w)
    redelivered = t.load_state_dict(tstate)
    t.publish("serving")
    t.flush()
    shards = {fqn: (lt.weights().detach().clone(), table_shard_info(dmp)[fqn]) for fqn, lt in t.local_tables.items()}
    torch.save(shards, os.path.join(out, f"rank-{rank}.pt"))
    t.close()
    dist.barrier()
    if rank == 0:
        _ship(root, url)
    dist.barrier()
    return {"redelivered": {k: int(v) for k, v in redelivered.items()}, "last": last}
