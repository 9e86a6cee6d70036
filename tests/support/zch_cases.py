"""A sharded managed-collision model for the ZCH tests (CPU, gloo), and per-rank test bodies.

Facts this relies on (TorchRec 1.8.0 / fbgemm-gpu-cpu 1.8.0, CPU):

* A ``ManagedCollisionEmbeddingCollection`` over ``MCHManagedCollisionModule`` shards on CPU
  when the planner is constrained to the ``fused`` kernel (the default kernel list fails);
  row-wise with ``buckets = world_size`` (the planner refuses uneven buckets).
* Raw ids are bucketed to ranks by range over ``input_hash_size``: raw id ``x`` goes to rank
  ``x * world_size // input_hash_size``.
* The first eviction calls ``fbgemm::reset_weight_momentum``, which has no CPU kernel
  (``NotImplementedError: Could not run 'fbgemm::reset_weight_momentum' with arguments from the
  'CPU' backend``). :func:`build_mc_model` gives those TBEs a Python version (zero the rows and
  their optimizer state), as the CUDA kernel does; TorchRec then re-initialises the rows.
* TorchRec's tracker fqn of an MC table is the MCH module's path
  (``sparse._managed_collision_collection._managed_collision_modules.<table>``): its
  ``fqn_to_feature_names`` lets the last module whose path holds the table name win.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim.apply_optimizer_in_backward import _apply_optimizer_in_backward
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
from torchrec.modules.mc_modules import LFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule
from torchrec.optim import RowWiseAdagrad

INPUT_HASH_SIZE = 4000
FEATURES = {"mc_0": ["f_0", "f_1"], "mc_1": ["f_2"]}


class MCModel(nn.Module):
    """An MC-EC under ``self.sparse``; returns a scalar loss."""

    def __init__(self, slots: int, world_size: int, eviction_interval: int, dim: int) -> None:
        super().__init__()
        ec = EmbeddingCollection(
            tables=[EmbeddingConfig(name=t, embedding_dim=dim, num_embeddings=slots, feature_names=f)
                    for t, f in FEATURES.items()], device=torch.device("meta"))
        mcc = ManagedCollisionCollection(
            managed_collision_modules={
                t: MCHManagedCollisionModule(zch_size=slots, device=torch.device("cpu"), eviction_policy=LFU_EvictionPolicy(),
                                             eviction_interval=eviction_interval, input_hash_size=INPUT_HASH_SIZE,
                                             buckets=world_size)
                for t in FEATURES},
            embedding_configs=ec.embedding_configs())
        self.sparse = ManagedCollisionEmbeddingCollection(ec, mcc, return_remapped_features=False)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        out, _ = self.sparse(kjt)
        loss = torch.zeros(())
        for jt in out.values():
            loss = loss + (jt.values() - 0.5).pow(2).sum()
        return loss


def build_mc_model(rank: int, world_size: int, slots: int = 32, eviction_interval: int = 2, dim: int = 8,
                   seed: int = 0) -> DistributedModelParallel:
    """Shard an :class:`MCModel` (``slots`` rows per table in all, row-wise over the ranks)."""
    torch.manual_seed(seed)
    model = MCModel(slots, world_size, eviction_interval, dim)
    _apply_optimizer_in_backward(RowWiseAdagrad, model.sparse._embedding_module.parameters(), {"lr": 0.1, "eps": 1e-8})
    pg = dist.GroupMember.WORLD
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"),
        constraints={t: ParameterConstraints(compute_kernels=["fused"], sharding_types=["row_wise"]) for t in FEATURES})
    plan = planner.collective_plan(model, None, pg)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"), plan=plan)
    from persistent_delta.trainer.zch_capture import cpu_eviction_fallback

    cpu_eviction_fallback(dmp)  # MCH's eviction has no fbgemm CPU kernel
    return dmp


def mc_batches(rank: int, world_size: int, n: int, seed: int, batch: int = 12, zipf_s: float = 1.05) -> List[KeyedJaggedTensor]:
    """Deterministic batches of raw ids (Zipf over a permutation of ``[0, INPUT_HASH_SIZE)``, so
    a few ids stay hot and many come and go: with a small slot budget evictions are frequent)."""
    feats = [f for fs in FEATURES.values() for f in fs]
    perm = torch.randperm(INPUT_HASH_SIZE, generator=torch.Generator().manual_seed(seed))
    probs = 1.0 / torch.arange(1, INPUT_HASH_SIZE + 1, dtype=torch.float64) ** zipf_s
    g = torch.Generator().manual_seed(seed * 7919 + rank * 31 + world_size)
    out = []
    for _ in range(n):
        lengths = torch.randint(1, 3, (len(feats) * batch,), generator=g)
        ids = perm[torch.multinomial(probs, int(lengths.sum()), replacement=True, generator=g)]
        out.append(KeyedJaggedTensor.from_lengths_sync(keys=feats, values=ids.long(), lengths=lengths))
    return out


def mc_step(dmp: DistributedModelParallel, kjt: KeyedJaggedTensor) -> None:
    dmp(kjt).backward()


def module_maps(dmp: nn.Module) -> Dict[str, Dict[int, int]]:
    """table name -> {raw id: global slot} straight from this rank's MCH buffers (the reference)."""
    out: Dict[str, Dict[int, int]] = {}
    for module in dmp.modules():
        mcms = getattr(getattr(module, "_managed_collision_collection", None), "_managed_collision_modules", None)
        if mcms is None:
            continue
        for name, mcm in mcms.items():
            raw, mapping = mcm._mch_sorted_raw_ids, mcm._mch_remapped_ids_mapping
            held = raw != torch.iinfo(torch.int64).max
            out[name] = dict(zip(raw[held].tolist(), mapping[held].tolist()))
    return out


