"""The step's cost of tracking by CPU time, with a bytes-alone floor and an A/A pair (issue 34.2,
issue 33.7).

On a machine shared with other jobs a wall-clock ratio measures the neighbours as much as the
tracker. This benchmark charges CPU time instead: for every block of ``--block`` steps it reads
the training thread's CPU (``time.thread_time``), the whole process's CPU
(``time.process_time``: the training thread, torch's intra-op threads, the library's writer
thread, anything else) and the wall time, per variant. Identical DMPs (``benchmarks._model``:
4 EC tables x 200k rows x dim 64, batch 2048, pooling 8, Zipf ids, fused row-wise Adagrad)
train on the same batches, interleaved in blocks whose order is rotated every round:

* ``a`` and ``b``: untracked, twice (``b/a`` is the A/A floor of the method);
* ``torchrec``: ``dmp.init_torchrec_delta_tracker`` (in memory, ``delete_on_read``);
* ``persistent``: ``attach(dmp, PersistentTrackerConfig(...))``, one consumer, ``delete_on_read``;
* ``floor``: untracked, plus, with no library code, the bytes the persistent variant writes:
  on a background thread, each step's rows first seen in the read window (ids computed before
  the run), gathered from the table's weights, CRC32C'd and put into a plain LMDB environment
  (one transaction per step, like the library's writer with embeddings); every ``--read-every``
  steps the training thread waits for that thread, reads the window's values back (a copy) and
  deletes them in one transaction;
* ``metrics`` (``--metrics``): ``persistent`` with ``serve_metrics(tracker=...)`` and a thread
  scraping it every ``--scrape-every`` seconds while (and only while) this variant's block runs.

Every tracked variant reads (``get_unique``) every ``--read-every`` steps inside its block, so a
block ends with the writer drained: the CPU it caused is inside its own block. Torch runs with
``--threads`` intra-op threads (default 1, so the training thread's CPU is the training compute
and the tracker's training-thread work is not hidden in a pool; 0 keeps torch's default).

Reported per variant: CPU per step (training thread, process), wall per step, the writer
thread's CPU per step, the training thread's CPU in the reads per step (``read_ms_per_step``), minor page faults per
step (the training thread's and the process's), bytes written per step; per round the ratios over ``a``; the medians and
the spread over rounds. The library's own share over the floor is
``(process CPU persistent - process CPU floor) / process CPU a`` (target <= 3% of the step).
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import struct
import threading
import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode

from benchmarks._common import CpuMonitor, emit, init_single_rank_pg, log, machine, rmtree, workdir
from benchmarks._cpu import thread_cpu_s, torchrec_store_bytes, writer_threads_of
from benchmarks._model import Workload, _local_weights, build_dmp, make_batches, train_step

CONSUMER = "bench"


class BytesFloor:
    """The persistent tracker's bytes with no library code (see the module docstring)."""

    def __init__(self, root: str, dmp: Any, batches: List[Any], w: Workload, window: int) -> None:
        import lmdb

        self.weights = [t for _, t in sorted(_local_weights(dmp).items())]
        span = w.batch * w.pooling
        # batch index -> per table, the ids first seen in its read window (computed once, untimed)
        self.new_ids: List[List[torch.Tensor]] = []
        seen = [np.zeros(w.rows, dtype=bool) for _ in range(w.num_tables)]
        for i, b in enumerate(batches):
            if i % window == 0:
                for s in seen:
                    s[:] = False
            per = []
            for t in range(w.num_tables):
                ids = np.unique(b.values[t * span:(t + 1) * span].numpy())
                fresh = ids[~seen[t][ids]]
                seen[t][fresh] = True
                per.append(torch.from_numpy(fresh))
            self.new_ids.append(per)
        self.path = os.path.join(root, "floor")
        os.makedirs(self.path, exist_ok=True)
        self.env = lmdb.open(self.path, map_size=1 << 36, sync=False, metasync=False, subdir=True)
        self.cv = threading.Condition()
        self.queue: List[int] = []
        self.busy = False
        self.keys: List[bytes] = []
        self.bytes_written = 0
        self.stop = False
        self.thread = threading.Thread(target=self._run, name="bytes-floor", daemon=True)
        self.thread.start()

    def step(self, batch_i: int) -> None:
        """Hand one step to the background thread (the training thread's whole share)."""
        with self.cv:
            self.queue.append(batch_i)
            self.cv.notify_all()

    def _run(self) -> None:
        import crc32c

        torch.set_num_threads(1)
        while True:
            with self.cv:
                while not self.queue and not self.stop:
                    self.cv.wait()
                if self.stop and not self.queue:
                    return
                i = self.queue.pop(0)
                self.busy = True
            with self.env.begin(write=True) as txn:
                for t, (weight, ids) in enumerate(zip(self.weights, self.new_ids[i])):
                    n, row = int(ids.numel()), int(weight.shape[1]) * weight.element_size()
                    buf = torch.empty(n * (8 + row), dtype=torch.uint8)
                    buf[:n * 8].view(torch.int64).copy_(ids)
                    torch.index_select(weight, 0, ids, out=buf[n * 8:].view(weight.dtype).view(n, -1))
                    value = memoryview(buf.numpy())
                    crc32c.crc32c(value)  # computed for its cost: the library checksums every record
                    key = struct.pack(">IQ", t, i)
                    txn.put(key, value)
                    self.keys.append(key)
                    self.bytes_written += len(value)
            with self.cv:
                self.busy = False
                self.cv.notify_all()

    def read_and_delete(self) -> int:
        """Wait for the thread, copy the window's values out and delete them (one transaction)."""
        with self.cv:
            while self.queue or self.busy:
                self.cv.wait()
        keys, self.keys = self.keys, []
        with self.env.begin(write=True) as txn:
            parts = [np.frombuffer(txn.get(k), dtype=np.uint8).copy() for k in keys]
            for k in keys:
                txn.delete(k)
        return sum(p.nbytes for p in parts)

    def close(self) -> None:
        with self.cv:
            self.stop = True
            self.cv.notify_all()
        self.thread.join()
        self.env.close()


