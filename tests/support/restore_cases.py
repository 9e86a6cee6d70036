"""Per-rank bodies of the restore tests (module level, so spawned ranks can import them).

A restart or restore changes each rank's log in its own transaction, one rank after the other.
These cases park one rank at the moment between the two ranks' transactions (right after the
collective where they agree), poll with a
``DeltaConsumer`` in another process while the ranks disagree, and report what it got.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torchrec.distributed.model_tracker.types import TrackingMode

from harness import build_sharded_model, make_batches, train_step
from procs import run_python
from persistent_delta import PersistentTrackerConfig, attach

# An out-of-process consumer: prints, per column-wise table, the ids of each rank's half and
# whether the merged table has its states (a missing half merges without states).
POLL = r"""
import json, sys
from persistent_delta import DeltaConsumer
with DeltaConsumer(sys.argv[1], "audit") as c:
    poll = c.poll()
    out = {"ranges": {str(r): list(v) for r, v in poll.ranges.items()}, "halves": {}, "stateless": []}
    for fqn, parts in poll.tables().items():
        out["halves"][fqn] = {str(p.rank): sorted(p.global_ids.tolist()) for p in parts}
    out["stateless"] = sorted(f for f, m in poll.merged().items() if m.states is None)
    if sys.argv[2] == "commit":
        c.commit()
