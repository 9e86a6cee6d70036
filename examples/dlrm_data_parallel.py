"""TorchRec's data-parallel DLRM example, on 2 CPU ranks, followed by a replica on the same host.

A port of ``examples/golden_training/train_dlrm_data_parallel.py`` of TorchRec: a ``DLRM`` over
the 26 Criteo categorical features (``DLRMTrain`` adds the loss), planned by
``EmbeddingShardingPlanner`` with table ``t_cat_10`` forced **data-parallel** (the ``dense``
kernel: every rank holds the whole table, DDP averages its gradients and a non-fused
``RowWiseAdagrad`` steps it) while the other 25 tables are sharded with ``RowWiseAdagrad`` fused
in backward; Adagrad on the dense archs; one ``CombinedOptimizer``; ``TrainPipelineSparseDist``;
the example's ``RandomRecDataset``. What the port changed for CPU: gloo, small tables
(``--rows``, ``--dim``), a CPU topology for the planner with the ``fused`` kernel for the
sharded tables, and no quantized comms (NCCL only in the original).

The replicated table is the path this example shows: each rank tracks the ids **it** looked up
(ID_ONLY), so each rank publishes its own rows of ``t_cat_10``; the replica applies every rank's
part and a row present on both takes the newest publish (equal values here: DDP keeps the
copies identical).

The integration, marked ``# [pd]`` on each line below (``tests/process/test_examples.py``
checks the counts): **7 lines in the trainer**: 2 imports, ``attach`` (2), the base shard files
(1: ``save_local_shards``), a publish every ``--publish-every`` steps (1), ``close`` (1); the
data-parallel table needs none of its own. **7 lines in the replica**: 1 import, ``load_base``
(1, waiting for the ranks' base files), ``DeltaConsumer`` (1), the poll/apply/commit loop (4).

``python examples/dlrm_data_parallel.py`` (from the repository root) trains, runs the replica
in another process (``DeltaConsumer`` on the trainer's log, channel ``snapshots``), then
compares the replica with TorchRec's own gather of the trained model, bit for bit, and exits
nonzero on any difference.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

DP_TABLE = "t_cat_10"


def _quiet() -> None:
    """torch/TorchRec-internal FutureWarnings and UserWarnings stay out of the output."""
    for category in (FutureWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(torch|torchrec|fbgemm_gpu)(\.|$)")
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    logging.getLogger("torchrec.distributed.planner").setLevel(logging.ERROR)  # its advice on topologies


def _save(obj: Any, path: str) -> None:
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def _get_random_dataset(num_embeddings: int, batch_size: int = 32, manual_seed: Optional[int] = None) -> Any:
    """TorchRec's example: random Criteo-shaped batches (the port adds ``manual_seed``: other ids
    per rank)."""
    from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
    from torchrec.datasets.random import RandomRecDataset

    return RandomRecDataset(keys=DEFAULT_CAT_NAMES, batch_size=batch_size, hash_size=num_embeddings,
                            ids_per_feature=1, num_dense=len(DEFAULT_INT_NAMES), manual_seed=manual_seed)


def train(rank: int, world_size: int, args: argparse.Namespace, port: int) -> None:
    """TorchRec's ``train()`` on one CPU rank, with the tracker (``# [pd]``)."""
    _quiet()
    from torch import distributed as dist
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
    from torchrec.distributed import TrainPipelineSparseDist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.inference.state_dict_transform import state_dict_gather, state_dict_to_device
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
    from torchrec.distributed.model_tracker.types import TrackingMode  # [pd]
    from persistent_delta import PersistentTrackerConfig, attach, save_local_shards  # [pd]

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cpu")
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(args.seed)
    learning_rate = args.lr
    eb_configs = [EmbeddingBagConfig(name=f"t_{feature_name}", embedding_dim=args.dim, num_embeddings=args.rows,
                                     feature_names=[feature_name]) for feature_name in DEFAULT_CAT_NAMES]

    def dlrm(dev: Optional[torch.device]) -> Any:
        return DLRMTrain(DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=eb_configs,
                                                                             device=torch.device("meta")),
                              dense_in_features=len(DEFAULT_INT_NAMES), dense_arch_layer_sizes=[64, args.dim],
                              over_arch_layer_sizes=[64, 1], dense_device=dev))

    train_model = dlrm(device)
    # table t_cat_10 data-parallel (the dense kernel), the others sharded (CPU: the fused kernel)
    constraints = {c.name: ParameterConstraints(sharding_types=["table_wise", "row_wise", "column_wise"],
                                                compute_kernels=["fused"]) for c in eb_configs}
    constraints[DP_TABLE] = ParameterConstraints(sharding_types=["data_parallel"], compute_kernels=["dense"])
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world_size, compute_device="cpu"),
                                       constraints=constraints)
    sharder = EmbeddingBagCollectionSharder()
    plan = planner.collective_plan(train_model, [sharder], dist.GroupMember.WORLD)
    apply_optimizer_in_backward(RowWiseAdagrad, train_model.model.sparse_arch.parameters(), {"lr": learning_rate})
    model = DistributedModelParallel(plan=plan, module=train_model, device=device, sharders=[sharder])
    tracker = attach(model, PersistentTrackerConfig(  # [pd]
        path=os.path.join(args.out, "log"), tracking_mode=TrackingMode.ID_ONLY, consumers=["serving"]))  # [pd]
    save_local_shards(tracker, os.path.join(args.out, "base"))  # [pd]

    # non fused (dense) embeddings are data parallel and use RowWiseAdagrad optimizer
    non_fused_embedding_optimizer = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.module.model.sparse_arch.named_parameters())),
        lambda params: RowWiseAdagrad(params, lr=learning_rate))

    def dense_filter(named_parameters: Iterator[Tuple[str, nn.Parameter]]) -> Iterator[Tuple[str, nn.Parameter]]:
        for fqn, param in named_parameters:
            if "sparse" not in fqn:
                yield fqn, param

    dense_optimizer = KeyedOptimizerWrapper(dict(dense_filter(model.named_parameters())),
                                            lambda params: torch.optim.Adagrad(params, lr=learning_rate))
    combined_optimizer = CombinedOptimizer([("non_fused_embedding_optim", non_fused_embedding_optimizer),
                                            ("dense_optim", dense_optimizer),
                                            ("fused_embedding_optim", model.fused_optimizer)])
    train_pipeline = TrainPipelineSparseDist(model, combined_optimizer, device)
    train_iterator = iter(_get_random_dataset(num_embeddings=args.rows, manual_seed=args.seed * 1_000_003 + rank))
    for step in range(args.steps):
        train_pipeline.progress(train_iterator)
        if (step + 1) % args.publish_every == 0 or step + 1 == args.steps:
            tracker.publish("serving")  # [pd]
    tracker.close()  # [pd]

    # TorchRec's gather of the sharded state to one CPU model: the trainer's tables, for the check
    state = model.state_dict()
    state.pop("persistent_delta_tracker", None)
    cpu_state_dict = state_dict_to_device(state, pg=dist.new_group(backend="gloo"), device=torch.device("cpu"))
    cpu_model = dlrm(None)
    if rank == 0:
        cpu_model = cpu_model.to_empty(device="cpu")
    state_dict_gather(cpu_state_dict, cpu_model.state_dict())
    dist.barrier()
    prefix = "model.sparse_arch.embedding_bag_collection.embedding_bags"
    local_dp = dict(model.named_parameters())  # the replicated table: the same on every rank?
    dp = [p for n, p in local_dp.items() if DP_TABLE in n][0].detach().clone()
    copies = [torch.empty_like(dp) for _ in range(world_size)]
    dist.all_gather(copies, dp)
    if rank == 0:
        bags = cpu_model.model.sparse_arch.embedding_bag_collection.embedding_bags
        _save({"tables": {f"{prefix}.{name}": bag.weight.detach().clone() for name, bag in bags.items()},
               "dp_copies_equal": all(torch.equal(c, copies[0]) for c in copies)},
              os.path.join(args.out, "trainer.pt"))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------ replica


