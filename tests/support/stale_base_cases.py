"""Per-rank body of the tests of a replica's base against its consumer's position (module level,
so spawned ranks can import it)."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping

import torch
import torch.distributed as dist
from torchrec.distributed.model_tracker.types import TrackingMode

from harness import build_sharded_model, make_batches, table_shard_info, train_step
from persistent_delta import DeltaConsumer, PersistentTrackerConfig, apply_poll, attach, load_base, save_local_shards

ROWS = 60


def serving_job_case(rank: int, world_size: int, root: str, base0: str, fresh: str) -> Dict[str, Any]:
    """The serving guide's loop on a ``delete_on_read`` log: the shard files saved before
    training (``base0``), a replica (rank 0's process) registered before the first publish that
    applies and commits every publish but the last, then one more publish and the shard files
    saved right after it (``fresh``). Returns this rank's shards at the last publish the replica
    applied and at the end, and (rank 0) the replica's tables, its ranges and its base's
    positions."""
    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_ROWWISE_ADAGRAD", rows=ROWS)
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["serving"], path=root,
                                            delete_on_read=True))
    save_local_shards(t, base0)
    dist.barrier()
    out: Dict[str, Any] = {"info": table_shard_info(dmp), "ranges": []}
    if rank == 0:
        tables = load_base(base0, wait=60)
        out["base_positions"] = tables.positions
        consumer = DeltaConsumer(root, "serving.snapshots", channel="snapshots", wait=60)
    dist.barrier()  # registered before the first publish
    for i, b in enumerate(make_batches("ec", 8, 8, seed=3, world_size=world_size, rank=rank, rows=ROWS)):
        train_step(dmp, b)
        if i % 2 == 1:
            t.publish("serving")
            t.flush()
            dist.barrier()
            if i < 7:
                out["applied_shards"] = {fqn: lt.weights().detach().clone() for fqn, lt in t.local_tables.items()}
                if rank == 0:
                    applied = apply_poll(tables, consumer.poll(timeout=10), complete_only=True)
                    consumer.commit()
                    out["ranges"].append(applied.ranges)
            dist.barrier()
    save_local_shards(t, fresh)  # right after the last publish: its next publish takes the next stamp
    out["final_shards"] = {fqn: lt.weights().detach().clone() for fqn, lt in t.local_tables.items()}
    out["next_stamp"], out["curr_batch_idx"] = t.next_stamp, t.curr_batch_idx
    if rank == 0:
        out["replica"] = {fqn: w.clone() for fqn, w in tables.items()}
        out["replica_positions"] = tables.positions
        consumer.close()
    dist.barrier()
    t.close()
    return out


def retention_mid_poll_case(rank: int, world_size: int, root: str, base_dir: str) -> Dict[str, Any]:
    """A replica restarted at its base, behind its consumer's committed position, whose first
    poll races the trainer's retention (a ``delete_on_read`` log, one rank): shard files saved
    after the first publish, three more publishes all read and committed by the replica before
    it "crashed"; then its consumer is moved back to the base's position and the trainer's next
    publish -- which deletes the snapshots below the committed position -- commits after the
    poll checked its bounds and before it read the records (the poll's fetch runs it first).
    Returns the poll's outcome (``"refused"``: the error; ``"applied"``: its ranges), the
    consumer's committed position and the base's."""
    from persistent_delta.errors import OffsetOutOfRangeError
    from persistent_delta.read import fetch

    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_ROWWISE_ADAGRAD", rows=ROWS)
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["serving"], path=root,
                                            delete_on_read=True))
    consumer = DeltaConsumer(root, "serving.snapshots", channel="snapshots")
    batches = make_batches("ec", 5, 8, seed=3, world_size=world_size, rank=rank, rows=ROWS)
    for i, b in enumerate(batches[:4]):
        train_step(dmp, b)
        t.publish("serving")
        t.flush()
        if i == 0:
            save_local_shards(t, base_dir)
    consumer.poll()
    out: Dict[str, Any] = {"committed": consumer.commit()}
    base = load_base(base_dir)
    out["base_positions"] = base.positions
    for r, position in base.positions.items():
        consumer.seek(position, rank=r)
    real = fetch.fetch_ranks

    def publish_first(*args: Any, **kwargs: Any) -> Any:
        fetch.fetch_ranks = real
        train_step(dmp, batches[4])
        t.publish("serving")
        t.flush()
        return real(*args, **kwargs)

    fetch.fetch_ranks = publish_first
    try:
        out["applied"] = apply_poll(base, consumer.poll(), complete_only=True).ranges
    except OffsetOutOfRangeError as exc:
        out["refused"] = str(exc)
    finally:
        fetch.fetch_ranks = real
    consumer.close()
    t.close()
    return out


def fresh_start_case(rank: int, world_size: int, root: str, old_base: str, new_base: str) -> Dict[str, Any]:
    """A job run twice on one log path: the first run publishes and saves its shard files at the
    end (``old_base``); the second starts afresh (``fresh=True``: a new log identity, batches
    from 0 again), saves its shard files before training (``new_base``, the documented path)
    and publishes. Returns this rank's shards at the end of the second run."""
    out: Dict[str, Any] = {}
    for run, (base, fresh) in enumerate(((old_base, False), (new_base, True))):
        dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_ROWWISE_ADAGRAD", rows=ROWS, seed=run)
        t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["serving"], path=root,
                                                fresh=fresh))
        if fresh:
            save_local_shards(t, base)
        for i, b in enumerate(make_batches("ec", 4, 8, seed=5 + run, world_size=world_size, rank=rank, rows=ROWS)):
            train_step(dmp, b)
            if i % 2 == 1:
                t.publish("serving")
        t.flush()
        if not fresh:
            save_local_shards(t, base)
        out["info"] = table_shard_info(dmp)
        out["final_shards"] = {fqn: lt.weights().detach().clone() for fqn, lt in t.local_tables.items()}
        dist.barrier()
        t.close()
        dist.barrier()
    return out