class GatedScraper:
    """Serve the tracker's metrics and scrape them every ``every`` seconds while enabled."""

    def __init__(self, tracker: Any, every: float) -> None:
        import urllib.request

        from persistent_delta.ops.metrics import serve_metrics

        self.server = serve_metrics(tracker=tracker, job="bench", port=0)
        self.enabled = threading.Event()
        self.stop = threading.Event()
        self.scrapes = 0
        url = f"http://127.0.0.1:{self.server.port}/metrics"

        def scrape() -> None:
            while not self.stop.is_set():
                if not self.enabled.wait(0.05):
                    continue
                with urllib.request.urlopen(url, timeout=10) as resp:
                    resp.read()
                self.scrapes += 1
                self.stop.wait(every)

        self.thread = threading.Thread(target=scrape, name="bench-scraper", daemon=True)
        self.thread.start()

    def close(self) -> int:
        self.stop.set()
        self.thread.join()
        self.server.close()
        return self.scrapes


def _attach(v: str, dmp: Any, mode: TrackingMode, root: str) -> Any:
    if v == "torchrec":
        return dmp.init_torchrec_delta_tracker(
            DeltaTrackerConfig(tracking_mode=mode, consumers=[CONSUMER], delete_on_read=True))
    if v in ("persistent", "metrics"):
        from persistent_delta import PersistentTrackerConfig, attach

        return attach(dmp, PersistentTrackerConfig(path=os.path.join(root, v), tracking_mode=mode,
                                                   consumers=[CONSUMER], delete_on_read=True, fresh=True))
    return None