def replica(args: argparse.Namespace) -> int:
    """Another process on the trainer's host: the base shard files, then every publish applied,
    until the driver's ``STOP`` file; saves ``replica.pt``."""
    from persistent_delta import DeltaConsumer, apply_poll, load_base  # [pd]

    tables = load_base(os.path.join(args.out, "base"), wait=120)  # [pd] every table whole, once every rank wrote its file
    applied, dp_parts = 0, 0
    with DeltaConsumer(os.path.join(args.out, "log"), "replica", channel="snapshots", wait=120) as consumer:  # [pd]
        while True:  # [pd]
            stop = os.path.exists(os.path.join(args.out, "STOP"))
            poll = consumer.poll(timeout=0.5)  # [pd]
            dp_parts = max(dp_parts, sum(1 for fqn, parts in poll.tables().items() if DP_TABLE in fqn
                                         for p in parts if p.global_ids.numel()))
            applied += apply_poll(tables, poll, complete_only=True).rows  # [pd]
            consumer.commit()  # [pd]
            if stop and poll.empty:
                break
    _save({"tables": tables, "applied_rows": applied, "dp_parts": dp_parts}, os.path.join(args.out, "replica.pt"))
    return 0


# ------------------------------------------------------------------------------------ driver


def drive(args: argparse.Namespace) -> int:
    from torch.multiprocessing.spawn import start_processes

    t0 = time.monotonic()
    if os.path.exists(args.out):
        shutil.rmtree(args.out)
    os.makedirs(args.out)
    argv = [sys.executable, os.path.abspath(__file__), "--role=replica", f"--out={args.out}"]
    serving = subprocess.Popen(argv, start_new_session=True)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        start_processes(train, args=(2, args, port), nprocs=2, start_method="spawn")
        open(os.path.join(args.out, "STOP"), "w").close()
        if serving.wait(timeout=300) != 0:
            print("[dlrm-dp] the replica failed", file=sys.stderr)
            return 2
    finally:
        if serving.poll() is None:
            os.killpg(serving.pid, signal.SIGKILL)
            serving.wait()
    want = torch.load(os.path.join(args.out, "trainer.pt"))
    got = torch.load(os.path.join(args.out, "replica.pt"))
    result: Dict[str, Any] = {"applied_rows": got["applied_rows"], "dp_parts": got["dp_parts"],
                              "dp_copies_equal": want["dp_copies_equal"], "tables": {}}
    for fqn, w in sorted(want["tables"].items()):
        r = got["tables"][fqn]
        bad = int((w != r).any(dim=1).sum()) if w.shape == r.shape else w.shape[0]
        result["tables"][fqn] = {"rows": w.shape[0], "mismatched": bad}
        if bad or DP_TABLE in fqn:
            print(f"  {fqn:<70} rows {w.shape[0]:>6}  mismatched {bad:>6}  {'OK' if bad == 0 else 'FAIL'}")
    ok = all(t["mismatched"] == 0 for t in result["tables"].values()) and want["dp_copies_equal"]
    result["ok"] = ok
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(result, f)
    print(f"[dlrm-dp] {'PASS' if ok else 'FAIL'}: {args.steps} steps, {len(want['tables'])} tables (1 data-parallel) "
          f"bit-exact: {ok}, {got['applied_rows']} rows applied by the replica, {time.monotonic() - t0:.1f}s", flush=True)
    return 0 if ok else 1


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python examples/dlrm_data_parallel.py", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument("--rows", type=int, default=1000, help="rows per table (default 1000)")
    p.add_argument("--dim", type=int, default=16, help="embedding dim (default 16)")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--publish-every", type=int, default=5, help="publish every K steps (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="dlrm-dp-out", help="output directory (replaced)")
    p.add_argument("--role", default="drive", choices=["drive", "replica"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.out = os.path.abspath(args.out)
    return args


def main(argv: Optional[List[str]] = None) -> int:
    _quiet()
    args = parse_args(argv)
    if args.role == "replica":
        return replica(args)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
