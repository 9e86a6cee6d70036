"""Trainer and replica sides of the shipping tests (tests/fleet/): spawnable trainer ranks, a
replica process that reads only from the stream, and waits on what the stream holds."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Dict, Optional

import torch
from torchrec.distributed.model_tracker.types import TrackingMode

from persistent_delta import PersistentTrackerConfig, attach
from persistent_delta.config import RetentionBound
from persistent_delta.fleet import nats, subjects, wire
from persistent_delta.fleet.streams import read_layout
from persistent_delta.read.consumer import DeltaReader
from harness import build_sharded_model, make_batches, table_shard_info, train_step

ROWS, DIM, TABLES, SEED = 100, 8, 2, 3


def trainer(rank: int, world_size: int, root: str, out: str, steps: int, publish_every: int, sharding: str,
            step_sleep: float = 0.0, retention_batches: Optional[int] = None, start_flag: str = "",
            big_rows: int = 0, base: str = "") -> Dict[str, Any]:
    """Train ``steps`` steps, publish every ``publish_every`` (and at the end), save the final
    local shards to ``out/rank-<r>.pt``. ``start_flag``: wait for that file before training.
    ``base``: ``"URL JOB STEP"``: upload a base to the stream right after the publish
    of that step."""
    dmp = build_sharded_model(rank, world_size, "ec", sharding, "EXACT_ROWWISE_ADAGRAD", num_tables=TABLES,
                              rows=max(ROWS, big_rows), dim=DIM, seed=SEED)
    bound = RetentionBound(max_batches=retention_batches) if retention_batches else None
    cfg = PersistentTrackerConfig(path=root, tracking_mode=TrackingMode.EMBEDDING, consumers=["serving"],
                                  delete_on_read=True, retention=bound)
    t = attach(dmp, cfg)
    while start_flag and not os.path.exists(start_flag):
        time.sleep(0.05)
    t0 = time.monotonic()
    for i, b in enumerate(make_batches("ec", steps, 8, seed=5, world_size=world_size, rank=rank, num_tables=TABLES,
                                       rows=max(ROWS, big_rows))):
        train_step(dmp, b)
        if (i + 1) % publish_every == 0 or i + 1 == steps:
            t.publish("serving")
            if base and i + 1 == int(base.split()[2]):
                from persistent_delta.fleet.ship import upload_base

                url, job, _ = base.split()
                upload_base(url, job, rank, t.curr_batch_idx, {f: lt.weights() for f, lt in t.local_tables.items()})
        if step_sleep:
            time.sleep(step_sleep)
    elapsed = time.monotonic() - t0
    shards = {fqn: (lt.weights().detach().clone(), info) for (fqn, lt), info in
              zip(sorted(t.local_tables.items()), [table_shard_info(dmp)[f] for f in sorted(t.local_tables)])}
    torch.save(shards, os.path.join(out, f"rank-{rank}.pt"))
    t.close()
    return {"elapsed": elapsed}


def assemble(out: str, world_size: int) -> Dict[str, torch.Tensor]:
    """The trainer's final full tables, from the saved shards."""
    full: Dict[str, torch.Tensor] = {}
    for r in range(world_size):
        for fqn, (w, info) in torch.load(os.path.join(out, f"rank-{r}.pt")).items():
            t = full.setdefault(fqn, torch.zeros(info["global_rows"], info["global_cols"], dtype=w.dtype))
            ro, co = info["row_offset"], info["col_offset"]
            t[ro:ro + w.shape[0], co:co + w.shape[1]] = w
    return full


DP_ROWS = 140_000  # > 131,072: one publish's per-row stamps alone (8 bytes a row) exceed a 1 MiB payload


def dp_trainer(rank: int, world_size: int, root: str, out: str) -> Dict[str, Any]:
    """A replicated (data-parallel) table_0 over DP_ROWS rows and a row-wise table_1, ID_ONLY,
    publish("serving") after every step. In the first step rank 0 looks up every row of
    table_0 (one publish of 140,000 replicated rows); later steps are small Zipf batches on
    both ranks, so a row's newest value comes from either rank's publish. Saves the final
    local shards to ``out/rank-<r>.pt``."""
    from harness import DENSE_IN, Batch, feature_names
    from torchrec import KeyedJaggedTensor

    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_ROWWISE_ADAGRAD", num_tables=2, rows=DP_ROWS,
                              dim=4, seed=SEED, dp_tables=(0,))
    t = attach(dmp, PersistentTrackerConfig(path=root, tracking_mode=TrackingMode.ID_ONLY, consumers=["serving"]))
    feats = [f for fs in feature_names(2).values() for f in fs]  # table_0: feature_0, feature_1; table_1: feature_2
    bags = 1000
    g = torch.Generator().manual_seed(rank)
    lengths = torch.cat([torch.full((bags,), DP_ROWS // bags if rank == 0 else 1, dtype=torch.long),
                         torch.zeros(bags, dtype=torch.long), torch.ones(bags, dtype=torch.long)])
    ids0 = torch.arange(DP_ROWS) if rank == 0 else torch.randint(0, DP_ROWS, (bags,), generator=g)
    first = Batch(torch.rand(bags, DENSE_IN, generator=g), KeyedJaggedTensor.from_lengths_sync(
        keys=feats, values=torch.cat([ids0, torch.randint(0, DP_ROWS, (bags,), generator=g)]), lengths=lengths))
    for b in [first] + make_batches("ec", 6, 16, seed=9, world_size=world_size, rank=rank, num_tables=2, rows=DP_ROWS,
                                    zipf_s=1.05):
        train_step(dmp, b)
        t.publish("serving")
    shards = {fqn: (lt.weights().detach().clone(), info) for (fqn, lt), info in
              zip(sorted(t.local_tables.items()), [table_shard_info(dmp)[f] for f in sorted(t.local_tables)])}
    torch.save(shards, os.path.join(out, f"rank-{rank}.pt"))
    t.close()
    return {}


def stream_caught_up(root: str, url: str, job: str, channel: str) -> bool:
    """Whether the stream holds every batch of the local logs' channel (ends equal)."""
    with DeltaReader(root, channel=channel) as r:
        local = r.end_offsets()
    conn = nats.Connection(url)
    try:
        layout = read_layout(conn, job, None)  # the stream of each rank
        for rank, end in local.items():
            last = conn.last_message(job, subjects.end_subject(job, channel, rank), stream=layout.stream(rank))
            if last is None or wire.Marker.decode(last.data, last.seq, "test").end != end:
                return False
        return True
    finally:
        conn.close()


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll ``cond`` every 0.1 s; raise AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
