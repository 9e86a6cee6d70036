"""Consumer read path (issue 14 item 1): ``DeltaReader.poll`` and ``poll.merged()`` in row
bytes per second, side by side with a plain memory copy of the same bytes.

    python -m benchmarks.read_path [--ranks 1,2,8] [--layouts row,col] [--channels snapshots,lookups]
                                   [--reps 9] [--threads N] [--cprofile FILE]

Logs are built without a DMP, the way a tracker writes them: per rank, a tracker meta (world
size), table entries with shard metadata and row shapes, ``--batches`` lookups batches
(update mode FIRST, fp32 ``(n, dim)`` states, each batch's ids unique, as the writer stores
them) and one publish (a ``KIND_SNAPSHOT`` record per table, stamped ``--batches``) of the rows
those batches touched: ~``--publish-rows`` rows over the table set (Zipf(1.05) ids over
``--tables`` x ``--rows`` rows). Row-wise: each rank holds a row range of every table;
column-wise: each rank holds a column slice of every row. Every configuration therefore
delivers the same merged rows (``publish-rows x dim`` fp32, 15.7 MB by default) per channel.

Per configuration (ranks x layout x channel) the merged result is first checked equal to a
reference computed from the generated data, then ``--reps`` repetitions (seeking back between
them) time ``poll()`` and ``merged()`` separately; medians are reported with GB/s of merged
row bytes, and ``memcpy``: a ``torch.clone`` of the same bytes (fresh output) and a copy into a
preallocated one. Target (issue 14): poll + merged >= 1 GB/s (<= 16 ms for 15.7 MB).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from benchmarks._common import CpuMonitor, ZipfIds, emit, log, machine, median, rmtree, wait_for_quiet, workdir

BENCH = "read_path"


@dataclass
class Table:
    """One global table's generated data: the lookups batches and the published rows."""

    fqn: str
    batches: List[torch.Tensor]  # per batch: unique global ids (ascending, as the writer stores them)
    states: List[torch.Tensor]  # per batch: (n, dim) fp32 states of those ids
    published: torch.Tensor  # ascending global ids of the publish
    values: torch.Tensor  # (n, dim) their current values


def make_tables(n_tables: int, rows: int, dim: int, publish_rows: int, batches: int, seed: int) -> List[Table]:
    """Per table: a Zipf id stream cut where it has touched its share of ``publish_rows``
    distinct rows, split into ``batches`` batches (deduplicated per batch)."""
    out = []
    for t in range(n_tables):
        want = publish_rows // n_tables + (1 if t < publish_rows % n_tables else 0)
        stream = ZipfIds(rows, 1.05, seed + 17 * t).sample(max(8 * want, 1 << 18))
        first = torch.full((rows,), stream.numel(), dtype=torch.int64)
        first.scatter_reduce_(0, stream, torch.arange(stream.numel()), reduce="amin")
        seen = torch.sort(first[first < stream.numel()]).values
        if seen.numel() < want:
            raise SystemExit(f"table {t}: only {seen.numel()} distinct rows in the stream, need {want}")
        stream = stream[: int(seen[want - 1]) + 1]
        g = torch.Generator().manual_seed(seed + t)
        ids = [torch.unique(b) for b in stream.tensor_split(batches)]
        states = [torch.randn(i.numel(), dim, generator=g) for i in ids]
        published = torch.unique(stream)
        out.append(Table(f"ec.t{t}", ids, states, published, torch.randn(published.numel(), dim, generator=g)))
    return out


def reference(tables: List[Table], channel: str) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """fqn -> (ascending global ids, rows): snapshots the published values, lookups FIRST."""
    if channel == "snapshots":
        return {t.fqn: (t.published, t.values) for t in tables}
    out = {}
    for t in tables:
        rows: Dict[int, torch.Tensor] = {}
        for ids, st in zip(t.batches, t.states):
            for i, gid in enumerate(ids.tolist()):
                rows.setdefault(gid, st[i])
        keys = sorted(rows)
        out[t.fqn] = (torch.tensor(keys, dtype=torch.int64), torch.stack([rows[k] for k in keys]))
    return out


