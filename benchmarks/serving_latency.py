"""Request latency of a serving replica while it applies publishes, and freshness (issue 32).

    python -m benchmarks.serving_latency [--quick] [--steps 150] [--only float,int8,fp16]
                                         [--interval-ms 10]

A trainer (this process, one gloo rank: ``benchmarks._model``'s EmbeddingCollection of 4 tables
x 100,000 rows x dim 64, batch 1024 x pooling 8, Zipf ids, ID_ONLY tracking, consumer
``serving``) trains ``--steps`` steps after a warm-up. A replica process serves requests on one
thread and applies the snapshots channel on another (poll, apply, commit), at one torch thread
each. Per replica kind, two runs:

* ``idle``: the trainer trains but never publishes (the replica applies nothing);
* ``applying``: the trainer publishes after every step (publish-every-step).

Replica kinds: ``float`` (today's replica: a dict of float32 tables that ``apply_poll`` writes,
requests are ``F.embedding_bag`` sums over them, no lock), ``int8`` and ``fp16``
(:class:`persistent_delta.serve.inference.InferenceReplica` over ``quantize_inference_model`` of
an EmbeddingBagCollection of the same tables; requests are ``replica.forward(kjt)``).

A request is 64 samples x 4 features x 8 Zipf ids (pooled sums), issued every
``--interval-ms`` (paced, not back to back); its latency includes any wait for the replica's
lock. Per run, one JSON line: request latency p50/p99/max (ms) and, when applying, freshness
per publish after the warm-up: ``applied`` = the replica's ``applied_at`` - the time of the
``publish()`` call; ``served`` = the end of the first request that started after the apply
returned - the time of the ``publish()`` call (rows served). One clock (``time.time()``), one
machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Tuple

from benchmarks._common import emit, init_single_rank_pg, log, machine, pct, rmtree, workdir

CONSUMER = "serving"
TABLES, ROWS, DIM, POOLING, BATCH = 4, 100_000, 64, 8, 1024  # --quick: 5,000 rows, batch 64 (set by main)
REQUEST_SAMPLES = 64


def _workload() -> Any:
    from benchmarks._model import Workload

    return Workload(num_tables=TABLES, rows=ROWS, dim=DIM, batch=BATCH, pooling=POOLING)


# ------------------------------------------------------------------------------- replica


def _requests(n: int) -> List[Tuple[Any, Any]]:
    """``n`` requests: (values, lengths) over the 4 features, Zipf ids."""
    import torch

    from benchmarks._common import ZipfIds

    samplers = [ZipfIds(ROWS, 1.05, 77 + t) for t in range(TABLES)]
    lengths = torch.full((TABLES * REQUEST_SAMPLES,), POOLING, dtype=torch.int64)
    return [(torch.cat([s.sample(REQUEST_SAMPLES * POOLING) for s in samplers]), lengths) for _ in range(n)]


def replica_main(root: str, kind: str, out: str, stop: str, from_stamp: int, interval_s: float) -> int:
    """Serve paced requests on a thread while polling and applying; write the results to ``out``."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

    from persistent_delta import DeltaConsumer, apply_poll

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    tables = {f"sparse.embeddings.t{t}": torch.rand(ROWS, DIM, generator=g) * 0.02 - 0.01 for t in range(TABLES)}
    features = [f"f{t}" for t in range(TABLES)]
    if kind == "float":
        target: Any = tables
        offsets = torch.arange(0, REQUEST_SAMPLES * POOLING, POOLING)
        weights = [tables[f"sparse.embeddings.t{t}"] for t in range(TABLES)]

        def serve(values: torch.Tensor, lengths: torch.Tensor) -> None:
            n = REQUEST_SAMPLES * POOLING
            for t in range(TABLES):
                F.embedding_bag(values[t * n:(t + 1) * n], weights[t], offsets, mode="sum")
    else:
        from torchrec.inference.modules import quantize_inference_model

        from persistent_delta.serve.inference import InferenceReplica

        class Serving(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.sparse = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
                    name=f"t{t}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{t}"]) for t in range(TABLES)])

            def forward(self, kjt: KeyedJaggedTensor) -> Any:
                return self.sparse(kjt)

        model = Serving()
        with torch.no_grad():
            for t in range(TABLES):
                model.sparse.embedding_bags[f"t{t}"].weight.copy_(tables[f"sparse.embeddings.t{t}"])
        dtype = torch.int8 if kind == "int8" else torch.float16
        target = InferenceReplica(quantize_inference_model(model, quantization_dtype=dtype))  # tables by name

        def serve(values: torch.Tensor, lengths: torch.Tensor) -> None:
            target.forward(KeyedJaggedTensor.from_lengths_sync(keys=features, values=values, lengths=lengths))

    requests = _requests(64)
    spans: List[Tuple[float, float]] = []
    halt = threading.Event()

    def serving() -> None:
        torch.set_num_threads(1)
        i = 0
        nxt = time.time()
        while not halt.is_set():
            values, lengths = requests[i % len(requests)]
            t0 = time.time()
            serve(values, lengths)
            spans.append((t0, time.time()))
            i += 1
            nxt += interval_s
            time.sleep(max(0.0, nxt - time.time()))

    publishes: List[Tuple[float, float]] = []  # (publish() call, applied_at)
    with DeltaConsumer(root, "replica", channel="snapshots", wait=60.0) as consumer:
        consumer.poll()
        consumer.commit()
        server = threading.Thread(target=serving)
        server.start()
        open(stop + ".ready", "w").close()
        while True:
            stopping = os.path.exists(stop)
            poll = consumer.poll(timeout=0.2)
            applied = apply_poll(target, poll, complete_only=True)
            consumer.commit()
            publishes.extend((t, applied.applied_at) for stamp, t in applied.publishes.items() if stamp >= from_stamp)
            if poll.empty and stopping:
                break
        halt.set()
        server.join()
    with open(out, "w") as f:
        json.dump({"spans": spans, "publishes": publishes}, f)
    return 0


