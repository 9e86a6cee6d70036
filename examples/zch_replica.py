"""A managed-collision (ZCH) model feeding a replica's raw-id map (``python examples/zch_replica.py``).

Two gloo ranks on CPU train an EmbeddingCollection whose tables are managed by TorchRec's
``MCHManagedCollisionModule`` (a small slot budget, so raw ids are admitted and evicted every
few steps) with the persistent tracker attached. Meanwhile this process is the replica: a
``DeltaConsumer`` polls the log, applies every poll's slot reassignments to a ``RawIdMap``
(``poll.zch()``: per table, the raw ids looked up, their slots, the reassignments and the raw ids
evicted), and commits. At the end it compares its (raw id -> slot) map with the trainer's,
read from the MCH modules' own buffers; the exit code is nonzero if they differ.

CPU note: fbgemm-gpu-cpu 1.8.0 has no CPU kernel for ``fbgemm::reset_weight_momentum``, which
TorchRec calls on every eviction; the trainer gives the TBEs a Python version (zero the rows
and their optimizer state, as the CUDA kernel does). On a GPU it is not needed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import warnings
from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
warnings.filterwarnings("ignore")

from persistent_delta import DeltaConsumer, PersistentTrackerConfig, RawIdMap, attach

RAW_IDS = 5000  # raw id space; bucketed to the ranks by range


def _trainer(rank: int, world: int, root: str, port: int, steps: int, slots: int, maps_path: str) -> None:
    _train(rank, world, root, port, steps, slots, maps_path)
    dist.destroy_process_group()
    # The group's gloo threads live until its last reference (cycles through the model) is
    # collected. At interpreter exit a thread still dropping the last collective's tensors would
    # need the GIL during finalization and abort the process; collect while the interpreter is whole.
    gc.collect()


def _train(rank: int, world: int, root: str, port: int, steps: int, slots: int, maps_path: str) -> None:
    from torch.distributed.optim.apply_optimizer_in_backward import _apply_optimizer_in_backward
    from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.model_tracker.types import TrackingMode
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
    from torchrec.modules.mc_modules import LFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule
    from torchrec.optim import RowWiseAdagrad

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            ec = EmbeddingCollection(tables=[EmbeddingConfig(name="users", embedding_dim=16, num_embeddings=slots,
                                                             feature_names=["user"])], device=torch.device("meta"))
            mcc = ManagedCollisionCollection(managed_collision_modules={"users": MCHManagedCollisionModule(
                zch_size=slots, device=torch.device("cpu"), eviction_policy=LFU_EvictionPolicy(), eviction_interval=3,
                input_hash_size=RAW_IDS, buckets=world)}, embedding_configs=ec.embedding_configs())
            self.sparse = ManagedCollisionEmbeddingCollection(ec, mcc, return_remapped_features=False)

        def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
            out, _ = self.sparse(kjt)
            return sum(((jt.values() - 0.5) ** 2).sum() for jt in out.values())  # type: ignore[return-value]

    torch.manual_seed(0)
    model = Model()
    _apply_optimizer_in_backward(RowWiseAdagrad, model.sparse._embedding_module.parameters(), {"lr": 0.1})
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"), constraints={
        "users": ParameterConstraints(compute_kernels=["fused"], sharding_types=["row_wise"])})
    pg = dist.GroupMember.WORLD
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"),
                                   plan=planner.collective_plan(model, None, pg))
    from persistent_delta.trainer import cpu_eviction_fallback

    cpu_eviction_fallback(dmp)  # MCH's eviction has no fbgemm CPU kernel
    tracker = attach(dmp, PersistentTrackerConfig(path=root, tracking_mode=TrackingMode.ID_ONLY, linger_steps=1))
    probs = 1.0 / torch.arange(1, RAW_IDS + 1, dtype=torch.float64) ** 1.05
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        ids = torch.randperm(RAW_IDS, generator=torch.Generator().manual_seed(7))[
            torch.multinomial(probs, 64, replacement=True, generator=g)]
        dmp(KeyedJaggedTensor.from_lengths_sync(keys=["user"], values=ids, lengths=torch.ones(64, dtype=torch.long))).backward()
    maps = {fqn: dict(zip(*(t.tolist() for t in m))) for fqn, m in tracker.zch.current_maps().items()}
    tracker.close()
    parts: list = [None] * world
    dist.all_gather_object(parts, maps)
    if rank == 0:
        merged: Dict[str, Dict[int, int]] = {}
        for p in parts:
            for fqn, m in p.items():
                merged.setdefault(fqn, {}).update(m)
        with open(maps_path, "w") as f:
            json.dump({fqn: sorted(m.items()) for fqn, m in merged.items()}, f)


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description="A ZCH model feeding a replica's raw-id map.")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--slots", type=int, default=64, help="slots per table in all (a small budget: many evictions)")
    ap.add_argument("--out", default=None, help="log root (default: a temporary directory)")
    args = ap.parse_args(argv)
    root = args.out or tempfile.mkdtemp(prefix="zch-replica-")
    maps_path = os.path.join(root, "trainer-maps.json")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(_trainer, args=(2, root, port, args.steps, args.slots, maps_path), nprocs=2, join=False,
                             start_method="spawn")
    replica, polls, moves, evicted = RawIdMap(), 0, 0, 0
    with DeltaConsumer(root, "replica", wait=120) as consumer:  # registers in both ranks' logs
        while True:
            done = ctx.join(timeout=0.01)
            poll = consumer.poll(timeout=0.5)
            for z in poll.zch().values():  # per table: raw ids, slots, reassignments, evictions
                moves += replica.apply(z)
                evicted += int(z.evicted_raw_ids.numel())
            consumer.commit()
            polls += 0 if poll.empty else 1
            if done and poll.empty:
                break
    with open(maps_path) as f:
        trainer = {fqn: {int(r): int(s) for r, s in pairs} for fqn, pairs in json.load(f).items()}
    ok = all(replica.as_dict(fqn) == m for fqn, m in trainer.items()) and set(replica.tables()) == set(trainer)
    for fqn, m in trainer.items():
        print(f"[zch] {fqn}: trainer maps {len(m)} raw ids, replica {len(replica.as_dict(fqn))}: "
              f"{'OK' if replica.as_dict(fqn) == m else 'DIFFERENT'}")
    print(f"[zch] {polls} polls, {moves} slot reassignments applied, {evicted} evictions seen")
    print("[zch] PASS" if ok else "[zch] FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
