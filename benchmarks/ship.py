"""Across hosts (issue 15): shipping throughput, end-to-end freshness, and a shipper's cost on
the trainer, against local NATS JetStream servers (file-backed; R=1, or a 3-node R=3 cluster).

    python -m benchmarks.ship [--quick] [--mb 256] [--reps 4] [--steps 300] [--cluster]

* **throughput** -- a rank log holding ``--mb`` MiB of row bytes (ids + states, FIRST mode,
  every id unique so every row is shipped) is shipped by a :class:`Shipper` with the trainer
  idle; MB/s of row bytes = row bytes / wall time from the first read to the last
  acknowledged marker. ``--reps`` runs (a fresh log and job each) in one process; the first
  is reported apart as ``cold_mb_per_s`` (a new process's first allocations and the server's
  first store blocks: a shipper runs for the trainer's life, so the steady state is the
  figure), the median and range of the rest as ``mb_per_s``. Target (R=1): >= 200 MB/s.
* **freshness** -- a 1-rank trainer process (EMBEDDING mode, ``publish()`` every step)
  records the wall-clock time of each ``publish()`` call; a shipper process ships the
  snapshots channel; this process is the remote replica: it polls the stream, applies the
  rows to its tables (``apply_poll``), records when each published batch was applied, and
  commits its position after every poll (``--commit-every S``: at most every S seconds instead; applying is
  idempotent, so a replica may commit periodically, like Kafka's auto-commit, and save the
  commit round trip before its next poll). Latency = applied - publish call (one clock).
  Target (R=1): p99 <= 100 ms.
* **trainer cost** -- the same trainer without a shipper and with one shipping both channels
  (a registered out-of-process lookups consumer makes the writer store every batch whole):
  mean step time, bytes the writer wrote, data file size. ``--shipper-nice N`` runs the
  shipper at ``persistent-delta ship --nice N``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

import torch

from benchmarks._common import emit, log, machine, median, pct, rmtree, workdir

TRAINER = r"""
import json, os, sys, time
import torch
from torchrec.distributed.model_tracker.types import TrackingMode
from benchmarks._common import init_single_rank_pg
from benchmarks._model import Workload, build_dmp, make_batches, train_step
from persistent_delta import PersistentTrackerConfig, attach
root, steps, flag, out, batch, rows = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
torch.set_num_threads(1)
init_single_rank_pg()
w = Workload(num_tables=2, rows=rows, dim=64, batch=batch, pooling=4)
dmp = build_dmp(w)
t = attach(dmp, PersistentTrackerConfig(path=root, tracking_mode=TrackingMode.EMBEDDING, consumers=["serving"],
                                         delete_on_read=True))
batches = make_batches(w, 20, seed=1)
print("READY", flush=True)
while flag != "-" and not os.path.exists(flag):
    time.sleep(0.01)
stamps, steps_s = [], []
for i in range(steps):
    t0 = time.perf_counter()
    train_step(dmp, batches[i % len(batches)])
    stamp, tp = t.curr_batch_idx, time.time()
    t.publish("serving")
    steps_s.append(time.perf_counter() - t0)
    stamps.append((stamp, tp))
t.flush()
st = t.stats()
t.close()
json.dump({"stamps": stamps, "steps_s": steps_s, "bytes_written": st.get("bytes_written", 0),
           "file_bytes": os.path.getsize(os.path.join(root, "rank-0", "data.mdb"))}, open(out, "w"))
