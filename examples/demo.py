"""The main job (``make demo``, i.e. ``python examples/demo.py``): online training that streams
fresh rows to a serving replica and survives a crash.

What it does, end to end, on CPU:

1. trains a small DLRM (``torchrec.models.dlrm.DLRM``) on 2 gloo ranks with synthetic,
   Zipf-distributed click data; its tables are sharded row-wise, table-wise and column-wise
   (table ``t`` gets ``t % 3``), with fused row-wise Adagrad, and the persistent tracker is
   attached with consumers ``serving`` and ``checkpoint``;
2. every ``--publish-every`` steps, ``tracker.publish("serving")`` writes the current values of
   the rows changed since the last publish into the log; a separate serving process
   (``DeltaConsumer(root, "replica", channel="snapshots")``) applies them to its own full copy
   of the tables and commits its position;
3. every ``--checkpoint-every`` steps, each rank saves its DMP state_dict, fused optimizer
   state and ``tracker.state_dict()`` (the ``checkpoint`` consumer reads the log then too);
   the initial and final tables are saved with ``persistent_delta.trainer.save_shards.save_local_shards``
   (``<out>/initial/`` and ``<out>/final/``, one ``rank-<r>.safetensors`` per rank) and
   assembled into full tables with ``load_base``;
4. at ``--kill-at`` the demo SIGKILLs the trainer (both ranks) and restarts it from its last
   checkpoint; ``tracker.load_state_dict`` re-delivers the rows touched after it (the restarted
   ranks warn when they drop a batch the SIGKILL left unfinished: the demo announces those
   warnings on the line before them, and they are its only warnings);
5. at the end it checks that the replica equals the trainer's tables bit for bit, prints the
   check, the ``offsets`` table and a one-line summary; the exit code is nonzero if the check or
   a command it shows fails.

``--fleet`` (``make demo-fleet``) runs the same job across "hosts": the driver starts a local
NATS JetStream server (``persistent_delta.testing``, 127.0.0.1, a fresh store under the
output directory), a shipper process (``persistent-delta ship``) beside the trainer, and the
serving replica reads **only from the stream** (``RemoteConsumer``; an audit hook fails any
open under the log directory). The shipper is SIGKILLed and restarted once too. The driver writes
the job's stream key (``<out>/stream.key``, what ``persistent-delta keygen`` writes) and passes it
to the shipper, the replica and every command it prints (``--key-file``), so each printed command
can be copied as is while the server runs. The plain ``make demo`` needs no server.

``python examples/demo.py --help`` (from the repository root) lists the flags. Third-party
FutureWarnings/UserWarnings from torch and TorchRec internals are silenced in the demo's own
processes (see ``_quiet_third_party_warnings``); warnings from ``persistent_delta`` still show.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

SPARSE = "sparse_arch.embedding_bag_collection"  # DLRM's EBC path
DENSE_IN = 13
THIRD_PARTY = r"(torch|torchrec|fbgemm_gpu)(\.|$)"  # modules whose warnings the demo does not show
# Printed right before the restarted trainer starts: when the SIGKILL left batches unfinished on some
# rank, each rank logs (persistent_delta.trainer.restore.resume_at) that they are dropped, indices skipped.
RESTART_WARNINGS = ("the restarted trainer now warns if the SIGKILL left batches unfinished on some rank: the "
                    "ranks drop them and skip their indices; the restore from the checkpoint re-delivers their rows "
                    "(expected)")


def _quiet_third_party_warnings() -> None:
    """Silence torch/TorchRec-internal deprecation noise in this process (the driver, the serving
    and trainer processes and every spawned rank call it first): FutureWarnings and UserWarnings
    attributed to torch, torchrec or fbgemm_gpu modules, and torch.fx's one-time
    ``is_fx_tracing`` log warning. Warnings from the demo and from ``persistent_delta`` still show."""
    for category in (FutureWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category, module=THIRD_PARTY)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


# ------------------------------------------------------------------------------- model & data


def build_model(args: argparse.Namespace, world_size: int) -> Any:
    """A DLRM sharded over the default process group (gloo, CPU)."""
    import torch.distributed as dist
    from torch.distributed.optim.apply_optimizer_in_backward import _apply_optimizer_in_backward
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.models.dlrm import DLRM
    from torchrec.optim import RowWiseAdagrad

    torch.manual_seed(args.seed)
    tables = [
        EmbeddingBagConfig(name=f"t{t}", embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[f"f{t}"])
        for t in range(args.tables)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRM(ebc, DENSE_IN, [32, args.dim], [32, 1])
    _apply_optimizer_in_backward(RowWiseAdagrad, model.sparse_arch.parameters(), {"lr": 0.05})

    def gen(t: int) -> Any:
        kind = t % 3
        if kind == 0:
            return row_wise()
        if kind == 1:
            return table_wise(rank=t % world_size)
        return column_wise(ranks=list(range(world_size)))

    plan = construct_module_sharding_plan(
        model.sparse_arch.embedding_bag_collection, {f"t{t}": gen(t) for t in range(args.tables)},
        local_size=world_size, world_size=world_size, device_type="cpu",
    )
    pg = dist.GroupMember.WORLD
    dmp = DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"), plan=ShardingPlan({SPARSE: plan})
    )
    return dmp


def make_batch(args: argparse.Namespace, step: int, rank: int) -> Tuple[torch.Tensor, Any, torch.Tensor]:
    """Deterministic synthetic click data for (step, rank): Zipf ids, clicks from a hidden rule."""
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 7919 + rank)
    b = args.batch
    dense = torch.rand(b, DENSE_IN, generator=g)
    probs = 1.0 / torch.arange(1, args.rows + 1, dtype=torch.float64) ** 1.1
    perm = torch.randperm(args.rows, generator=torch.Generator().manual_seed(args.seed))
    lengths = torch.randint(1, args.pooling + 1, (args.tables * b,), generator=g)
    ids = perm[torch.multinomial(probs, int(lengths.sum()), replacement=True, generator=g)]
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{t}" for t in range(args.tables)], values=ids, lengths=lengths)
    labels = ((dense[:, 0] + (ids[: b] % 7).float() / 7.0) > 1.0).float()
    return dense, kjt, labels


# ------------------------------------------------------------------------------------ trainer


def _atomic_torch_save(obj: Any, path: str) -> None:
    from persistent_delta.log import atomic_write_bytes

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())


def _atomic_write(path: str, text: str) -> None:
    from persistent_delta.log import atomic_write_bytes

    atomic_write_bytes(path, text.encode())


def train_rank(rank: int, world_size: int, args: argparse.Namespace, port: int) -> None:
    """One trainer rank: resume from the latest checkpoint if any, train, publish, checkpoint."""
    _quiet_third_party_warnings()  # a spawned process: the parent's filters do not carry over
    import torch.distributed as dist
    from tqdm import tqdm
    from torchrec.distributed.model_tracker.types import TrackingMode

    from persistent_delta import PersistentTrackerConfig, attach
    from persistent_delta import save_local_shards

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    out = args.out
    dmp = build_model(args, world_size)
    cfg = PersistentTrackerConfig(
        path=os.path.join(out, "log"), tracking_mode=TrackingMode[args.mode], consumers=["serving", "checkpoint"],
        delete_on_read=True,
    )
    tracker = attach(dmp, cfg)
    tracking_s = 0.0
    latest = os.path.join(out, "ckpt", "LATEST")
    start = 0
    if os.path.exists(latest):
        step_dir = open(latest).read().strip()
        saved = torch.load(os.path.join(out, "ckpt", step_dir, f"rank-{rank}.pt"), weights_only=False)
        dmp.load_state_dict(saved["model"])
        dmp.fused_optimizer.load_state_dict(saved["optim"])
        t0 = time.perf_counter()
        redelivered = tracker.load_state_dict(saved["tracker"])
        tracking_s += time.perf_counter() - t0
        start = saved["step"]
        if rank == 0:
            print(f"[trainer] restarted from checkpoint at step {start}: re-delivering "
                  f"{sum(redelivered.values())} rows touched after it", flush=True)
    else:
        save_local_shards(tracker, os.path.join(out, "initial"))
    opt = torch.optim.SGD([p for n, p in dmp.named_parameters() if "embedding_bags" not in n], lr=0.05)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    published = 0
    bar = tqdm(range(start, args.steps), desc=f"train (rank {rank})", disable=rank != 0 or None, initial=start,
               total=args.steps, leave=False)
    for step in bar:
        if step == args.kill_at and rank == 0 and not os.path.exists(os.path.join(out, "KILL_ME")):
            _atomic_write(os.path.join(out, "KILL_ME"), str(step))
            time.sleep(600)  # the driver SIGKILLs us here
        dense, kjt, labels = make_batch(args, step, rank)
        opt.zero_grad()
        logits = dmp(dense, kjt).squeeze(-1)
        loss_fn(logits, labels).backward()
        opt.step()
        done = step + 1
        if done % args.publish_every == 0 or done == args.steps:
            if not (args.skip_publish_at and done == args.skip_publish_at):
                t0 = time.perf_counter()
                published += sum(tracker.publish("serving").values())
                tracking_s += time.perf_counter() - t0
        if done % args.checkpoint_every == 0 and done < args.steps:
            t0 = time.perf_counter()
            tracker.get_unique("checkpoint")  # the incremental-checkpoint consumer reads its delta
            tstate = tracker.state_dict()
            tracking_s += time.perf_counter() - t0
            step_dir = f"step-{done}"
            os.makedirs(os.path.join(out, "ckpt", step_dir), exist_ok=True)
            _atomic_torch_save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict(),
                                "tracker": tstate, "step": done},
                               os.path.join(out, "ckpt", step_dir, f"rank-{rank}.pt"))
            dist.barrier()
            if rank == 0:
                _atomic_write(latest, step_dir)
    t0 = time.perf_counter()
    tracker.flush()
    tracking_s += time.perf_counter() - t0
    stats = tracker.stats()
    save_local_shards(tracker, os.path.join(out, "final"))
    tracker.close()
    _atomic_write(os.path.join(out, f"trainer-rank-{rank}.json"), json.dumps(
        {"published": published, "tracking_s": tracking_s, "wait_s": stats.get("total_wait_s", 0.0),
         "bytes_written": stats.get("bytes_written", 0)}))
    dist.barrier()
    dist.destroy_process_group()


def run_trainer(args: argparse.Namespace) -> None:
    from torch.multiprocessing.spawn import start_processes

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start_processes(train_rank, args=(args.world_size, args, port), nprocs=args.world_size, start_method="spawn")


# ------------------------------------------------------------------------------------ serving


def _shard_files(ckpt_dir: str, world_size: int) -> List[str]:
    return [os.path.join(ckpt_dir, f"rank-{r}.safetensors") for r in range(world_size)]


def assemble(ckpt_dir: str) -> Dict[str, torch.Tensor]:
    """Full tables (fqn -> [rows, cols]) from the per-rank files that
    ``persistent_delta.trainer.save_shards.save_local_shards`` wrote into ``ckpt_dir``."""
    from persistent_delta import load_base

    return load_base(ckpt_dir)


def serve(args: argparse.Namespace) -> int:
    """The serving replica: start from the initial tables, apply published rows until the
    trainer is done and everything published is applied; save the replica."""
    from persistent_delta import DeltaConsumer, apply_poll

    out = args.out
    initial = os.path.join(out, "initial")
    while not all(os.path.exists(path) for path in _shard_files(initial, args.world_size)):
        time.sleep(0.1)
    replica = assemble(initial)
    applied_rows = 0
    done_file = "TRAINER_DONE"
    if args.fleet:
        from persistent_delta.fleet import RemoteConsumer

        _forbid(os.path.join(out, "log"))  # the replica reads the stream only, never the trainer's disk
        consumer: Any = RemoteConsumer(args.server, "demo", "replica", channel="snapshots", wait=120,
                                       key=args.key_file)  # the job's stream key: no key, no data
        done_file = "SHIPPED"  # the driver saw every published batch on the stream
    else:
        consumer = DeltaConsumer(os.path.join(out, "log"), "replica", channel="snapshots")
    with consumer:
        while True:
            trainer_done = os.path.exists(os.path.join(out, done_file))
            poll = consumer.poll(timeout=0.5)  # wakes on the trainer's commit (fleet: on a marker)
            applied_rows += apply_poll(replica, poll, complete_only=True).rows
            consumer.commit()
            if trainer_done and poll.empty:
                break
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in replica.items()}, os.path.join(out, "replica.safetensors"))
    _atomic_write(os.path.join(out, "serving.json"), json.dumps({"applied_rows": applied_rows}))
    return 0


# ------------------------------------------------------------------------------------ driver


def _forbid(root: str) -> None:
    """Fail every open/listdir under ``root`` in this process (an audit hook)."""
    root = os.path.realpath(root)

    def hook(event: str, hargs: Any) -> None:
        if event in ("open", "os.listdir", "os.scandir") and hargs and isinstance(hargs[0], (str, bytes, os.PathLike)):
            p = os.path.realpath(os.fsdecode(hargs[0]))
            if p == root or p.startswith(root + os.sep):
                raise PermissionError(f"the fleet replica may not read the trainer's log: {p}")

    sys.addaudithook(hook)


def _ship_argv(args: argparse.Namespace) -> List[str]:
    """The shipper's ``persistent-delta`` arguments, with the job's stream key."""
    return ["ship", os.path.join(args.out, "log"), "--server", args.server, "--job", "demo", "--channels", "snapshots",
            "--key-file", args.key_file]


def _shipper(args: argparse.Namespace) -> subprocess.Popen:  # type: ignore[type-arg]
    return subprocess.Popen([sys.executable, "-m", "persistent_delta", *_ship_argv(args)], start_new_session=True)


def _show_and_run(argv: List[str]) -> bool:
    """Print ``persistent-delta ARGS`` as a user would copy it, run it in this process; whether it succeeded."""
    from persistent_delta.cli import main as cli_main

    print("\n[demo] persistent-delta " + shlex.join(argv), flush=True)
    rc = cli_main(argv)
    sys.stdout.flush()
    return rc == 0


def _stream_caught_up(args: argparse.Namespace) -> bool:
    """Whether the stream holds every published batch of the local logs: each rank's latest
    genuine range marker on the stream (read under the job's key) ends where its log ends."""
    from persistent_delta import DeltaReader
    from persistent_delta.fleet import open_transport
    from persistent_delta.ops import stream_ends_of

    with DeltaReader(os.path.join(args.out, "log"), channel="snapshots") as reader:
        local = reader.end_offsets()
    conn = open_transport(args.server)
    try:
        shipped = stream_ends_of(args.key_file, False, "demo").ends(conn, "demo", "snapshots", sorted(local))
        return all(shipped.get(rank) == end for rank, end in local.items())
    finally:
        conn.close()


def _child(args: argparse.Namespace, role: str) -> subprocess.Popen:  # type: ignore[type-arg]
    """This script again, as the ``serve`` or ``train`` process (it calls
    ``_quiet_third_party_warnings`` in its ``main``)."""
    argv = [sys.executable, os.path.abspath(__file__), f"--role={role}"] + [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
        if k not in ("role", "fleet") and v is not None] + (["--fleet"] if args.fleet else [])
    return subprocess.Popen(argv, start_new_session=True)


def drive(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    out = args.out
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    print(f"[demo] {args.steps} steps, {args.tables} tables x {args.rows} rows x dim {args.dim}, mode {args.mode}, "
          f"2 ranks; publish every {args.publish_every}, checkpoint every {args.checkpoint_every}, "
          f"SIGKILL at step {args.kill_at}; output in {out}", flush=True)
    nats = None
    if args.fleet:
        from persistent_delta.fleet import write_key_file
        from persistent_delta.testing import LocalServer

        nats = LocalServer(os.path.join(out, "nats")).start()
        args.server = nats.url
        args.key_file = os.path.join(out, "stream.key")  # `persistent-delta keygen`: for the shipper, replica, commands
        write_key_file(args.key_file)
        print(f"[demo] fleet: JetStream server at {nats.url}; shipper -> stream -> replica (no access to the log)",
              flush=True)
        print(f"[demo] the job's stream key, as `persistent-delta keygen PATH` writes it: {args.key_file}", flush=True)
        print("[demo] persistent-delta " + shlex.join(_ship_argv(args)), flush=True)
    try:
        return _drive(args, t_start, nats)
    finally:
        if nats is not None:
            nats.stop()


def _stop(proc: Optional[subprocess.Popen]) -> None:  # type: ignore[type-arg]
    """SIGKILL a child's process group if it still runs (a failed run leaves no process behind
    holding the demo's output open)."""
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _drive(args: argparse.Namespace, t_start: float, nats: Any) -> int:
    children: Dict[str, Any] = {}
    try:
        return _drive_children(args, t_start, children)
    finally:
        for proc in children.values():
            _stop(proc)


def _drive_children(args: argparse.Namespace, t_start: float, children: Dict[str, Any]) -> int:
    out = args.out
    shipper = children["shipper"] = _shipper(args) if args.fleet else None
    server = children["server"] = _child(args, "serve")
    trainer = children["trainer"] = _child(args, "train")
    kill_file = os.path.join(out, "KILL_ME")
    killed = shipper_killed = False
    while trainer.poll() is None:
        if shipper is not None and not shipper_killed and os.path.exists(kill_file):
            os.killpg(shipper.pid, signal.SIGKILL)
            shipper.wait()
            shipper_killed = True
            print("[demo] SIGKILLed the shipper; restarting it", flush=True)
            shipper = children["shipper"] = _shipper(args)
        if not killed and os.path.exists(kill_file):
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait()
            killed = True
            print(f"[demo] SIGKILLed the trainer at step {open(kill_file).read()}; restarting from its last checkpoint",
                  flush=True)
            # announced, so that a reader (and tests/process/test_demo.py) knows the warnings below are no fault
            print(f"[demo] {RESTART_WARNINGS}", flush=True)
            trainer = children["trainer"] = _child(args, "train")
        time.sleep(0.05)
    if trainer.returncode != 0:
        os.killpg(server.pid, signal.SIGKILL)
        print(f"[demo] trainer failed with exit code {trainer.returncode}", file=sys.stderr)
        return 2
    _atomic_write(os.path.join(out, "TRAINER_DONE"), "1")
    if shipper is not None:
        deadline = time.monotonic() + 120
        while not _stream_caught_up(args) and time.monotonic() < deadline:
            time.sleep(0.1)
        _atomic_write(os.path.join(out, "SHIPPED"), "1")
    if server.wait(timeout=300) != 0:
        print("[demo] serving process failed", file=sys.stderr)
        return 2

    from safetensors.torch import load_file

    trainer_tables = assemble(os.path.join(out, "final"))
    replica = load_file(os.path.join(out, "replica.safetensors"))
    ok = True
    print("\n[demo] replica check (bit for bit, every row of every table):", flush=True)
    for fqn in sorted(trainer_tables):
        want, got = trainer_tables[fqn], replica[fqn]
        bad = int((want != got).any(dim=1).sum())
        ok &= bad == 0
        print(f"  {fqn:<45} rows {want.shape[0]:>7}  mismatched {bad:>6}  {'OK' if bad == 0 else 'FAIL'}", flush=True)
    ok &= _show_and_run(["offsets", os.path.join(out, "log")])  # a command that fails fails the demo
    if shipper is not None:
        ok &= _show_and_run(["offsets", "--server", args.server, "--job", "demo", "--key-file", args.key_file])
        print("\n[demo] stopping the shipper (SIGTERM); it prints what it shipped:", flush=True)
        shipper.send_signal(signal.SIGTERM)
        shipper.wait(30)
    stats = [json.load(open(os.path.join(out, f"trainer-rank-{r}.json"))) for r in range(args.world_size)]
    logged = sum(os.path.getsize(os.path.join(out, "log", f"rank-{r}", "data.mdb")) for r in range(args.world_size))
    applied = json.load(open(os.path.join(out, "serving.json")))["applied_rows"]
    print(
        f"\n[demo] {'PASS' if ok else 'FAIL'}: {args.steps} steps (trainer killed and restarted: {killed}"
        f"{', shipper killed and restarted: ' + str(shipper_killed) if args.fleet else ''}), "
        f"{sum(s['published'] for s in stats)} rows published after the restart, {applied} rows applied by the replica, "
        f"{sum(s['bytes_written'] for s in stats)} bytes logged after the restart ({logged} bytes on disk), "
        f"{max(s['tracking_s'] for s in stats):.2f}s spent tracking (publish/checkpoint/flush), "
        f"{time.perf_counter() - t_start:.1f}s in all", flush=True
    )
    return 0 if ok else 1


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python examples/demo.py",
        description="Online training on 2 CPU ranks that streams fresh rows to a serving replica and survives a SIGKILL.",
    )
    p.add_argument("--steps", type=int, default=120, help="training steps (default 120)")
    p.add_argument("--tables", type=int, default=3, help="embedding tables (default 3: row-, table-, column-wise)")
    p.add_argument("--rows", type=int, default=20000, help="rows per table (default 20000)")
    p.add_argument("--dim", type=int, default=16, help="embedding dim, a multiple of 8 (default 16)")
    p.add_argument("--batch", type=int, default=256, help="batch size per rank (default 256)")
    p.add_argument("--pooling", type=int, default=4, help="max ids per bag (default 4)")
    p.add_argument("--mode", default="ID_ONLY", choices=["ID_ONLY", "MOMENTUM_LAST", "MOMENTUM_DIFF", "ROWWISE_ADAGRAD"],
                   help="tracking mode (EMBEDDING is EC-only; DLRM uses an EBC)")
    p.add_argument("--publish-every", type=int, default=10, help="publish fresh rows every K steps")
    p.add_argument("--checkpoint-every", type=int, default=25, help="checkpoint every M steps")
    p.add_argument("--kill-at", type=int, default=70, help="SIGKILL the trainer at this step (-1: never)")
    p.add_argument("--skip-publish-at", type=int, default=0, help=argparse.SUPPRESS)  # tests: a lost publish must fail
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world-size", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--out", default="demo-out", help="output directory (replaced)")
    p.add_argument("--role", default="drive", choices=["drive", "train", "serve"], help=argparse.SUPPRESS)
    p.add_argument("--fleet", action="store_true",
                   help="across hosts: a local JetStream server, a shipper, and a replica reading only from the stream")
    p.add_argument("--server", default=None, help=argparse.SUPPRESS)  # set by the driver in --fleet mode
    p.add_argument("--key-file", default=None, help=argparse.SUPPRESS)  # the stream key, made by the driver
    args = p.parse_args(argv)
    if args.dim % 8:
        p.error("--dim must be a multiple of 8")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    _quiet_third_party_warnings()
    args = parse_args(argv)
    args.out = os.path.abspath(args.out)
    if args.role == "train":
        run_trainer(args)
        return 0
    if args.role == "serve":
        return serve(args)
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
