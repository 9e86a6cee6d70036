"""TorchRec's two-tower retrieval example, on 2 CPU ranks, followed across hosts by a replica.

A port of ``examples/retrieval/two_tower_train.py`` of TorchRec (its ``TwoTower`` and
``TwoTowerTrainTask`` modules and its ``RandomRecDataset`` loader are copied below, minus the
FAISS index, which needs a GPU build): the same model, ``DistributedModelParallel``,
``RowWiseAdagrad`` fused in backward, Adam on the dense towers through
``KeyedOptimizerWrapper``, ``TrainPipelineSparseDist`` and the example's random dataset, on gloo.
What the port changed for CPU: the tables are small (``--rows``), and the plan is explicit (the
query table column-wise, the candidate table table-wise) because CPU plans need the ``fused``
kernel. The dataset is seeded per rank and per start (new ids after a restart, as new data
would be). What it added for a restore: a checkpoint every ``--checkpoint-every`` steps
(``model.state_dict()``, which carries the tracker's state, and both optimizers'; Adam over the
parameters that are not fused, ``in_backward_optimizer_filter``, so that its state loads) and,
when started again, the restore from it; and at the end, TorchRec's own gather of the sharded
state to one CPU model (the example's ``state_dict_to_device`` + ``state_dict_gather``), the
trainer's tables the check compares with.

The integration, marked ``# [pd]`` on each line below (``tests/process/test_examples.py``
checks the counts): **10 lines in the trainer**: 2 imports, ``attach`` (2), a base on the
stream at the first start (4: a publish, then ``upload_base``), a publish every
``--publish-every`` steps (1), ``close`` (1); the checkpoint and its restore take none (the
tracker's state rides in ``model.state_dict()``). **7 lines in the replica**: 1 import,
``RemoteConsumer`` (1), ``bootstrap`` (1, waiting for the trainer's base), the poll/apply/commit
loop (4). The shipper is a command beside the trainer and no
code: ``persistent-delta ship LOG --server URL --job JOB --channels snapshots --key-file KEY``.

``python examples/two_tower_fleet.py`` (from the repository root) runs the whole job:

1. a local NATS JetStream server (``persistent_delta.testing.LocalServer``, 127.0.0.1) and the
   job's stream key;
2. the shipper process, the replica process and the trainer (2 spawned ranks);
3. ``--kills N``: N times, at a random step after a new checkpoint (and a random instant
   within it), the driver SIGKILLs both ranks and starts the trainer again, which restores its
   latest checkpoint (``model.load_state_dict`` restores the tracker too: it re-delivers the
   rows touched after the checkpoint, at a fresh batch index);
4. the replica runs in another process that may not read the trainer's log (an audit hook
   fails every open under it): it starts from the base on the stream, applies every publish,
   and saves its tables when told the stream holds everything;
5. the driver compares the replica with the trainer's gathered tables, bit for bit, and exits
   nonzero on any difference.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

JOB = "twotower"
KEYS = ["userId", "movieId"]  # torchrec.datasets.movielens.DEFAULT_RATINGS_COLUMN_NAMES[:2]


def _quiet() -> None:
    """torch/TorchRec-internal FutureWarnings and UserWarnings stay out of the output."""
    for category in (FutureWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(torch|torchrec|fbgemm_gpu)(\.|$)")
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


# ------------------------------------------------- TorchRec's example (BSD-licensed, (c) Meta)


class TwoTower(nn.Module):
    """TorchRec's ``examples/retrieval/modules/two_tower.py`` ``TwoTower``: embeds the query and
    the candidate into the same space (an EBC of two tables, an MLP per tower)."""

    def __init__(self, embedding_bag_collection: Any, layer_sizes: List[int],
                 device: Optional[torch.device] = None) -> None:
        from torchrec.modules.mlp import MLP

        super().__init__()
        configs = embedding_bag_collection.embedding_bag_configs()
        assert len(configs) == 2, "Expected two EmbeddingBags in the two tower model"
        assert configs[0].embedding_dim == configs[1].embedding_dim, "Both EmbeddingBagConfigs must have the same dimension"
        embedding_dim: int = configs[0].embedding_dim
        self._feature_names_query: List[str] = configs[0].feature_names
        self._candidate_feature_names: List[str] = configs[1].feature_names
        self.ebc = embedding_bag_collection
        self.query_proj = MLP(in_size=embedding_dim, layer_sizes=layer_sizes, device=device)
        self.candidate_proj = MLP(in_size=embedding_dim, layer_sizes=layer_sizes, device=device)

    def forward(self, kjt: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        pooled_embeddings = self.ebc(kjt)
        query_embedding: torch.Tensor = self.query_proj(
            torch.cat([pooled_embeddings[feature] for feature in self._feature_names_query], dim=1))
        candidate_embedding: torch.Tensor = self.candidate_proj(
            torch.cat([pooled_embeddings[feature] for feature in self._candidate_feature_names], dim=1))
        return query_embedding, candidate_embedding


class TwoTowerTrainTask(nn.Module):
    """TorchRec's ``TwoTowerTrainTask``: the two-tower model with a binary cross-entropy loss,
    for a train pipeline."""

    def __init__(self, two_tower: TwoTower) -> None:
        super().__init__()
        self.two_tower = two_tower
        self.loss_fn: nn.Module = nn.BCEWithLogitsLoss()

    def forward(self, batch: Any) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        query_embedding, candidate_embedding = self.two_tower(batch.sparse_features)
        logits = (query_embedding * candidate_embedding).sum(dim=1).squeeze()
        loss = self.loss_fn(logits, batch.labels.float())
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())


def get_dataloader(batch_size: int, num_embeddings: int, pin_memory: bool = False, num_workers: int = 0,
                   manual_seed: Optional[int] = None) -> Any:
    """TorchRec's ``examples/retrieval/data/dataloader.py``: random two-feature batches (the port
    adds ``manual_seed``: other ids per rank, and after a restart, as new data would be)."""
    from torch.utils.data import DataLoader
    from torchrec.datasets.random import RandomRecDataset

    return DataLoader(
        RandomRecDataset(keys=KEYS, batch_size=batch_size, hash_size=num_embeddings, ids_per_feature=1, num_dense=0,
                         manual_seed=manual_seed),
        batch_size=None, batch_sampler=None, pin_memory=pin_memory, num_workers=num_workers,
    )


# ------------------------------------------------------------------------------------ trainer


def _save(obj: Any, path: str) -> None:
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def train(rank: int, world_size: int, args: argparse.Namespace, port: int) -> None:
    """TorchRec's ``train()`` on one CPU rank, with the tracker (``# [pd]``) and a checkpoint."""
    _quiet()
    from torch import distributed as dist
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    from torchrec.distributed import TrainPipelineSparseDist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.inference.state_dict_transform import state_dict_gather, state_dict_to_device
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
    from torchrec.distributed.model_tracker.types import TrackingMode  # [pd]
    from persistent_delta import PersistentTrackerConfig, attach, upload_base  # [pd]

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cpu")
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(args.seed)
    layer_sizes = [128, 64]
    eb_configs = [EmbeddingBagConfig(name=f"t_{feature_name}", embedding_dim=args.dim, num_embeddings=args.rows,
                                     feature_names=[feature_name]) for feature_name in KEYS]
    two_tower_model = TwoTower(EmbeddingBagCollection(tables=eb_configs, device=torch.device("meta")),
                               layer_sizes=layer_sizes, device=device)
    two_tower_train_task = TwoTowerTrainTask(two_tower_model)
    apply_optimizer_in_backward(RowWiseAdagrad, two_tower_train_task.two_tower.ebc.parameters(), {"lr": args.lr})
    plan = construct_module_sharding_plan(  # CPU: an explicit plan (the fused kernel)
        two_tower_train_task.two_tower.ebc, {"t_userId": column_wise(ranks=list(range(world_size))),
                                             "t_movieId": table_wise(rank=world_size - 1)},
        local_size=world_size, world_size=world_size, device_type="cpu")
    model = DistributedModelParallel(module=two_tower_train_task, device=device,
                                     env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
                                     plan=ShardingPlan({"two_tower.ebc": plan}))
    optimizer = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                      lambda params: torch.optim.Adam(params, lr=args.lr))
    tracker = attach(model, PersistentTrackerConfig(  # [pd]
        path=os.path.join(args.out, "log"), tracking_mode=TrackingMode[args.mode], consumers=["serving"]))  # [pd]

    start, latest = 0, os.path.join(args.out, "ckpt", "LATEST")
    if os.path.exists(latest):  # restart: the model (and with it the tracker) and both optimizers
        saved = torch.load(os.path.join(args.out, "ckpt", open(latest).read().strip(), f"rank-{rank}.pt"),
                           weights_only=False)
        tracker_state = saved["model"].pop(f"persistent_delta_tracker.rank_{rank}") if args.restore != "model" \
            else None
        model.load_state_dict(saved["model"])  # with the tracker's state in it: restores the tracker too
        model.fused_optimizer.load_state_dict(saved["fused"])
        optimizer.init_state()  # a KeyedOptimizer loads into initialized state only
        optimizer.load_state_dict(saved["dense"])
        if args.restore == "tracker":  # the same restore, called explicitly
            tracker.load_state_dict(tracker_state)
        start = saved["step"]
    if start == 0:  # [pd] a base for replicas, on every rank, right after a publish
        tracker.publish("serving")  # [pd]
        upload_base(args.server, JOB, rank, tracker.curr_batch_idx,  # [pd]
                    {fqn: t.weights() for fqn, t in tracker.local_tables.items()}, key=args.key_file)  # [pd]

    dl_iterator = iter(get_dataloader(batch_size=args.batch, num_embeddings=args.rows,
                                      manual_seed=args.seed * 1_000_003 + start * 2 + rank))
    train_pipeline = TrainPipelineSparseDist(model, optimizer, device)
    for step in range(start, args.steps):
        train_pipeline.progress(dl_iterator)
        done = step + 1
        if rank == 0:  # for the driver's SIGKILLs
            _write(os.path.join(args.out, "progress"), str(done))
        if done % args.publish_every == 0 or done == args.steps:
            tracker.publish("serving")  # [pd]
        if done % args.checkpoint_every == 0 and done < args.steps:
            step_dir = os.path.join(args.out, "ckpt", f"step-{done}")
            os.makedirs(step_dir, exist_ok=True)
            _save({"model": model.state_dict(), "fused": model.fused_optimizer.state_dict(),
                   "dense": optimizer.state_dict(), "step": done}, os.path.join(step_dir, f"rank-{rank}.pt"))
            dist.barrier()
            if rank == 0:
                _write(latest, f"step-{done}")
    tracker.close()  # [pd]

    # TorchRec's gather of the sharded state to one CPU model: the trainer's tables, for the check
    checkpoint_pg = dist.new_group(backend="gloo")
    state = model.state_dict()
    state.pop("persistent_delta_tracker", None)
    cpu_state_dict = state_dict_to_device(state, pg=checkpoint_pg, device=torch.device("cpu"))
    two_tower_train_cpu = TwoTowerTrainTask(TwoTower(EmbeddingBagCollection(tables=eb_configs,
                                                                             device=torch.device("meta")),
                                                     layer_sizes=layer_sizes))
    if rank == 0:
        two_tower_train_cpu = two_tower_train_cpu.to_empty(device="cpu")
    state_dict_gather(cpu_state_dict, two_tower_train_cpu.state_dict())
    dist.barrier()
    if rank == 0:
        ebc = two_tower_train_cpu.two_tower.ebc
        _save({f"two_tower.ebc.embedding_bags.{name}": bag.weight.detach().clone()
               for name, bag in ebc.embedding_bags.items()}, os.path.join(args.out, "trainer.pt"))
    dist.destroy_process_group()


