"""The cost of ``publish()`` by CPU time, per row format (issue 32 item 6).

    python -m benchmarks.publish_cost_formats [--rounds 12] [--every 10] [--formats native,float16,bfloat16,int8]
                                              [--threads 1] [--out benchmarks/results/publish_cost_formats.jsonl]
    python -m benchmarks.publish_cost_formats --quick     # smoke run: tables of 5,000 rows, batch 64, 1 round of 2 steps

Why CPU time: on this 2-core machine shared with other jobs, wall-clock throughput ratios
cannot resolve a few percent (the bytes alone with no library code cost 1.005-1.054 of a
step's time, and A/A spans 0.975-1.044: benchmarks/README.md). The CPU a thread or a process
uses is much less sensitive to the neighbours. Two parts are measured:

* **the training thread**: ``time.thread_time()`` around ``tracker.publish(...)`` (the
  capture: the consumer's unread ids, the gather of their rows into the record buffers),
  against **the bare gather** of the same rows into reused buffers (``index_select`` of each
  table's rows, ids precomputed: no library code). Target: <= 1.5x. At one torch intra-op
  thread (``--threads 1``, the default, as ``step_cpu``): with a pool, ``thread_time`` counts
  only the calling thread's share of a parallel gather, plus its spinning while a pool worker
  waits for a core the writer or a neighbour holds, so the ratio measured the scheduler.
* **the whole process**: ``time.process_time()`` from the ``publish()`` call until the writer
  committed it (the training thread, then the writer thread's conversion, checksum, LMDB puts
  and retention; waited for with the writer's barrier, not ``flush()``, whose fsync would
  charge the library with writeback the floor does not do: both are synced untimed after),
  per published MB, against **the bytes-alone floor** of
  the same format: the bare gather, the conversion to the format (cast, FBGEMM int8
  quantization), a CRC32C and a plain LMDB put of each table's bytes with the delete of the
  previous publish's, one transaction on a background thread. Target: <= 1.3x.
* **the writer thread**: its own CPU clock (``pthread_getcpuclockid``) over the same span, per
  publish: the conversion to each row format, the checksum, the LMDB puts and retention
  (``writer_ms_median``).

Workload: one rank (gloo), an EmbeddingCollection of 4 tables x 100,000 rows x dim 64, batch
1024 x pooling 8, Zipf ids, fused row-wise Adagrad, ID_ONLY with consumer ``serving``: the
``freshness`` benchmark's. One tracked model per format (same seed, same batches, so every
variant publishes the same rows), each publishing only its format (a snapshots consumer of
that format is registered, as a replica would be, and moved past each publish untimed, so
that retention deletes the previous publish in the next one's transaction, as the floor
does; without it every publish stays on disk and each commit writes to new pages: 2-4x the
writer's CPU; ``native`` is float32 here), plus an A/A twin of ``native`` (the noise). Each round trains every model ``--every`` steps (untimed), flushes
(untimed), then times one publish of each variant and each floor, in a shuffled order. The
first round is a warm-up, dropped. The training thread's part is also split: the consumer's
unread ids (``consume_read_ids``, timed by wrapping it: the writer's accumulation of them, or
the log at a consumer's first publish) and the rest. Prints one JSON line per format and a summary; ``--out``
appends them to a results file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional

from benchmarks._common import emit, init_single_rank_pg, log, machine, median, rmtree, workdir

CONSUMER = "serving"
FORMATS = ("native", "float16", "bfloat16", "int8")
_QUICK = False  # --quick: the smoke run's small tables and batches (set by main)


def _workload() -> Any:
    from benchmarks._model import Workload

    if _QUICK:
        return Workload(num_tables=4, rows=5_000, dim=64, batch=64, pooling=8)
    return Workload(num_tables=4, rows=100_000, dim=64, batch=1024, pooling=8)


def _tracked(root: str, seed: int) -> Any:
    from torchrec.distributed.model_tracker.types import TrackingMode

    from benchmarks._model import build_dmp
    from persistent_delta import PersistentTrackerConfig, attach

    dmp = build_dmp(_workload(), seed=seed)
    tracker = attach(dmp, PersistentTrackerConfig(path=root, tracking_mode=TrackingMode.ID_ONLY, consumers=[CONSUMER],
                                                  delete_on_read=True, fresh=True))
    return dmp, tracker


class BytesFloor:
    """The least a durable publish of ``fmt`` rows costs, no library code: the gather of the
    rows changed in the last ``every`` steps into reused buffers (the caller's thread: the
    *bare gather*), then on a background thread the conversion to ``fmt``, a CRC32C and a plain
    LMDB put of each table's bytes with the delete of the previous publish's, one transaction."""

    def __init__(self, root: str, weights: List[Any], fmt: str) -> None:
        import lmdb

        self.weights, self.fmt = weights, fmt
        self.path = os.path.join(root, f"floor-{fmt}")
        os.makedirs(self.path, exist_ok=True)
        self.env = lmdb.open(self.path, map_size=1 << 36, sync=False, metasync=False, subdir=True)
        self.bufs: List[Any] = [None] * len(weights)
        self.conv_bufs: List[Any] = [None] * len(weights)  # the background thread's (float formats)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=f"floor-{fmt}")
        self.pending: Any = None
        self.stamp = 0
        self.nbytes = 0  # bytes stored by the last publish

    def gather(self, ids: List[Any]) -> None:
        """The bare gather (caller's thread), then the store handed to the background thread."""
        import torch

        if self.pending is not None:
            self.pending.result()
        rows = []
        for t, (weight, tid) in enumerate(zip(self.weights, ids)):
            n = int(tid.numel())
            buf = self.bufs[t]
            if buf is None or buf.shape[0] < n:
                buf = self.bufs[t] = torch.empty((int(n * 1.25) + 1, weight.shape[1]), dtype=weight.dtype)
            torch.index_select(weight, 0, tid, out=buf[:n])
            rows.append((tid, buf[:n]))
        self.pending = self.pool.submit(self._store, self.stamp, rows)
        self.stamp += 1

    def _store(self, stamp: int, rows: List[Any]) -> None:
        import crc32c


        total = 0
        with self.env.begin(write=True) as txn:
            for t, (tid, r) in enumerate(rows):
                conv = self._convert(t, r)
                for part in (tid, conv):
                    value = memoryview(part.contiguous().view(-1).view(torch_uint8()).numpy())
                    crc32c.crc32c(value)  # computed for its cost, as the library checksums every record
                    txn.put(struct.pack(">IQB", t, stamp, part is tid), value)
                    total += len(value)
                    if stamp:
                        txn.delete(struct.pack(">IQB", t, stamp - 1, part is tid))
        self.nbytes = total

    def _convert(self, t: int, rows: Any) -> Any:
        """``rows`` in the floor's format: a float format cast into a reused buffer (one pass,
        as the library casts into its record), int8 FBGEMM's row-wise quantization."""
        import torch

        from persistent_delta.log import codec

        if self.fmt == "native":
            return rows
        if self.fmt == "int8":
            return codec.quantize_int8(rows)
        dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[self.fmt]
        buf = self.conv_bufs[t]
        if buf is None or buf.numel() < rows.numel():
            buf = self.conv_bufs[t] = torch.empty(int(rows.numel() * 1.25) + 1, dtype=dtype)
        out = buf[:rows.numel()].view(rows.shape)
        out.copy_(rows)
        return out

    def flush(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def sync(self) -> None:
        self.env.sync(True)

    def close(self) -> None:
        self.flush()
        self.pool.shutdown()
        self.env.close()


def torch_uint8() -> Any:
    import torch

    return torch.uint8


def _recent_ids(batches: List[Any], end: int, every: int) -> List[Any]:
    """Per table, the unique ids the last ``every`` batches before ``end`` looked up (what a
    publish every ``every`` steps carries)."""
    import torch

    w = _workload()
    span = w.batch * w.pooling
    recent = [batches[(end - k) % len(batches)] for k in range(1, every + 1)]
    return [torch.unique(torch.cat([b.values[t * span:(t + 1) * span] for b in recent])) for t in range(w.num_tables)]


def _record_bytes(tracker: Any, fmt: str, rows: Dict[str, int]) -> int:
    """Bytes of the rows a publish of ``fmt`` stored (ids + states; headers not counted)."""
    dim = _workload().dim
    per = {"native": dim * 4, "float32": dim * 4, "float16": dim * 2, "bfloat16": dim * 2, "int8": dim + 4}[fmt]
    return sum(n * (8 + per) for n in rows.values())


_IDS_S: List[float] = []  # thread CPU of each consume_read_ids call (the publish's unread ids)


def _time_id_reads() -> None:
    """Wrap the publish's taking of the consumer's unread ids to time it (thread CPU)."""
    from persistent_delta.trainer import publish

    orig = publish.consume.consume_read_ids

    def timed(*a: Any, **k: Any) -> Any:
        c0 = time.thread_time()
        try:
            return orig(*a, **k)
        finally:
            _IDS_S.append(time.thread_time() - c0)

    publish.consume.consume_read_ids = timed  # type: ignore[assignment]


def _writer_clock(root: str) -> Any:
    """A function returning the CPU seconds used so far by the background writer thread of
    the tracker whose log root is ``root`` (the thread is named after its rank log's path)."""
    import threading

    ident = next(t.ident for t in threading.enumerate()
                 if t.name.startswith("persistent-delta-writer:") and t.name.split(":", 1)[1].startswith(root + os.sep))
    clock = time.pthread_getcpuclockid(ident)
    return lambda: time.clock_gettime(clock)


def run(rounds: int, every: int, formats: List[str], seed: int = 0) -> List[Dict[str, Any]]:
    import torch

    from benchmarks._model import _local_weights, make_batches, train_step

    _time_id_reads()

    init_single_rank_pg()
    root = workdir("publish-cost-formats")
    variants = list(formats) + ["native_aa"]
    from persistent_delta.read.consumer import DeltaConsumer

    models: Dict[str, Any] = {}
    replicas: Dict[str, Any] = {}
    for v in variants:
        models[v] = _tracked(os.path.join(root, v), seed)
        replicas[v] = DeltaConsumer(os.path.join(root, v), "replica", channel="snapshots",
                                    format="native" if v == "native_aa" else v)
    batches = make_batches(_workload(), 40, seed=seed + 1)
    weights = [t for _, t in sorted(_local_weights(models[variants[0]][0]).items())]
    floors = {f: BytesFloor(root, weights, f) for f in formats}
    log("variants %s; %d rounds of %d steps", variants, rounds, every)
    train_s: Dict[str, List[float]] = {v: [] for v in variants}  # training thread CPU per publish
    ids_s: Dict[str, List[float]] = {v: [] for v in variants}  # of which the unread ids' read
    writer_s: Dict[str, List[float]] = {v: [] for v in variants}  # the writer thread's CPU per publish
    writer_clock = {v: _writer_clock(os.path.join(root, v)) for v in variants}
    proc_s: Dict[str, List[float]] = {v: [] for v in variants}  # process CPU per publish
    wall_s: Dict[str, List[float]] = {v: [] for v in variants}
    mb: Dict[str, float] = {}
    gather_s: Dict[str, List[float]] = {f: [] for f in formats}  # the bare gather, training thread CPU
    floor_proc_s: Dict[str, List[float]] = {f: [] for f in formats}
    floor_mb: Dict[str, float] = {}
    done = 0
    rng = random.Random(seed)
    for rnd in range(rounds + 1):
        for v in variants:
            dmp, tracker = models[v]
            for k in range(every):
                train_step(dmp, batches[(done + k) % len(batches)])
            tracker.flush()
        done += every
        ids = _recent_ids(batches, done % len(batches), every)
        order = [("lib", v) for v in variants] + [("floor", f) for f in formats]
        rng.shuffle(order)
        for kind, v in order:
            if kind == "lib":
                tracker = models[v][1]
                fmt = "native" if v == "native_aa" else v
                _IDS_S.clear()
                wc0 = writer_clock[v]()
                w0, p0, c0 = time.perf_counter(), time.process_time(), time.thread_time()
                rows = tracker.publish(CONSUMER, formats=[fmt])
                c1 = time.thread_time()
                tracker._settle()  # the writer committed it (no fsync: see the module docs)
                p1, w1 = time.process_time(), time.perf_counter()
                wc1 = writer_clock[v]()
                tracker.flush()  # untimed
                rep_c = replicas[v]
                rep_c.seek(rep_c.end_offsets()[0])  # the replica applied it (untimed)
                rep_c.commit()
                if rnd:
                    train_s[v].append(c1 - c0)
                    ids_s[v].append(sum(_IDS_S))
                    proc_s[v].append(p1 - p0)
                    writer_s[v].append(wc1 - wc0)
                    wall_s[v].append(w1 - w0)
                    mb[v] = _record_bytes(tracker, fmt, rows) / 1e6
            else:
                fl = floors[v]
                p0, c0 = time.process_time(), time.thread_time()
                fl.gather(ids)
                c1 = time.thread_time()
                fl.flush()
                p1 = time.process_time()
                fl.sync()  # untimed
                if rnd:
                    gather_s[v].append(c1 - c0)
                    floor_proc_s[v].append(p1 - p0)
                    floor_mb[v] = fl.nbytes / 1e6
        if rnd:
            log("round %d: publish() ms %s | bare gather ms %s", rnd,
                {v: round(1e3 * train_s[v][-1], 2) for v in variants},
                {f: round(1e3 * gather_s[f][-1], 2) for f in formats})
    out = []
    base = "native"
    for v in variants:
        fmt = "native" if v == "native_aa" else v
        g, fp = median(gather_s[fmt]), median(floor_proc_s[fmt])
        t, p = median(train_s[v]), median(proc_s[v])
        rec = emit(
            "publish_cost_formats", variant=v, format=fmt, rounds=rounds, every=every,
            published_mb=mb[v], floor_mb=floor_mb[fmt],
            publish_thread_ms_median=1e3 * t, publish_thread_ms_range=[1e3 * min(train_s[v]), 1e3 * max(train_s[v])],
            bare_gather_ms_median=1e3 * g, bare_gather_ms_range=[1e3 * min(gather_s[fmt]), 1e3 * max(gather_s[fmt])],
            thread_over_gather=t / g, unread_ids_ms_median=1e3 * median(ids_s[v]),
            thread_minus_ids_over_gather=(t - median(ids_s[v])) / g,
            thread_over_gather_per_round=sorted(a / b for a, b in zip(train_s[v], gather_s[fmt])),
            writer_ms_median=1e3 * median(writer_s[v]),
            writer_ms_range=[1e3 * min(writer_s[v]), 1e3 * max(writer_s[v])],
            process_ms_median=1e3 * p, process_ms_range=[1e3 * min(proc_s[v]), 1e3 * max(proc_s[v])],
            floor_process_ms_median=1e3 * fp,
            process_ms_per_mb=1e3 * p / mb[v], floor_process_ms_per_mb=1e3 * fp / floor_mb[fmt],
            process_over_floor=p / fp,
            process_over_floor_per_round=sorted(a / b for a, b in zip(proc_s[v], floor_proc_s[fmt])),
            wall_ms_median=1e3 * median(wall_s[v]),
            vs_native_thread=t / median(train_s[base]), vs_native_process=p / median(proc_s[base]),
            byte_ratio_vs_native=mb[v] / mb[base],
        )
        out.append(rec)
    emit("publish_cost_formats_summary", aa_thread=median(train_s["native_aa"]) / median(train_s["native"]),
         aa_writer=median(writer_s["native_aa"]) / median(writer_s["native"]),
         aa_process=median(proc_s["native_aa"]) / median(proc_s["native"]),
         aa_thread_per_round=sorted(a / b for a, b in zip(train_s["native_aa"], train_s["native"])),
         machine=machine())
    for c in replicas.values():
        c.close()
    for _, tracker in models.values():
        tracker.close()
    for fl in floors.values():
        fl.close()
    rmtree(root)
    del torch
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--every", type=int, default=10, help="steps between publishes")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--out", help="append the JSON lines to this file")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: tables of 5,000 rows, batch 64, 1 round (after the warm-up round) of 2 steps")
    args = ap.parse_args(argv)
    if args.quick:
        global _QUICK
        _QUICK = True
        args.rounds, args.every = 1, 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    formats = [f for f in args.formats.split(",") if f]
    if "native" not in formats:
        formats.insert(0, "native")
    recs = run(args.rounds, args.every, formats)
    if args.out:
        with open(args.out, "a") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
