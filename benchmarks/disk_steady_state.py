"""Steady-state disk use under retention (issue 4e).

``--steps`` steps (default 5,000) with ``delete_on_read`` and one consumer that reads every
``--read-every`` (10) steps. The LMDB file never shrinks, so what matters is whether freed pages
are reused: the report is the largest file size (allocated blocks, as ``du``; the apparent size
is reported too) over the run divided by the peak live data
(the largest sum of record value bytes the log held at any read). Configurations:

* ``tracker_dmp``: a real (small) sharded DMP trained with ``persistent_delta.attach(...,
  tracking_mode=EMBEDDING, delete_on_read=True)`` and ``tracker.get_unique(consumer)`` every
  ``--read-every`` steps (the tracker compacts, reads, commits the offset, deletes below it).
  Live bytes are measured right before each read, after ``tracker.flush()`` has committed
  everything recorded so far (a small DMP: 4 tables x 20k rows x dim 32, batch 256, pooling 4;
  the full-size DMP would take ~10 minutes for 5,000 steps on 2 cores).
* ``store_read_delete``: ``LmdbDeltaStore.append_many`` of realistic step groups (4 x 4096 Zipf
  ids + 4096 x 64 float32 states, ~4.3 MB per step), and every ``--read-every`` steps
  ``get_unique(offset)`` then ``delete(up_to_idx=next offset)``, the tracker's retention rule.
* ``store_compact_read_delete``: the same, with ``compact(offset, end)`` before the read (what the
  tracker does: the merged record is written before the old ones are deleted).

One JSON line per configuration, with file size samples over time.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
from torchrec.distributed.model_tracker.types import TrackingMode, UpdateMode

from benchmarks._common import ZipfIds, emit, init_single_rank_pg, log, machine, rmtree, workdir
from persistent_delta import LmdbDeltaStore
from persistent_delta.log.deltalog import DeltaLog, ReadTxn
from persistent_delta.log.records import AppendRecord


def live_bytes(lg: DeltaLog) -> Tuple[int, int]:
    """(records, value bytes) currently in the log's records DB."""

    def count(r: ReadTxn) -> Tuple[int, int]:
        n = b = 0
        for e in r.tables().values():
            for _bi, _s, nb in r.iter_record_keys(e.table_id):
                n += 1
                b += nb
        return n, b

    return lg.read(count)


def file_size(path: str) -> int:
    """Disk use of ``data.mdb``: allocated blocks (what ``du`` reports). With LMDB's writemap
    the apparent size is the whole (sparse) map, so ``st_size`` would overstate it."""
    try:
        st = os.stat(os.path.join(path, "data.mdb"))
    except OSError:
        return 0
    return min(st.st_size, st.st_blocks * 512)


def apparent_size(path: str) -> int:
    try:
        return os.path.getsize(os.path.join(path, "data.mdb"))
    except OSError:
        return 0


class Recorder:
    def __init__(self, path: str, every: int) -> None:
        self.path, self.every = path, every
        self.peak_live = 0
        self.max_file = 0
        self.samples: List[Tuple[int, int, int]] = []  # (step, file bytes, live bytes before the read)

    def sample(self, step: int, live: int) -> None:
        f = file_size(self.path)
        self.peak_live = max(self.peak_live, live)
        self.max_file = max(self.max_file, f)
        if step % self.every == 0:
            self.samples.append((step, f, live))

    def result(self, name: str, steps: int, wall: float, **extra: Any) -> Dict[str, Any]:
        final = file_size(self.path)
        self.max_file = max(self.max_file, final)
        r = self.max_file / self.peak_live if self.peak_live else None
        return emit(
            "disk_steady_state",
            config=name,
            steps=steps,
            max_file_bytes=self.max_file,
            final_file_bytes=final,
            final_apparent_bytes=apparent_size(self.path),
            peak_live_bytes=self.peak_live,
            max_file_over_peak_live=r,
            target={"max_ratio": 1.5, "met": r is not None and r <= 1.5},
            samples_step_file_live=self.samples,
            wall_s=wall,
            **extra,
            machine=machine(),
        )


