"""Per-rank bodies of the capped-publish tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
from torchrec.distributed.model_tracker.types import TrackingMode

from harness import build_sharded_model, make_batches, train_step
from persistent_delta import DeltaConsumer, PersistentTrackerConfig, attach
from persistent_delta.log.deltalog import DeltaLog
from persistent_delta.log.deferred import read_deferred
from persistent_delta.log.records import log_start
from persistent_delta.serve.apply import apply_poll

ROW_BYTES = 8 + 8 * 4  # an id and 8 float32 values (build_sharded_model's dim)


def _config(root: str) -> PersistentTrackerConfig:
    return PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["serving"], path=root,
                                   delete_on_read=True)


def _deferred(path: str) -> Dict[str, List[int]]:
    with DeltaLog(path, readonly=True) as log:
        return log.read(lambda r: {f: t.tolist() for f, t in read_deferred(r, "serving").ids.items()})


def _mismatched(replica: Dict[str, torch.Tensor], t: Any) -> Dict[str, List[int]]:
    """fqn -> rows where the replica differs from the trainer's table (none: equal)."""
    return {f: torch.nonzero((replica[f] != lt.weights()).any(dim=1)).flatten().tolist()
            for f, lt in t.local_tables.items() if not torch.equal(replica[f], lt.weights())}


