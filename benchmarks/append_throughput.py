"""Append throughput of the log vs a raw sequential file write of the same bytes (issue 4b).

A step group is ``--tables`` records of ``--ids`` int64 ids (Zipf over 200k rows) plus
``ids x --dim`` float32 states (EMBEDDING-mode records: 4 x 16k x 64 = ~17 MB per step). Each
configuration writes ``--steps`` such groups into a fresh file/log and reports the payload (raw
tensor bytes) per second and its ratio to the raw page-cache write:

* ``raw_page_cache``: ``os.write`` of the tensors' bytes, sequentially, no fsync;
* ``raw_fsync_per_step``: the same plus ``fdatasync`` after every step;
* ``encode_only``: ``codec.encode_record`` of every record (header, crc32c, one copy), no I/O;
* ``store_append_many``: ``LmdbDeltaStore.append_many`` (validate + encode + one transaction)
  per step, for every :class:`~persistent_delta.Durability`; ON_FLUSH also reports the rate
  with the final ``flush()`` included;
* ``log_write_preencoded``: records encoded once up front, then one ``DeltaLog.write`` per step
  (``store.write_records``): the LMDB part alone;
* ``tracker_writer``: the tracker's ``BackgroundWriter`` (dedup FIRST + encode + group commit)
  fed one ``StepWrite`` per step, timed until its barrier (payload = captured bytes; it
  writes fewer bytes after dedup).
* ``raw_page_cache_aa``: the raw page-cache write again, ranked against the first one like
  every other configuration: the A/A floor (how far a ratio moves with nothing changed).

``--processes N`` measures instead how the tracker's writer scales across processes: ``N``
spawned processes, each writing its own log, started together, against one such process
alone (interleaved, ``--reps`` times each); each process runs the writer once untimed first.
The figure is the aggregate captured bytes per second of the ``N`` over the one's
(``scaling``; the issue's target for 2 is >= 1.8).

Configurations are interleaved over ``--reps`` repetitions (the order rotates); the ratio to
the raw page-cache write is the median over repetitions of the ratio within a repetition, and
GB/s is the median too. Files are
deleted right after each configuration, so dirty pages are dropped instead of written back
during the next one. One JSON line per configuration.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from benchmarks._common import CpuMonitor, ZipfIds, emit, free_bytes, log, machine, median, rmtree, wait_for_quiet, workdir
from persistent_delta import Durability, LmdbDeltaStore
from persistent_delta.log import codec
from persistent_delta.log.records import AppendRecord

Step = List[Tuple[str, torch.Tensor, torch.Tensor]]


def make_steps(n_distinct: int, tables: int, ids: int, dim: int, seed: int) -> List[Step]:
    out = []
    samplers = [ZipfIds(200_000, 1.05, seed + t) for t in range(tables)]
    g = torch.Generator().manual_seed(seed)
    for _ in range(n_distinct):
        out.append([(f"sparse.embeddings.t{t}", samplers[t].sample(ids), torch.randn(ids, dim, generator=g))
                    for t in range(tables)])
    return out


def payload(step: Step) -> int:
    return sum(i.numel() * i.element_size() + s.numel() * s.element_size() for _, i, s in step)


def _raw(path: str, steps: List[Step], n: int, fsync: bool) -> float:
    fd = os.open(os.path.join(path, "raw.bin"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        bufs = [[memoryview(i.numpy()).cast("B"), memoryview(s.numpy()).cast("B")] for st in steps for _, i, s in st]
        per_step = len(steps[0])
        t0 = time.perf_counter()
        for k in range(n):
            base = (k % len(steps)) * per_step
            for j in range(per_step):
                for b in bufs[base + j]:
                    mv = b
                    while mv:
                        w = os.write(fd, mv)
                        mv = mv[w:]
            if fsync:
                os.fdatasync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def _encode_only(steps: List[Step], n: int) -> float:
    t0 = time.perf_counter()
    for k in range(n):
        for _, i, s in steps[k % len(steps)]:
            codec.encode_record(i, s)
    return time.perf_counter() - t0


def _store(path: str, steps: List[Step], n: int, durability: Durability) -> Tuple[float, float]:
    store = LmdbDeltaStore(os.path.join(path, "log"), UpdateMode.FIRST, durability=durability)
    try:
        t0 = time.perf_counter()
        for k in range(n):
            store.append_many([AppendRecord(k, f, i, s) for f, i, s in steps[k % len(steps)]])
        t1 = time.perf_counter()
        store.flush()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t0
    finally:
        store.close()


def _log_preencoded(path: str, steps: List[Step], n: int, durability: Durability) -> float:
    from persistent_delta.log.records import write_records

    store = LmdbDeltaStore(os.path.join(path, "log"), UpdateMode.FIRST, durability=durability)
    try:
        enc = [[(f, codec.encode_record(i, s), i, s) for f, i, s in st] for st in steps]
        t0 = time.perf_counter()
        for k in range(n):
            recs = [(AppendRecord(k, f, i, s), v) for f, v, i, s in enc[k % len(steps)]]
            store.log.write(lambda w, recs=recs: write_records(w, recs))
        return time.perf_counter() - t0
    finally:
        store.close()


def _tracker_writer(path: str, steps: List[Step], n: int, durability: Durability) -> Tuple[float, Dict[str, Any]]:
    from persistent_delta.config import LogOptions
    from persistent_delta.log.deltalog import DeltaLog
    from persistent_delta.trainer.operations import StepWrite
    from persistent_delta.trainer.writer import BackgroundWriter

    lg = DeltaLog(os.path.join(path, "log"), update_mode=UpdateMode.FIRST.value,
                  options=LogOptions.resolve(durability=durability))
    wr = BackgroundWriter(lg, UpdateMode.FIRST)
    try:
        t0 = time.perf_counter()
        for k in range(n):
            recs = [AppendRecord(k, f, i, s) for f, i, s in steps[k % len(steps)]]
            wr.submit(StepWrite(records=recs, curr_batch_idx=k + 1))
        wr.barrier()
        dt = time.perf_counter() - t0
        return dt, wr.stats()
    finally:
        wr.close()
        lg.close()


def _writer_child(args: Tuple[int, int, int, int, int, str, bool], ready: Any, out: Any) -> None:
    """One process of ``--processes``: its own steps and log; waits at ``ready`` until every
    process is set up, then writes; puts ``(start, end)`` (``time.monotonic``, one clock for
    every process on Linux) of its writer's run into ``out``."""
    steps_n, distinct, tables, ids, dim, path, tune = args
    if tune:
        os.environ["PERSISTENT_DELTA_TUNE_MALLOC"] = "1"
    steps = make_steps(distinct, tables, ids, dim, seed=7)
    warm = os.path.join(path, "warm")
    os.makedirs(warm)
    _raw(warm, steps, min(steps_n, 10), False)  # untimed, as the in-process runs' warm-up
    _tracker_writer(warm, steps, steps_n, Durability.ON_FLUSH)  # untimed: a fresh process's first run
    rmtree(warm)  # faults in all its memory, which the in-process runs' later repetitions do not
    ready.wait()
    t0 = time.monotonic()
    _tracker_writer(path, steps, steps_n, Durability.ON_FLUSH)
    out.put((t0, time.monotonic()))