print(json.dumps(out))
"""


def poll_out_of_process(root: str, commit: bool = True) -> Dict[str, Any]:
    """Poll as the registered consumer "audit" in another process (``commit``: and commit;
    a commit writes to every rank's log, so it waits for a held one)."""
    import json

    return json.loads(run_python(POLL, root, "commit" if commit else "no").stdout.strip().splitlines()[-1])


def _rewind(path: str, batch: int) -> None:
    """As if this rank had been SIGKILLed before committing ``batch``: its records of ``batch``
    on are gone and its open batch was ``batch``."""
    from persistent_delta.log.deltalog import DeltaLog
    from persistent_delta.log.schema import META_CLOSED_END, META_CURR_BATCH

    with DeltaLog(path) as log:
        def rewind(w: Any) -> None:
            for e in w.tables().values():
                w.delete_records(e.table_id, batch, None)
                e2 = e.copy()
                e2.last_batch_idx = min(e2.last_batch_idx, batch - 1)
                w.stage_table(e2)
            w.set_meta(META_CURR_BATCH, batch)
            w.set_meta(META_CLOSED_END, 0)
        log.write(rewind)


class ParkAfterCollective:
    """Park this rank right after its next ``all_reduce`` (the restart's or restore's agreement,
    which the other ranks have then passed too) until the file ``go`` appears: its next
    transaction waits while the others' have committed. A delay of a real rank, nothing
    replaced: the collective itself runs."""

    def __init__(self, held: str, go: str) -> None:
        self._held, self._go = held, go
        self._real = dist.all_reduce

    def arm(self) -> None:
        def all_reduce(*args: Any, **kwargs: Any) -> Any:
            dist.all_reduce = self._real  # once
            out = self._real(*args, **kwargs)
            open(self._held, "w").close()
            while not os.path.exists(self._go):
                time.sleep(0.01)
            return out
        dist.all_reduce = all_reduce


def killed_between_commits_case(rank: int, world_size: int, root: str, stage: str) -> Dict[str, Any]:
    """Two ranks, column-wise tables: checkpoint at batch 3, train to batch 8, rank 1 commits
    batch 8 and rank 0 is killed before it does; restart (and, with ``stage == "restore"``,
    restore the checkpoint). Rank 1 is parked before its transaction of the ``stage`` while an
    out-of-process consumer polls; returns (rank 0) what that poll and a poll after the ranks
    settled got."""
    flags = os.path.join(os.path.dirname(root), "flags")
    os.makedirs(flags, exist_ok=True)
    held, go = os.path.join(flags, "held"), os.path.join(flags, "go")
    cfg = PersistentTrackerConfig(tracking_mode=TrackingMode.EMBEDDING, path=root)
    dmp = build_sharded_model(rank, world_size, "ec", "column_wise", "EXACT_SGD")
    batches = make_batches("ec", 12, 8, seed=9, world_size=world_size, rank=rank)
    t = attach(dmp, cfg)
    for b in batches[:3]:
        train_step(dmp, b)
    ckpt = {fqn: lt.weights().detach().clone() for fqn, lt in t.local_tables.items()}
    tstate = t.state_dict()
    dist.barrier()
    if rank == 0:
        poll_out_of_process(root)  # registers "audit" at the checkpoint: it reads batches 3.. later
    dist.barrier()
    for b in batches[3:8]:
        train_step(dmp, b)
    t.close()
    if rank == 0:
        _rewind(os.path.join(root, "rank-0"), 8)
        if stage == "restart":
            poll_out_of_process(root)  # "audit" reads what every rank completed: up to batch 8
    dist.barrier()
    out: Dict[str, Any] = {}
    park = ParkAfterCollective(held, go)
    if rank == 1 and stage == "restart":
        park.arm()
    t = attach(dmp, cfg)
    if stage == "restore":
        with torch.no_grad():
            for fqn, w in ckpt.items():
                t.local_tables[fqn].weights().copy_(w)
        if rank == 1:
            park.arm()
        t.load_state_dict(tstate)
    if rank == 0:
        while not os.path.exists(held):
            time.sleep(0.01)
        out["during"] = poll_out_of_process(root, commit=False)
        open(go, "w").close()
    dist.barrier()
    t.flush()
    dist.barrier()
    if rank == 0:
        out["after"] = poll_out_of_process(root)
    dist.barrier()
    t.close()
    return out


def halves_missing(result: Dict[str, Any]) -> List[str]:
    """The tables of a poll result where one rank's half holds ids the other's lacks."""
    bad = []
    for fqn, halves in result["halves"].items():
        sets = [set(v) for v in halves.values()]
        if len(sets) == 2 and sets[0] != sets[1] or len(sets) == 1 and sets[0]:
            bad.append(fqn)
    return bad + [f for f in result["stateless"] if f not in bad]


def model_state_case(rank: int, world_size: int, root: str, how: str) -> Dict[str, Any]:
    """Checkpoint with ``dmp.state_dict()`` at batch 3, train to batch 8, restart the tracker
    (a new one on the same path) and restore the model: ``how == "dmp"`` with
    ``dmp.load_state_dict`` of that checkpoint (the tracker's state comes along);
    ``how == "weights"``: the table weights only (the tracker's restore forgotten). Reports
    the batch index after one step, the warnings of that step, and (``"dmp"``) whether the
    re-delivered rows hold the checkpoint's values. An untracked model loads the same
    checkpoint strictly."""
    import warnings

    from persistent_delta import DeltaReader
    from persistent_delta.trainer.restore import state_key

    ckpt_file = os.path.join(os.path.dirname(root), f"ckpt.{rank}")
    cfg = PersistentTrackerConfig(tracking_mode=TrackingMode.EMBEDDING, path=root)
    dmp = build_sharded_model(rank, world_size, "ec", "column_wise", "EXACT_SGD")
    batches = make_batches("ec", 12, 8, seed=9, world_size=world_size, rank=rank)
    t = attach(dmp, cfg)
    for b in batches[:3]:
        train_step(dmp, b)
    state = dmp.state_dict()
    out: Dict[str, Any] = {"key_saved": state_key(rank) in state}
    torch.save(state, ckpt_file)
    saved_weights = {fqn: lt.weights().detach().clone() for fqn, lt in t.local_tables.items()}
    for b in batches[3:8]:
        train_step(dmp, b)
    t.close()
    dist.barrier()
    t = attach(dmp, cfg)
    last = t.curr_batch_idx
    ckpt = torch.load(ckpt_file, weights_only=False)
    if how == "dmp":
        result = dmp.load_state_dict(ckpt)
        out["unexpected"] = list(result.unexpected_keys)
    else:
        with torch.no_grad():
            for fqn, w in saved_weights.items():
                t.local_tables[fqn].weights().copy_(w)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_step(dmp, batches[8])
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    out["last"], out["after_step"] = last, t.curr_batch_idx
    t.flush()
    dist.barrier()
    if how == "dmp":  # the re-delivery batch (last + 1) holds the checkpoint's values of its rows
        with DeltaReader(root, start=last + 1) as reader:
            poll = reader.poll(max_batches=1)
        same, rows = True, 0
        for fqn, d in poll.ranks[rank].tables.items():
            ids = d.rows.ids.long()
            rows += int(ids.numel())
            same = same and bool(torch.equal(d.rows.states, saved_weights[fqn][ids]))
        out["redelivered_rows"], out["redelivered_exact"] = rows, same
    dist.barrier()
    t.close()
    # a model without a tracker loads the checkpoint strictly: the tracker's entry is reported
    plain = build_sharded_model(rank, world_size, "ec", "column_wise", "EXACT_SGD", seed=1)
    result = plain.load_state_dict(torch.load(ckpt_file, weights_only=False), strict=True)
    out["plain_unexpected"] = list(result.unexpected_keys)
    return out



def dropped_publish_case(rank: int, world_size: int, root: str, in_checkpoint_batch: bool = False) -> Dict[str, Any]:
    """Two ranks (row-wise and column-wise tables, a publishing consumer "serving", each step
    committed at once): publish, train, checkpoint, train a step, publish again -- and a
    SIGKILL leaves rank 1's log as it was at the checkpoint (its writer had committed nothing
    later: neither the step nor the publish) and rank 0's right after the publish (committed,
    its stamp still open: the demo's SIGKILL right after a publish). The restart drops rank 0's
    step (its batch is not complete on rank 1) and keeps its publish (closed: the dead writer's
    publish is complete), and rank 1's snapshots end moves up to it (rank 1 died before its
    publish); the restore, training on and a publish follow. A replica of the initial tables
    that applies every publish (``complete_only=True``) must equal the trainer's tables: the
    kept publish carried rows changed *before* the checkpoint, which no other publish carries,
    and rows of the lost step, which the restore re-delivers. Returns (each rank) whether its
    shards match, whether the restart dropped lookups records on this rank, the snapshots end
    after the restart and the kept publish's stamp.

    ``in_checkpoint_batch``: the publish is made in the checkpoint's own batch, right after the
    checkpoint (no step between), and rank 0 then closes (as a rank does at exit when a
    collective fails): its batch is complete there and not on rank 1. Its publish is closed
    then, and a reader of rank 0 alone (a shipper's) reads it and commits before the restart:
    its position must still be served after the restart (``served``), not fall past the end."""
    import logging
    import shutil

    from persistent_delta import DeltaReader
    from persistent_delta.log import position_rules
    from persistent_delta.log.schema import SNAPSHOTS
    from persistent_delta.serve.apply import apply_poll
    from publish_rules_cases import _initial_replica, _replica_matches

    cfg = PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["serving"], path=root,
                                  async_writes=False)
    dmp = build_sharded_model(rank, world_size, "ec", "row_wise,column_wise", "EXACT_SGD")
    batches = make_batches("ec", 12, 8, seed=9, world_size=world_size, rank=rank)
    t = attach(dmp, cfg)
    replica = _initial_replica(t, 100, 8, 0)
    for b in batches[:3]:
        train_step(dmp, b)
    t.publish("serving")
    for b in batches[3:6]:  # rows changed here are carried by the next publish only
        train_step(dmp, b)
    ckpt = {fqn: lt.weights().detach().clone() for fqn, lt in t.local_tables.items()}
    tstate = t.state_dict()
    rank_dir = os.path.join(root, f"rank-{rank}")
    killed = os.path.join(os.path.dirname(root), f"killed-rank-{rank}")
    os.makedirs(killed)
    if rank == 1:  # rank 1's log as the SIGKILL leaves it: its writer committed nothing after the checkpoint
        t._log.copy_compacted(killed)
    if not in_checkpoint_batch:
        train_step(dmp, batches[6])
    stamp = t.next_stamp
    t.publish("serving")  # committed at once (async_writes=False), its stamp open until the batch ends
    if rank == 0 and not in_checkpoint_batch:  # rank 0's log as the SIGKILL leaves it: the publish committed
        t._log.copy_compacted(killed)
    t.close()  # (in_checkpoint_batch: rank 0's log as its close leaves it)
    if rank == 1 or not in_checkpoint_batch:
        for name in ("data.mdb", "lock.mdb"):
            os.remove(os.path.join(rank_dir, name))
        shutil.move(os.path.join(killed, "data.mdb"), os.path.join(rank_dir, "data.mdb"))
    shipped = None
    if rank == 0 and in_checkpoint_batch:  # a shipper reads rank 0 alone: the closed publish
        with DeltaReader(root, channel="snapshots", ranks=[0]) as shipper:
            shipped = shipper.poll().ranks[0].end_idx
    dist.barrier()
    seen: List[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("persistent_delta.trainer.restore").addHandler(handler)
    t = attach(dmp, cfg)  # the restart: drops what is not complete on every rank
    logging.getLogger("persistent_delta.trainer.restore").removeHandler(handler)
    snapshots_end = t._log.read(lambda r: position_rules.bounds(r, SNAPSHOTS)[1])
    served = None
    if shipped is not None:  # its position is still served: no OffsetOutOfRangeError (reset=None)
        with DeltaReader(root, channel="snapshots", ranks=[0]) as shipper:
            shipper.seek(shipped)
            served = shipper.poll().ranks[0].start_idx == shipped
    with torch.no_grad():
        for fqn, w in ckpt.items():
            t.local_tables[fqn].weights().copy_(w)
    t.load_state_dict(tstate)
    for b in batches[6:8]:
        train_step(dmp, b)
    t.flush()
    dist.barrier()
    with DeltaReader(root, channel="snapshots") as reader:  # before the next publish: no rank is behind
        behind = dict(reader.poll().behind)
    dist.barrier()
    t.publish("serving")
    t.flush()
    dist.barrier()
    with DeltaReader(root, channel="snapshots") as reader:
        apply_poll(replica, reader.poll(), complete_only=True)
    out = {"matches": _replica_matches(t, replica), "behind": behind, "stamp": stamp, "snapshots_end": snapshots_end,
           "served": served, "dropped": any("dropped" in m and "dropped 0 " not in m for m in seen)}
    dist.barrier()
    t.close()
    return out


def behind_while_settling_case(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """Two ranks publish, train to batch 8; rank 0 alone publishes in batch 8 and is killed
    right after (its stamp open, batch 8 incomplete), rank 1 completed batch 8. The restart
    keeps rank 0's publish and moves rank 1's snapshots end up to it; rank 1 is parked before
    its transaction while rank 0, settled, polls the snapshots channel. Returns (rank 0) the
    ranks behind that poll and one after the ranks settled reported, and the warnings."""
    import warnings

    from persistent_delta import DeltaReader
    from persistent_delta.log.deltalog import DeltaLog
    from persistent_delta.log.schema import META_SNAPSHOT_END, META_SNAPSHOT_OPEN

    flags = os.path.join(os.path.dirname(root), "flags")
    os.makedirs(flags, exist_ok=True)
    held, go = os.path.join(flags, "held"), os.path.join(flags, "go")
    cfg = PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["serving"], path=root,
                                  async_writes=False)
    dmp = build_sharded_model(rank, world_size, "ec", "row_wise,column_wise", "EXACT_SGD")
    batches = make_batches("ec", 12, 8, seed=9, world_size=world_size, rank=rank)
    t = attach(dmp, cfg)
    for b in batches[:3]:
        train_step(dmp, b)
    t.publish("serving")
    for b in batches[3:8]:
        train_step(dmp, b)
    if rank == 0:
        before = t._log.read(lambda r: int(r.meta(META_SNAPSHOT_END, 0)))
        t.publish("serving")  # stamped 8
    t.close()
    if rank == 0:  # as the SIGKILL right after the publish's commit left it: batch 8 and its stamp open
        _rewind(os.path.join(root, "rank-0"), 8)
        with DeltaLog(os.path.join(root, "rank-0")) as log:
            log.write(lambda w: (w.set_meta(META_SNAPSHOT_END, before), w.set_meta(META_SNAPSHOT_OPEN, 8)))
    dist.barrier()
    park = ParkAfterCollective(held, go)
    if rank == 1:
        park.arm()
    out: Dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        t = attach(dmp, cfg)
        if rank == 0:
            while not os.path.exists(held):
                time.sleep(0.01)
            with DeltaReader(root, channel="snapshots") as reader:
                out["during"] = dict(reader.poll().behind)
            open(go, "w").close()
        dist.barrier()
        if rank == 0:
            with DeltaReader(root, channel="snapshots") as reader:
                out["after"] = dict(reader.poll().behind)
    out["warnings"] = [str(w.message) for w in seen if "behind" in str(w.message)]
    dist.barrier()
    t.close()
    return out