def run_trainer(args: argparse.Namespace) -> None:
    from torch.multiprocessing.spawn import start_processes

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_processes(train, args=(2, args, port), nprocs=2, start_method="spawn")


# ------------------------------------------------------------------------------------ replica


def _forbid(root: str) -> None:
    """Fail every open/listdir under ``root`` in this process (the replica reads the stream only)."""
    root = os.path.realpath(root)

    def hook(event: str, hargs: Any) -> None:
        if event in ("open", "os.listdir", "os.scandir") and hargs and isinstance(hargs[0], (str, bytes, os.PathLike)):
            p = os.path.realpath(os.fsdecode(hargs[0]))
            if p == root or p.startswith(root + os.sep):
                raise PermissionError(f"the replica may not read the trainer's log: {p}")

    sys.addaudithook(hook)


def replica(args: argparse.Namespace) -> int:
    """Another host's replica: a base from the stream, then every publish applied, until the
    driver's ``STOP`` file says the stream holds everything; saves ``replica.pt``."""
    from persistent_delta import RemoteConsumer, apply_poll  # [pd]

    _forbid(os.path.join(args.out, "log"))
    with RemoteConsumer(args.server, JOB, "replica", channel="snapshots", key=args.key_file, wait=120) as consumer:  # [pd]
        tables = consumer.bootstrap(wait=120)  # [pd] the full tables, once the trainer uploaded them; positions just past the base
        applied = 0
        while True:  # [pd]
            stop = os.path.exists(os.path.join(args.out, "STOP"))
            poll = consumer.poll(timeout=0.5)  # [pd]
            applied += apply_poll(tables, poll, complete_only=True).rows  # [pd]
            consumer.commit()  # [pd]
            if stop and poll.empty:
                break
    _save({"tables": tables, "applied_rows": applied}, os.path.join(args.out, "replica.pt"))
    return 0


