"""Per-rank bodies of the tests of publish's rules: a consumer reads or publishes, and the
ranks' publishes (module level, so spawned ranks can import them)."""

from __future__ import annotations

import warnings
from typing import Any, Dict

from torchrec.distributed.model_tracker.types import TrackingMode

from harness import build_sharded_model, make_batches, train_step
from persistent_delta import PersistentTrackerConfig, attach
from persistent_delta.errors import ConsumerRoleError


def _refused(call: Any) -> str:
    try:
        call()
    except ConsumerRoleError as exc:
        return str(exc)
    return ""


def role_case(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """``get_unique`` then ``publish`` of one consumer, and the reverse, across a restart; and
    the documented path (one consumer reads, another publishes), with warnings as errors."""
    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_SGD")
    batches = make_batches("ec", 8, 8, seed=5, world_size=world_size, rank=rank)
    cfg = PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["mixed", "pub", "ckpt", "serving"],
                                  path=root)
    t = attach(dmp, cfg)
    out: Dict[str, Any] = {}
    for b in batches[:2]:
        train_step(dmp, b)
    read = t.get_unique("mixed")
    out["read_rows"] = sum(int(r.ids.numel()) for r in read.values())
    out["publish_after_read"] = _refused(lambda: t.publish("mixed"))
    t.publish("pub")
    out["read_after_publish"] = _refused(lambda: t.get_unique("pub"))
    t.close()
    t = attach(dmp, cfg)  # the roles are in the log: a restarted trainer refuses the same mixes
    train_step(dmp, batches[2])
    out["read_after_restart"] = _refused(lambda: t.get_unique("pub"))
    out["publish_after_restart"] = _refused(lambda: t.publish("mixed"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        published = 0
        for b in batches[3:]:
            train_step(dmp, b)
            t.get_unique("ckpt")
            published += sum(t.publish("serving").values())
        out["documented_published"] = published
    t.remove_consumer("pub")  # a consumer's role changes by registering it again
    t.add_consumer("pub")
    t.get_unique("pub")
    out["reregistered_reads"] = True
    t.close()
    return out


def _replica_matches(t: Any, replica: Dict[str, Any]) -> Dict[str, bool]:
    """fqn -> whether this rank's shard of each table equals the replica's cells of it."""
    import torch

    out = {}
    for fqn, lt in t.local_tables.items():
        w = lt.weights().detach()
        cells = replica[fqn][lt.row_offset:lt.row_offset + w.shape[0], lt.col_offset:lt.col_offset + w.shape[1]]
        out[fqn] = bool(torch.equal(cells, w))
    return out


def _initial_replica(t: Any, rows: int, dim: int, seed: int) -> Dict[str, Any]:
    from harness import global_table_weights

    full = global_table_weights(2, rows, dim, seed)
    return {fqn: full[fqn.rsplit(".", 1)[1]].clone() for fqn in t.local_tables}


def rank0_only_case(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """Only rank 0 publishes (a common habit): the replica's poll says rank 1 is behind (a
    ``RanksBehindWarning``, ``poll.behind``), ``apply_poll(complete_only=True)`` raises
    ``RanksBehindError``, and ``offsets`` shows rank 1 behind."""
    import torch.distributed as dist

    from persistent_delta import DeltaReader
    from persistent_delta.errors import RanksBehindError, RanksBehindWarning
    from persistent_delta.ops.positions import describe
    from persistent_delta.serve.apply import apply_poll

    dmp = build_sharded_model(rank, world_size, "ec", "row_wise,column_wise", "EXACT_SGD")
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["serving"], path=root))
    batches = make_batches("ec", 6, 8, seed=9, world_size=world_size, rank=rank)
    for i, b in enumerate(batches):
        train_step(dmp, b)
        if rank == 0 and i in (2, 4):
            t.publish("serving")
    t.flush()
    dist.barrier()  # every rank's steps are committed
    out: Dict[str, Any] = {"curr": t.curr_batch_idx}
    if rank == 0:
        replica = _initial_replica(t, 100, 8, 0)
        with warnings.catch_warnings(record=True) as seen, DeltaReader(root, channel="snapshots") as reader:
            warnings.simplefilter("always")
            poll = reader.poll()
            out["behind"] = dict(getattr(poll, "behind", {}))
            out["complete"] = poll.complete
            out["warned"] = [str(w.message) for w in seen if issubclass(w.category, RanksBehindWarning)]
            try:
                apply_poll(replica, poll, complete_only=True)
                out["refused"] = ""
            except RanksBehindError as exc:
                out["refused"] = str(exc)
                out["refused_behind"] = exc.behind
            out["second_warned"] = len([w for w in seen if issubclass(w.category, RanksBehindWarning)])
            reader.poll()  # told once per rank
            out["third_warned"] = len([w for w in seen if issubclass(w.category, RanksBehindWarning)])
        out["offsets"] = {r.rank: getattr(r, "snapshots_behind", None) for r in describe(root)}
    dist.barrier()
    t.close()
    return out


def uneven_publishes_case(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """Rank 0 drains its rows in capped publishes (three per step), rank 1 publishes once: the
    batch indices stay the same on both ranks (a publish never moves them), the lookups
    channel stays complete, and the replica fed by every poll equals the trainer's tables."""
    import torch.distributed as dist

    from persistent_delta import DeltaReader
    from persistent_delta.errors import RanksBehindWarning
    from persistent_delta.serve.apply import apply_poll

    dmp = build_sharded_model(rank, world_size, "ec", "row_wise,column_wise", "EXACT_SGD")
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["serving"], path=root))
    batches = make_batches("ec", 5, 8, seed=11, world_size=world_size, rank=rank)
    out: Dict[str, Any] = {"curr": [], "publishes": 0}
    for b in batches:
        train_step(dmp, b)
        if rank == 0:
            for _ in range(2):
                t.publish("serving", max_rows=3)
                out["publishes"] += 1
        t.publish("serving")  # carries whatever is still deferred
        out["publishes"] += 1
        out["curr"].append(t.curr_batch_idx)
    t.flush()
    dist.barrier()
    replica = _initial_replica(t, 100, 8, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RanksBehindWarning)
        with DeltaReader(root, channel="snapshots") as reader:
            applied = apply_poll(replica, reader.poll(), complete_only=True)
            out["snapshot_ranges"] = dict(applied.ranges)
        with DeltaReader(root) as lookups:
            poll = lookups.poll()
            out["lookups_complete"] = poll.complete
            out["lookups_ranges"] = dict(poll.ranges)
    out["replica_equal"] = _replica_matches(t, replica)
    dist.barrier()
    t.close()
    return out


