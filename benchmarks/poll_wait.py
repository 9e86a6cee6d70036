"""Blocking poll (issue 12 item 8): latency from the commit that completes a batch to the
``poll(timeout=...)`` that returns it, and the CPU a waiting poll uses.

    python -m benchmarks.poll_wait [--commits 300] [--idle-s 5]

A writer process commits one small batch at random intervals (5-25 ms) the way the tracker
does (records of batch b together with the persisted batch index b + 1, in one transaction) and
records the wall-clock time right after each commit; this process polls with a timeout and
records when each batch arrived. Latency = arrival - commit, per batch (same clock:
``time.time()`` on one machine). CPU: the waiting process's own CPU time over ``--idle-s``
seconds of a poll that times out (nothing is committed meanwhile), as a fraction of one core.
Targets: p99 latency <= 5 ms, waiting CPU < 1% of a core.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import List, Optional

from benchmarks._common import emit, log, machine, pct, rmtree, workdir

WRITER = r"""
import json, random, sys, time
import torch
from torchrec.distributed.model_tracker.types import UpdateMode
from persistent_delta.log.deltalog import DeltaLog
from persistent_delta.log.records import AppendRecord
from persistent_delta.log.schema import LOOKUPS, META_CURR_BATCH, META_TRACKER, ConsumerEntry, Delivery, TrackerMeta
from persistent_delta.trainer.operations import StepWrite
from persistent_delta.trainer.writer import commit_operations
path, n = sys.argv[1], int(sys.argv[2])
log = DeltaLog(path, update_mode="none")
log.write(lambda w: (w.set_meta(META_TRACKER, TrackerMeta("id_only", "none", ["t"], 0, 1).to_value()),
                     w.set_consumer("ext", ConsumerEntry.new(0, LOOKUPS, Delivery.POLL_COMMIT))))
print("READY", flush=True)
sys.stdin.readline()
rng = random.Random(0)
out = []
for b in range(1, n + 1):
    time.sleep(rng.uniform(0.005, 0.025))
    ids = torch.randint(0, 100000, (2048,))
    commit_operations(log, UpdateMode.NONE, [StepWrite(records=[AppendRecord(b, "t", ids)], curr_batch_idx=b + 1)])
    out.append(time.time())
print(json.dumps(out), flush=True)
log.close()
"""


def _cpu_s() -> float:
    s = resource.getrusage(resource.RUSAGE_SELF)
    return s.ru_utime + s.ru_stime


def main(argv: Optional[List[str]] = None) -> int:
    from persistent_delta import DeltaReader

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--commits", type=int, default=300)
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--quick", action="store_true", help="smoke run: 30 commits, 1 s idle")
    args = ap.parse_args(argv)
    if args.quick:
        args.commits, args.idle_s = 30, 1.0
    base = workdir("poll-wait-")
    root = os.path.join(base, "log")
    try:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
        w = subprocess.Popen([sys.executable, "-c", WRITER, os.path.join(root, "rank-0"), str(args.commits)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert w.stdout is not None and w.stdin is not None
        assert w.stdout.readline().strip() == "READY"
        arrivals = {}
        with DeltaReader(root) as reader:
            reader.poll()
            cpu0, t0 = _cpu_s(), time.monotonic()
            idle = reader.poll(timeout=args.idle_s)  # nothing is committed meanwhile
            idle_cpu = (_cpu_s() - cpu0) / (time.monotonic() - t0)
            assert idle.empty
            log("waiting poll: %.3f%% of a core over %.1f s", 100 * idle_cpu, args.idle_s)
            w.stdin.write("go\n")
            w.stdin.flush()
            got = 0
            while got < args.commits:
                poll = reader.poll(timeout=5.0)
                now = time.time()
                for _, (a, b) in poll.ranges.items():
                    for batch in range(max(a, 1), b):
                        arrivals.setdefault(batch, now)
                got = max(arrivals, default=0)
        commits = json.loads(w.stdout.readline())
        w.wait()
        lat = [1000 * (arrivals[b] - commits[b - 1]) for b in range(1, args.commits + 1)]
        emit("poll_wait", commits=args.commits, latency_ms_p50=pct(lat, 0.5), latency_ms_p99=pct(lat, 0.99),
             latency_ms_max=max(lat), idle_cpu_fraction=idle_cpu, idle_s=args.idle_s, machine=machine())
    finally:
        rmtree(base)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
