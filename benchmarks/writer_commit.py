"""The writer thread's CPU per EMBEDDING step, with no model (issue 34.2): ``commit_operations``
alone, on one thread, before/after in the same run.

    python -m benchmarks.writer_commit [--steps 100] [--rounds 3] [--base DIR] [--quick]

Each step commits 4 records (4 tables x 16,384 Zipf ids over 200k rows, float32 rows of dim
64 in blocks reused from step to step, as EMBEDDING's capture holds them) through the window
filter, with one in-transaction lookups consumer whose offset moves (and the records below it
are deleted) every 10 steps, as a reader's ``get_unique`` does. Reported: the thread CPU
(``time.thread_time``) of ``commit_operations`` per step, after 20 warm-up steps, and the bytes
stored per step. ``--base DIR`` (e.g. ``git archive <commit> persistent_delta | tar -x -C DIR``)
runs the library found in ``DIR`` too; every round runs each library in a fresh process, in
alternating order. A component figure: the training step around it is ``benchmarks.step_cpu``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Dict, List, Optional

from benchmarks._common import emit, log, machine

CHILD = r"""
import json, os, sys, tempfile, time, shutil
import numpy as np, torch
from torchrec.distributed.model_tracker.types import UpdateMode
from persistent_delta.log.deltalog import DeltaLog
from persistent_delta.log import records as R
from persistent_delta.log.schema import ConsumerEntry, Delivery
from persistent_delta.trainer.operations import StepWrite
from persistent_delta.trainer.window import WindowFilter
from persistent_delta.trainer import writer as W
torch.set_num_threads(1)
steps, warmup, mode = int(sys.argv[1]), int(sys.argv[2]), UpdateMode.FIRST
rng = np.random.default_rng(0)
tables = [f"t{i}" for i in range(4)]
blocks = {t: torch.randn(16384, 64, generator=torch.Generator().manual_seed(i)) for i, t in enumerate(tables)}
ids = [[torch.from_numpy((rng.zipf(1.05, 16384) - 1) % 200_000) for _ in tables] for _ in range(steps + warmup)]
root = tempfile.mkdtemp(prefix="pd-writer-commit-", dir=os.environ.get("PERSISTENT_DELTA_BENCH_DIR") or None)
log = DeltaLog(root, update_mode=mode.value)
log.write(lambda w: w.set_consumer("a", ConsumerEntry.new(0, "lookups", Delivery.IN_TRANSACTION)))
window = WindowFilter(mode)
kw = {"buffers": R.EncodeBuffers()} if hasattr(R, "EncodeBuffers") else {}
cpu, nbytes = 0.0, 0
for b in range(1, steps + warmup + 1):
    recs = [R.AppendRecord(b, t, ids[b - 1][i], blocks[t]) for i, t in enumerate(tables)]
    t0 = time.thread_time()
    _, n = W.commit_operations(log, mode, [StepWrite(records=recs, curr_batch_idx=b)], window, **kw)
    if b > warmup:
        cpu += time.thread_time() - t0
        nbytes += n
    if b % 10 == 0:
        def move(w, b=b):
            w.set_consumer("a", ConsumerEntry.new(b + 1, "lookups", Delivery.IN_TRANSACTION))
            R.delete_below(w, b + 1)
        log.write(move)
log.close()
shutil.rmtree(root, ignore_errors=True)
print(json.dumps({"library": W.__file__, "ms_per_step": 1000 * cpu / steps, "bytes_per_step": nbytes / steps}))
"""


def _child(lib: str, steps: int, warmup: int) -> Dict[str, float]:
    env = dict(os.environ, PYTHONPATH=lib)
    out = subprocess.run([sys.executable, "-c", CHILD, str(steps), str(warmup)], env=env, cwd=lib, check=True, capture_output=True,
                         text=True)  # cwd: "-c" puts it first on sys.path
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--base", default=None, metavar="DIR", help="also run the library found in DIR")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round of 10 steps after 2 warm-up steps")
    args = ap.parse_args(argv)
    warmup = 20
    if args.quick:
        args.steps, args.rounds, warmup = 10, 1, 2
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    libs = {"persistent": here, **({"base": os.path.abspath(args.base)} if args.base else {})}
    got: Dict[str, List[Dict[str, float]]] = {v: [] for v in libs}
    for r in range(args.rounds):
        order = list(libs) if r % 2 == 0 else list(reversed(libs))
        for v in order:
            got[v].append(_child(libs[v], args.steps, warmup))
            log("round %d %s: %.2f ms/step", r + 1, v, got[v][-1]["ms_per_step"])
    emit("writer_commit", steps=args.steps, rounds=args.rounds,
         libraries={v: got[v][0]["library"] for v in libs},
         ms_per_step={v: [g["ms_per_step"] for g in got[v]] for v in libs},
         ms_per_step_median={v: statistics.median(g["ms_per_step"] for g in got[v]) for v in libs},
         bytes_per_step={v: got[v][0]["bytes_per_step"] for v in libs}, machine=machine())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
