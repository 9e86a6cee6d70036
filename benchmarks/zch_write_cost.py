"""Write cost of logging managed-collision raw ids (issue 16): mean step time of an MC-EC model
untracked, tracked without raw ids (``zch_raw_ids=False``: slot ids only, as any table) and
tracked with them (raw ids per lookup, slot reassignments, evictions).

Three identical one-rank DMPs (an MC-EC of ``--tables`` tables of ``--slots`` slots over
``MCHManagedCollisionModule``, LFU eviction every ``--eviction-interval`` batches, fused
row-wise Adagrad, ``--batch`` ids per feature from a Zipf over ``--raw-ids`` raw ids) train on
the same batches, in blocks of ``--block`` steps per model, the models' order rotated every
round; each tracked block ends with ``flush()`` so the writer's work falls inside its own block.
Prints one JSON line: mean step time per model, the ratios, and the side records written.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.optim.apply_optimizer_in_backward import _apply_optimizer_in_backward
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.model_tracker.types import TrackingMode
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
from torchrec.modules.mc_modules import LFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule
from torchrec.optim import RowWiseAdagrad

from benchmarks._common import emit, init_single_rank_pg, log, machine, mean, ratio, rmtree, workdir
from persistent_delta import PersistentTrackerConfig, attach


class _Model(torch.nn.Module):
    def __init__(self, tables: int, slots: int, dim: int, interval: int, raw_ids: int) -> None:
        super().__init__()
        names = [f"mc_{t}" for t in range(tables)]
        ec = EmbeddingCollection(tables=[EmbeddingConfig(name=n, embedding_dim=dim, num_embeddings=slots,
                                                         feature_names=[f"f_{n}"]) for n in names],
                                 device=torch.device("meta"))
        mcc = ManagedCollisionCollection(
            managed_collision_modules={n: MCHManagedCollisionModule(
                zch_size=slots, device=torch.device("cpu"), eviction_policy=LFU_EvictionPolicy(),
                eviction_interval=interval, input_hash_size=raw_ids) for n in names},
            embedding_configs=ec.embedding_configs())
        self.sparse = ManagedCollisionEmbeddingCollection(ec, mcc, return_remapped_features=False)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        out, _ = self.sparse(kjt)
        return sum(((jt.values() - 0.5) ** 2).sum() for jt in out.values())  # type: ignore[return-value]


def _build(args: argparse.Namespace) -> DistributedModelParallel:
    torch.manual_seed(0)
    model = _Model(args.tables, args.slots, args.dim, args.eviction_interval, args.raw_ids)
    _apply_optimizer_in_backward(RowWiseAdagrad, model.sparse._embedding_module.parameters(), {"lr": 0.05, "eps": 1e-8})
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cpu"),
        constraints={f"mc_{t}": ParameterConstraints(compute_kernels=["fused"]) for t in range(args.tables)})
    pg = dist.GroupMember.WORLD
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"),
                                   plan=planner.collective_plan(model, None, pg))
    from persistent_delta.trainer.zch_capture import cpu_eviction_fallback

    cpu_eviction_fallback(dmp)  # MCH's eviction has no fbgemm CPU kernel
    return dmp


def _batches(args: argparse.Namespace, n: int) -> List[KeyedJaggedTensor]:
    probs = 1.0 / torch.arange(1, args.raw_ids + 1, dtype=torch.float64) ** args.zipf
    g = torch.Generator().manual_seed(1)
    keys = [f"f_mc_{t}" for t in range(args.tables)]
    out = []
    for _ in range(n):
        ids = torch.multinomial(probs, args.batch * len(keys), replacement=True, generator=g)
        out.append(KeyedJaggedTensor.from_lengths_sync(keys=keys, values=ids, lengths=torch.ones(ids.numel(), dtype=torch.long)))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", type=int, default=2)
    ap.add_argument("--slots", type=int, default=20000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--raw-ids", type=int, default=200000)
    ap.add_argument("--zipf", type=float, default=1.05)
    ap.add_argument("--eviction-interval", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 128 slots over 5,000 raw ids, batch 128, eviction every 2 batches, 1 round of 3 steps")
    args = ap.parse_args(argv)
    if args.quick:
        args.slots, args.raw_ids, args.batch, args.eviction_interval = 128, 5_000, 128, 2
        args.rounds, args.block, args.warmup = 1, 3, 3
    torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    init_single_rank_pg()
    root = workdir("zch_write_cost")
    models: Dict[str, Any] = {}
    trackers: Dict[str, Any] = {}
    for name in ("untracked", "slots_only", "raw_ids"):
        models[name] = _build(args)
        if name != "untracked":
            trackers[name] = attach(models[name], PersistentTrackerConfig(
                path=os.path.join(root, name), tracking_mode=TrackingMode.ID_ONLY, zch_raw_ids=name == "raw_ids"))
    batches = _batches(args, args.warmup + args.rounds * args.block)
    times: Dict[str, List[float]] = {n: [] for n in models}
    order = list(models)
    for name in order:  # warm-up: evictions start, buffers allocated
        for kjt in batches[:args.warmup]:
            models[name](kjt).backward()
        if name in trackers:
            trackers[name].flush()
    for rnd in range(args.rounds):
        block = batches[args.warmup + rnd * args.block:args.warmup + (rnd + 1) * args.block]
        for name in order[rnd % 3:] + order[:rnd % 3]:
            t0 = time.perf_counter()
            for kjt in block:
                models[name](kjt).backward()
            if name in trackers:
                trackers[name].flush()
            times[name].append((time.perf_counter() - t0) / len(block))
        log("round %d: %s", rnd, {n: round(ts[-1] * 1e3, 2) for n, ts in times.items()})
    side = {}
    for name, t in trackers.items():
        side[name] = t.log.read(lambda r: sum(
            n for e in r.tables().values() for _, _, n in r.iter_record_keys(e.table_id | (1 << 31), 0, None)))
        t.close()
    ms = {n: mean(ts) * 1e3 for n, ts in times.items()}
    emit("zch_write_cost", machine=machine(), args=vars(args), mean_step_ms=ms,
         raw_ids_vs_slots_only=ratio(ms["raw_ids"], ms["slots_only"]),
         raw_ids_vs_untracked=ratio(ms["raw_ids"], ms["untracked"]),
         slots_only_vs_untracked=ratio(ms["slots_only"], ms["untracked"]),
         per_round_ms={n: [round(x * 1e3, 2) for x in ts] for n, ts in times.items()}, side_record_bytes=side)
    rmtree(root)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