def full(ranks: Any, key: str) -> Dict[str, torch.Tensor]:
    """The trainer's whole tables from every rank's ``key`` shards (row-wise)."""
    tables: Dict[str, torch.Tensor] = {}
    for res in ranks:
        for fqn, w in res[key].items():
            info = res["info"][fqn]
            t = tables.setdefault(fqn, torch.full((info["global_rows"], info["global_cols"]), float("nan")))
            t[info["row_offset"]:info["row_offset"] + w.shape[0], info["col_offset"]:info["col_offset"] + w.shape[1]] = w
    assert not any(bool(t.isnan().any()) for t in tables.values())
    return tables


def tables_diff(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor], limit: int = 4) -> List[str]:
    """What keeps a replica's tables ``got`` from being bit-equal to ``want`` (fqn -> a 2-D
    table): the tables only one holds, a shape or dtype apart, and per table how many rows
    differ with the first ``limit`` of them (row id, both values). Empty when bit-equal, so
    ``assert not (d := tables_diff(got, want)), d`` fails naming the rows to look at."""
    out = [f"{fqn}: only in {'the replica' if fqn in got else 'the trainer'}" for fqn in sorted(set(got) ^ set(want))]
    for fqn in sorted(set(got) & set(want)):
        a, b = got[fqn], want[fqn]
        if a.shape != b.shape or a.dtype != b.dtype:
            out.append(f"{fqn}: {tuple(a.shape)} {a.dtype} in the replica, {tuple(b.shape)} {b.dtype} in the trainer")
            continue
        rows = (a != b).reshape(a.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
        if rows:
            shown = "; ".join(f"row {r}: {a[r].tolist()} != {b[r].tolist()}" for r in rows[:limit])
            out.append(f"{fqn}: {len(rows)} rows differ ({shown})")
    return out
