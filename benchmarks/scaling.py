"""How the costs grow: scaling sweeps with plots (issue 34.1).

One thing varies per sweep (``--sweep``); each point runs in a fresh process (so its memory
figures are its own) and prints one JSON line; the sweep writes ``benchmarks/results/scaling-
<sweep>.json`` (every point, plus the fitted log-log slope of each curve) and a PNG beside it,
copied to ``docs/images/`` for docs/scaling.md.

* ``rows``: ids looked up per step, 10^3..10^5 (``--big`` adds 10^6: ~5 s of CPU per step in
  TorchRec's kernels alone here), one table of 4x as many rows, dim 8, uniform ids, EMBEDDING
  mode, a read every 5 steps: untracked vs TorchRec's tracker vs persistent_delta.
* ``table``: table rows 10^6..10^8 at dim 8 with a fixed 10^4 ids per step (all three).
* ``lag``: a consumer reading every L = 10, 30, 100 steps (10^4 ids per step over 400k rows, dim
  16): TorchRec's in-memory store grows with L, the persistent tracker's memory does not (its
  disk does).
* ``ranks``: 1, 2, 4, 8 gloo ranks on CPU (4 tables x 50k rows x dim 16 row-wise, 128 x 8 ids per
  table per rank and step, the same ids on every rank), the three models interleaved in each
  rank; bytes and CPU per rank, not wall time (8 ranks on 2 cores).
* ``consumers``: 1, 4, 16 out-of-process ``DeltaConsumer`` processes reading one trainer's log
  (EMBEDDING, 4 tables x 100k x dim 16, batch 512 x 8) while it trains 40 steps: the trainer's CPU
  per step, each consumer's poll CPU, the bytes it received, the largest file.
* ``loglen``: logs of 10^3..10^5 batches (``LmdbDeltaStore``, one table, 256 ids per batch with
  dim-8 FIRST states): open, a reader's open + a poll of 10 batches from the middle, retention
  (deleting the 10 oldest batches), compaction of 10 batches in the middle (wall and CPU), file
  size.

Measured at each point, where it applies: training-thread CPU per step (``time.thread_time``,
torch at one intra-op thread so that it is the training compute), process CPU per step, the
writer thread's CPU per step, bytes written per step, the read's time (``get_unique``, or a
consumer's poll), resident memory (now and peak), disk.

``python -m benchmarks.scaling --sweep rows`` (or ``--sweep all``); ``--quick`` for a smoke run
with fewer and smaller points; ``--no-plot`` to skip matplotlib; ``--out DIR`` for the results
and plots (default ``benchmarks/results``). ``--smoke`` (the tests' smoke run, implies
``--quick``): only the first point of each sweep, of the DMP points only the ``persistent``
variant (the ``ranks`` child runs all three), smaller (``SMOKE_SIZES``), and by default only the sweeps ``rows``, ``ranks``,
``consumers`` and ``loglen`` (one per kind of child; ``table`` and ``lag`` run the child of
``rows``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
DOC_IMAGES = os.path.join(os.path.dirname(HERE), "docs", "images")
VARIANTS = ("untracked", "torchrec", "persistent")
CONSUMER = "bench"


# ============================================================================ child: DMP points


def _batches(rows: int, batch: int, pooling: int, n: int, seed: int) -> List[Any]:
    """``n`` batches of uniform ids (``torch.randint``: no table-sized sampler, so 10^8 rows fit)."""
    import torch

    from benchmarks._model import DENSE_IN, BatchData

    g = torch.Generator().manual_seed(seed)
    lengths = torch.full((batch,), pooling, dtype=torch.int64)
    return [BatchData(dense=torch.rand(batch, DENSE_IN, generator=g),
                      values=torch.randint(rows, (batch * pooling,), generator=g),
                      lengths=lengths, labels=(torch.rand(batch, generator=g) > 0.5).float())
            for _ in range(n)]


def _attach(variant: str, dmp: Any, root: str, mode: str = "EMBEDDING") -> Any:
    from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode

    if variant == "torchrec":
        return dmp.init_torchrec_delta_tracker(DeltaTrackerConfig(
            tracking_mode=TrackingMode[mode], consumers=[CONSUMER], delete_on_read=True))
    if variant == "persistent":
        from persistent_delta import PersistentTrackerConfig, attach

        return attach(dmp, PersistentTrackerConfig(path=root, tracking_mode=TrackingMode[mode],
                                                   consumers=[CONSUMER], delete_on_read=True, fresh=True))
    return None


def child_dmp(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """One (point, variant): build a one-table DMP, train ``steps`` steps reading every
    ``read_every``, and measure."""
    import gc

    import torch

    from benchmarks._common import dir_bytes, init_single_rank_pg, rmtree, workdir
    from benchmarks._cpu import peak_rss_bytes, rss_bytes, thread_cpu_s, torchrec_store_bytes, writer_threads_of
    from benchmarks._model import Workload, build_dmp, train_step

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    init_single_rank_pg("gloo")
    w = Workload(num_tables=1, rows=cfg["rows"], dim=cfg["dim"], batch=cfg["batch"], pooling=cfg["pooling"])
    rss0 = rss_bytes()
    dmp = build_dmp(w, seed=0)
    gc.collect()
    rss_model = rss_bytes()
    root = workdir("scaling")
    tr = _attach(cfg["variant"], dmp, root)
    period = cfg["read_every"]
    batches = _batches(cfg["rows"], cfg["batch"], cfg["pooling"], min(period, cfg["steps"]), seed=1)
    writers = list(writer_threads_of(tr)) if cfg["variant"] == "persistent" else []
    step_thread = step_proc = step_wall = 0.0
    read_wall: List[float] = []
    read_proc = 0.0
    held_max = 0
    rss_max = 0
    done = 0
    wr0 = 0.0
    warm = cfg["warmup"]
    for k in range(warm + cfg["steps"]):
        if k == warm:
            wr0 = sum(thread_cpu_s(t) for t in writers)
            bytes0 = tr.stats()["bytes_written"] if writers else 0
            rss_max = rss_bytes()
        t0, th0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        train_step(dmp, batches[k % len(batches)])
        t1, th1, p1 = time.perf_counter(), time.thread_time(), time.process_time()
        done += 1
        if k >= warm:
            step_wall += t1 - t0
            step_thread += th1 - th0
            step_proc += p1 - p0
        if tr is not None and done % period == 0:
            if cfg["variant"] == "torchrec":
                held_max = max(held_max, torchrec_store_bytes(tr) or 0)
            rss_max = max(rss_max, rss_bytes())
            r0, rp0 = time.perf_counter(), time.process_time()
            rows = tr.get_unique(CONSUMER)
            if k >= warm:
                read_wall.append(time.perf_counter() - r0)
                read_proc += time.process_time() - rp0
            del rows
    if tr is not None and hasattr(tr, "flush"):
        tr.flush()
    n = cfg["steps"]
    out = dict(cfg)
    out.update(
        step_thread_ms=1e3 * step_thread / n, step_process_ms=1e3 * step_proc / n, step_wall_ms=1e3 * step_wall / n,
        # the library's writer works between steps too: its CPU per step, and the process's
        # CPU per step with the reads and the writer included
        writer_ms=1e3 * (sum(thread_cpu_s(t) for t in writers) - wr0) / n,
        process_all_ms=1e3 * (step_proc + read_proc) / n,
        read_ms=1e3 * (sum(read_wall) / len(read_wall)) if read_wall else None,
        reads=len(read_wall),
        bytes_per_step=((tr.stats()["bytes_written"] - bytes0) / n) if writers else None,
        torchrec_held_bytes=held_max if cfg["variant"] == "torchrec" else None,
        rss_model_bytes=rss_model - rss0, rss_bytes=rss_max, rss_over_model_bytes=rss_max - rss_model,
        peak_rss_bytes=peak_rss_bytes(),
        disk_bytes=dir_bytes(root) if cfg["variant"] == "persistent" else None,
    )
    if tr is not None and hasattr(tr, "close"):
        tr.close()
    rmtree(root)
    return out


# ============================================================================ child: ranks


def _rank_main(rank: int, world: int, port: int, cfg: Dict[str, Any], outdir: str) -> None:
    import datetime
    import gc

    import torch
    import torch.distributed as dist

    from benchmarks._common import dir_bytes
    from benchmarks._cpu import rss_bytes, thread_cpu_s, torchrec_store_bytes, writer_threads_of
    from benchmarks._model import Workload, build_dmp, make_batches, train_step

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))
    w = Workload(num_tables=4, rows=cfg["rows"], dim=cfg["dim"], batch=cfg["batch"], pooling=cfg["pooling"])
    batches = make_batches(w, cfg["read_every"], seed=3, rank=rank)
    dmps = {v: build_dmp(w, seed=0) for v in VARIANTS}
    trackers = {v: _attach(v, dmps[v], os.path.join(outdir, "log")) for v in VARIANTS}
    writers = list(writer_threads_of(trackers["persistent"]))
    acc = {v: {"thread": 0.0, "process": 0.0, "writer": 0.0} for v in VARIANTS}
    block = cfg["read_every"]
    rounds = cfg["rounds"]
    held = 0
    b0 = 0.0
    for r in range(rounds + 1):
        for v in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
            gc.collect()
            dist.barrier()
            wr = sum(thread_cpu_s(t) for t in writers) if v == "persistent" else 0.0
            th0, p0 = time.thread_time(), time.process_time()
            for k in range(block):
                train_step(dmps[v], batches[k])
            if v == "torchrec":
                held = max(held, torchrec_store_bytes(trackers[v]) or 0)
            if trackers[v] is not None:
                trackers[v].get_unique(CONSUMER)
            if r == 0:
                if v == "persistent":
                    b0 = trackers[v].stats()["bytes_written"]
                continue
            acc[v]["thread"] += time.thread_time() - th0
            acc[v]["process"] += time.process_time() - p0
            if v == "persistent":
                acc[v]["writer"] += sum(thread_cpu_s(t) for t in writers) - wr
    steps = rounds * block
    res = {"rank": rank, "world": world,
           **{f"{v}_{k}_ms": 1e3 * acc[v][k] / steps for v in VARIANTS for k in ("thread", "process")},
           "persistent_writer_ms": 1e3 * acc["persistent"]["writer"] / steps,
           "bytes_per_step": (trackers["persistent"].stats()["bytes_written"] - b0) / steps,
           "torchrec_held_bytes": held, "rss_bytes": rss_bytes()}
    trackers["persistent"].close()
    res["disk_bytes"] = dir_bytes(os.path.join(outdir, "log", f"rank-{rank}"))
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def child_ranks(cfg: Dict[str, Any]) -> Dict[str, Any]:
    import socket

    import torch.multiprocessing as mp

    from benchmarks._common import rmtree, workdir

    outdir = workdir("scaling-ranks")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = cfg["ranks"]
    mp.spawn(_rank_main, args=(world, port, cfg, outdir), nprocs=world, join=True)
    per = [json.load(open(os.path.join(outdir, f"rank{r}.json"))) for r in range(world)]
    rmtree(outdir)
    out = dict(cfg)
    for key in per[0]:
        if key in ("rank", "world"):
            continue
        out[key] = sum(p[key] for p in per) / world  # mean per rank
    out["total_bytes_per_step"] = sum(p["bytes_per_step"] for p in per)
    return out


# ============================================================================ child: consumers


def consumer_main(root: str, name: str, stop_file: str, out_file: str) -> None:
    """A consumer process: poll with a timeout, commit, until ``stop_file`` exists and the log
    is drained; writes its poll statistics to ``out_file``."""
    import torch

    from persistent_delta.read.consumer import DeltaConsumer

    torch.set_num_threads(1)
    c = DeltaConsumer(root, name, wait=60.0)
    open(out_file + ".ready", "w").close()
    polls = batches = 0
    ranges: List[Any] = []  # the first polls' (start, end) of rank 0, for a look at them
    cpu = wall = 0.0
    nbytes = 0
    while True:
        t0, c0 = time.perf_counter(), time.thread_time()
        p = c.poll(timeout=0.2)
        if not p.empty:
            batches += max(r.end_idx - r.start_idx for r in p.ranks.values())
            if len(ranges) < 40:
                ranges.append([(r.start_idx, r.end_idx) for r in p.ranks.values()][0])
            for d in p.merged().values():
                nbytes += sum(t.numel() * t.element_size() for t in (d.global_ids, d.states) if t is not None)
            c.commit()
            cpu += time.thread_time() - c0
            wall += time.perf_counter() - t0
            polls += 1
        elif os.path.exists(stop_file):
            break
    c.close()
    with open(out_file, "w") as f:
        json.dump({"polls": polls, "batches": batches, "poll_cpu_s": cpu, "poll_wall_s": wall, "bytes": nbytes,
                   "ranges": ranges}, f)


def child_consumers(cfg: Dict[str, Any]) -> Dict[str, Any]:
    import gc

    import torch

    from benchmarks._common import init_single_rank_pg, rmtree, workdir
    from benchmarks._cpu import rss_bytes, thread_cpu_s, writer_threads_of
    from benchmarks._model import Workload, build_dmp, make_batches, train_step

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    init_single_rank_pg("gloo")
    w = Workload(num_tables=4, rows=100_000, dim=16, batch=512, pooling=8)
    dmp = build_dmp(w, seed=0)
    batches = make_batches(w, 10, seed=2)
    root = workdir("scaling-consumers")
    tr = _attach("persistent", dmp, root)
    train_step(dmp, batches[0])
    tr.flush()
    stop = os.path.join(root, "stop")
    procs = []
    outs = []
    for i in range(cfg["consumers"]):
        out = os.path.join(root, f"c{i}.json")
        outs.append(out)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "benchmarks.scaling", "--consumer-child", json.dumps([root, f"c{i}", stop, out])],
            cwd=os.path.dirname(HERE)))
    deadline = time.monotonic() + 300
    while not all(os.path.exists(o + ".ready") for o in outs):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError("consumers did not start")
        time.sleep(0.2)
    writers = list(writer_threads_of(tr))
    gc.collect()
    wr0 = sum(thread_cpu_s(t) for t in writers)
    th0, p0, t0 = time.thread_time(), time.process_time(), time.perf_counter()
    size_max = 0
    data = os.path.join(tr.path, "data.mdb")
    for k in range(cfg["steps"]):
        train_step(dmp, batches[k % len(batches)])
        if (k + 1) % 10 == 0:
            tr.get_unique(CONSUMER)
            size_max = max(size_max, os.path.getsize(data))
        if cfg.get("pace_ms"):
            time.sleep(cfg["pace_ms"] / 1e3)
    n = cfg["steps"]
    res = dict(cfg)
    res.update(step_thread_ms=1e3 * (time.thread_time() - th0) / n,
               process_ms=1e3 * (time.process_time() - p0) / n,
               writer_ms=1e3 * (sum(thread_cpu_s(t) for t in writers) - wr0) / n,
               wall_ms=1e3 * (time.perf_counter() - t0) / n,
               bytes_per_step=tr.stats()["bytes_written"] / (n + 1),
               file_bytes_max=size_max, rss_bytes=rss_bytes())
    tr.flush()
    open(stop, "w").close()
    for p in procs:
        p.wait(timeout=300)
    stats = [json.load(open(o)) for o in outs]
    res["consumer_poll_cpu_ms_per_poll"] = 1e3 * sum(s["poll_cpu_s"] for s in stats) / max(1, sum(s["polls"] for s in stats))
    res["consumer_poll_wall_ms_per_poll"] = 1e3 * sum(s["poll_wall_s"] for s in stats) / max(1, sum(s["polls"] for s in stats))
    res["consumer_poll_cpu_ms_per_step"] = 1e3 * sum(s["poll_cpu_s"] for s in stats) / len(stats) / n
    res["consumer_polls"] = sum(s["polls"] for s in stats) / len(stats)
    res["consumer_batches"] = sum(s["batches"] for s in stats) / len(stats)  # batches a consumer's polls moved over
    res["consumer_bytes_per_step"] = sum(s["bytes"] for s in stats) / len(stats) / n  # merged bytes it received
    res["consumer0_first_ranges"] = stats[0]["ranges"]
    res["file_bytes_end"] = os.path.getsize(data)
    tr.close()
    rmtree(root)
    return res


# ============================================================================ child: log length


def child_loglen(cfg: Dict[str, Any]) -> Dict[str, Any]:
    import torch
    from torchrec.distributed.model_tracker.types import UpdateMode

    from benchmarks._common import rmtree, workdir
    from benchmarks._cpu import rss_bytes
    from persistent_delta.log.records import AppendRecord
    from persistent_delta.log.position_rules import safe_compact
    from persistent_delta.read.consumer import DeltaReader
    from persistent_delta.adapters.delta_store import LmdbDeltaStore

    torch.set_num_threads(1)
    n, ids_per, dim = cfg["batches"], cfg["ids"], cfg["dim"]
    root = workdir("scaling-loglen")
    path = os.path.join(root, "rank-0")
    g = torch.Generator().manual_seed(0)
    pool_ids = [torch.unique(torch.randint(100_000, (ids_per,), generator=g)) for _ in range(16)]
    states = [torch.rand(int(i.numel()), dim, generator=g) for i in pool_ids]
    store = LmdbDeltaStore(path, UpdateMode.FIRST)
    t0 = time.perf_counter()
    group = 200
    for s in range(0, n, group):
        store.append_many([AppendRecord(b, "t0", pool_ids[b % 16], states[b % 16]) for b in range(s, min(n, s + group))])
    write_s = time.perf_counter() - t0
    store.close()
    size = os.path.getsize(os.path.join(path, "data.mdb"))
    reps = cfg["reps"]

    cpu: Dict[str, float] = {}

    def timed(fn: Callable[[], Any], name: str) -> float:
        ts, cs = [], []
        for _ in range(reps):
            t, c = time.perf_counter(), time.thread_time()
            fn()
            ts.append(time.perf_counter() - t)
            cs.append(time.thread_time() - c)
        cpu[name] = 1e3 * sorted(cs)[len(cs) // 2]
        return sorted(ts)[len(ts) // 2]

    def open_close() -> None:
        LmdbDeltaStore(path, UpdateMode.FIRST, readonly=True).close()

    open_s = timed(open_close, "open_cpu_ms")
    mid = n // 2
    rss0 = rss_bytes()

    def consumer_poll() -> None:
        c = DeltaReader(root, start=mid)
        p = c.poll(max_batches=10)
        p.merged()
        c.close()

    poll_s = timed(consumer_poll, "poll_middle_cpu_ms")
    rss_poll = rss_bytes() - rss0
    store = LmdbDeltaStore(path, UpdateMode.FIRST)
    # retention: the 10 oldest batches at a time; compaction: 10 batches in the middle at a time
    dels, dels_cpu = [], []
    for k in range(reps):
        t, c = time.perf_counter(), time.thread_time()
        store.delete(up_to_idx=10 * (k + 1))
        dels.append(time.perf_counter() - t)
        dels_cpu.append(time.thread_time() - c)
    cpu["retention_cpu_ms"] = 1e3 * sorted(dels_cpu)[len(dels_cpu) // 2]
    comps, comps_cpu = [], []
    merged = 0
    for k in range(reps):
        s = mid + 10 * k
        t, c = time.perf_counter(), time.thread_time()
        got = store.log.write(lambda w, s=s: safe_compact(w, UpdateMode.FIRST, s, s + 10))
        comps.append(time.perf_counter() - t)
        comps_cpu.append(time.thread_time() - c)
        merged += sum(got.values())
    cpu["compaction_cpu_ms"] = 1e3 * sorted(comps_cpu)[len(comps_cpu) // 2]
    store.close()
    rmtree(root)
    out = dict(cfg)
    out.update(write_s_per_batch=write_s / n, file_bytes=size, file_bytes_per_batch=size / n,
               open_ms=1e3 * open_s, poll_middle_ms=1e3 * poll_s, poll_rss_bytes=rss_poll,
               retention_ms=1e3 * sorted(dels)[len(dels) // 2], compaction_ms=1e3 * sorted(comps)[len(comps) // 2],
               compaction_records_merged=merged, **cpu)
    return out


# ============================================================================ parent: sweeps


def _run_child(kind: str, cfg: Dict[str, Any], timeout: float = 900) -> Dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.scaling", "--child", kind, json.dumps(cfg)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=os.path.dirname(HERE), capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        sys.stderr.write(p.stderr[-3000:])
        raise RuntimeError(f"point {kind} {cfg} failed ({p.returncode})")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"[scaling] {kind} {cfg} -> done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return res


Point = Tuple[str, Dict[str, Any], float]  # (child kind, configuration, timeout)


def sweep_rows(quick: bool) -> List[Point]:
    # 10^6 ids per step costs ~5 s of CPU per step in TorchRec's CPU kernels alone here: out
    # of reach with other jobs on 2 cores (it is extrapolated in docs/scaling.md); --big adds it
    pts = [1_000, 10_000] if quick else [1_000, 10_000, 100_000] + ([1_000_000] if BIG else [])
    return [("dmp", dict(variant=v, x=n, rows=4 * n, dim=8, batch=min(n, 1000), pooling=max(1, n // 1000),
                         steps=10, warmup=2, read_every=5), 1800)
            for n in pts for v in VARIANTS]


def sweep_table(quick: bool) -> List[Point]:
    pts = [10 ** 6, 10 ** 7] if quick else [10 ** 6, 10 ** 7, 10 ** 8]
    return [("dmp", dict(variant=v, x=n, rows=n, dim=8, batch=1000, pooling=10, steps=20, warmup=5,
                         read_every=10), 1800)
            for n in pts for v in VARIANTS]


def sweep_lag(quick: bool) -> List[Point]:
    pts = [10, 30] if quick else [10, 30, 100]
    return [("dmp", dict(variant=v, x=L, rows=400_000, dim=16, batch=1000, pooling=10, steps=max(L, 20),
                         warmup=0, read_every=L), 1800)
            for L in pts for v in ("torchrec", "persistent")]


def sweep_ranks(quick: bool) -> List[Point]:
    pts = [1, 2] if quick else [1, 2, 4, 8]
    return [("ranks", dict(x=n, ranks=n, rows=50_000, dim=16, batch=128, pooling=8, read_every=10, rounds=2), 1800)
            for n in pts]


def sweep_consumers(quick: bool) -> List[Point]:
    pts = [1, 2] if quick else [1, 4, 16]
    return [("consumers", dict(x=k, consumers=k, steps=40), 1800) for k in pts]


def sweep_loglen(quick: bool) -> List[Point]:
    pts = [1_000, 10_000] if quick else [1_000, 10_000, 100_000]
    return [("loglen", dict(x=n, batches=n, ids=256, dim=8, reps=5), 900) for n in pts]


BIG = False
SWEEPS: Dict[str, Callable[[bool], List[Point]]] = {
    "rows": sweep_rows, "table": sweep_table, "lag": sweep_lag, "ranks": sweep_ranks,
    "consumers": sweep_consumers, "loglen": sweep_loglen,
}

# sweep -> (x label, panels: (title, [(series label, variant or None, key)], y label))
PANELS: Dict[str, Any] = {
    "rows": ("ids looked up per step", [
        ("CPU per step", [("untracked: training thread", "untracked", "step_thread_ms"),
                          ("TorchRec: training thread", "torchrec", "step_thread_ms"),
                          ("persistent: training thread", "persistent", "step_thread_ms"),
                          ("persistent: writer thread", "persistent", "writer_ms")], "ms"),
        ("a read (get_unique): process CPU", [("TorchRec", "torchrec", "read_cpu_ms"),
                                              ("persistent", "persistent", "read_cpu_ms")], "ms"),
        ("bytes", [("persistent: written per step", "persistent", "bytes_per_step"),
                   ("persistent: disk", "persistent", "disk_bytes"),
                   ("TorchRec: held in memory (max)", "torchrec", "torchrec_held_bytes")], "bytes"),
        ("memory over the model (RSS)", [("untracked", "untracked", "rss_over_model_bytes"),
                                         ("TorchRec", "torchrec", "rss_over_model_bytes"),
                                         ("persistent", "persistent", "rss_over_model_bytes")], "bytes")]),
    "table": ("table rows (dim 8; 10^4 ids per step)", None),
    "lag": ("steps between a consumer's reads", [
        ("memory held for the consumer", [("TorchRec: store (ids + states)", "torchrec", "torchrec_held_bytes"),
                                          ("TorchRec: RSS over the model", "torchrec", "rss_over_model_bytes"),
                                          ("persistent: RSS over the model", "persistent", "rss_over_model_bytes"),
                                          ("persistent: disk", "persistent", "disk_bytes")], "bytes"),
        ("CPU per step", [("TorchRec: training thread", "torchrec", "step_thread_ms"),
                          ("persistent: training thread", "persistent", "step_thread_ms"),
                          ("persistent: writer thread", "persistent", "writer_ms")], "ms"),
        ("a read (get_unique): process CPU", [("TorchRec", "torchrec", "read_cpu_ms"),
                                              ("persistent", "persistent", "read_cpu_ms")], "ms")]),
    "ranks": ("ranks (gloo on CPU, weak scaling)", [
        ("CPU per step per rank", [("untracked: training thread", None, "untracked_thread_ms"),
                                   ("TorchRec: training thread", None, "torchrec_thread_ms"),
                                   ("persistent: training thread", None, "persistent_thread_ms"),
                                   ("persistent: writer thread", None, "persistent_writer_ms")], "ms"),
        ("bytes per step", [("per rank", None, "bytes_per_step"), ("whole job", None, "total_bytes_per_step")], "bytes"),
        ("memory per rank", [("TorchRec held", None, "torchrec_held_bytes"), ("RSS (3 models)", None, "rss_bytes"),
                             ("persistent disk", None, "disk_bytes")], "bytes")]),
    "consumers": ("out-of-process consumers", [
        ("trainer CPU per step", [("training thread", None, "step_thread_ms"), ("writer thread", None, "writer_ms"),
                                  ("process", None, "process_ms")], "ms"),
        ("consumers", [("CPU per trainer step, each consumer", None, "consumer_poll_cpu_ms_per_step"),
                       ("poll CPU per poll (mean)", None, "consumer_poll_cpu_ms_per_poll"),
                       ("poll wall per poll (mean)", None, "consumer_poll_wall_ms_per_poll")], "ms"),
        ("disk and memory", [("largest file", None, "file_bytes_max"), ("trainer RSS", None, "rss_bytes")], "bytes")]),
    "loglen": ("batches in the log", [
        ("wall time (shared machine)", [("open", None, "open_ms"),
                                        ("reader open + poll 10 from the middle", None, "poll_middle_ms"),
                                        ("retention: delete the 10 oldest", None, "retention_ms"),
                                        ("compact 10 in the middle", None, "compaction_ms")], "ms"),
        ("CPU time (thread)", [("open", None, "open_cpu_ms"),
                               ("reader open + poll 10 from the middle", None, "poll_middle_cpu_ms"),
                               ("retention: delete the 10 oldest", None, "retention_cpu_ms"),
                               ("compact 10 in the middle", None, "compaction_cpu_ms")], "ms"),
        ("disk", [("file", None, "file_bytes"), ("file per batch", None, "file_bytes_per_batch")], "bytes")]),
}
PANELS["table"] = (PANELS["table"][0], PANELS["rows"][1])


def _value(p: Dict[str, Any], key: str) -> Optional[float]:
    if key == "read_cpu_ms" and p.get("reads"):
        # the process CPU of the reads, per read (wall is meaningless on a shared machine)
        return (p["process_all_ms"] - p["step_process_ms"]) * p["steps"] / p["reads"]
    return p.get(key)


def _series(points: Sequence[Dict[str, Any]], variant: Optional[str], key: str) -> List[Any]:
    xs, ys = [], []
    for p in points:
        if variant is not None and p.get("variant") != variant:
            continue
        y = _value(p, key)
        if y is None or y <= 0:
            continue
        xs.append(p["x"])
        ys.append(y)
    return [xs, ys]


def slope(xs: Sequence[float], ys: Sequence[float]) -> Optional[float]:
    """Least-squares slope of log y over log x: the exponent of the growth law (1: linear)."""
    if len(xs) < 2:
        return None
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return None if den == 0 else sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / den


def fit_all(name: str, points: Sequence[Dict[str, Any]]) -> Dict[str, Optional[float]]:
    out: Dict[str, Optional[float]] = {}
    for _title, series, _unit in PANELS[name][1]:
        for label, variant, key in series:
            xs, ys = _series(points, variant, key)
            out[label + f" [{key}]"] = slope(xs, ys)
    return out


def plot(name: str, points: Sequence[Dict[str, Any]], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xlabel, panels = PANELS[name]
    cols = min(2, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.0 * cols, 4.3 * nrows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(panels):]:
        ax.set_visible(False)
    for ax, (title, series, unit) in zip(flat, panels):
        for label, variant, key in series:
            xs, ys = _series(points, variant, key)
            if xs:
                s = slope(xs, ys)
                ax.plot(xs, ys, marker="o", label=label + (f" (slope {s:.2f})" if s is not None else ""))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(unit)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"persistent_delta scaling: {name} (2-core shared VM; log-log)", fontsize=11)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


SMOKE_SWEEPS = ("rows", "ranks", "consumers", "loglen")  # one per kind of child
SMOKE_SIZES = {"ranks": {"rows": 5_000}, "consumers": {"steps": 20}, "loglen": {"batches": 200, "reps": 2}}


def run_sweep(name: str, quick: bool, do_plot: bool, out: str = RESULTS, smoke: bool = False) -> None:
    """Run the points one by one, rewriting the results file after each (a sweep cut short
    keeps what it measured), then fit and plot (into ``out``). ``smoke``: the first point only
    (of a DMP point, only its ``persistent`` variant)."""
    from benchmarks._common import machine

    t0 = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"scaling-{name}{'-quick' if quick else ''}.json")
    points: List[Dict[str, Any]] = []
    res: Dict[str, Any] = {}
    todo = SWEEPS[name](quick)
    if smoke:
        todo = [(kind, {**cfg, **SMOKE_SIZES.get(kind, {})}, timeout) for kind, cfg, timeout in todo
                if cfg["x"] == todo[0][1]["x"] and cfg.get("variant", "persistent") == "persistent"]
    for kind, cfg, timeout in todo:
        points.append(_run_child(kind, cfg, timeout))
        res = {"sweep": name, "quick": quick, "points": points, "slopes": fit_all(name, points),
               "wall_s": time.perf_counter() - t0, "machine": machine()}
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps({"bench": "scaling", "sweep": name, "slopes": res["slopes"], "results": path}), flush=True)
    if do_plot:
        png = path[:-5] + ".png"
        plot(name, points, png)
        if not quick:
            os.makedirs(DOC_IMAGES, exist_ok=True)
            shutil.copy(png, os.path.join(DOC_IMAGES, os.path.basename(png)))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", default=None, help=",".join(SWEEPS) + " or all")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--big", action="store_true", help="add the 10^6 ids per step point to --sweep rows")
    ap.add_argument("--replot", default=None, help="redraw the PNG of a results JSON file")
    ap.add_argument("--out", default=RESULTS, help="directory of the results and plots (default: benchmarks/results)")
    ap.add_argument("--smoke", action="store_true",
                    help="smoke run (implies --quick): the first point of each sweep; default sweeps "
                         + ",".join(SMOKE_SWEEPS))
    ap.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--consumer-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        import warnings

        warnings.filterwarnings("ignore")
        kind, cfg = args.child[0], json.loads(args.child[1])
        fn = {"dmp": child_dmp, "ranks": child_ranks, "consumers": child_consumers, "loglen": child_loglen}[kind]
        print(json.dumps(fn(cfg)), flush=True)
        return 0
    if args.consumer_child:
        consumer_main(*json.loads(args.consumer_child))
        return 0
    if args.replot:
        res = json.load(open(args.replot))
        res["slopes"] = fit_all(res["sweep"], res["points"])
        with open(args.replot, "w") as f:
            json.dump(res, f, indent=1)
        png = args.replot[:-5] + ".png"
        plot(res["sweep"], res["points"], png)
        if not res.get("quick"):
            os.makedirs(DOC_IMAGES, exist_ok=True)
            shutil.copy(png, os.path.join(DOC_IMAGES, os.path.basename(png)))
        return 0
    global BIG
    BIG = args.big
    if args.smoke:
        args.quick = True
    if args.sweep is None and args.smoke:
        names = list(SMOKE_SWEEPS)
    else:
        names = list(SWEEPS) if args.sweep in (None, "all") else args.sweep.split(",")
    for name in names:
        run_sweep(name, args.quick, not args.no_plot, args.out, args.smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