def run(args: argparse.Namespace) -> Dict[str, Any]:
    mode = TrackingMode[args.mode]
    w = Workload(rows=args.rows, batch=args.batch)
    variants = ["a", "b", "torchrec", "persistent", "floor"] + (["metrics"] if args.metrics else [])
    if args.only:
        variants = [v for v in variants if v in args.only.split(",") or v == "a"]
    root = workdir("step-cpu")
    total = args.warmup + args.steps
    log("%s: %d batches, %d DMPs (%s)", mode.name, total, len(variants), ",".join(variants))
    batches = make_batches(w, total, seed=args.seed)
    dmps = {v: build_dmp(w, seed=args.seed) for v in variants}
    trackers = {v: _attach(v, dmps[v], mode, root) for v in variants}
    floor = BytesFloor(root, dmps["floor"], batches, w, args.read_every) if "floor" in variants else None
    scraper = GatedScraper(trackers["metrics"], args.scrape_every) if "metrics" in variants else None
    writers = {v: list(writer_threads_of(trackers[v])) for v in variants if v in ("persistent", "metrics")}
    side = {v: (lambda ts=ts: sum(thread_cpu_s(t) for t in ts)) for v, ts in writers.items()}
    if floor is not None:
        side["floor"] = lambda: thread_cpu_s(floor.thread)
    done = {v: 0 for v in variants}
    block = args.block
    rounds_warm = -(-args.warmup // block)
    rounds = args.steps // block
    per_round: List[Dict[str, Dict[str, float]]] = []
    monitor = CpuMonitor()
    for r in range(rounds_warm + rounds):
        record = r >= rounds_warm
        k = r % len(variants)
        order = variants[k:] + variants[:k]
        row: Dict[str, Dict[str, float]] = {}
        for v in order:
            dmp, tr = dmps[v], trackers[v]
            if scraper is not None and v == "metrics":
                scraper.enabled.set()
            gc.collect()
            s0 = side[v]() if v in side else 0.0
            f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            fp0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0, th0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            read_th = 0.0
            for j in range(block):
                i = min(r * block + j, total - 1)
                train_step(dmp, batches[i])
                if floor is not None and v == "floor":
                    floor.step(i)
                done[v] += 1
                if done[v] % args.read_every == 0:
                    r0 = time.thread_time()
                    if tr is not None:
                        del_rows = tr.get_unique(CONSUMER)
                        del del_rows
                    elif floor is not None and v == "floor":
                        floor.read_and_delete()
                    read_th += time.thread_time() - r0
            row[v] = {"wall": time.perf_counter() - t0, "thread": time.thread_time() - th0,
                      "process": time.process_time() - p0,
                      "side": (side[v]() - s0) if v in side else 0.0, "read": read_th,
                      "faults": resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0,
                      "process_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - fp0}
            if scraper is not None and v == "metrics":
                scraper.enabled.clear()
        if record:
            per_round.append(row)
        if record and (r - rounds_warm) % max(1, rounds // 4) == 0:
            log("round %d/%d: process ms/step %s", r - rounds_warm + 1, rounds,
                {v: round(1e3 * row[v]["process"] / block, 1) for v in variants})
    foreign = monitor.foreign_cpus()
    steps = len(per_round) * block
    out: Dict[str, Any] = {}
    for v in variants:
        for key in ("wall", "thread", "process", "side", "read"):
            out.setdefault(f"{key}_ms_per_step", {})[v] = 1e3 * sum(rw[v][key] for rw in per_round) / steps
        # minor page faults per step: the training thread's, and the whole process's
        out.setdefault("thread_faults_per_step", {})[v] = sum(rw[v]["faults"] for rw in per_round) / steps
        out.setdefault("process_faults_per_step", {})[v] = sum(rw[v]["process_faults"] for rw in per_round) / steps

    def ratios(key: str) -> Dict[str, Dict[str, float]]:
        res = {}
        for v in variants:
            if v == "a":
                continue
            xs = sorted(rw[v][key] / rw["a"][key] for rw in per_round if rw["a"][key] > 0)
            tot = sum(rw[v][key] for rw in per_round) / max(1e-12, sum(rw["a"][key] for rw in per_round))
            res[f"{v}/a"] = {"total": tot, "median": statistics.median(xs),
                             "p25": xs[len(xs) // 4], "p75": xs[(3 * len(xs)) // 4]}
        return res

    proc = out["process_ms_per_step"]
    derived: Dict[str, Any] = {}
    if "persistent" in proc and "floor" in proc:
        derived["library_over_floor_pct_of_step"] = 100 * (proc["persistent"] - proc["floor"]) / proc["a"]
        derived["floor_over_untracked_pct"] = 100 * (proc["floor"] - proc["a"]) / proc["a"]
        # per round: (persistent - floor) / a, the spread beside the A/A's (b - a) / a
        lib = sorted(100 * (rw["persistent"]["process"] - rw["floor"]["process"]) / rw["a"]["process"]
                     for rw in per_round)
        derived["library_over_floor_pct_rounds_median"] = statistics.median(lib)
    if "b" in proc:
        aa = sorted(100 * (rw["b"]["process"] - rw["a"]["process"]) / rw["a"]["process"] for rw in per_round)
        derived["aa_pct_rounds_median"] = statistics.median(aa)
        derived["aa_pct_total"] = 100 * (proc["b"] - proc["a"]) / proc["a"]
    if "metrics" in proc and "persistent" in proc:
        derived["metrics_over_persistent_pct_process"] = 100 * (proc["metrics"] - proc["persistent"]) / proc["a"]
        thr = out["thread_ms_per_step"]
        derived["metrics_over_persistent_pct_thread"] = 100 * (thr["metrics"] - thr["persistent"]) / thr["a"]
    bytes_per_step = {}
    for v in ("persistent", "metrics"):
        if trackers.get(v) is not None:
            bytes_per_step[v] = trackers[v].stats()["bytes_written"] / max(1, done[v])
    if floor is not None:
        bytes_per_step["floor"] = floor.bytes_written / max(1, done["floor"])
    trec_bytes = torchrec_store_bytes(trackers.get("torchrec")) if "torchrec" in variants else None
    scrapes = scraper.close() if scraper is not None else 0
    if floor is not None:
        floor.close()
    for tr in trackers.values():
        if tr is not None and hasattr(tr, "close"):
            tr.close()
    del dmps, trackers
    gc.collect()
    rmtree(root)
    return emit(
        "step_cpu", mode=mode.name, steps=steps, block=block, read_every=args.read_every,
        torch_threads=torch.get_num_threads(), workload=vars(w), variants=variants,
        **out,
        ratios_process=ratios("process"), ratios_thread=ratios("thread"), ratios_wall=ratios("wall"),
        **derived, bytes_written_per_step=bytes_per_step,
        tune_malloc=os.environ.get("PERSISTENT_DELTA_TUNE_MALLOC", ""), torchrec_store_bytes_at_end=trec_bytes,
        metrics_scrapes=scrapes, foreign_cpus=foreign, machine=machine(),
    )


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="EMBEDDING")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--read-every", type=int, default=10)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--metrics", action="store_true", help="add the 'metrics' variant (issue 33.7)")
    ap.add_argument("--scrape-every", type=float, default=1.0)
    ap.add_argument("--only", default=None, help="comma list of variants besides 'a'")
    ap.add_argument("--repeat", type=int, default=1, help="run the whole comparison this many times")
    ap.add_argument("--quick", action="store_true", help="smoke run: 40 steps, 50k rows, batch 512")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.rows, args.batch = 40, 10, 50_000, 512
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    init_single_rank_pg("gloo")
    for _ in range(args.repeat):
        run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
