"""Bases and increments (issue 48, item 6), side by side in one run, on one gloo rank.

The benchmark model (``benchmarks._model``: EC tables, fused row-wise Adagrad) with a tracker
(``ID_ONLY``) and ``Checkpoints`` (``trainer/increments``). Per interval of ``K`` steps the
batches draw their ids uniformly from a fresh random ``p`` of each table's rows (``--touched``,
default 1%, 5%, 20%), so an interval touches about that share. Measured, interleaved over
``--reps`` intervals per share:

* ``bytes``: the increment's part file vs a full ``dcp.save`` of the same state at the same
  step (``full_over_increment``: how many times fewer bytes the increment writes);
* ``cpu``: the training thread's CPU time in ``save_increment`` plus the increment writer
  thread's, vs the training thread's CPU time of the interval's ``K`` steps (``cpu_share``);
  CPU time, not wall clock, since the machine is shared;
* ``restore``: with a base and ``--increments`` increments, the restore's data path -- ``dcp.load``
  of the base into the model's state, ``load_state_dict``, then the parts read memory-mapped and
  checked (``checkpoint.format.read_part``) and their rows written, each ending with its newest
  value (``trainer.increments.apply_rows``, what ``Checkpoints.restore`` runs) -- for 0..n
  increments (the curve), vs one
  ``dcp.load`` of a full checkpoint of the same state, and vs the base
  ``checkpoint.consolidate`` folded them into; repeated, interleaved, median; the A/A floor is
  two full loads.

One JSON line per share and one for the restore; the machine's load is in each line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Dict, List

import torch
import torch.distributed.checkpoint as dcp
from torchrec import KeyedJaggedTensor
from torchrec.distributed.model_tracker.types import TrackingMode

from benchmarks._common import dir_bytes, emit, init_single_rank_pg, log, machine, rmtree, workdir
from benchmarks._cpu import thread_cpu_s, threads_named
from benchmarks._model import DENSE_IN, Workload, build_dmp
from persistent_delta import PersistentTrackerConfig, attach
from persistent_delta.checkpoint.chain import latest_chain
from persistent_delta.checkpoint.consolidate import consolidate
from persistent_delta.checkpoint.format import read_part
from persistent_delta.trainer.increments import Checkpoints, apply_rows


def _step(dmp: Any, w: Workload, rows: torch.Tensor, g: torch.Generator) -> None:
    """One training step on ids drawn uniformly from ``rows`` (every table)."""
    opt = dmp._bench_opt
    opt.zero_grad(set_to_none=True)
    n = w.batch * w.pooling
    vals = torch.cat([rows[torch.randint(0, len(rows), (n,), generator=g)] for _ in range(w.num_tables)])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=dmp._bench_features, values=vals,
                                              lengths=torch.full((w.num_tables * w.batch,), w.pooling))
    loss = dmp(torch.rand(w.batch, DENSE_IN, generator=g), kjt, (torch.rand(w.batch, generator=g) > 0.5).float())
    loss.backward()
    opt.step()


def _wait(ckpt: Checkpoints) -> None:
    """Wait for the increment being written (what the next training forward does)."""
    ckpt._finish_pending()


def _writer_cpu() -> float:
    return sum(thread_cpu_s(t) for t in threads_named("pd-increments"))


def _full_state(dmp: Any) -> Dict[str, Any]:
    return {"model": {k: v for k, v in dmp.state_dict().items() if "persistent_delta" not in k},
            "fused": dmp.fused_optimizer.state_dict()}


def measure_intervals(dmp: Any, ckpt: Checkpoints, w: Workload, k: int, shares: List[float], reps: int,
                      scratch: str) -> None:
    g = torch.Generator().manual_seed(1)
    got: Dict[float, Dict[str, List[float]]] = {p: {"inc": [], "full": [], "cpu_inc": [], "cpu_train": []}
                                                for p in shares}
    for rep in range(reps):
        for p in shares:  # interleaved: every share once per repetition
            rows = torch.randperm(w.rows, generator=g)[:max(1, int(p * w.rows))]
            t0 = time.thread_time()
            for _ in range(k):
                _step(dmp, w, rows, g)
            train = time.thread_time() - t0
            c0, wc0 = time.thread_time(), _writer_cpu()
            path = ckpt.save_increment()
            _wait(ckpt)
            inc_cpu = time.thread_time() - c0 + _writer_cpu() - wc0
            full = os.path.join(scratch, f"full-{rep}-{p}")
            dcp.save(_full_state(dmp), checkpoint_id=full)
            got[p]["inc"].append(dir_bytes(path) if path else 0)
            got[p]["full"].append(dir_bytes(full))
            got[p]["cpu_inc"].append(inc_cpu)
            got[p]["cpu_train"].append(train)
            rmtree(full)
    for p in shares:
        m = {key: statistics.median(v) for key, v in got[p].items()}
        emit("checkpoint_increments", kind="interval", touched=p, steps=k, rows=w.rows, tables=w.num_tables,
             dim=w.dim, increment_bytes=m["inc"], full_bytes=m["full"],
             full_over_increment=m["full"] / max(m["inc"], 1), cpu_increment_s=m["cpu_inc"],
             cpu_train_s=m["cpu_train"], cpu_share=m["cpu_inc"] / m["cpu_train"], reps=reps, machine=machine())


def _timed_load(dmp: Any, path: str, parts: List[Any], tables: Dict[str, Any]) -> float:
    t0 = time.perf_counter()
    state = _full_state(dmp)
    dcp.load(state, checkpoint_id=path)
    dmp.load_state_dict(state["model"], strict=False)
    dmp.fused_optimizer.load_state_dict(state["fused"])
    apply_rows(tables, [read_part(inc, header)["rows"] for inc, header in parts])
    return time.perf_counter() - t0


def measure_restore(dmp: Any, ckpt: Checkpoints, w: Workload, k: int, n: int, reps: int,
                    scratch: str) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(2)
    ckpt.save_base()
    for _ in range(n):
        rows = torch.randperm(w.rows, generator=g)[:max(1, w.rows // 20)]
        for _ in range(k):
            _step(dmp, w, rows, g)
        ckpt.save_increment()
    _wait(ckpt)
    chain = latest_chain(ckpt.root)
    full = os.path.join(scratch, "full")
    dcp.save(_full_state(dmp), checkpoint_id=full)
    folded = consolidate(ckpt.root).path
    parts = [(inc.path, inc.headers[0]) for inc in chain.increments]
    tables = ckpt.tracker.local_tables
    curve: Dict[int, List[float]] = {i: [] for i in range(n + 1)}
    fulls: List[float] = []
    fulls_b: List[float] = []
    cons: List[float] = []
    for _ in range(reps):
        fulls.append(_timed_load(dmp, full, [], tables))
        for i in range(n + 1):
            curve[i].append(_timed_load(dmp, chain.base, parts[:i], tables))
        cons.append(_timed_load(dmp, folded, [], tables))
        fulls_b.append(_timed_load(dmp, full, [], tables))
    med = {i: statistics.median(v) for i, v in curve.items()}
    f = statistics.median(fulls)
    return emit("checkpoint_increments", kind="restore", increments=n, steps=k, rows=w.rows, full_s=f,
         full_again_s=statistics.median(fulls_b), aa_floor=statistics.median(fulls_b) / f,
         chain_s=med[n], chain_over_full=med[n] / f, consolidated_s=statistics.median(cons),
         consolidated_over_full=statistics.median(cons) / f, curve_s=[med[i] for i in range(n + 1)], reps=reps,
         machine=machine())


def plot(rec: Dict[str, Any], png: str) -> None:
    """The restore curve (seconds against increments), with the full and consolidated loads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    curve = rec["curve_s"]
    ax.plot(range(len(curve)), curve, marker="o", label="base + n increments")
    ax.axhline(rec["full_s"], color="gray", linestyle="--", label="one full dcp.load")
    ax.axhline(rec["consolidated_s"], color="green", linestyle=":", label="consolidated base")
    ax.set_xlabel("increments")
    ax.set_ylabel("restore time (s, median)")
    ax.set_title(f"restore vs increments ({rec['rows']} rows x 4 tables)")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: small tables, few steps")
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--k", type=int, default=100, help="steps per interval (increments every K steps)")
    ap.add_argument("--touched", default="0.01,0.05,0.2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--increments", type=int, default=10)
    ap.add_argument("--plot", default=None, help="write the restore curve as a PNG here")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.k, args.reps, args.increments = 5000, 3, 1, 3
    torch.set_num_threads(1)
    init_single_rank_pg()
    w = Workload(num_tables=4, rows=args.rows, dim=64, batch=256 if args.quick else 1024, pooling=4)
    scratch = workdir("increments")
    try:
        dmp = build_dmp(w)
        tracker = attach(dmp, PersistentTrackerConfig(path=os.path.join(scratch, "log"),
                                                      tracking_mode=TrackingMode.ID_ONLY))
        ckpt = Checkpoints(dmp, None, os.path.join(scratch, "ckpt"))
        ckpt.save_base()
        log("intervals: K=%d, touched %s, %d reps", args.k, args.touched, args.reps)
        measure_intervals(dmp, ckpt, w, args.k, [float(x) for x in args.touched.split(",")], args.reps, scratch)
        log("restore: a base and %d increments", args.increments)
        rec = measure_restore(dmp, ckpt, w, max(1, args.k // 10), args.increments, args.reps, scratch)
        if args.plot:
            plot(rec, args.plot)
        ckpt.close()
        tracker.close()
    finally:
        rmtree(scratch)


if __name__ == "__main__":
    main()