"""


def _env() -> Dict[str, str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def throughput(mb: int, servers: Any, replicas: int, base: str, reps: int) -> Dict[str, Any]:
    runs = [_throughput_once(mb, servers, replicas, base, rep) for rep in range(reps)]
    steady = sorted(r["mb_per_s"] for r in runs[1:]) or [runs[0]["mb_per_s"]]
    return emit("ship_throughput", replicas=replicas, row_mb=runs[0]["row_mb"], reps=len(steady),
                mb_per_s=median(steady), mb_per_s_min=steady[0], mb_per_s_max=steady[-1],
                cold_mb_per_s=runs[0]["mb_per_s"], messages=runs[0]["messages"],
                retries=sum(r["retries"] for r in runs), target_mb_per_s=200 if replicas == 1 else None)


def _throughput_once(mb: int, servers: Any, replicas: int, base: str, rep: int) -> Dict[str, Any]:
    from torchrec.distributed.model_tracker.types import UpdateMode

    from persistent_delta import LmdbDeltaStore
    from persistent_delta.fleet.ship import Shipper
    from persistent_delta.fleet.transport import StreamOptions

    root = os.path.join(base, f"tp-log-r{replicas}-{rep}")
    rows_per_batch = (4 << 20) // (8 + 64 * 4)  # 4 MiB of row bytes per batch
    batches = max(1, (mb << 20) // (rows_per_batch * (8 + 64 * 4)))
    with LmdbDeltaStore(os.path.join(root, "rank-0"), updateMode=UpdateMode.FIRST) as store:
        for b in range(batches):
            ids = torch.arange(b * rows_per_batch, (b + 1) * rows_per_batch, dtype=torch.int64)
            store.append(b, "t", ids, torch.randn(rows_per_batch, 64))
    shipper = Shipper(root, servers, f"tp{replicas}-{rep}", channels=["lookups"], max_batches=4,
                      stream=StreamOptions(replicas=replicas))
    try:
        t0 = time.perf_counter()
        while shipper.run_once() or not shipper.stats() or shipper.stats()[0]["position"] < batches:
            pass
        dt = time.perf_counter() - t0
        st = shipper.stats()[0]
    finally:
        shipper.close()
        rmtree(root)
    log("throughput R=%d rep %d: %.0f MB/s", replicas, rep, st["row_bytes"] / 1e6 / dt)
    return {"row_mb": st["row_bytes"] / 1e6, "seconds": dt, "mb_per_s": st["row_bytes"] / 1e6 / dt,
            "messages": st["messages"], "retries": st["retries"]}


TRAINER_ROWS = 100_000  # rows of each of the trainer's 2 tables (--quick: 5,000)


def _trainer(root: str, steps: int, out: str, flag: str, batch: int = 512) -> subprocess.Popen:  # type: ignore[type-arg]
    return subprocess.Popen([sys.executable, "-c", TRAINER, root, str(steps), flag, out, str(batch), str(TRAINER_ROWS)],
                            env=_env(),
                            stdout=subprocess.PIPE, text=True)


def freshness(steps: int, url: Any, replicas: int, base: str, batch: int, commit_every_s: float = 0.0) -> Dict[str, Any]:
    from persistent_delta import apply_poll
    from persistent_delta.fleet.remote import RemoteConsumer

    root, out, flag = os.path.join(base, f"fr-log-r{replicas}"), os.path.join(base, f"fr-r{replicas}.json"), \
        os.path.join(base, f"go-r{replicas}")
    job = f"fresh{replicas}-{batch}"
    trainer = _trainer(root, steps, out, flag, batch)
    assert trainer.stdout is not None and trainer.stdout.readline().strip() == "READY"
    urls = url if isinstance(url, str) else ",".join(url)
    shipper = subprocess.Popen([sys.executable, "-m", "persistent_delta", "ship", root, "--server", urls, "--job", job,
                                "--channels", "snapshots", "--replicas", str(replicas)],
                               env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    applied: Dict[int, float] = {}
    shipped: Dict[int, float] = {}
    tables: Dict[str, torch.Tensor] = {}
    try:
        consumer = RemoteConsumer(url, job, "bench", channel="snapshots", wait=60)
        open(flag, "w").close()
        deadline = None
        committed = 0.0
        while trainer.poll() is None or not applied or max(applied) < steps - 1:
            if trainer.poll() is not None:
                deadline = deadline or time.monotonic() + 60
                if time.monotonic() > deadline:
                    log("freshness: the replica did not reach the last publish within 60 s after training")
                    break
            p = consumer.poll(timeout=0.2)
            for d in p:
                if d.fqn not in tables and d.shard is not None and d.states is not None:
                    tables[d.fqn] = torch.zeros(d.shard.global_rows, d.shard.global_cols or d.states.shape[1],
                                                dtype=d.states.dtype)
            apply_poll(tables, p, complete_only=True)  # the library's one "applied" (at its read_threads)
            now = time.time()
            for r, (s, e) in p.ranges.items():
                for b in range(s, e):
                    applied.setdefault(b, now)
                    shipped.setdefault(b, consumer.last_shipped.get(r, now))
            if trainer.poll() is not None and p.empty and consumer.position() == consumer.end_offsets():
                if os.path.exists(out) and max(applied, default=-1) >= max(s for s, _ in json.load(open(out))["stamps"]):
                    break
            if time.monotonic() - committed >= commit_every_s:  # applying is idempotent (newest wins): a
                consumer.commit()  # replica commits periodically, as Kafka's auto-commit does
                committed = time.monotonic()
        consumer.close()
    finally:
        shipper.terminate()
        shipper.wait(30)
        trainer.wait(60)
    res = json.load(open(out))
    lat = [applied[s] - tp for s, tp in res["stamps"] if s in applied]
    to_ship = [shipped[s] - tp for s, tp in res["stamps"] if s in shipped]
    rmtree(root)
    steps_ms = sum(res["steps_s"]) / len(res["steps_s"]) * 1e3
    return emit("ship_freshness", replicas=replicas, batch=batch, mean_step_ms=steps_ms,
                row_mb_per_s=res["bytes_written"] / 1e6 / (sum(res["steps_s"]) or 1), publishes=len(res["stamps"]),
                measured=len(lat),
                p50_ms=pct(lat, 0.5) * 1e3, p99_ms=pct(lat, 0.99) * 1e3, max_ms=max(lat) * 1e3 if lat else None,
                ship_p50_ms=pct(to_ship, 0.5) * 1e3, ship_p99_ms=pct(to_ship, 0.99) * 1e3,
                commit_every_s=commit_every_s, target_p99_ms=100 if replicas == 1 else None)


def trainer_cost(steps: int, url: str, base: str, nice: int = 0) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for with_shipper in (False, True):
        root, res = os.path.join(base, f"cost-{with_shipper}"), os.path.join(base, f"cost-{with_shipper}.json")
        flag = os.path.join(base, f"cost-go-{with_shipper}")
        trainer = _trainer(root, steps, res, flag)
        assert trainer.stdout is not None and trainer.stdout.readline().strip() == "READY"
        shipper = None
        if with_shipper:
            shipper = subprocess.Popen(["nice", "-n", str(nice), sys.executable, "-m", "persistent_delta", "ship", root,
                                        "--server", url, "--job", "cost"], env=_env(), stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
            time.sleep(3.0)  # registered before training starts
        open(flag, "w").close()
        trainer.wait(600)
        if shipper is not None:
            shipper.terminate()
            shipper.wait(30)
        r = json.load(open(res))
        steps_s = r["steps_s"][len(r["steps_s"]) // 5:]  # warm
        out["shipper" if with_shipper else "alone"] = {"mean_step_ms": sum(steps_s) / len(steps_s) * 1e3,
                                                       "bytes_written": r["bytes_written"],
                                                       "file_bytes": r["file_bytes"]}
        rmtree(root)
    return emit("ship_trainer_cost", alone=out["alone"], with_shipper=out["shipper"],
                step_ratio=out["shipper"]["mean_step_ms"] / out["alone"]["mean_step_ms"],
                bytes_ratio=out["shipper"]["bytes_written"] / max(1, out["alone"]["bytes_written"]))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 4 MiB shipped twice, 10 trainer steps on tables of 5,000 rows, one freshness "
                         "batch size (the first)")
    ap.add_argument("--mb", type=int, default=256, help="row MiB shipped in each throughput run")
    ap.add_argument("--reps", type=int, default=4, help="throughput runs; the first is reported apart (cold)")
    ap.add_argument("--steps", type=int, default=300, help="trainer steps in the freshness and cost runs")
    ap.add_argument("--cluster", action="store_true", help="also a 3-node R=3 cluster")
    ap.add_argument("--batches", default="64,512", help="trainer batch sizes of the freshness runs")
    ap.add_argument("--only", default="throughput,freshness,cost")
    ap.add_argument("--shipper-nice", type=int, default=0,
                    help="niceness of the shipper process in the cost run (0: as the trainer)")
    ap.add_argument("--commit-every", type=float, default=0.0,
                    help="seconds between the freshness replica's commits (0: after every poll)")
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        global TRAINER_ROWS
        args.mb, args.steps, args.reps, args.batches, TRAINER_ROWS = 4, 10, 2, args.batches[:1], 5_000
    from persistent_delta.testing import LocalCluster, LocalServer

    emit("ship_machine", **machine())
    only = set(args.only.split(","))
    base = workdir("ship")
    if not os.environ.get("PERSISTENT_DELTA_STREAM_KEY_FILE"):  # stream data is authenticated: one key for the run
        from persistent_delta.fleet.auth import write_key_file

        os.environ["PERSISTENT_DELTA_STREAM_KEY_FILE"] = os.path.join(base, "stream.key")
        write_key_file(os.environ["PERSISTENT_DELTA_STREAM_KEY_FILE"])
    try:
        with LocalServer(os.path.join(base, "nats")) as server:
            log("R=1 file-backed server at %s", server.url)
            if "throughput" in only:
                throughput(args.mb, server.url, 1, base, args.reps)
            if "freshness" in only:
                for batch in args.batches:
                    freshness(args.steps, server.url, 1, base, batch, args.commit_every)
            if "cost" in only:
                trainer_cost(args.steps, server.url, base, args.shipper_nice)
        if args.cluster:
            with LocalCluster(os.path.join(base, "cluster")) as cluster:
                log("R=3 cluster at %s", cluster.urls)
                time.sleep(2.0)
                if "throughput" in only:
                    throughput(args.mb, cluster.urls, 3, base, args.reps)
                if "freshness" in only:
                    for batch in args.batches:
                        freshness(args.steps, cluster.urls, 3, base, batch, args.commit_every)
    finally:
        rmtree(base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