def gather_maps(maps: Dict[str, Dict[int, int]]) -> Dict[str, Dict[int, int]]:
    """The union over ranks of :func:`module_maps` (a collective)."""
    parts: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, maps)
    out: Dict[str, Dict[int, int]] = {}
    for p in parts:
        for name, m in p.items():
            out.setdefault(name, {}).update(m)
    return out


def _side_of_batch(tracker: Any, batch_idx: int) -> Dict[str, List[Tuple[int, torch.Tensor, torch.Tensor]]]:
    """fqn -> side records (kind, shard-local slots, states) of one batch, read from the log."""
    from persistent_delta.log.zch_records import iter_side

    def read(r: Any) -> Dict[str, List[Tuple[int, torch.Tensor, torch.Tensor]]]:
        return {fqn: [(k, ids, st) for _, k, ids, st in iter_side(r, r.table(fqn), batch_idx, batch_idx + 1)]
                for fqn in tracker.zch.tables}
    return tracker.log.read(read)


def mch_hook_case(rank: int, world_size: int, root: str, steps: int = 10) -> Dict[str, Any]:
    """Every step: the raw ids recorded for the batch are the raw ids fed (over all ranks); an
    admitted one's slot is the one the module's own buffers give it after the step, an
    unadmitted one sits in the default slot and is in no map; the slot reassignments applied in
    order reproduce the module's map. The durable get_indexed_lookups gives the batch's raw ids."""
    from persistent_delta import PersistentTrackerConfig, RawIdMap, attach
    from persistent_delta.adapters.raw_ids import install_raw_id_tracker
    from persistent_delta.log import codec
    from persistent_delta.log.zch_records import ZchDelta
    from torchrec.distributed.model_tracker.types import TrackingMode

    dmp = build_mc_model(rank, world_size)
    tracker = attach(dmp, PersistentTrackerConfig(path=root, tracking_mode=TrackingMode.ID_ONLY, linger_steps=1))
    raw_tracker = install_raw_id_tracker(dmp, tracker, consumers=["rawc"])
    tracker.add_consumer("keep")  # never reads: retention keeps the log for the tools checked afterwards
    replica = RawIdMap()
    names = {fqn: z.name for fqn, z in tracker.zch.tables.items()}
    counts = {"admitted": 0, "unadmitted": 0, "moves": 0, "evicted": 0}
    for kjt in mc_batches(rank, world_size, steps, seed=5):
        mc_step(dmp, kjt)
        b = tracker.curr_batch_idx
        tracker.flush()
        side = _side_of_batch(tracker, b)  # before the reads below: their retention deletes what both consumed
        changed = tracker.get_unique()  # rows changed in this batch: looked up, or re-initialised by an eviction
        got = raw_tracker.get_indexed_lookups(sorted(names.values()), "rawc")
        mine = torch.cat([torch.cat(got[n][0]).view(-1) for n in sorted(got)]) if got else torch.empty(0, dtype=torch.int64)
        fed = kjt.values()
        all_fed: List[Any] = [None] * world_size
        all_got: List[Any] = [None] * world_size
        dist.all_gather_object(all_fed, fed)
        dist.all_gather_object(all_got, mine)
        assert torch.equal(torch.cat(all_fed).sort().values, torch.cat(all_got).sort().values), f"batch {b}: raw ids"
        maps = module_maps(dmp)
        for fqn, recs in side.items():
            z = tracker.zch.tables[fqn]
            m = maps[names[fqn]]
            for kind, slots, st in recs:
                gslots = slots + z.row_offset
                if kind == codec.KIND_SLOTS:
                    moved = slots[st[:, 0] != st[:, 1]]  # (a base lists unchanged slots too)
                    assert bool(torch.isin(moved, changed[fqn].ids).all()), f"batch {b}: reassigned slots not changed rows"
                    counts["moves"] += int(slots.numel())
                    counts["evicted"] += int(((st[:, 0] != -1) & (st[:, 0] != st[:, 1])).sum())
                    replica.apply(ZchDelta(fqn, b, b + 1, slots=gslots, taken=st[:, 0], given=st[:, 1]))
                    continue
                for raw, ok, slot in zip(st[:, 0].tolist(), st[:, 1].tolist(), gslots.tolist()):
                    if ok:
                        assert m.get(raw) == slot, (b, fqn, raw, slot, m.get(raw))
                        counts["admitted"] += 1
                    else:
                        assert raw not in m and slot == z.row_offset + z.default_slot(), (b, fqn, raw, slot)
                        counts["unadmitted"] += 1
            assert replica.as_dict(fqn) == m, f"batch {b} {fqn}: replica map differs from the module's"
    tracker.close()
    return counts


