"""Step overhead of tracking: untracked vs TorchRec's tracker vs persistent_delta (issue 4a).

Three identical DMPs (``benchmarks._model``: 4 EC tables x 200k rows x dim 64, batch 2048,
pooling 8, Zipf ids, fused EXACT_ROWWISE_ADAGRAD, bottom/top MLPs) train on the same batches:

* ``untracked``: no tracker;
* ``torchrec``: ``dmp.init_torchrec_delta_tracker(DeltaTrackerConfig(...))``;
* ``persistent``: ``persistent_delta.attach(dmp, PersistentTrackerConfig(path=..., ...))``.

Both trackers have one consumer and ``delete_on_read`` (TorchRec's default) and are read with
``get_unique(consumer)`` every ``--read-every`` steps; that read is part of the step it follows,
so the mean step time is the training throughput with periodic reads included.

Steps are interleaved in blocks of ``--block`` steps per model, and the order of the three
models is rotated every round. The default block equals the read period, so every block ends
with a ``get_unique``, which drains persistent_delta's background writer: all the work the
persistent variant causes (including its writer thread's CPU) falls inside its own timed block
instead of slowing down whichever model runs next. ``--block 1`` interleaves single steps (the
writer then overlaps the other models' steps, which flatters persistent_delta on 2 cores).

One rank (world size 1, gloo process group in this process): on a 2-core machine a second
rank only adds scheduler noise. Denormals are flushed (``torch.set_flush_denormal``): without
it fbgemm's CPU row-wise Adagrad backward slows down 6x after a few steps as the row-wise
state and the updates underflow, which swamps every other effect.

Other processes on the machine are watched (``/proc/stat``): each mode first waits up to
``--wait-quiet`` seconds for a quiet machine, the JSON reports ``foreign_cpus`` (CPUs used by
other processes during the run), and ``ratios_by_mean_quiet_rounds`` recomputes the ratios
over the rounds during which other processes used less than ``--noisy-cpus`` CPUs (a round
holds one block of every model, so dropping whole rounds keeps the comparison fair), and
``ratios_median_of_rounds`` is the median over rounds of the per-round ratio (robust to bursts).

``--device cuda`` runs the three models on this process's GPU (a one-rank NCCL group; the
CUDA builds of torch and fbgemm-gpu: docs/gpu-check.md); each timed step then ends with
``torch.cuda.synchronize()``, so a step's time is its GPU time, not its launch time.

``--null`` attaches no tracker at all (an A/A run): the three ratios should then be 1.0, and
their spread is the noise floor of the comparison on this machine.

``--metrics`` has the persistent tracker serve its Prometheus metrics
(:func:`persistent_delta.ops.metrics.serve_metrics`) and scrapes them every ``--scrape-every``
seconds from a thread of the same process for the whole run: compare its ratios with a run
without it.

Prints one JSON line per tracking mode. ``--cprofile DIR`` writes cProfile stats of the
persistent model's training-thread time (``DIR/step_<mode>.prof``).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import statistics
import time
from typing import Any, Dict, List, Optional

import torch
from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode

from benchmarks._common import (
    CpuMonitor,
    Stats,
    emit,
    init_single_rank_pg,
    log,
    machine,
    ratio,
    rmtree,
    wait_for_quiet,
    workdir,
)
from benchmarks._model import Workload, build_dmp, make_batches, train_step

VARIANTS = ("untracked", "torchrec", "persistent")
CONSUMER = "bench"
TARGETS = {
    # mode -> {ratio name: max}
    "EMBEDDING": {"persistent/untracked": 1.10, "persistent/torchrec": 0.85},
    "ID_ONLY": {"persistent/untracked": 1.03},
}


def _attach(variant: str, dmp: Any, mode: TrackingMode, root: str, durability: Optional[str], null: bool = False) -> Any:
    if variant == "untracked" or null:
        return None
    if variant == "torchrec":
        return dmp.init_torchrec_delta_tracker(
            DeltaTrackerConfig(tracking_mode=mode, consumers=[CONSUMER], delete_on_read=True)
        )
    from persistent_delta import PersistentTrackerConfig, attach

    kw: Dict[str, Any] = {}
    if durability:
        kw["durability"] = durability
    return attach(
        dmp,
        PersistentTrackerConfig(
            path=root, tracking_mode=mode, consumers=[CONSUMER], delete_on_read=True, fresh=True, **kw
        ),
    )


def run_mode(mode: TrackingMode, args: argparse.Namespace, w: Workload) -> Dict[str, Any]:
    root = workdir(f"step-{mode.name.lower()}")
    total = args.warmup + args.steps
    log("%s: building %d batches and 3 DMPs", mode.name, total)
    batches = make_batches(w, total, seed=args.seed, device=args.device)
    dmps = {v: build_dmp(w, seed=args.seed, device=args.device) for v in VARIANTS}
    trackers = {v: _attach(v, dmps[v], mode, root, args.durability, args.null) for v in VARIANTS}
    scraper = _Scraper(trackers["persistent"], args.scrape_every) if args.metrics and trackers["persistent"] else None
    times: Dict[str, List[float]] = {v: [] for v in VARIANTS}
    reads: Dict[str, List[float]] = {v: [] for v in VARIANTS}
    done = {v: 0 for v in VARIANTS}
    prof = cProfile.Profile() if args.cprofile else None

    def one_step(v: str, i: int, record: bool) -> None:
        dmp, tr = dmps[v], trackers[v]
        profile = prof is not None and v == "persistent" and record
        t0 = time.perf_counter()
        if profile:
            prof.enable()
        train_step(dmp, batches[i])
        done[v] += 1
        tr_s = 0.0
        if tr is not None and done[v] % args.read_every == 0:
            t1 = time.perf_counter()
            rows = tr.get_unique(CONSUMER)
            tr_s = time.perf_counter() - t1
            del rows
        if args.device == "cuda":
            torch.cuda.synchronize()  # (the step's GPU work, not its launch, is what is timed)
        if profile:
            prof.disable()
        dt = time.perf_counter() - t0
        if record:
            times[v].append(dt)
            if tr is not None and tr_s:
                reads[v].append(tr_s)

    block = args.block
    rounds_warm = -(-args.warmup // block)
    rounds = args.steps // block
    quiet_before = wait_for_quiet(args.wait_quiet)
    whole = CpuMonitor()
    round_times: List[Dict[str, float]] = []  # per timed round: variant -> seconds
    round_foreign: List[float] = []
    t_start = time.perf_counter()
    for r in range(rounds_warm + rounds):
        record = r >= rounds_warm
        order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
        base = r * block
        mon = CpuMonitor()
        before = {v: len(times[v]) for v in VARIANTS}
        for v in order:
            for k in range(block):
                one_step(v, min(base + k, total - 1), record)
        if record:
            round_times.append({v: sum(times[v][before[v]:]) for v in VARIANTS})
            round_foreign.append(mon.foreign_cpus() or 0.0)
        if record and (r - rounds_warm) % max(1, rounds // 5) == 0:
            log("%s: round %d/%d, mean so far %s ms", mode.name, r - rounds_warm + 1, rounds,
                {v: round(1e3 * sum(t) / max(1, len(t)), 1) for v, t in times.items()})
    wall = time.perf_counter() - t_start
    foreign = whole.foreign_cpus()
    quiet = [rt for rt, f in zip(round_times, round_foreign) if f < args.noisy_cpus]

    stats = {v: Stats.of(times[v]) for v in VARIANTS}
    scrapes = scraper.close() if scraper is not None else 0
    pers = trackers["persistent"]
    writer_stats = pers.stats() if hasattr(pers, "stats") else {}
    log_bytes = _file_size(os.path.join(pers.path, "data.mdb")) if pers is not None else 0
    for v in ("torchrec", "persistent"):
        tr = trackers[v]
        if hasattr(tr, "close"):
            tr.close()
    if prof is not None:
        os.makedirs(args.cprofile, exist_ok=True)
        out = os.path.join(args.cprofile, f"step_{mode.name}.prof")
        prof.dump_stats(out)
        log("cProfile of the persistent model's training thread: %s", out)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(r"persistent_delta", 25)
    del dmps, trackers
    gc.collect()
    rmtree(root)

    m = {v: stats[v].mean_s for v in VARIANTS}
    md = {v: stats[v].median_s for v in VARIANTS}
    ratios = {
        "persistent/untracked": ratio(m["persistent"], m["untracked"]),
        "persistent/torchrec": ratio(m["persistent"], m["torchrec"]),
        "torchrec/untracked": ratio(m["torchrec"], m["untracked"]),
    }
    median_ratios = {
        "persistent/untracked": ratio(md["persistent"], md["untracked"]),
        "persistent/torchrec": ratio(md["persistent"], md["torchrec"]),
        "torchrec/untracked": ratio(md["torchrec"], md["untracked"]),
    }
    quiet_ratios: Optional[Dict[str, Optional[float]]] = None
    if quiet:
        q = {v: sum(rt[v] for rt in quiet) for v in VARIANTS}
        quiet_ratios = {
            "persistent/untracked": ratio(q["persistent"], q["untracked"]),
            "persistent/torchrec": ratio(q["persistent"], q["torchrec"]),
            "torchrec/untracked": ratio(q["torchrec"], q["untracked"]),
        }
    # Noise-robust: each round holds one block (with its get_unique) of every model, run
    # back to back, so the per-round ratio is a throughput ratio; bursts of foreign load hit
    # a few rounds, and the median over rounds ignores them.
    def _round_median(a: str, b: str) -> Optional[float]:
        rs = [rt[a] / rt[b] for rt in round_times if rt[b] > 0]
        return statistics.median(rs) if rs else None

    round_median_ratios = {
        "persistent/untracked": _round_median("persistent", "untracked"),
        "persistent/torchrec": _round_median("persistent", "torchrec"),
        "torchrec/untracked": _round_median("torchrec", "untracked"),
    }
    targets = {
        name: {"max": lim, "value": ratios[name], "met": ratios[name] is not None and ratios[name] <= lim}
        for name, lim in TARGETS.get(mode.name, {}).items()
    }
    return emit(
        "step_overhead",
        mode=mode.name,
        null_run=args.null,
        device=args.device,
        metrics=bool(args.metrics),
        metrics_scrapes=scrapes,
        world_size=1,
        steps=stats["untracked"].n,
        warmup=args.warmup,
        block=block,
        read_every=args.read_every,
        workload=vars(w) if hasattr(w, "__dict__") else str(w),
        mean_ms={v: 1e3 * m[v] for v in VARIANTS},
        median_ms={v: 1e3 * md[v] for v in VARIANTS},
        p90_ms={v: 1e3 * stats[v].p90_s for v in VARIANTS},
        get_unique_ms={v: 1e3 * sum(reads[v]) / len(reads[v]) for v in VARIANTS if reads[v]},
        ratios_by_mean=ratios,
        ratios_by_median=median_ratios,
        ratios_by_mean_quiet_rounds=quiet_ratios,
        ratios_median_of_rounds=round_median_ratios,
        quiet_rounds=len(quiet),
        rounds=len(round_times),
        foreign_cpus=foreign,
        foreign_cpus_before=quiet_before,
        targets=targets,
        persistent_writer=writer_stats,
        persistent_log_bytes=log_bytes,
        wall_s=wall,
        machine=machine(),
    )


class _Scraper:
    """``--metrics``: the persistent tracker serves its metrics (``serve_metrics(tracker=...)``)
    and a thread scrapes them every ``every`` seconds, as Prometheus would, for the whole run."""

    def __init__(self, tracker: Any, every: float) -> None:
        import threading
        import urllib.request

        from persistent_delta.ops.metrics import serve_metrics

        self.server = serve_metrics(tracker=tracker, job="bench", port=0)
        self.stop = threading.Event()
        self.scrapes = 0
        url = f"http://127.0.0.1:{self.server.port}/metrics"

        def scrape() -> None:
            while not self.stop.wait(every):
                with urllib.request.urlopen(url, timeout=10) as resp:
                    resp.read()
                self.scrapes += 1

        self.thread = threading.Thread(target=scrape, name="bench-scraper", daemon=True)
        self.thread.start()

    def close(self) -> int:
        self.stop.set()
        self.thread.join()
        self.server.close()
        return self.scrapes


def _file_size(p: str) -> int:
    try:
        return os.path.getsize(p)
    except OSError:
        return 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="ID_ONLY,EMBEDDING,ROWWISE_ADAGRAD")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per model (after warmup)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--read-every", type=int, default=10)
    ap.add_argument("--block", type=int, default=None, help="steps per model before switching (default: --read-every)")
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--sharding", default="row_wise", choices=["row_wise", "table_wise"])
    ap.add_argument("--durability", default=None, help="persistent_delta durability (default: its default)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the models train (cuda: a one-rank NCCL group on the current GPU)")
    ap.add_argument("--cprofile", default=None, metavar="DIR")
    ap.add_argument("--null", action="store_true",
                    help="A/A run: no tracker on any model (the ratios then show the method's noise floor)")
    ap.add_argument("--wait-quiet", type=float, default=300.0,
                    help="wait up to this many seconds for other processes to go quiet before each mode")
    ap.add_argument("--noisy-cpus", type=float, default=0.3,
                    help="a round during which other processes used more CPUs than this is 'noisy'")
    ap.add_argument("--metrics", action="store_true",
                    help="the persistent tracker serves Prometheus metrics, scraped every --scrape-every seconds")
    ap.add_argument("--scrape-every", type=float, default=1.0, help="seconds between scrapes with --metrics")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 10 steps after 5, 10k rows, batch 128, a read every 5 steps")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.rows, args.batch, args.wait_quiet = 10, 5, 10_000, 128, 0.0
        args.read_every = 5
    if args.block is None:
        args.block = args.read_every
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    init_single_rank_pg("nccl" if args.device == "cuda" else "gloo")
    w = Workload(rows=args.rows, batch=args.batch, sharding=args.sharding)
    for name in args.modes.split(","):
        run_mode(TrackingMode[name.strip()], args, w)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
