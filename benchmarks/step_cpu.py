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
* ``held`` (only with ``--only ...,held``): untracked, but a post-lookup hook keeps each step's
  lookup output alive until the next step has run, with no library code: what the EMBEDDING
  tracker did until it copied the rows into reused blocks (``trainer/capture.py``), to measure
  what that lifetime alone costs (page faults, CPU);
* ``metrics`` (``--metrics``): ``persistent`` with ``serve_metrics(tracker=...)`` and a thread
  scraping it every ``--scrape-every`` seconds while (and only while) this variant's block runs.

With ``--isolate`` every variant runs in a process of its own, driven block by block over a pipe
(still interleaved): glibc's malloc state (its dynamic mmap threshold and heap trimming, which
decide how many pages each step faults in) is then each model's own, as in a job, instead of
shared by all the models of one process. ``--base DIR`` (with ``--isolate``) adds the variant
``base``: ``persistent`` with the library found in ``DIR`` (e.g. ``git archive <commit>
persistent_delta | tar -x -C DIR``), for a before/after in the same interleaved run.

Every tracked variant reads (``get_unique``) every ``--read-every`` steps inside its block, so a
block ends with the writer drained: the CPU it caused is inside its own block. Torch runs with
``--threads`` intra-op threads (default 1, so the training thread's CPU is the training compute
and the tracker's training-thread work is not hidden in a pool; 0 keeps torch's default).

