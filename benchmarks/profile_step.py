"""Train one model with one tracker, for profilers (not part of ``run_all``).

    py-spy record --threads --idle -f raw -o out.txt -- \
        python -m benchmarks.profile_step --tracker persistent --mode EMBEDDING --steps 200
    python -m benchmarks.profile_step --tracker persistent --mode EMBEDDING --cprofile out.prof

Same workload as ``step_overhead`` (``--rows``/``--batch`` to shrink it); ``get_unique`` every
``--read-every`` steps. Prints one JSON line: mean step time, and for the persistent tracker
the time spent in its training-thread entry points (``record_lookup``, ``step``,
``get_unique``) measured by wrapping them, plus its writer statistics.
"""

from __future__ import annotations

import argparse
import cProfile
import time
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional

import torch
from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode

from benchmarks._common import Stats, emit, init_single_rank_pg, log, rmtree, workdir
from benchmarks._model import Workload, build_dmp, make_batches, train_step


def _wrap(obj: Any, name: str, acc: Dict[str, float]) -> None:
    fn: Callable[..., Any] = getattr(obj, name)

    def timed(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[name] += time.perf_counter() - t0

    setattr(obj, name, timed)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tracker", default="persistent", choices=["none", "torchrec", "persistent"])
    ap.add_argument("--mode", default="EMBEDDING")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--read-every", type=int, default=10)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--cprofile", default=None, help="write cProfile stats of the training thread here")
    ap.add_argument("--quick", action="store_true", help="smoke run: 10 steps after 2, 10k rows, batch 128, a read every 5")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.rows, args.batch, args.read_every = 10, 2, 10_000, 128, 5
    torch.set_flush_denormal(True)
    init_single_rank_pg()
    w = Workload(rows=args.rows, batch=args.batch)
    mode = TrackingMode[args.mode]
    batches = make_batches(w, args.warmup + args.steps, seed=0)
    dmp = build_dmp(w)
    root = workdir("profile")
    tr: Any = None
    acc: Dict[str, float] = defaultdict(float)
    if args.tracker == "torchrec":
        tr = dmp.init_torchrec_delta_tracker(DeltaTrackerConfig(tracking_mode=mode, consumers=["bench"]))
    elif args.tracker == "persistent":
        from persistent_delta import PersistentTrackerConfig, attach

        tr = attach(dmp, PersistentTrackerConfig(path=root, tracking_mode=mode, consumers=["bench"], fresh=True))
        for name in ("step", "get_unique"):
            _wrap(tr, name, acc)
        # record_lookup is registered as a bound method in the sharded modules: wrap there.
        for m in tr.tracked_modules.values():
            for attr in ("post_lookup_tracker_fn",):
                if getattr(m, attr, None) is not None:
                    orig = getattr(m, attr)

                    def rec(*a: Any, _o: Any = orig, **kw: Any) -> Any:
                        t0 = time.perf_counter()
                        try:
                            return _o(*a, **kw)
                        finally:
                            acc["record_lookup"] += time.perf_counter() - t0

                    setattr(m, attr, rec)
    prof = cProfile.Profile() if args.cprofile else None
    times: List[float] = []
    for i, b in enumerate(batches):
        if i == args.warmup:
            acc.clear()
            if prof:
                prof.enable()
        t0 = time.perf_counter()
        train_step(dmp, b)
        if tr is not None and (i + 1) % args.read_every == 0:
            tr.get_unique("bench")
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    if prof:
        prof.disable()
        prof.dump_stats(args.cprofile)
        log("cProfile stats in %s", args.cprofile)
    s = Stats.of(times)
    stats = tr.stats() if tr is not None and hasattr(tr, "stats") else {}
    emit("profile_step", tracker=args.tracker, mode=mode.name, steps=s.n, mean_ms=1e3 * s.mean_s,
         median_ms=1e3 * s.median_s, training_thread_ms_per_step={k: 1e3 * v / s.n for k, v in acc.items()},
         writer=stats)
    if tr is not None and hasattr(tr, "close"):
        tr.close()
    rmtree(root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