def same_steps_case(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """The documented path: every rank publishes at the same steps. A replica applying every
    poll with ``complete_only=True`` as the trainer goes is never told anything and equals the
    trainer's tables at the end, bit for bit."""
    import torch.distributed as dist

    from persistent_delta import DeltaReader
    from persistent_delta.errors import RanksBehindWarning
    from persistent_delta.serve.apply import apply_poll

    dmp = build_sharded_model(rank, world_size, "ec", "row_wise,column_wise", "EXACT_SGD")
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["serving"], path=root))
    batches = make_batches("ec", 6, 8, seed=13, world_size=world_size, rank=rank)
    replica = _initial_replica(t, 100, 8, 0)
    out: Dict[str, Any] = {"polls": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RanksBehindWarning)
        with DeltaReader(root, channel="snapshots") as reader:
            for i, b in enumerate(batches):
                train_step(dmp, b)
                if i % 2 == 1:
                    t.publish("serving")
                poll = reader.poll()  # a replica polling while the ranks train
                out["polls"] += 1
                assert not poll.behind, poll.behind
                apply_poll(replica, poll, complete_only=True)
            t.flush()
            dist.barrier()
            apply_poll(replica, reader.poll(), complete_only=True)
    out["replica_equal"] = _replica_matches(t, replica)
    out["curr"] = t.curr_batch_idx
    dist.barrier()
    t.close()
    return out


def inline_case(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """Each ``publish()`` with ``inline_publish=True`` and with the default writer options:
    which thread ran its transaction, whether it was in the log when the call returned (a read
    transaction right after it), and whether a replica that applies
    every poll ends equal to the trainer's tables."""
    import threading

    from persistent_delta import DeltaReader
    from persistent_delta.config import WriterOptions
    from persistent_delta.log import position_rules
    from persistent_delta.serve.apply import apply_poll
    from persistent_delta.trainer import publish as publish_mod

    out: Dict[str, Any] = {}
    real = publish_mod.write_publish
    for name, options in (("inline", WriterOptions(inline_publish=True)), ("handed", WriterOptions())):
        dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_SGD")
        path = f"{root}-{name}"
        t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["serving"], path=path,
                                                writer=options))
        threads = []

        def spy(*args: Any, **kw: Any) -> Any:
            threads.append(threading.get_ident())
            return real(*args, **kw)

        publish_mod.write_publish = spy
        replica = _initial_replica(t, 100, 8, 0)
        seen = []
        try:
            with DeltaReader(path, channel="snapshots") as reader:
                for b in make_batches("ec", 5, 8, seed=17, world_size=world_size, rank=rank):
                    train_step(dmp, b)
                    t.publish("serving")
                    # right after the call: the publish's stamp (the batch being recorded) stored, still open
                    seen.append((t._log.read(position_rules.snapshot_open), t.curr_batch_idx))
                    apply_poll(replica, reader.poll(), complete_only=True)
                t.flush()
                apply_poll(replica, reader.poll(), complete_only=True)
        finally:
            publish_mod.write_publish = real
        out[name] = dict(on_caller=[th == threading.get_ident() for th in threads],
                         committed_on_return=[stamp == curr for stamp, curr in seen],
                         replica_equal=_replica_matches(t, replica))
        t.close()
    return out