class _Sparse(nn.Module):
    def __init__(self, sparse: nn.Module) -> None:
        super().__init__()
        self.sparse = sparse

    def forward(self, kjt: KeyedJaggedTensor) -> Any:
        return self.sparse(kjt)


def hash_zch_case(rank: int, world_size: int, root: str, steps: int = 5) -> Dict[str, Any]:
    """Differential test against TorchRec's ``RawIdTracker`` on a HashZch MC-EC (eval mode:
    fbgemm-gpu-cpu's ``zero_collision_hash`` runs read-only lookups only, so the identities are
    filled as a trained checkpoint would hold them). Per forward, TorchRec's answer to its TBE
    consumer and the durable ``get_indexed_lookups`` of the same batch are equal."""
    from torchrec.distributed.model_tracker.types import ModelTrackerConfigs, RawIdTrackerConfig, Trackers
    from torchrec.modules.hash_mc_modules import HashZchManagedCollisionModule
    from torchrec.distributed.model_tracker.types import TrackingMode

    from persistent_delta.adapters.raw_ids import PersistentRawIdTracker
    from persistent_delta import PersistentTrackerConfig, attach

    torch.manual_seed(0)
    slots = 32
    ec = EmbeddingCollection(tables=[EmbeddingConfig(name="hz_0", embedding_dim=8, num_embeddings=slots,
                                                     feature_names=["g_0", "g_1"])], device=torch.device("meta"))
    mcc = ManagedCollisionCollection(
        managed_collision_modules={"hz_0": HashZchManagedCollisionModule(
            zch_size=slots, device=torch.device("cpu"), total_num_buckets=world_size, max_probe=4, input_hash_size=0)},
        embedding_configs=ec.embedding_configs())
    model = _Sparse(ManagedCollisionEmbeddingCollection(ec, mcc, return_remapped_features=False))
    _apply_optimizer_in_backward(RowWiseAdagrad, model.sparse._embedding_module.parameters(), {"lr": 0.1})
    pg = dist.GroupMember.WORLD
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"),
        constraints={"hz_0": ParameterConstraints(compute_kernels=["fused"], sharding_types=["row_wise"])})
    plan = planner.collective_plan(model, None, pg)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"), plan=plan,
                                   model_tracker_configs=ModelTrackerConfigs(raw_id_tracker_config=RawIdTrackerConfig()))
    trec = dmp.model_trackers[Trackers.RAW_ID_TRACKER.name]
    answers: List[Dict[str, Any]] = []
    orig = trec.get_indexed_lookups

    def spy(tables: List[str], consumer: Any = None) -> Dict[str, Any]:
        out = orig(tables, consumer)
        answers.append(out)
        return out

    spied = 0
    for lookup in dmp._dmp_wrapped_module.sparse._embedding_module._lookups:
        for emb in lookup._emb_modules:  # the TBE asks through the wrapper it was given
            wrapper = getattr(emb, "_raw_id_tracker_wrapper", None)
            if wrapper is not None:
                wrapper.get_indexed_lookups, spied = spy, spied + 1
    assert spied, "TorchRec wired no TBE to its raw-id tracker"
    mcm = dmp._dmp_wrapped_module.sparse._managed_collision_collection._managed_collision_modules["hz_0"]
    with torch.no_grad():  # a trained table's identities: slot s holds raw id 7 * s + 1000 * rank
        mcm._hash_zch_identities.copy_(torch.arange(mcm._hash_zch_identities.numel()).view_as(mcm._hash_zch_identities) * 7
                                       + 1000 * rank)
    tracker = attach(dmp, PersistentTrackerConfig(path=root, tracking_mode=TrackingMode.ID_ONLY))
    ours = PersistentRawIdTracker(tracker, consumers=["ours"])
    dmp.eval()
    g = torch.Generator().manual_seed(rank + 1)
    compared = 0
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.randint(0, 5000, (24,), generator=g)
            kjt = KeyedJaggedTensor.from_lengths_sync(keys=["g_0", "g_1"], values=ids,
                                                      lengths=torch.ones(24, dtype=torch.long))
            before = len(answers)
            dmp(kjt)
            assert len(answers) == before + 1, "TorchRec's TBE consumer did not ask its raw-id tracker"
            ref = answers[-1]
            got = ours.get_indexed_lookups(["hz_0"], "ours")
            assert set(got) == set(ref), (got, ref)
            for table, (raws, _meta) in ref.items():
                mine = got[table][0]
                assert len(mine) == len(raws) and all(torch.equal(a, b) for a, b in zip(mine, raws)), (table, mine, raws)
                compared += sum(int(r.numel()) for r in raws)
    tracker.close()
    return {"compared": compared}


