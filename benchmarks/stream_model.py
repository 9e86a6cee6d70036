"""The shipping model on paper: what a job of N ranks asks of its JetStream stream(s).

Owns: the arithmetic of docs/scaling.md -- bytes per step per rank by tracking mode, the
stream throughput a job of ``N`` ranks and ``R`` replicas needs, the disk retention holds per
host, and how many streams (Raft groups, one leader each) carry the job. Run it to print the
tables of that page::

    python -m benchmarks.stream_model                 # the page's tables
    python -m benchmarks.stream_model --ranks 64 --rows-per-window 70450 --dim 64 --window 10 \\
        --steps-per-s 4 --replicas 3 --mode EMBEDDING --channels snapshots

Everything here is a model: the inputs marked *measured* come from benchmarks/README.md
(``benchmarks.ship --cluster``, ``benchmarks.freshness``); the rest is arithmetic, checked by
``tests/unit/test_stream_model.py``.

Bytes per row of a record, by what the tracker stores (``trainer/capture.py``):

* ids: 8 B (int64 shard-local row ids);
* lookups states: ID_ONLY none; EMBEDDING the row (``dim * value_bytes``); MOMENTUM_LAST the
  momentum's norm (4 B: one float per row); MOMENTUM_DIFF the momentum row (``dim * 4`` with
  EXACT_ADAGRAD, 4 B with row-wise Adagrad); ROWWISE_ADAGRAD 4 B;
* snapshots (``publish``): the row's values, ``dim * value_bytes``.

Rows per window: FIRST and NONE modes (all but MOMENTUM_LAST) write each row once per read
window (the writer's window filter), so a window of ``W`` steps writes its *unique* rows
``U_W``; MOMENTUM_LAST (LAST) writes each step's unique rows, ``W * u_1``. A publish writes the
window's unique rows.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

MODES = ("ID_ONLY", "EMBEDDING", "MOMENTUM_LAST", "MOMENTUM_DIFF", "ROWWISE_ADAGRAD")
ID_BYTES = 8
STATE_FLOAT_BYTES = 4  # optimizer states are fp32
MB = 1e6

# Measured (benchmarks/README.md, `python -m benchmarks.ship --cluster --only throughput`): one
# stream at R=3 on a local 3-node cluster sharing 2 cores.
MEASURED_STREAM_R3_BPS = (81 * MB, 102 * MB)
# Per message on the stream: NATS headers (message id, PD-Auth authenticator, part/chunk) and the
# part's msgpack header; a guess from the wire format, small against 1 MiB chunks.
MESSAGE_OVERHEAD_BYTES = 300
CHUNK_BYTES = (1 << 20) - 4096  # a NATS server's default max payload (1 MiB) less the wire's headroom
# Local log file size over live data in steady state (measured: benchmarks.disk_steady_state).
LOG_FILE_OVER_LIVE = 1.15


def state_bytes_per_row(mode: str, dim: int, value_bytes: int = 4, per_element_momentum: bool = False) -> int:
    """Bytes of the tracked state of one row in ``mode`` (0 for ID_ONLY).

    ``per_element_momentum``: the fused optimizer keeps a momentum per element (EXACT_ADAGRAD)
    rather than per row (row-wise Adagrad); only MOMENTUM_DIFF stores that row whole.
    """
    if mode == "ID_ONLY":
        return 0
    if mode == "EMBEDDING":
        return dim * value_bytes
    if mode == "MOMENTUM_LAST":
        return STATE_FLOAT_BYTES  # the norm of the momentum row
    if mode == "MOMENTUM_DIFF":
        return dim * STATE_FLOAT_BYTES if per_element_momentum else STATE_FLOAT_BYTES
    if mode == "ROWWISE_ADAGRAD":
        return STATE_FLOAT_BYTES
    raise ValueError(f"unknown tracking mode {mode!r}; one of {MODES}")


@dataclass(frozen=True)
class Job:
    """One training job, per rank and per window of ``window`` steps (the read or publish period).

    Attributes:
        ranks: N, training ranks.
        rows_per_step: u_1, unique rows one rank's step touches (all its tables).
        rows_per_window: U_W, unique rows one rank touches in ``window`` steps (<= window * u_1).
        dim: the rows' width (columns of the local shard).
        window: W, steps between reads of the lookups consumer and between publishes.
        steps_per_s: training steps a second.
        mode: the tracking mode.
        channels: what the shipper sends: ``("snapshots",)``, ``("lookups",)`` or both.
        replicas: R, JetStream replicas of the stream.
        consumers: K, remote consumers reading everything (serving replicas, checkpointers).
        retention_s: how long the stream keeps messages (its ``max_age``).
        ranks_per_host: training ranks on one host (its local logs share a disk).
        value_bytes: bytes per value (4: fp32; 2: fp16/bf16 publishes).
        per_element_momentum: EXACT_ADAGRAD (MOMENTUM_DIFF stores momentum rows).
        tables: tables per rank (messages per shipped range: one part per table + a marker).
    """

    ranks: int = 64
    rows_per_step: int = 12_000
    rows_per_window: int = 70_450  # with dim 64 at fp32: an 18.6 MB publish (benchmarks.freshness)
    dim: int = 64
    window: int = 10
    steps_per_s: float = 4.0
    mode: str = "EMBEDDING"
    channels: Tuple[str, ...] = ("snapshots",)
    replicas: int = 3
    consumers: int = 4
    retention_s: float = 600.0
    ranks_per_host: int = 8
    value_bytes: int = 4
    per_element_momentum: bool = False
    tables: int = 4


def lookups_bytes_per_window(job: Job) -> float:
    """Row bytes one rank writes to its lookups channel per window."""
    per_row = ID_BYTES + state_bytes_per_row(job.mode, job.dim, job.value_bytes, job.per_element_momentum)
    rows = job.window * job.rows_per_step if job.mode == "MOMENTUM_LAST" else job.rows_per_window
    return float(rows * per_row)


def snapshot_bytes_per_publish(job: Job) -> float:
    """Row bytes of one rank's publish (the window's unique rows, ids and values)."""
    return float(job.rows_per_window * (ID_BYTES + job.dim * job.value_bytes))


def shipped_bytes_per_window(job: Job) -> float:
    """Bytes one rank's shipper sends per window: the channels' rows, plus per message a fixed
    overhead (each table's part in chunks, and one marker per range)."""
    total = 0.0
    for channel in job.channels:
        rows = snapshot_bytes_per_publish(job) if channel == "snapshots" else lookups_bytes_per_window(job)
        per_table = rows / job.tables
        messages = job.tables * max(1, math.ceil(per_table / CHUNK_BYTES)) + 1
        total += rows + messages * MESSAGE_OVERHEAD_BYTES
    return total


def bytes_per_step_per_rank(job: Job) -> float:
    """Average bytes a rank ships per training step."""
    return shipped_bytes_per_window(job) / job.window


@dataclass(frozen=True)
class Need:
    """What a job asks of the stream layer (bytes per second unless said otherwise)."""

    per_rank_bps: float  # one rank's shipper
    ingest_bps: float  # B: into the stream(s), all ranks
    replication_bps: float  # (R - 1) * B: leader to followers
    cluster_disk_write_bps: float  # R * B: every replica writes every byte
    consumer_read_bps: float  # K * B: remote consumers reading everything
    streams_needed: int  # at the stream ceiling given (one Raft leader takes each stream's writes)
    ranks_per_stream: int  # the most ranks one stream carries at that ceiling
    stream_disk_per_node_bytes: float  # retained stream bytes on each node holding a replica
    local_log_per_host_bytes: float  # the hosts' own logs (retention at two windows, file overhead)


def need(job: Job, stream_bps: float = MEASURED_STREAM_R3_BPS[0], headroom: float = 1.0,
         nodes: Optional[int] = None) -> Need:
    """The stream throughput, replication traffic and disk of ``job``.

    Args:
        job: the job.
        stream_bps: the most one stream (one Raft leader) ingests at ``job.replicas`` replicas
            (default: the low end of the measured R=3 figure).
        headroom: the fraction of ``stream_bps`` to plan for (0.5: run streams half full).
        nodes: NATS servers the streams spread over (default: ``job.replicas``, the smallest
            cluster); each holds ``replicas / nodes`` of every stream's bytes.

    Returns:
        The :class:`Need`.
    """
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom must be in (0, 1], got {headroom}")
    per_rank = bytes_per_step_per_rank(job) * job.steps_per_s
    ingest = per_rank * job.ranks
    usable = stream_bps * headroom
    nodes = nodes or job.replicas
    # a local log holds about two windows (the one being written, the one being shipped) per channel
    live_local = 2 * sum(snapshot_bytes_per_publish(job) if c == "snapshots" else lookups_bytes_per_window(job)
                         for c in ("snapshots", "lookups"))
    return Need(
        per_rank_bps=per_rank,
        ingest_bps=ingest,
        replication_bps=(job.replicas - 1) * ingest,
        cluster_disk_write_bps=job.replicas * ingest,
        consumer_read_bps=job.consumers * ingest,
        streams_needed=max(1, math.ceil(ingest / usable)),
        ranks_per_stream=max(0, int(usable // per_rank)) if per_rank else job.ranks,
        stream_disk_per_node_bytes=ingest * job.retention_s * job.replicas / nodes,
        local_log_per_host_bytes=live_local * LOG_FILE_OVER_LIVE * job.ranks_per_host,
    )


def rank_groups(ranks: int, streams: int) -> List[range]:
    """The proposed layout: ranks split into ``streams`` contiguous groups as even as can be
    (group ``g`` ships into stream ``PD_<job>_g<g>``); each rank in exactly one group."""
    if streams < 1 or ranks < 1:
        raise ValueError("ranks and streams must be >= 1")
    streams = min(streams, ranks)
    base, extra = divmod(ranks, streams)
    out, start = [], 0
    for g in range(streams):
        size = base + (1 if g < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


# ----------------------------------------------------------------------------- the page's tables


def _fmt_bytes(b: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{b:.0f} B"


def table_modes(job: Job) -> List[Dict[str, str]]:
    """Per mode: bytes per row, lookups and snapshots bytes per step per rank."""
    rows = []
    for mode in MODES:
        j = replace(job, mode=mode)
        rows.append({
            "mode": mode,
            "state B/row": str(state_bytes_per_row(mode, j.dim, j.value_bytes, j.per_element_momentum)),
            "lookups / step / rank": _fmt_bytes(lookups_bytes_per_window(j) / j.window),
            "snapshots / step / rank": _fmt_bytes(snapshot_bytes_per_publish(j) / j.window),
        })
    return rows


def table_ranks(job: Job, ranks: Sequence[int], headroom: float) -> List[Dict[str, str]]:
    """Per job size: what the stream layer must carry and how many streams that takes."""
    out = []
    for n in ranks:
        j = replace(job, ranks=n)
        low, high = need(j, MEASURED_STREAM_R3_BPS[0], headroom), need(j, MEASURED_STREAM_R3_BPS[1], headroom)
        out.append({
            "ranks": str(n),
            "ingest": _fmt_bytes(low.ingest_bps) + "/s",
            "replication": _fmt_bytes(low.replication_bps) + "/s",
            "consumer reads": _fmt_bytes(low.consumer_read_bps) + "/s",
            "streams": (str(low.streams_needed) if high.streams_needed == low.streams_needed
                        else f"{high.streams_needed}-{low.streams_needed}"),
            "disk per node": _fmt_bytes(low.stream_disk_per_node_bytes),
        })
    return out


def render(rows: List[Dict[str, str]]) -> str:
    """A Markdown table."""
    heads = list(rows[0])
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    lines += ["| " + " | ".join(r[h] for h in heads) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    d = Job()
    ap.add_argument("--ranks", type=int, default=d.ranks)
    ap.add_argument("--rows-per-step", type=int, default=d.rows_per_step)
    ap.add_argument("--rows-per-window", type=int, default=d.rows_per_window)
    ap.add_argument("--dim", type=int, default=d.dim)
    ap.add_argument("--window", type=int, default=d.window)
    ap.add_argument("--steps-per-s", type=float, default=d.steps_per_s)
    ap.add_argument("--mode", default=d.mode, choices=MODES)
    ap.add_argument("--channels", default=",".join(d.channels), help="snapshots, lookups or both (comma-separated)")
    ap.add_argument("--replicas", type=int, default=d.replicas)
    ap.add_argument("--consumers", type=int, default=d.consumers)
    ap.add_argument("--retention-s", type=float, default=d.retention_s)
    ap.add_argument("--ranks-per-host", type=int, default=d.ranks_per_host)
    ap.add_argument("--value-bytes", type=int, default=d.value_bytes, choices=[1, 2, 4])
    ap.add_argument("--headroom", type=float, default=0.5, help="plan streams to run at this fraction of the ceiling")
    ap.add_argument("--quick", action="store_true",
                    help="accepted as every benchmark's smoke flag: this arithmetic is instant, nothing to shrink")
    args = ap.parse_args(argv)
    job = Job(ranks=args.ranks, rows_per_step=args.rows_per_step, rows_per_window=args.rows_per_window, dim=args.dim,
              window=args.window, steps_per_s=args.steps_per_s, mode=args.mode,
              channels=tuple(c.strip() for c in args.channels.split(",")), replicas=args.replicas,
              consumers=args.consumers, retention_s=args.retention_s, ranks_per_host=args.ranks_per_host,
              value_bytes=args.value_bytes)
    print(f"## Bytes per step per rank by mode (U_W={job.rows_per_window} rows per {job.window}-step window, "
          f"u_1={job.rows_per_step} rows per step, dim {job.dim})\n")
    print(render(table_modes(job)))
    n = need(job)
    planned = need(job, headroom=args.headroom)
    print(f"\n## This job: {job.ranks} ranks, {job.mode}, channels {','.join(job.channels)}, R={job.replicas}\n")
    print(f"- per rank: {_fmt_bytes(n.per_rank_bps)}/s; into the stream layer: {_fmt_bytes(n.ingest_bps)}/s")
    print(f"- replication (leaders to followers): {_fmt_bytes(n.replication_bps)}/s; disk writes over the cluster: "
          f"{_fmt_bytes(n.cluster_disk_write_bps)}/s; {job.consumers} consumers read {_fmt_bytes(n.consumer_read_bps)}/s")
    print(f"- one stream (R={job.replicas}, measured {MEASURED_STREAM_R3_BPS[0] / MB:.0f}-"
          f"{MEASURED_STREAM_R3_BPS[1] / MB:.0f} MB/s) carries {n.ranks_per_stream} such ranks; this job needs "
          f"{n.streams_needed} streams full, {planned.streams_needed} at {args.headroom:.0%} headroom")
    print(f"- retention: {_fmt_bytes(n.stream_disk_per_node_bytes)} of stream per NATS node ({job.retention_s:.0f} s, "
          f"{job.replicas} nodes); local logs {_fmt_bytes(n.local_log_per_host_bytes)} per host of "
          f"{job.ranks_per_host} ranks")
    print(f"\n## Job size vs streams (R={job.replicas}, {args.headroom:.0%} headroom)\n")
    print(render(table_ranks(job, (8, 16, 32, 64, 128, 256), args.headroom)))
    groups = rank_groups(job.ranks, planned.streams_needed)
    print(f"\n## Proposed layout for this job: {len(groups)} streams, ranks per stream "
          f"{', '.join(f'{g.start}-{g.stop - 1}' for g in groups)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