def run_tracker(args: argparse.Namespace) -> None:
    from benchmarks._model import Workload, build_dmp, make_batches, train_step
    from persistent_delta import PersistentTrackerConfig, attach

    torch.set_flush_denormal(True)
    init_single_rank_pg()
    w = Workload(rows=20_000, dim=32, batch=256, pooling=4)
    root = workdir("disk-tracker")
    batches = make_batches(w, 200, seed=3)
    dmp = build_dmp(w, seed=3)
    tr = attach(dmp, PersistentTrackerConfig(path=root, tracking_mode=TrackingMode.EMBEDDING, consumers=["reader"],
                                             delete_on_read=True, fresh=True))
    rec = Recorder(tr.path, max(args.read_every, args.steps // 50))
    t0 = time.perf_counter()
    try:
        for step in range(1, args.steps + 1):
            train_step(dmp, batches[step % len(batches)])
            if step % args.read_every == 0:
                tr.flush()
                rec.sample(step, live_bytes(tr.log)[1])
                tr.get_unique("reader")
            if step % 1000 == 0:
                log("tracker_dmp: step %d, file %.1f MB, peak live %.1f MB", step, file_size(tr.path) / 1e6, rec.peak_live / 1e6)
        rec.result("tracker_dmp", args.steps, time.perf_counter() - t0, workload=vars(w), writer=tr.stats())
    finally:
        tr.close()
        rmtree(root)


def run_store(args: argparse.Namespace, compact: bool) -> None:
    name = "store_compact_read_delete" if compact else "store_read_delete"
    root = workdir("disk-store")
    path = os.path.join(root, "log")
    samplers = [ZipfIds(200_000, 1.05, 40 + t) for t in range(4)]
    g = torch.Generator().manual_seed(2)
    pool = [[(f"sparse.embeddings.t{t}", samplers[t].sample(args.ids), torch.randn(args.ids, 64, generator=g))
             for t in range(4)] for _ in range(16)]
    store = LmdbDeltaStore(path, UpdateMode.FIRST)
    rec = Recorder(path, max(args.read_every, args.steps // 50))
    offset = 0
    t0 = time.perf_counter()
    try:
        for step in range(args.steps):
            store.append_many([AppendRecord(step, f, i, s) for f, i, s in pool[step % len(pool)]])
            if (step + 1) % args.read_every == 0:
                end = step + 1
                rec.sample(end, live_bytes(store.log)[1])
                if compact and end - offset > 1:
                    store.compact(offset, end)
                    rec.sample(end, live_bytes(store.log)[1])  # merged record + originals? (one txn: no)
                store.get_unique(offset)
                offset = end
                store.delete(offset)
            if (step + 1) % 1000 == 0:
                log("%s: step %d, file %.1f MB, peak live %.1f MB", name, step + 1, file_size(path) / 1e6, rec.peak_live / 1e6)
        rec.result(name, args.steps, time.perf_counter() - t0, step_payload_bytes=sum(
            i.numel() * 8 + s.numel() * 4 for _, i, s in pool[0]))
    finally:
        store.close()
        rmtree(root)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="tracker_dmp,store_read_delete,store_compact_read_delete")
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--read-every", type=int, default=10)
    ap.add_argument("--ids", type=int, default=4096, help="ids per table per step (store configs)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 100 steps, 1024 ids")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.ids = 100, 1024
    for c in args.configs.split(","):
        c = c.strip()
        log("disk steady state: %s, %d steps", c, args.steps)
        if c == "tracker_dmp":
            run_tracker(args)
        elif c in ("store_read_delete", "store_compact_read_delete"):
            run_store(args, compact=c == "store_compact_read_delete")
        else:
            raise SystemExit(f"unknown config {c!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
