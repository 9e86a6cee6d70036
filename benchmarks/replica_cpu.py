"""The CPU a publish costs along its path, part by part (issue 49.1): the floor under the
freshness lag that ``benchmarks.freshness`` measures with a replica competing for the cores.

    python -m benchmarks.replica_cpu [--quick] [--publishes 300] [--every 1] [--cprofile FILE]

Same workload and trainer as ``benchmarks.freshness`` (one rank; 4 tables x 100,000 rows x dim
64, batch 1024 x pooling 8, Zipf ids; ID_ONLY tracking with the consumer ``serving``), and a
replica, ``DeltaConsumer(root, "replica", channel="snapshots")`` applying to its own full tables
(:func:`persistent_delta.apply_poll`, tables allocated by ``torch.zeros`` as a user's would be).
The replica competes with nobody for a core: it runs in the training thread, between steps. Every
``--every`` steps the trainer publishes, then the replica reads the publish before it (readable
once this step's records ended its batch; ``poll(max_batches=every)``), applies it and commits.
The log stays at its steady size (the replica's commits let retention delete what it read), as
in ``benchmarks.freshness``. Measured by thread CPU clocks: each ``publish()`` call, the
replica's poll, apply and commit, and the writer thread's CPU over the measured steps
(everything it does: the steps' records and the publishes) per publish.

One JSON line: p50 and p99 of each part in ms of CPU, their sum at p50 (``path_cpu_ms``: the
lag a publish would have if each part ran on a core of its own with no wait in between), the
bytes per publish and a memcpy of them (same run). ``--cprofile FILE``: the replica's
polls, applies and commits under cProfile (thread CPU clock), written to FILE.
"""

from __future__ import annotations

import argparse
import cProfile
import sys
import threading
import time
from typing import Any, Dict, List, Optional

from benchmarks._common import emit, init_single_rank_pg, log, machine, median, pct, rmtree, workdir


def _writer_cpu_s() -> float:
    """The CPU seconds of this process's tracker writer threads so far (the library names them
    ``persistent-delta-writer:<path>``); raises if there is none, rather than report 0."""
    writers = [t.ident for t in threading.enumerate() if t.name.startswith("persistent-delta-writer") and t.ident]
    if not writers:
        raise RuntimeError("no tracker writer thread found (persistent-delta-writer:*): its name changed?")
    return sum(time.clock_gettime(time.pthread_getcpuclockid(ident)) for ident in writers)


def _p(xs: List[float]) -> Dict[str, float]:
    return {"p50": 1e3 * pct(xs, 0.5), "p99": 1e3 * pct(xs, 0.99)}


def run(publishes: int, every: int, warmup: int, cprofile: Optional[str]) -> Dict[str, Any]:
    import torch

    from benchmarks import freshness
    from benchmarks._model import make_batches, train_step
    from persistent_delta import DeltaConsumer, apply_poll

    batches = make_batches(freshness._workload(), 50, seed=1)
    root = workdir("replica-cpu")
    tables: Dict[str, torch.Tensor] = {}
    calls: List[float] = []
    polls: List[float] = []
    applies: List[float] = []
    commits: List[float] = []
    rows: List[int] = []
    nbytes: List[int] = []
    profile = cProfile.Profile(time.thread_time) if cprofile else None
    try:
        dmp, tracker = freshness._tracked(root, seed=1)
        with DeltaConsumer(root, "replica", channel="snapshots", wait=60.0) as consumer:
            consumer.poll()
            consumer.commit()
            w0 = 0.0
            for i in range((warmup + publishes + 1) * every):
                measured = i >= warmup * every
                if i == warmup * every:
                    w0 = _writer_cpu_s()
                train_step(dmp, batches[i % len(batches)])
                if (i + 1) % every:
                    continue
                c0 = time.thread_time()
                tracker.publish(freshness.CONSUMER)
                c1 = time.thread_time()
                if i < every:
                    continue  # the first publish is readable once the next step's records end its batch
                # the replica: the publish before this one (readable now), read, applied, committed
                if profile is not None and measured:
                    profile.enable()
                t0 = time.thread_time()
                poll = consumer.poll(max_batches=every, timeout=10.0)
                t1 = time.thread_time()
                freshness.add_tables(tables, poll)  # (not timed: a replica allocates its tables once)
                t2 = time.thread_time()
                applied = apply_poll(tables, poll, complete_only=True)
                t3 = time.thread_time()
                consumer.commit()
                t4 = time.thread_time()
                if profile is not None:
                    profile.disable()
                if poll.empty:
                    raise RuntimeError(f"step {i}: the replica found no publish to read")
                if measured and len(polls) < publishes:
                    calls.append(c1 - c0)
                    polls.append(t1 - t0)
                    applies.append(t3 - t2)
                    commits.append(t4 - t3)
                    rows.append(applied.rows)
                    nbytes.append(applied.nbytes)
            writer_s = (_writer_cpu_s() - w0) / max(1, publishes + 1)
        tracker.close()
        if profile is not None:
            profile.dump_stats(cprofile)
    finally:
        rmtree(root)
    per_publish = int(median(nbytes)) if nbytes else 0
    gbps = freshness.memcpy_gbps(per_publish)
    parts = {"publish_call": _p(calls), "replica_poll": _p(polls), "replica_apply": _p(applies),
             "replica_commit": _p(commits)}
    path = parts["publish_call"]["p50"] + 1e3 * writer_s + sum(parts[k]["p50"] for k in
                                                                ("replica_poll", "replica_apply", "replica_commit"))
    return emit("replica_cpu", publish_every=every, publishes=len(polls), cpu_ms=parts,
                writer_cpu_ms_per_publish=1e3 * writer_s, path_cpu_ms=path,
                rows_per_publish=int(median(rows)) if rows else 0, bytes_per_publish=per_publish,
                copy_floor_ms=per_publish / max(gbps, 1e-9) / 1e6, torch_threads=torch.get_num_threads(),
                machine=machine())


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: tables of 5,000 rows, batch 64, 5 publishes after 2")
    ap.add_argument("--publishes", type=int, default=300, help="measured publishes")
    ap.add_argument("--every", type=int, default=1, help="publish every this many steps")
    ap.add_argument("--warmup", type=int, default=20, help="publishes before the measured ones")
    ap.add_argument("--cprofile", default=None, help="write a cProfile of the replica's polls, applies and commits to this file")
    args = ap.parse_args(argv)
    if args.publishes < 1 or args.every < 1 or args.warmup < 0:
        ap.error("--publishes and --every must be at least 1, --warmup at least 0")
    if args.quick:
        from benchmarks import freshness

        freshness._QUICK = True
        args.publishes, args.warmup = 5, 2
    init_single_rank_pg()
    log("replica_cpu: %d publishes every %d steps", args.publishes, args.every)
    run(args.publishes, args.every, args.warmup, args.cprofile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