def capped_publish_case(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """Publish with caps far below the changed rows, training between publishes, then without
    training until nothing is deferred; a float replica applies every publish. Returns what each
    publish carried and reported, and how the replica compares."""
    from persistent_delta.errors import InvalidInputError

    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_ROWWISE_ADAGRAD")
    t = attach(dmp, _config(root))
    replica = {fqn: lt.weights().detach().clone() for fqn, lt in t.local_tables.items()}
    consumer = DeltaConsumer(root, "replica", channel="snapshots")
    batches = make_batches("ec", 12, 8, seed=3, world_size=world_size, rank=rank)
    out: Dict[str, Any] = {"publishes": [], "refused": []}
    looked_up: List[Dict[str, torch.Tensor]] = []

    def publish(**caps: Any) -> None:
        at_call = {fqn: lt.weights().detach().clone() for fqn, lt in t.local_tables.items()}
        carried = t.publish("serving", **caps)
        pending = t.stats()["publish_deferred_rows"]
        t.flush()
        poll = consumer.poll()
        # every row of this publish carries its value at this call (a deferred row: the newest)
        stale = sum(int((d.states != at_call[d.fqn][d.ids.long()]).any(dim=1).sum()) for d in poll if d.ids.numel())
        apply_poll(replica, poll)
        consumer.commit()
        lookups = t.log.read(lambda r: (log_start(r), r.consumer("serving").offset))
        out["publishes"].append({"caps": caps, "carried": sum(carried.values()), "pending": pending,
                                 "poll_pending": poll.deferred, "stale": stale, "deferred": _deferred(t.path),
                                 "log_start": lookups[0], "offset": lookups[1]})

    # phase 1: train and publish at most 7 rows per publish
    for b in batches[:6]:
        train_step(dmp, b)
        looked_up.append({f: torch.unique(torch.cat([b.sparse[k].values() for k in feats]))
                          for f, feats in t.fqn_to_feature_names().items()})
        publish(max_rows=7)
    # a row deferred at one publish and looked up again before a later publish carried it
    again = 0
    for i, p in enumerate(out["publishes"][:5]):
        for fqn, ids in p["deferred"].items():
            again += int(torch.isin(torch.tensor(ids), looked_up[i + 1][fqn]).sum())
    out["deferred_then_changed"] = again
    while out["publishes"][-1]["pending"]:
        publish(max_rows=7)
    out["equal_after_rows_cap"] = _mismatched(replica, t)
    # phase 2: a byte cap of 3 rows
    for b in batches[6:9]:
        train_step(dmp, b)
    publish(max_bytes=3 * ROW_BYTES)
    while out["publishes"][-1]["pending"]:
        publish(max_bytes=3 * ROW_BYTES)
    out["equal_after_bytes_cap"] = _mismatched(replica, t)
    # phase 3: a capped publish, then an uncapped one carries everything still deferred
    for b in batches[9:12]:
        train_step(dmp, b)
    publish(max_rows=2)
    publish()
    out["equal_after_uncapped"] = _mismatched(replica, t)
    for bad in ({"max_rows": 0}, {"max_rows": -3}, {"max_rows": True}, {"max_rows": 2.5}, {"max_rows": "3"},
                {"max_bytes": 0}, {"max_bytes": ROW_BYTES - 1}, {"max_rows": 3, "order": "most_changed"}):
        try:
            t.publish("serving", **bad)
            out["refused"].append("published")
        except InvalidInputError as exc:
            out["refused"].append(str(exc))
    consumer.close()
    t.close()
    return out


def shipped_caps_case(rank: int, world_size: int, root: str, url: str, job: str) -> Dict[str, Any]:
    """Train and publish with a cap of 12 rows, then without training until nothing is deferred;
    after each publish a local snapshots poll and, through a shipper and ``url``'s nats-server,
    a remote one, then a remote poll with nothing new. Returns each publish's (tracker's pending
    rows, local poll's deferred, remote poll's deferred, remote poll's rows, the empty remote
    poll's deferred)."""
    from persistent_delta.fleet.remote import RemoteConsumer
    from persistent_delta.fleet.ship import Shipper

    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_ROWWISE_ADAGRAD")
    t = attach(dmp, _config(root))
    local = DeltaConsumer(root, "replica", channel="snapshots")
    out: Dict[str, Any] = {"publishes": []}
    with Shipper(root, url, job, channels=["snapshots"], max_batches=4) as shipper:
        shipper.run_once()  # creates the job's stream (nothing published yet)
        remote = RemoteConsumer(url, job, "remote", channel="snapshots", wait=30)
        try:
            def publish(**caps: Any) -> None:
                t.publish("serving", **caps)
                t.flush()
                want = local.poll()
                local.commit()
                while shipper.run_once():
                    pass
                got = remote.poll(timeout=10.0)
                remote.commit()
                again = remote.poll(timeout=0)  # nothing new: the count stands
                assert again.num_rows == 0, again.ranges
                out["publishes"].append((int(t.stats()["publish_deferred_rows"]), want.deferred, got.deferred,
                                         got.num_rows, again.deferred))

            for b in make_batches("ec", 2, 8, seed=3, world_size=world_size, rank=rank):
                train_step(dmp, b)
                publish(max_rows=12)
            while out["publishes"][-1][0]:
                publish(max_rows=12)
        finally:
            remote.close()
    local.close()
    t.close()
    return out


def killed_after_capped_publish(root: str) -> None:
    """(A script body, see ``__main__``.) Train, publish with a cap of 3 rows, flush, print the
    deferred rows, then SIGKILL this process."""
    from harness import init_gloo

    init_gloo()
    dmp = build_sharded_model(0, 1, "ec", "row_wise", "EXACT_ROWWISE_ADAGRAD")
    t = attach(dmp, _config(root))
    DeltaConsumer(root, "replica", channel="snapshots").close()  # registered, at the first publish
    for b in make_batches("ec", 4, 8, seed=9, world_size=1, rank=0):
        train_step(dmp, b)
    t.publish("serving", max_rows=3)
    t.flush()  # the publish and its deferred rows are committed and fsynced
    print("PENDING", int(t.stats()["publish_deferred_rows"]), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def restart_after_kill_case(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """Reopen the killed trainer's log: the deferred rows are still due; one uncapped publish
    carries exactly them (nothing was looked up since), with this process's values."""
    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_ROWWISE_ADAGRAD")
    t = attach(dmp, _config(root))
    deferred = _deferred(t.path)
    before = int(t.stats()["publish_deferred_rows"])
    with DeltaConsumer(root, "replica", channel="snapshots", register=False) as consumer:
        first = consumer.poll()  # the killed process's publish
        poll_before, killed_rows = first.deferred, first.num_rows
        consumer.commit()
        carried = t.publish("serving")
        t.flush()
        poll = consumer.poll()
        rows = {d.fqn: d.ids.tolist() for d in poll if d.ids.numel()}
        values_ok = all(torch.equal(d.states, t.local_tables[d.fqn].weights()[d.ids.long()]) for d in poll)
        after = poll.deferred
    out = {"deferred": deferred, "pending_before": before, "killed_rows": killed_rows, "poll_pending_before": poll_before,
           "carried": carried, "rows": rows, "values_ok": values_ok, "poll_pending_after": after,
           "stats_after": int(t.stats()["publish_deferred_rows"])}
    t.close()
    return out


if __name__ == "__main__":
    killed_after_capped_publish(sys.argv[1])


def mc_snapshot_replica_case(rank: int, world_size: int, root: str, mode_name: str, steps: int = 12) -> Dict[str, Any]:
    """A managed-collision model with frequent evictions, publishing every step; a replica reads
    only the snapshots channel (float tables + a RawIdMap). After every publish: which rows and
    which map entries differ from the trainer's, and the evicted raw ids reported."""
    from persistent_delta import RawIdMap
    from zch_cases import build_mc_model, mc_batches, mc_step, module_maps

    dmp = build_mc_model(rank, world_size)
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode[mode_name], consumers=["serving"], path=root,
                                            delete_on_read=True))
    names = {fqn: z.name for fqn, z in t.zch.tables.items()}
    rows = {fqn: t.local_tables[fqn].weights().detach().clone() for fqn in names}
    dim = int(next(iter(rows.values())).shape[1])
    from persistent_delta.serve.inference import InferenceReplica

    serving = InferenceReplica(_quantized_mc_model(rows, dim))
    raw_map = RawIdMap()
    out: Dict[str, Any] = {"rows_differ": [], "map_differs": [], "evicted": 0, "tombstones_held": 0,
                           "int8_rows_differ": [], "forward_differs": [], "served_admitted": 0}
    DeltaConsumer(root, "keep", channel="snapshots").close()  # keeps every publish for a shipper after the run
    with DeltaConsumer(root, "replica", channel="snapshots") as consumer:
        for kjt in mc_batches(rank, world_size, steps, seed=5):
            mc_step(dmp, kjt)
            t.publish("serving")
            t.flush()
            poll = consumer.poll()
            apply_poll(rows, poll)
            apply_poll(serving, poll)
            maps = module_maps(dmp)
            for fqn, z in poll.zch().items():
                raw_map.apply(z)
                out["evicted"] += int(z.evicted_raw_ids.numel())
                held = set(maps[names[fqn]])
                out["tombstones_held"] += sum(1 for r in z.evicted_raw_ids.tolist() if r in held)
            consumer.commit()
            out["rows_differ"].append(sum(int((rows[f] != t.local_tables[f].weights()).any(dim=1).sum()) for f in names))
            out["map_differs"].append(sum(1 for f, n in names.items() if raw_map.as_dict(f) != maps[n]))
            out["int8_rows_differ"].append(_int8_rows_differ(serving, {f: t.local_tables[f].weights() for f in names}))
            # the quantized MC model's forward on every raw id (admitted, evicted, never seen)
            # against TorchRec's quantization of the trainer's model now: its tables and its
            # MCH buffers (raw id -> slot)
            reference = _quantized_mc_model({f: t.local_tables[f].weights() for f in names}, dim, mch_buffers(dmp))
            request = _every_raw_id()
            with serving.serving() as model, torch.no_grad():
                got, _ = model.sparse(request)
                want, _ = reference.sparse(request)
            out["forward_differs"].append(sum(int((got[k].values() != want[k].values()).any(dim=1).sum()) for k in want))
            out["served_admitted"] += sum(len(m) for m in maps.values())
    t.close()
    return out


def mch_buffers(dmp: Any) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """table name -> (``_mch_sorted_raw_ids``, ``_mch_remapped_ids_mapping``) of the trainer's MCH
    modules (one rank: the whole map)."""
    out = {}
    for module in dmp.modules():
        mcms = getattr(getattr(module, "_managed_collision_collection", None), "_managed_collision_modules", None)
        for name, mcm in (mcms or {}).items():
            out[name] = (mcm._mch_sorted_raw_ids.detach().clone(), mcm._mch_remapped_ids_mapping.detach().clone())
    return out


def _every_raw_id() -> Any:
    """A request looking up every raw id of the hash space under every feature, one per bag."""
    from torchrec import KeyedJaggedTensor
    from zch_cases import FEATURES, INPUT_HASH_SIZE

    feats = [f for fs in FEATURES.values() for f in fs]
    ids = torch.arange(INPUT_HASH_SIZE).repeat(len(feats))
    return KeyedJaggedTensor.from_lengths_sync(keys=feats, values=ids, lengths=torch.ones(ids.numel(), dtype=torch.long))


def _quantized_mc_model(base: Dict[str, torch.Tensor], dim: int,
                        maps: Optional[Dict[str, Tuple[torch.Tensor, torch.Tensor]]] = None) -> Any:
    """TorchRec's int8 quantization of an unsharded MC-EC with the trainer's tables
    (``zch_cases.FEATURES``) from ``base`` (fqn -> full table), and MCH buffers from ``maps``
    (table name -> sorted raw ids, slot mapping; default: empty), in eval mode."""
    from torchrec import EmbeddingCollection, EmbeddingConfig
    from torchrec.inference.modules import quantize_inference_model
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
    from torchrec.modules.mc_modules import LFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule
    from zch_cases import FEATURES, INPUT_HASH_SIZE

    by_name = {fqn.rsplit(".", 1)[-1]: w for fqn, w in base.items()}
    ec = EmbeddingCollection(tables=[EmbeddingConfig(name=n, embedding_dim=dim, num_embeddings=int(by_name[n].shape[0]),
                                                     feature_names=f) for n, f in FEATURES.items()])
    with torch.no_grad():
        for n in FEATURES:
            ec.embeddings[n].weight.copy_(by_name[n])
    mcms = {n: MCHManagedCollisionModule(
        zch_size=int(by_name[n].shape[0]), device=torch.device("cpu"), eviction_policy=LFU_EvictionPolicy(),
        eviction_interval=2, input_hash_size=INPUT_HASH_SIZE) for n in FEATURES}
    for n, (sorted_raw, mapping) in (maps or {}).items():
        mcms[n]._mch_sorted_raw_ids.copy_(sorted_raw)
        mcms[n]._mch_remapped_ids_mapping.copy_(mapping)
    mcc = ManagedCollisionCollection(managed_collision_modules=mcms, embedding_configs=ec.embedding_configs())
    model = torch.nn.Module()
    model.sparse = ManagedCollisionEmbeddingCollection(ec, mcc, return_remapped_features=False)
    return quantize_inference_model(model).eval()


def _int8_rows_differ(replica: Any, tables: Dict[str, torch.Tensor]) -> int:
    """Rows where the replica's int8 bytes (values, scale, bias) differ from TorchRec's row-wise
    int8 quantization of the trainer's ``tables`` now."""
    by_name = {fqn.rsplit(".", 1)[-1]: w for fqn, w in tables.items()}
    differ = 0
    for table in replica.tables.values():
        want = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(by_name[table.name].float().contiguous(), 8)
        got = replica.weights(table.fqn)
        differ += int((got != want).any(dim=1).sum())
    return differ


def publish_cases(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """:func:`capped_publish_case` and :func:`mc_snapshot_replica_case` (ROWWISE_ADAGRAD: a mode
    whose lookups records never list a re-initialised slot) in one spawned process, each on a
    log root of its own."""
    return {"caps": capped_publish_case(rank, world_size, os.path.join(root, "caps")),
            "evictions": mc_snapshot_replica_case(rank, world_size, os.path.join(root, "mc"), "ROWWISE_ADAGRAD")}