Reported per variant: CPU per step (training thread, process), wall per step, the writer
thread's CPU per step, the training thread's CPU in the reads per step (``read_ms_per_step``), minor page faults per
step (the training thread's, the process's, and the training thread's in the reads), bytes written per step; per round the ratios over ``a``; the medians and
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
    if v in ("persistent", "metrics", "base"):
        from persistent_delta import PersistentTrackerConfig, attach

        return attach(dmp, PersistentTrackerConfig(path=os.path.join(root, v), tracking_mode=mode,
                                                   consumers=[CONSUMER], delete_on_read=True, fresh=True))
    return None


class Host:
    """Some of the variants, each with its DMP (and tracker, floor or scraper), run block by block
    in this process: all of them in one process, or one per process with ``--isolate``."""

    def __init__(self, args: argparse.Namespace, variants: List[str], root: str) -> None:
        self.args, self.variants = args, variants
        mode = TrackingMode[args.mode]
        w = Workload(rows=args.rows, batch=args.batch)
        self.total = args.warmup + args.steps
        self.batches = make_batches(w, self.total, seed=args.seed)
        self.dmps = {v: build_dmp(w, seed=args.seed) for v in variants}
        self.trackers = {v: _attach(v, self.dmps[v], mode, root) for v in variants}
        self.floor = BytesFloor(root, self.dmps["floor"], self.batches, w, args.read_every) if "floor" in variants else None
        self.scraper = GatedScraper(self.trackers["metrics"], args.scrape_every) if "metrics" in variants else None
        writers = {v: list(writer_threads_of(self.trackers[v])) for v in variants if v in ("persistent", "metrics", "base")}
        self.side = {v: (lambda ts=ts: sum(thread_cpu_s(t) for t in ts)) for v, ts in writers.items()}
        if self.floor is not None:
            floor = self.floor
            self.side["floor"] = lambda: thread_cpu_s(floor.thread)
        self.held: List[torch.Tensor] = []
        if "held" in variants:
            from torchrec.distributed.embedding import ShardedEmbeddingCollection

            def hold(kjt: Any, states: torch.Tensor, *rest: Any) -> None:
                self.held.append(states.detach())

            for m in self.dmps["held"].modules():
                if isinstance(m, ShardedEmbeddingCollection):
                    m.register_post_lookup_tracker_fn(hold)
        self.done = {v: 0 for v in variants}

    def block(self, v: str, r: int) -> Dict[str, float]:
        """Run block ``r`` of variant ``v``; returns its CPU, wall, reads and faults."""
        args, block = self.args, self.args.block
        dmp, tr, floor = self.dmps[v], self.trackers[v], self.floor
        if self.scraper is not None and v == "metrics":
            self.scraper.enabled.set()
        gc.collect()
        s0 = self.side[v]() if v in self.side else 0.0
        f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        fp0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0, th0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        read_th, read_faults = 0.0, 0
        for j in range(block):
            i = min(r * block + j, self.total - 1)
            train_step(dmp, self.batches[i])
            if floor is not None and v == "floor":
                floor.step(i)
            if v == "held":
                del self.held[:-1]  # each step's lookup output lives until the next step's ends
            self.done[v] += 1
            if self.done[v] % args.read_every == 0:
                r0, rf0 = time.thread_time(), resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
                if tr is not None:
                    del_rows = tr.get_unique(CONSUMER)
                    del del_rows
                elif floor is not None and v == "floor":
                    floor.read_and_delete()
                read_th += time.thread_time() - r0
                read_faults += resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - rf0
        self.held.clear()
        row = {"wall": time.perf_counter() - t0, "thread": time.thread_time() - th0,
               "process": time.process_time() - p0,
               "side": (self.side[v]() - s0) if v in self.side else 0.0, "read": read_th, "read_faults": read_faults,
               "faults": resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0,
               "process_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - fp0}
        if self.scraper is not None and v == "metrics":
            self.scraper.enabled.clear()
        return row

    def finish(self) -> Dict[str, Any]:
        """Bytes written per step, TorchRec's store at the end, scrapes; closes everything."""
        out: Dict[str, Any] = {"bytes_per_step": {}, "trec_bytes": None, "scrapes": 0}
        for v in ("persistent", "metrics", "base"):
            if self.trackers.get(v) is not None:
                out["bytes_per_step"][v] = self.trackers[v].stats()["bytes_written"] / max(1, self.done[v])
        if self.floor is not None:
            out["bytes_per_step"]["floor"] = self.floor.bytes_written / max(1, self.done["floor"])
        if "torchrec" in self.variants:
            out["trec_bytes"] = torchrec_store_bytes(self.trackers.get("torchrec"))
        if self.scraper is not None:
            out["scrapes"] = self.scraper.close()
        if self.floor is not None:
            self.floor.close()
        for tr in self.trackers.values():
            if tr is not None and hasattr(tr, "close"):
                tr.close()
        self.dmps.clear()
        self.trackers.clear()
        gc.collect()
        return out


class Child:
    """A variant in a process of its own (``--isolate``), run by the parent block by block over
    a pipe: the parent writes a round number, the child runs its block and answers one JSON line."""

    def __init__(self, v: str, argv: List[str], base: Optional[str] = None) -> None:
        import json
        import subprocess
        import sys

        self.json = json
        env, cwd = dict(os.environ), None
        if v == "base":  # the library from another tree (run from there: "-m" puts it first), the benchmark from this one
            here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
            cwd = base
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.step_cpu", *argv, "--child", v],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=cwd)

    def ask(self, line: str) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"a variant's process ended (exit status {self.proc.wait()})")
        return self.json.loads(answer)

    def close(self) -> Any:
        out = self.ask("end")
        self.proc.wait()
        return out


def child_main(args: argparse.Namespace) -> int:
    """The ``--child`` side of :class:`Child`: host one variant and answer the parent's rounds."""
    import json
    import sys

    root = workdir(f"step-cpu-{args.child}")
    host = Host(args, [args.child], root)
    import persistent_delta

    print(json.dumps({"ready": True, "library": os.path.dirname(persistent_delta.__file__)}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "end":
            print(json.dumps(host.finish()), flush=True)
            break
        print(json.dumps(host.block(args.child, int(cmd))), flush=True)
    rmtree(root)
    return 0


def run(args: argparse.Namespace, argv: List[str]) -> Dict[str, Any]:
    mode = TrackingMode[args.mode]
    w = Workload(rows=args.rows, batch=args.batch)
    variants = ["a", "b", "torchrec", "persistent", "floor"] + (["metrics"] if args.metrics else [])
    if args.only and "held" in args.only.split(","):
        variants.append("held")
    if args.only:
        variants = [v for v in variants if v in args.only.split(",") or v == "a"]
    if args.base:
        if not args.isolate:
            raise SystemExit("--base needs --isolate (the other tree's library in a process of its own)")
        variants.append("base")
    total = args.warmup + args.steps
    log("%s: %d batches, %d DMPs (%s)%s", mode.name, total, len(variants), ",".join(variants),
        ", a process each" if args.isolate else "")
    root = workdir("step-cpu")
    host: Optional[Host] = None
    children: Dict[str, Child] = {}
    libraries: Dict[str, str] = {}
    if args.isolate:
        children = {v: Child(v, argv, args.base) for v in variants}
        for v, c in children.items():  # each announces itself once its model is built
            assert c.proc.stdout is not None
            libraries[v] = c.json.loads(c.proc.stdout.readline())["library"]

        def block(v: str, r: int) -> Dict[str, float]:
            return children[v].ask(str(r))
    else:
        host = Host(args, variants, root)
        block = host.block
    rounds_warm = -(-args.warmup // args.block)
    rounds = args.steps // args.block
    per_round: List[Dict[str, Dict[str, float]]] = []
    monitor = CpuMonitor()
    for r in range(rounds_warm + rounds):
        record = r >= rounds_warm
        k = r % len(variants)
        order = variants[k:] + variants[:k]
        row: Dict[str, Dict[str, float]] = {v: block(v, r) for v in order}
        if record:
            per_round.append(row)
        if record and (r - rounds_warm) % max(1, rounds // 4) == 0:
            log("round %d/%d: process ms/step %s", r - rounds_warm + 1, rounds,
                {v: round(1e3 * row[v]["process"] / args.block, 1) for v in variants})
    foreign = monitor.foreign_cpus()
    steps = len(per_round) * args.block
    out: Dict[str, Any] = {}
    for v in variants:
        for key in ("wall", "thread", "process", "side", "read"):
            out.setdefault(f"{key}_ms_per_step", {})[v] = 1e3 * sum(rw[v][key] for rw in per_round) / steps
        # minor page faults per step: the training thread's, and the whole process's
        out.setdefault("thread_faults_per_step", {})[v] = sum(rw[v]["faults"] for rw in per_round) / steps
        out.setdefault("process_faults_per_step", {})[v] = sum(rw[v]["process_faults"] for rw in per_round) / steps
        out.setdefault("read_faults_per_step", {})[v] = sum(rw[v]["read_faults"] for rw in per_round) / steps

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
    if host is not None:
        ends = [host.finish()]
    else:
        ends = [c.close() for c in children.values()]
    bytes_per_step: Dict[str, float] = {}
    for e in ends:
        bytes_per_step.update(e["bytes_per_step"])
    trec_bytes = next((e["trec_bytes"] for e in ends if e["trec_bytes"] is not None), None)
    scrapes = sum(e["scrapes"] for e in ends)
    rmtree(root)
    return emit(
        "step_cpu", mode=mode.name, steps=steps, block=args.block, read_every=args.read_every,
        torch_threads=torch.get_num_threads(), workload=vars(w), variants=variants, isolated=bool(args.isolate),
        libraries=libraries,
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
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 10 steps after 5 in blocks of 5, 10k rows, batch 128, a read every 5 steps")
    ap.add_argument("--isolate", action="store_true",
                    help="each variant in a process of its own (its own allocator state), still interleaved")
    ap.add_argument("--base", default=None, metavar="DIR",
                    help="with --isolate: add the variant 'base', the persistent tracker of the library "
                         "in DIR (a directory holding another version's persistent_delta package)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.rows, args.batch, args.block, args.read_every = 10, 5, 10_000, 128, 5, 5
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    init_single_rank_pg("gloo")
    if args.child:
        return child_main(args)
    child_argv = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in (
        "mode", "steps", "warmup", "block", "read_every", "rows", "batch", "threads", "seed", "scrape_every")]
    for _ in range(args.repeat):
        run(args, child_argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