# ------------------------------------------------------------------------------------ driver


def _child(args: argparse.Namespace, role: str, **extra: Any) -> subprocess.Popen:  # type: ignore[type-arg]
    flags = {**vars(args), **extra, "role": role}
    argv = [sys.executable, os.path.abspath(__file__)]
    for k, v in flags.items():
        if isinstance(v, bool):
            argv += [f"--{k.replace('_', '-')}"] if v else []
        elif v is not None:
            argv.append(f"--{k.replace('_', '-')}={v}")
    return subprocess.Popen(argv, start_new_session=True)


def _shipper(args: argparse.Namespace) -> subprocess.Popen:  # type: ignore[type-arg]
    return subprocess.Popen([sys.executable, "-m", "persistent_delta", "ship", os.path.join(args.out, "log"),
                             "--server", args.server, "--job", JOB, "--channels", "snapshots",
                             "--key-file", args.key_file], start_new_session=True)


def _stream_caught_up(args: argparse.Namespace, probe: Any) -> bool:
    """Whether the stream holds every batch of the trainer's local snapshots channel."""
    from persistent_delta import DeltaReader

    with DeltaReader(os.path.join(args.out, "log"), channel="snapshots") as reader:
        local = reader.end_offsets()
    return probe.end_offsets() == local


def drive(args: argparse.Namespace) -> int:
    from persistent_delta import RemoteConsumer
    from persistent_delta.fleet import write_key_file
    from persistent_delta.testing import LocalServer

    t0 = time.monotonic()
    if os.path.exists(args.out):
        shutil.rmtree(args.out)
    os.makedirs(args.out)
    rng = random.Random(args.seed)
    server = LocalServer(os.path.join(args.out, "nats")).start()
    args.server, args.key_file = server.url, os.path.join(args.out, "stream.key")
    write_key_file(args.key_file)
    procs: List[subprocess.Popen] = []  # type: ignore[type-arg]
    try:
        shipper = _shipper(args)
        serving = _child(args, "replica")
        procs += [shipper, serving]
        latest = os.path.join(args.out, "ckpt", "LATEST")
        kills = 0
        while True:
            seen, target = _read(latest), None
            trainer = _child(args, "train")
            procs.append(trainer)
            killed = False
            while trainer.poll() is None:
                ckpt = _read(latest)
                if kills < args.kills and target is None and ckpt != seen:  # a new checkpoint: a kill within M steps
                    target = int(ckpt.split("-")[1]) + rng.randint(1, max(1, args.checkpoint_every - 1))
                progress = _read(os.path.join(args.out, "progress"))
                if target is not None and progress and int(progress) >= target:
                    time.sleep(rng.uniform(0.0, args.kill_window))  # a random instant within the step
                    if trainer.poll() is None:
                        os.killpg(trainer.pid, signal.SIGKILL)
                        trainer.wait()
                        kills += 1
                        killed = True
                        print(f"[two-tower] SIGKILLed both ranks after step {progress} ({kills} of {args.kills}); "
                              "restarting", flush=True)
                    break
                time.sleep(0.01)
            if killed:
                continue
            if trainer.wait() != 0:
                print(f"[two-tower] trainer failed: exit code {trainer.returncode}", file=sys.stderr)
                return 2
            break
        with RemoteConsumer(args.server, JOB, "probe", channel="snapshots", key=args.key_file, wait=60) as probe:
            deadline = time.monotonic() + 120
            while not _stream_caught_up(args, probe):
                if time.monotonic() > deadline:
                    print("[two-tower] the shipper did not catch up", file=sys.stderr)
                    return 2
                time.sleep(0.1)
        open(os.path.join(args.out, "STOP"), "w").close()
        if serving.wait(timeout=300) != 0:
            print("[two-tower] the replica failed", file=sys.stderr)
            return 2
        want = torch.load(os.path.join(args.out, "trainer.pt"))
        got = torch.load(os.path.join(args.out, "replica.pt"))
        result: Dict[str, Any] = {"kills": kills, "applied_rows": got["applied_rows"], "tables": {}}
        for fqn, w in sorted(want.items()):
            r = got["tables"][fqn]
            bad = int((w != r).any(dim=1).sum()) if w.shape == r.shape else w.shape[0]
            result["tables"][fqn] = {"rows": w.shape[0], "mismatched": bad}
            print(f"  {fqn:<40} rows {w.shape[0]:>6}  mismatched {bad:>6}  {'OK' if bad == 0 else 'FAIL'}")
        ok = all(t["mismatched"] == 0 for t in result["tables"].values())
        result["ok"] = ok
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f)
        print(f"[two-tower] {'PASS' if ok else 'FAIL'}: {args.steps} steps, {kills} SIGKILLs, "
              f"{got['applied_rows']} rows applied by the replica, {time.monotonic() - t0:.1f}s", flush=True)
        return 0 if ok else 1
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM if p is procs[0] else signal.SIGKILL)
                p.wait(30)
        server.stop()


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python examples/two_tower_fleet.py", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument("--rows", type=int, default=4096, help="rows per table (default 4096)")
    p.add_argument("--dim", type=int, default=64, help="embedding dim (default 64, as TorchRec's example)")
    p.add_argument("--batch", type=int, default=32, help="batch size per rank (default 32, as TorchRec's example)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--mode", default="ID_ONLY", choices=["ID_ONLY", "MOMENTUM_DIFF", "ROWWISE_ADAGRAD"],
                   help="tracking mode (default ID_ONLY)")
    p.add_argument("--publish-every", type=int, default=5, help="publish every K steps (default 5)")
    p.add_argument("--checkpoint-every", type=int, default=10, help="checkpoint every M steps (default 10)")
    p.add_argument("--kills", type=int, default=1,
                   help="SIGKILL the trainer N times, each at a random step after a new checkpoint (default 1)")
    p.add_argument("--kill-window", type=float, default=0.05,
                   help="and within this many seconds after that step (default 0.05)")
    p.add_argument("--restore", default="model", choices=["model", "tracker", "none"],
                   help="how a restart restores the tracker: with the model's load_state_dict (default), with "
                        "tracker.load_state_dict, or not at all (the replica then drifts: the check fails)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="two-tower-out", help="output directory (replaced)")
    p.add_argument("--role", default="drive", choices=["drive", "train", "replica"], help=argparse.SUPPRESS)
    p.add_argument("--server", default=None, help=argparse.SUPPRESS)
    p.add_argument("--key-file", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.out = os.path.abspath(args.out)
    return args


def main(argv: Optional[List[str]] = None) -> int:
    _quiet()
    args = parse_args(argv)
    if args.role == "train":
        run_trainer(args)
        return 0
    if args.role == "replica":
        return replica(args)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