# ------------------------------------------------------------------------------- trainer


def run(kind: str, applying: bool, steps: int, warmup: int, interval_s: float, batches: List[Any]) -> Dict[str, Any]:
    from torchrec.distributed.model_tracker.types import TrackingMode

    from benchmarks._model import build_dmp, train_step
    from persistent_delta import PersistentTrackerConfig, attach

    root = workdir(f"serving-{kind}")
    dmp = build_dmp(_workload(), seed=1)
    tracker = attach(dmp, PersistentTrackerConfig(path=root, tracking_mode=TrackingMode.ID_ONLY, consumers=[CONSUMER],
                                                  delete_on_read=True, fresh=True))
    out, stop = root + ".replica.json", root + ".stop"
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.serving_latency", "--role", "replica", "--root", root,
                             "--kind", kind, "--replica-out", out, "--replica-stop", stop,
                             "--from-stamp", str(tracker.curr_batch_idx + warmup),
                             "--interval-ms", str(interval_s * 1e3), "--rows", str(ROWS)])
    deadline = time.monotonic() + 300
    while not os.path.exists(stop + ".ready"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the replica did not start")
        time.sleep(0.05)
    t_start = time.time()
    for i in range(warmup + steps):
        train_step(dmp, batches[i % len(batches)])
        if applying:
            tracker.publish(CONSUMER)
        if i + 1 == warmup:
            t_start = time.time()
    t_end = time.time()
    tracker.close()
    open(stop, "w").close()
    if proc.wait(timeout=600) != 0:
        raise RuntimeError(f"the replica exited with {proc.returncode}")
    with open(out) as f:
        res = json.load(f)
    rmtree(root)
    for path in (out, stop, stop + ".ready"):
        os.remove(path)
    spans = [(a, b) for a, b in res["spans"] if t_start <= a <= t_end]
    lat = [(b - a) * 1e3 for a, b in spans]
    applied = [(at - t) * 1e3 for t, at in res["publishes"]]
    served = []
    starts = [a for a, _ in spans]
    import bisect

    for t, at in res["publishes"]:
        k = bisect.bisect_left(starts, at)
        if k < len(spans):
            served.append((spans[k][1] - t) * 1e3)
    rec: Dict[str, Any] = {
        "kind": kind, "applying": applying, "steps": steps, "requests": len(lat),
        "latency_ms": {"p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "max": max(lat) if lat else None},
        "step_ms": (t_end - t_start) / max(steps, 1) * 1e3,
    }
    if applying:
        rec["publishes"] = len(applied)
        rec["applied_ms"] = {"p50": pct(applied, 0.5), "p99": pct(applied, 0.99), "max": max(applied) if applied else None}
        rec["served_ms"] = {"p50": pct(served, 0.5), "p99": pct(served, 0.99), "max": max(served) if served else None}
    return rec


def main(argv: Any = None) -> int:
    global ROWS, BATCH
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", default="driver", choices=["driver", "replica"])
    ap.add_argument("--root", default="")
    ap.add_argument("--kind", default="int8")
    ap.add_argument("--replica-out", default="")
    ap.add_argument("--replica-stop", default="")
    ap.add_argument("--from-stamp", type=int, default=0)
    ap.add_argument("--interval-ms", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--only", default=None,
                    help="replica kinds (default: float,int8,fp16; --quick: float,int8, fp16 being int8's code)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: tables of 5,000 rows, batch 64, the float and int8 replicas once each, applying "
                         "every step, 10 steps after 2")
    ap.add_argument("--rows", type=int, default=ROWS, help=argparse.SUPPRESS)  # the replica's: the trainer's rows
    args = ap.parse_args(argv)
    ROWS = 5_000 if args.quick else args.rows
    if args.quick:
        BATCH = 64
    args.only = args.only or ("float,int8" if args.quick else "float,int8,fp16")
    if args.role == "replica":
        return replica_main(args.root, args.kind, args.replica_out, args.replica_stop, args.from_stamp,
                            args.interval_ms / 1e3)
    from benchmarks._model import make_batches

    steps, warmup = (10, 2) if args.quick else (args.steps, args.warmup)
    init_single_rank_pg()
    emit("serving_latency.machine", **machine())
    batches = make_batches(_workload(), 32, seed=3)
    for kind in args.only.split(","):
        for applying in ((True,) if args.quick else (False, True)):
            log("%s replica, %s", kind, "applying every step" if applying else "idle")
            emit("serving_latency", **run(kind, applying, steps, warmup, args.interval_ms / 1e3, batches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
