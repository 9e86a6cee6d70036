"""Reopen/restart time vs log size (issue 4d).

For each size (default ~10 MB, ~1 GB, ~10 GB of records; ``--quick``, a smoke run: 10 MB) a
fresh log is filled with ``append_many`` groups of 4 big tables (records of up to ~16.5 MB:
64k int64 ids + 64k x 64 float32 states), and closed; a ``small`` table gets one 100-id record
in the first group only, so what reading it costs does not grow with the log. A last batch then appends 100 ids to every table. Timed (median of ``--reps``):

* ``open``: ``LmdbDeltaStore(path)`` alone;
* ``open_get_unique_last``: open + ``get_unique(from_idx=last batch)`` (the small last batch of
  every table: what a restarted consumer that is caught up reads);
* ``open_small_table``: open + the unique rows of the ``small`` table only (its two records:
  the first batch's and the last one's).

Each is measured warm (log in the page cache) and cold (``fsync`` + ``posix_fadvise
DONTNEED`` of ``data.mdb`` before every repetition; no root needed). Disk space is checked
before each log is built; each log is deleted before the next one. One JSON line per size and
a summary line with the largest/smallest ratios.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable, Dict, List, Optional

import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from benchmarks._common import (
    CpuMonitor,
    drop_file_cache,
    emit,
    free_bytes,
    log,
    machine,
    median,
    rmtree,
    wait_for_quiet,
    workdir,
)
from persistent_delta import LmdbDeltaStore
from persistent_delta.log.records import AppendRecord, read_unique

BIG = [f"sparse.embeddings.t{t}" for t in range(4)]
SMALL = "sparse.embeddings.small"
MODE = UpdateMode.FIRST
DIM = 64


def _parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1e3, "M": 1e6, "G": 1e9}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)


def build(path: str, size: int) -> Dict[str, Any]:
    rows = 65536
    rec_bytes = rows * (8 + 4 * DIM)
    if size < 8 * rec_bytes:  # small logs: smaller records, at least 16 of them
        rows = max(256, size // (16 * (8 + 4 * DIM)))
        rec_bytes = rows * (8 + 4 * DIM)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 200_000, (rows,), generator=g)
    states = torch.randn(rows, DIM, generator=g)
    small_ids = torch.arange(100)
    small_states = torch.zeros(100, DIM)
    t0 = time.perf_counter()
    written = 0
    b = 0
    with LmdbDeltaStore(path, MODE) as store:
        while written < size:
            recs = [AppendRecord(b, f, ids, states) for f in BIG]
            if b == 0:
                recs.append(AppendRecord(b, SMALL, small_ids, small_states))
            store.append_many(recs)
            written += 4 * rec_bytes
            b += 1
        store.append_many([AppendRecord(b, f, small_ids, small_states) for f in BIG + [SMALL]])
        store.flush()
    dt = time.perf_counter() - t0
    return {"record_rows": rows, "groups": b, "last_batch": b, "payload_bytes": written, "build_s": dt,
            "file_bytes": os.path.getsize(os.path.join(path, "data.mdb"))}


def measure(path: str, last: int, reps: int, cold: bool) -> Dict[str, List[float]]:
    data = os.path.join(path, "data.mdb")

    def op_open() -> None:
        LmdbDeltaStore(path, MODE).close()

    def op_last() -> None:
        with LmdbDeltaStore(path, MODE) as s:
            rows = s.get_unique(last)
            assert all(r.ids.numel() == 100 for r in rows.values()), {k: r.ids.numel() for k, r in rows.items()}

    def op_small() -> None:
        with LmdbDeltaStore(path, MODE) as s:
            rows = s.log.read(lambda r: read_unique(r, MODE, 0, tables=[SMALL]))
            assert rows[SMALL].ids.numel() == 100

    ops: Dict[str, Callable[[], None]] = {"open": op_open, "open_get_unique_last": op_last, "open_small_table": op_small}
    out: Dict[str, List[float]] = {k: [] for k in ops}
    for _ in range(reps):
        for name, fn in ops.items():
            if cold:
                drop_file_cache(data)
            t0 = time.perf_counter()
            fn()
            out[name].append(time.perf_counter() - t0)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10M,1G,10G")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--wait-quiet", type=float, default=60.0, help="wait up to this long for a quiet machine")
    ap.add_argument("--cold-reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="smoke run: one log of 10M, 3 warm and 1 cold repetitions")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.reps, args.cold_reps, args.wait_quiet = "10M", 3, 1, 0.0
    sizes = sorted(_parse_size(s) for s in args.sizes.split(","))
    results: List[Dict[str, Any]] = []
    for size in sizes:
        root = workdir("reopen")
        need = int(size * 1.3) + (2 << 30)
        free = free_bytes(root)
        if free < need:
            log("skipping %d bytes: %d free under %s, need %d", size, free, root, need)
            rmtree(root)
            continue
        path = os.path.join(root, "log")
        try:
            log("building a log of ~%.2f GB (%.1f GB free)", size / 1e9, free / 1e9)
            info = build(path, size)
            log("built in %.1fs (%.2f GB/s); measuring", info["build_s"], info["payload_bytes"] / info["build_s"] / 1e9)
            wait_for_quiet(args.wait_quiet)
            mon = CpuMonitor()
            measure(path, info["last_batch"], 1, cold=False)  # untimed: first touch after the build
            warm = measure(path, info["last_batch"], args.reps, cold=False)
            t0 = time.perf_counter()
            drop_file_cache(os.path.join(path, "data.mdb"))
            writeback_s = time.perf_counter() - t0
            cold = measure(path, info["last_batch"], args.cold_reps, cold=True)
            foreign = mon.foreign_cpus()
        finally:
            rmtree(root)
        rec = emit(
            "reopen_time",
            target_bytes=size,
            **info,
            warm_ms={k: 1e3 * median(v) for k, v in warm.items()},
            cold_ms={k: 1e3 * median(v) for k, v in cold.items()},
            warm_ms_all={k: [1e3 * x for x in v] for k, v in warm.items()},
            cold_ms_all={k: [1e3 * x for x in v] for k, v in cold.items()},
            first_writeback_s=writeback_s,
            foreign_cpus=foreign,
            machine=machine(),
        )
        results.append(rec)
    if len(results) >= 2:
        small, big = results[0], results[-1]
        ratios = {
            f"{temp}_{k}": big[f"{temp}_ms"][k] / small[f"{temp}_ms"][k]
            for temp in ("warm", "cold")
            for k in big["warm_ms"]
        }
        # A process restart finds the log in the page cache (warm); a machine restart does not.
        emit(
            "reopen_time_summary",
            largest_bytes=big["payload_bytes"],
            smallest_bytes=small["payload_bytes"],
            ratio_largest_over_smallest=ratios,
            target={
                "max_ratio": 2.0,
                "on": "open_get_unique_last",
                "met_warm": ratios["warm_open_get_unique_last"] <= 2.0,
                "met_cold": ratios["cold_open_get_unique_last"] <= 2.0,
            },
            machine=machine(),
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
