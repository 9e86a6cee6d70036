"""The CPU a stream leader spends per MB shipped, on a local 3-node cluster (R=3): one stream
for the job against two streams (a stream per rank, ``ranks_per_stream=1``) whose leaders sit on
different servers (issue 34; the model it feeds is ``docs/scaling.md``).

    python -m benchmarks.stream_leaders [--mb 64] [--reps 3] [--out FILE.jsonl] [--quick]

Each run builds a 2-rank log of ``--mb`` MiB of row bytes per rank (FIRST mode, 4 MiB batches,
every id unique: every row is shipped), creates the job's stream(s) at R=3, moves a leader
(``$JS.API.STREAM.LEADER.STEPDOWN``) until the two streams' leaders are on different servers,
then ships both ranks with one in-process :class:`~persistent_delta.fleet.ship.Shipper`. Around
the shipping it reads each server process's CPU time (``utime + stime`` of ``/proc/<pid>/stat``)
and the shipper's (``time.process_time``). Variants are interleaved, and the one-stream variant
runs twice per round (``one`` and ``one-again``: the A/A pair that shows the noise).

Per run and server: CPU ms per MB of row bytes the job shipped, and the server's role (leader of
which streams, follower of which). Three servers and the shipper share this machine's cores:
wall-clock MB/s is reported but is the machine's, not a cluster's; the CPU per MB is the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any, Dict, List, Optional

import torch

from benchmarks._common import emit, log, machine, median, rmtree, workdir

VARIANTS = ("one", "two", "one-again")
RANKS = 2
_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """utime + stime of process ``pid``, in seconds (``/proc/<pid>/stat`` fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TCK  # fields after the command: 3.. -> utime is the 14th


def _make_log(root: str, mb: int) -> int:
    from torchrec.distributed.model_tracker.types import UpdateMode

    from persistent_delta import LmdbDeltaStore

    rows = (4 << 20) // (8 + 64 * 4)
    batches = max(1, (mb << 20) // (rows * (8 + 64 * 4)))
    for rank in range(RANKS):
        with LmdbDeltaStore(os.path.join(root, f"rank-{rank}"), updateMode=UpdateMode.FIRST) as store:
            for b in range(batches):
                ids = torch.arange(b * rows, (b + 1) * rows, dtype=torch.int64)
                store.append(b, "t", ids, torch.randn(rows, 64))
    return batches


def _leader(conn: Any, stream: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        async def info() -> Any:
            return await conn.js.stream_info(stream)

        si = conn.call(f"describe {stream}", info)
        leader = si.cluster.leader if si.cluster is not None else None
        if leader:
            return str(leader)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{stream} has no leader")
        time.sleep(0.1)


def _stepdown(conn: Any, stream: str) -> None:
    async def req() -> Any:
        return await conn.nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=5)

    conn.call(f"step {stream}'s leader down", req)
    time.sleep(0.5)


def _prepare(urls: List[str], job: str, variant: str) -> Dict[str, str]:
    """Create the job's stream(s) at R=3; for two streams, leaders on different servers.
    Returns stream -> its leader's server name."""
    from persistent_delta.fleet.auth import resolve_keyring
    from persistent_delta.fleet.nats import Connection
    from persistent_delta.fleet.streams import settle_layout
    from persistent_delta.fleet.transport import StreamOptions

    opts = StreamOptions(replicas=3)
    conn = Connection(urls, wait=10)
    try:
        layout = settle_layout(conn, job, opts, 1 if variant == "two" else None, resolve_keyring(None, False, "bench"))
        for r in range(RANKS):
            if not layout.single:
                conn.ensure_job(job, opts, streams=layout.spec(r))
        streams = list(layout.streams(range(RANKS)))
        leaders = {s: _leader(conn, s) for s in streams}
        for _ in range(20):
            if len(set(leaders.values())) == len(streams):
                break
            _stepdown(conn, streams[-1])
            leaders[streams[-1]] = _leader(conn, streams[-1])
        return leaders
    finally:
        conn.close()


def run_once(cluster: Any, base: str, variant: str, rnd: int, mb: int) -> Dict[str, Any]:
    from persistent_delta.fleet.ship import Shipper
    from persistent_delta.fleet.transport import StreamOptions

    root = os.path.join(base, f"log-{variant}-{rnd}")
    batches = _make_log(root, mb)
    job = f"sl-{variant}-{rnd}"
    leaders = _prepare(cluster.urls, job, variant)
    pids = {s.name: s.proc.pid for s in cluster.servers}
    shipper = Shipper(root, cluster.urls, job, channels=["lookups"], max_batches=4, stream=StreamOptions(replicas=3),
                      ranks_per_stream=1 if variant == "two" else None)
    try:
        before = {n: proc_cpu_s(p) for n, p in pids.items()}
        c0, t0 = time.process_time(), time.perf_counter()
        while shipper.run_once() or len(shipper.stats()) < RANKS or any(
                s["position"] < batches for s in shipper.stats()):
            pass
        wall, ship_cpu = time.perf_counter() - t0, time.process_time() - c0
        after = {n: proc_cpu_s(p) for n, p in pids.items()}
        row_mb = sum(s["row_bytes"] for s in shipper.stats()) / 1e6
    finally:
        shipper.close()
        rmtree(root)
    servers = {}
    for n in pids:
        led = [s for s, lead in leaders.items() if lead == n]
        servers[n] = {"cpu_ms_per_mb": (after[n] - before[n]) * 1e3 / row_mb, "leads": led}
    rec = emit("stream_leaders", variant=variant, round=rnd, streams=len(leaders), row_mb=row_mb, wall_s=wall,
               mb_per_s=row_mb / wall, shipper_cpu_ms_per_mb=ship_cpu * 1e3 / row_mb, servers=servers,
               loadavg_1m=os.getloadavg()[0])
    log("%s round %d: %.0f MB in %.1f s; servers %s", variant, rnd, row_mb, wall,
        {n: f"{v['cpu_ms_per_mb']:.2f} ms/MB{' (leader)' if v['leads'] else ''}" for n, v in servers.items()})
    return rec


def summary(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per variant, medians over rounds: the leaders' and the followers' CPU ms per MB (of the
    job's bytes), the busiest server's, and MB/s."""
    out: Dict[str, Any] = {}
    for variant in VARIANTS:
        rs = [r for r in runs if r["variant"] == variant]
        if not rs:
            continue
        lead = [v["cpu_ms_per_mb"] for r in rs for v in r["servers"].values() if v["leads"]]
        follow = [v["cpu_ms_per_mb"] for r in rs for v in r["servers"].values() if not v["leads"]]
        busiest = [max(v["cpu_ms_per_mb"] for v in r["servers"].values()) for r in rs]
        out[variant] = {"leader_ms_per_mb": median(lead), "leader_range": [min(lead), max(lead)],
                        "follower_ms_per_mb": median(follow) if follow else None,
                        "follower_range": [min(follow), max(follow)] if follow else None,
                        "busiest_ms_per_mb": median(busiest), "mb_per_s": median([r["mb_per_s"] for r in rs]),
                        "shipper_ms_per_mb": median([r["shipper_cpu_ms_per_mb"] for r in rs]), "rounds": len(rs)}
    return emit("stream_leaders_summary", **out)


def main(argv: Optional[List[str]] = None) -> int:
    from persistent_delta.fleet.auth import write_key_file
    from persistent_delta.testing import LocalCluster

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=64, help="row MiB per rank in each run (default 64)")
    ap.add_argument("--reps", type=int, default=3, help="rounds; each runs every variant once (default 3)")
    ap.add_argument("--out", help="append every record (JSON lines) to this file")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round of one 4 MiB batch per rank (--mb 1 --reps 1)")
    args = ap.parse_args(argv)
    if args.quick:
        args.mb, args.reps = 1, 1
    base = workdir("stream-leaders")
    records: List[Dict[str, Any]] = [emit("machine", **machine())]
    try:
        if not os.environ.get("PERSISTENT_DELTA_STREAM_KEY_FILE"):  # stream data is authenticated: one key for the run
            os.environ["PERSISTENT_DELTA_STREAM_KEY_FILE"] = os.path.join(base, "stream.key")
            write_key_file(os.environ["PERSISTENT_DELTA_STREAM_KEY_FILE"])
        with LocalCluster(os.path.join(base, "cluster")) as cluster:
            runs = []
            for rnd in range(args.reps):
                order = VARIANTS if rnd % 2 == 0 else tuple(reversed(VARIANTS))  # interleaved
                for variant in order:
                    runs.append(run_once(cluster, base, variant, rnd, args.mb))
            records += runs + [summary(runs)]
    finally:
        rmtree(base)
    if args.out:
        with open(args.out, "a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