def ordered_case(rank: int, world_size: int, root: str, ckpt_root: str, kind: str) -> Dict[str, Any]:
    """Train, saving a shard checkpoint (which records its batch) every 4 steps, three times;
    an external consumer is registered so the trainer writes every batch whole (replay can
    start anywhere). Returns the checkpoints' batches and, for an MC model, the final raw-id
    maps (union over ranks)."""
    from harness import build_sharded_model, make_batches, train_step
    from persistent_delta import DeltaConsumer, PersistentTrackerConfig, attach
    from persistent_delta.trainer.save_shards import save_local_shards
    from torchrec.distributed.model_tracker.types import TrackingMode

    if kind == "mc":
        dmp = build_mc_model(rank, world_size)
        feed = [lambda k=k: mc_step(dmp, k) for k in mc_batches(rank, world_size, 12, seed=13)]
    else:
        dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_ROWWISE_ADAGRAD")
        feed = [lambda b=b: train_step(dmp, b) for b in make_batches("ec", 12, 8, seed=13, world_size=world_size,
                                                                         rank=rank)]
    tracker = attach(dmp, PersistentTrackerConfig(path=root, tracking_mode=TrackingMode.ID_ONLY))
    if rank == 0:
        DeltaConsumer(root, "exporter", wait=30).close()
    dist.barrier()
    batches = []
    for i, step in enumerate(feed):
        step()
        if i % 4 == 3:
            save_local_shards(tracker, os.path.join(ckpt_root, f"ckpt{i // 4}"))
            batches.append(tracker.curr_batch_idx)
    tracker.close()
    maps = gather_maps(module_maps(dmp)) if kind == "mc" else {}
    return {"batches": batches, "maps": maps}


def ship_case(rank: int, world_size: int, root: str, steps: int, step_sleep: float = 0.0) -> Dict[str, Any]:
    """Train an MC model ``steps`` steps (16 slots per rank and table, evictions every 2 steps)
    while a shipper ships the log (tests/fleet/test_zch_ship.py); a consumer registered at batch 0
    keeps the whole log for the local comparison. Returns the trainer's raw-id maps (union
    over ranks, from the modules' own buffers)."""
    import time

    from persistent_delta import DeltaConsumer, PersistentTrackerConfig, attach
    from torchrec.distributed.model_tracker.types import TrackingMode

    dmp = build_mc_model(rank, world_size)
    tracker = attach(dmp, PersistentTrackerConfig(path=root, tracking_mode=TrackingMode.ID_ONLY))
    if rank == 0:
        DeltaConsumer(root, "keep", wait=30).close()  # registered before any batch: every batch kept whole
    dist.barrier()
    for kjt in mc_batches(rank, world_size, steps, seed=21):
        mc_step(dmp, kjt)
        if step_sleep:
            time.sleep(step_sleep)
    tracker.close()
    return {"maps": gather_maps(module_maps(dmp))}