def _processes(args: argparse.Namespace, root: str, total: int) -> None:
    """``--processes N``: N writer processes together against one alone (see the module docs)."""
    ctx = multiprocessing.get_context("spawn")
    gbps: Dict[int, List[float]] = {1: [], args.processes: []}
    foreign: List[float] = []
    for rep in range(args.reps):
        wait_for_quiet(args.wait_quiet)
        for n in ((1, args.processes) if rep % 2 == 0 else (args.processes, 1)):
            dirs = [os.path.join(root, f"p{n}-{rep}-{i}") for i in range(n)]
            ready, out = ctx.Barrier(n + 1), ctx.Queue()
            procs = []
            for d in dirs:
                os.makedirs(d)
                procs.append(ctx.Process(target=_writer_child, args=(
                    (args.steps, args.distinct, args.tables, args.ids, args.dim, d, args.tune_malloc), ready, out)))
                procs[-1].start()
            ready.wait()  # (every child has built its steps and warmed up)
            mon = CpuMonitor()
            spans = [out.get(timeout=600) for _ in procs]
            for p in procs:
                p.join()
                if p.exitcode:
                    raise SystemExit(f"a writer process failed (exit code {p.exitcode})")
            foreign.append(mon.foreign_cpus() or 0.0)  # (after the joins: the children's CPU is ours)
            wall = max(e for _, e in spans) - min(t for t, _ in spans)
            gbps[n].append(n * total / wall / 1e9)
            for d in dirs:
                rmtree(d)
        log("rep %d done", rep + 1)
    one, many = gbps[1], gbps[args.processes]
    per_rep = [many[i] / one[i] for i in range(min(len(one), len(many)))]
    emit("append_throughput", config="tracker_writer_processes", processes=args.processes,
         durability=Durability.ON_FLUSH.value, steps=args.steps, total_bytes_per_process=total, reps=len(per_rep),
         gbps_one=median(one), gbps_together=median(many), gbps_one_per_rep=one, gbps_together_per_rep=many,
         scaling=median(per_rep), scaling_per_rep=per_rep,
         target={"min_scaling": 1.8, "met": median(per_rep) >= 1.8} if args.processes == 2 else None,
         foreign_cpus_max=max(foreign, default=None), tune_malloc=args.tune_malloc, machine=machine())


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=24, help="step groups per configuration (~17 MB each)")
    ap.add_argument("--tables", type=int, default=4)
    ap.add_argument("--ids", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--distinct", type=int, default=8, help="distinct step groups cycled through")
    ap.add_argument("--wait-quiet", type=float, default=60.0, help="wait up to this long for a quiet machine")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 10 steps of 2,048 ids per table, 1 repetition; a failing configuration fails the run")
    ap.add_argument("--tune-malloc", action="store_true",
                    help="opt in to LogOptions.tune_malloc (process-wide glibc thresholds) for every log opened here")
    ap.add_argument("--processes", type=int, default=0,
                    help="instead of the configurations: N tracker writers in N processes (each its own log) "
                         "together against one alone (the aggregate GB/s ratio, 'scaling')")
    args = ap.parse_args(argv)
    if args.tune_malloc:
        os.environ["PERSISTENT_DELTA_TUNE_MALLOC"] = "1"
    if args.quick:
        args.steps, args.reps, args.distinct, args.ids, args.wait_quiet = 10, 1, 4, 2048, 0.0
    steps = make_steps(args.distinct, args.tables, args.ids, args.dim, seed=7)
    per_step = payload(steps[0])
    total = per_step * args.steps
    root = workdir("append")
    need = 2 * total + (1 << 30)
    if free_bytes(root) < need * max(1, args.processes):
        raise SystemExit(f"not enough disk under {root}: need {need * max(1, args.processes)} bytes free")
    if args.processes:
        if args.processes < 2:
            raise SystemExit("--processes: at least 2")
        try:
            _processes(args, root, total)
        finally:
            rmtree(root)
        return 0

    configs: List[Tuple[str, Optional[Durability], Callable[[str], Any]]] = [
        ("raw_page_cache", None, lambda p: _raw(p, steps, args.steps, False)),
        ("raw_page_cache_aa", None, lambda p: _raw(p, steps, args.steps, False)),
        ("raw_fsync_per_step", None, lambda p: _raw(p, steps, args.steps, True)),
        ("encode_only", None, lambda p: _encode_only(steps, args.steps)),
    ]
    for d in (Durability.ON_FLUSH, Durability.NO_METASYNC, Durability.SYNC):
        configs.append(("store_append_many", d, lambda p, d=d: _store(p, steps, args.steps, d)))
    for d in (Durability.ON_FLUSH, Durability.SYNC):
        configs.append(("log_write_preencoded", d, lambda p, d=d: _log_preencoded(p, steps, args.steps, d)))
    configs.append(("tracker_writer", Durability.ON_FLUSH, lambda p: _tracker_writer(p, steps, args.steps, Durability.ON_FLUSH)))

    results: Dict[Tuple[str, Optional[Durability]], List[Any]] = {(c, d): [] for c, d, _ in configs}
    warm = os.path.join(root, "warmup")
    os.makedirs(warm)
    _raw(warm, steps, min(args.steps, 10), False)  # untimed: first-touch costs of the buffers
    rmtree(warm)
    log("append: %d steps of %.1f MB, %d configurations x %d reps", args.steps, per_step / 1e6, len(configs), args.reps)
    foreign: Dict[Tuple[str, Optional[Durability]], List[float]] = {(c, d): [] for c, d, _ in configs}
    for rep in range(args.reps):
        wait_for_quiet(args.wait_quiet)
        order = configs[rep % len(configs):] + configs[:rep % len(configs)]
        for name, d, fn in order:
            sub = os.path.join(root, f"{name}-{d.value if d else 'raw'}-{rep}")
            os.makedirs(sub)
            gc.collect()
            mon = CpuMonitor()
            try:
                results[(name, d)].append(fn(sub))
                foreign[(name, d)].append(mon.foreign_cpus() or 0.0)
            except Exception as exc:  # noqa: BLE001 - an API change in one config should not stop the rest
                if args.quick:  # ... but a smoke run exists to show it
                    raise
                log("%s %s failed: %r", name, d, exc)
            rmtree(sub)
        log("rep %d done", rep + 1)

    raw = [r for r in results[("raw_page_cache", None)]]
    raw_s = median(raw)
    raw_gbps = total / raw_s / 1e9

    def secs_of(name: str, r: Any) -> float:
        return float(r[0]) if name in ("store_append_many", "tracker_writer") else float(r)
    for name, d, _ in configs:
        rs = results[(name, d)]
        if not rs:
            continue
        extra: Dict[str, Any] = {}
        if name == "store_append_many":
            secs = median([r[0] for r in rs])
            extra["gbps_with_final_flush"] = total / median([r[1] for r in rs]) / 1e9
        elif name == "tracker_writer":
            secs = median([r[0] for r in rs])
            extra["writer_stats"] = rs[-1][1]
        else:
            secs = median(rs)
        gbps = total / secs / 1e9
        # Per repetition, against the raw write of the same repetition (run close in time):
        # robust to load that comes and goes between repetitions.
        per_rep = [raw[i] / secs_of(name, r) for i, r in enumerate(rs) if i < len(raw)]
        rec: Dict[str, Any] = dict(
            config=name,
            durability=d.value if d else None,
            steps=args.steps,
            step_bytes=per_step,
            total_bytes=total,
            reps=len(rs),
            seconds_median=secs,
            ms_per_step=1e3 * secs / args.steps,
            gbps=gbps,
            ratio_to_raw_page_cache=median(per_rep) if per_rep else gbps / raw_gbps,
            ratio_of_medians=gbps / raw_gbps,
            ratio_per_rep=per_rep,
            seconds_per_rep=[secs_of(name, r) for r in rs],
            foreign_cpus_max=max(foreign[(name, d)], default=None),
            **extra,
        )
        if name == "store_append_many" and d == Durability.ON_FLUSH:
            rec["target"] = {"min_ratio": 0.5, "met": rec["ratio_to_raw_page_cache"] >= 0.5}
        emit("append_throughput", **rec, tune_malloc=args.tune_malloc, machine=machine())
    rmtree(root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