def write_job(root: str, tables: List[Table], world: int, layout: str, rows: int, dim: int) -> Dict[str, int]:
    """Write one log per rank under ``root``; returns the stored record bytes per channel."""
    from torchrec.distributed.model_tracker.types import UpdateMode

    from persistent_delta.log import codec
    from persistent_delta.log.layout import rank_dir
    from persistent_delta.log.deltalog import DeltaLog, WriteTxn
    from persistent_delta.log.records import AppendRecord, encode_records, write_records
    from persistent_delta.log.schema import META_CURR_BATCH, META_SNAPSHOT_END, META_TRACKER, SNAPSHOTS, TrackerMeta

    n_batches = len(tables[0].batches)
    stamp = n_batches  # publish at the current batch index, after the batches it covers
    total = {"lookups": 0, "snapshots": 0}
    for rank in range(world):
        if layout == "row":
            lo, hi = rank * rows // world, (rank + 1) * rows // world
            c0, c1 = 0, dim
        else:
            lo, hi = 0, rows
            c0, c1 = rank * dim // world, (rank + 1) * dim // world
        stype = "row_wise" if layout == "row" else "column_wise"

        def local(ids: torch.Tensor, vals: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
            keep = (ids >= lo) & (ids < hi)
            return ids[keep] - lo, vals[keep][:, c0:c1].contiguous()

        lookups = []
        for t in tables:
            for b, (ids, st) in enumerate(zip(t.batches, t.states)):
                li, ls = local(ids, st)
                lookups.append(AppendRecord(b, t.fqn, li, ls))
        encoded = encode_records(lookups, UpdateMode.FIRST)
        snaps = [codec.encode_record(*local(t.published, t.values), codec.KIND_SNAPSHOT) for t in tables]
        total["lookups"] += sum(len(v) for _, v in encoded)
        total["snapshots"] += sum(len(v) for v in snaps)

        def build(w: WriteTxn, rank: int = rank, encoded: Any = encoded, snaps: Any = snaps, lo: int = lo,
                  hi: int = hi, c0: int = c0, c1: int = c1, stype: str = stype) -> None:
            w.set_meta(META_TRACKER, TrackerMeta("embedding", "first", [t.fqn for t in tables], rank, world).to_value())
            for t in tables:
                entry = w.ensure_table(t.fqn)
                entry.meta["shard"] = dict(table_name=t.fqn.split(".")[-1], sharding_type=stype, row_offset=lo,
                                           col_offset=c0, local_rows=hi - lo, local_cols=c1 - c0, global_rows=rows,
                                           global_cols=dim)
                entry.values_dtype = entry.states_dtype = "float32"
                entry.values_tail = entry.states_tail = [c1 - c0]
                w.stage_table(entry)
            write_records(w, encoded)
            for t, value in zip(tables, snaps):
                w.put_record(w.tables()[t.fqn].table_id, stamp, value, channel=SNAPSHOTS)
            w.set_meta(META_CURR_BATCH, n_batches)
            w.set_meta(META_SNAPSHOT_END, stamp + 1)

        with DeltaLog(rank_dir(root, rank), update_mode=UpdateMode.FIRST.value) as dl:
            dl.write(build)
    return total


def check(merged: Dict[str, Any], ref: Dict[str, Tuple[torch.Tensor, torch.Tensor]], what: str) -> None:
    if sorted(merged) != sorted(ref):
        raise SystemExit(f"{what}: tables {sorted(merged)} != {sorted(ref)}")
    for fqn, (ids, rows) in ref.items():
        m = merged[fqn]
        if not torch.equal(m.global_ids, ids) or m.states is None or not torch.equal(m.states, rows):
            raise SystemExit(f"{what}: merged {fqn} differs from the reference")


def measure(root: str, channel: str, start: int, ref: Dict[str, Tuple[torch.Tensor, torch.Tensor]], reps: int,
            what: str, prof: Optional[cProfile.Profile]) -> Dict[str, Any]:
    import gc

    from persistent_delta import DeltaReader

    with DeltaReader(root, channel=channel, start=start) as reader:
        check(reader.poll().merged(), ref, what)
        polls, merges = [], []
        for _ in range(reps):
            reader.seek(start)
            gc.collect()
            if prof is not None:
                prof.enable()
            t0 = time.perf_counter()
            poll = reader.poll()
            t1 = time.perf_counter()
            merged = poll.merged()
            t2 = time.perf_counter()
            if prof is not None:
                prof.disable()
            polls.append(t1 - t0)
            merges.append(t2 - t1)
            del poll, merged
    row_bytes = sum(r.nbytes for _, r in ref.values())
    srcs = [r for _, r in ref.values()]
    outs = [torch.empty_like(s) for s in srcs]
    clones, copies = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        cl = [s.clone() for s in srcs]
        t1 = time.perf_counter()
        for o, s in zip(outs, srcs):
            o.copy_(s)
        t2 = time.perf_counter()
        clones.append(t1 - t0)
        copies.append(t2 - t1)
        del cl
    p, m, c, k = median(polls), median(merges), median(clones), median(copies)
    gbs = lambda s: row_bytes / s / 1e9  # noqa: E731
    return dict(row_bytes=row_bytes, rows=sum(int(i.numel()) for i, _ in ref.values()),
                poll_ms=1e3 * p, merged_ms=1e3 * m, total_ms=1e3 * (p + m), poll_gbs=gbs(p), merged_gbs=gbs(m),
                total_gbs=gbs(p + m), memcpy_clone_ms=1e3 * c, memcpy_clone_gbs=gbs(c), memcpy_warm_ms=1e3 * k,
                memcpy_warm_gbs=gbs(k), poll_ms_all=[1e3 * x for x in polls], merged_ms_all=[1e3 * x for x in merges])


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="1,2,8")
    ap.add_argument("--layouts", default="row,col")
    ap.add_argument("--channels", default="snapshots,lookups")
    ap.add_argument("--tables", type=int, default=4)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--publish-rows", type=int, default=61_512)
    ap.add_argument("--batches", type=int, default=10)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--quiet-wait-s", type=float, default=60.0, help="wait up to this long for a quiet machine")
    ap.add_argument("--tune-malloc", action="store_true",
                    help="raise glibc's malloc thresholds first (persistent_delta.log.alloc.tune_malloc)")
    ap.add_argument("--cprofile", default=None, help="write a cProfile of the timed polls and merges here")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.ranks, args.reps, args.quiet_wait_s = "1,8", 3, 0.0
    if args.threads:
        torch.set_num_threads(args.threads)
    tuned = False
    if args.tune_malloc:
        from persistent_delta.log.alloc import tune_malloc

        tuned = tune_malloc()
    prof = cProfile.Profile() if args.cprofile else None
    log("generating %d tables x %d rows, %d publish rows, %d batches", args.tables, args.rows, args.publish_rows,
        args.batches)
    tables = make_tables(args.tables, args.rows, args.dim, args.publish_rows, args.batches, seed=14)
    refs = {ch: reference(tables, ch) for ch in args.channels.split(",")}
    base = workdir("read-path")
    try:
        for world in [int(x) for x in args.ranks.split(",")]:
            for layout in args.layouts.split(","):
                root = os.path.join(base, f"{world}-{layout}")
                stored = write_job(root, tables, world, layout, args.rows, args.dim)
                for channel, ref in refs.items():
                    what = f"{world} rank(s), {layout}-wise, {channel}"
                    foreign = wait_for_quiet(args.quiet_wait_s)
                    mon = CpuMonitor()
                    res = measure(root, channel, args.batches if channel == "snapshots" else 0, ref, args.reps, what,
                                  prof)
                    log("%s: poll %.1f ms + merged %.1f ms = %.2f GB/s (memcpy %.1f ms fresh, %.1f ms warm)", what,
                        res["poll_ms"], res["merged_ms"], res["total_gbs"], res["memcpy_clone_ms"],
                        res["memcpy_warm_ms"])
                    emit(BENCH, ranks=world, layout=layout, channel=channel, tables=args.tables, dim=args.dim,
                         batches=args.batches, tune_malloc=tuned, stored_bytes=stored[channel], **res, foreign_cpus_before=foreign,
                         foreign_cpus=mon.foreign_cpus(), machine=machine())
                rmtree(root)
    finally:
        rmtree(base)
    if prof is not None:
        prof.dump_stats(args.cprofile)
        log("cProfile written to %s", args.cprofile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
