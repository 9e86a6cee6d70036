"""What every remote consumer and shipper of a job's stream has done, read from the stream.

Owns: the describe computation for a job's stream (remote consumers' positions from the
``offsets`` bucket, the stream's end per rank from its end markers, their health from the commit
history stored with each position, shippers' statistics from the ``meta`` bucket, the job's
streams and the ranks each holds) shared by ``persistent-delta offsets --server``, the exporter
and ``top``. A rank's end is read from the stream that holds it (the job's layout:
:mod:`persistent_delta.fleet.streams`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from persistent_delta.fleet import subjects
from persistent_delta.fleet.remote import lock_key, stored_history
from persistent_delta.fleet.streams import Layout, read_layout
from persistent_delta.fleet.transport import ConnectOptions, ServerSpec, Transport, open_transport
from persistent_delta.fleet.wire import Marker
from persistent_delta.log import codec
from persistent_delta.ops.health import Health, health


@dataclass
class RemoteConsumerRow:
    """One remote consumer on one rank: its position in the stream, its lag in batches and its
    ``health`` (:func:`persistent_delta.ops.health.health` over the commits stored with its
    position, as for a local consumer: ``ok``, ``lagging`` or ``stalled``)."""

    consumer: str
    channel: str
    rank: int
    offset: Optional[int]
    stream_end: int
    lag: Optional[int]
    commit_time: Optional[float]
    active: bool
    health: str = Health.OK.value


@dataclass
class ShipperRow:
    """One shipper feed (a rank and channel), from the statistics it stores in the job's meta bucket."""

    rank: int
    channel: str
    position: int
    log_end: int
    lag_batches: int
    row_bytes: int
    retries: int
    last_shipped: Optional[float]
    host: str
    pid: int
    last_error: str


@dataclass
class StreamRow:
    """One of the job's streams: its name and the ranks of the job that ship into it (those
    whose shipper stored table metadata)."""

    stream: str
    ranks: List[int]
    layout: str


def stream_ends(conn: Transport, job: str, channel: str, ranks: Sequence[int],
                layout: Optional[Layout] = None) -> Dict[int, int]:
    """rank -> the stream's end (one past the last complete batch shipped) of ``channel``; 0 when
    none. Each rank's end is read from its stream (``layout``: default, the job's recorded one)."""
    layout = layout or read_layout(conn, job, None)
    out = {}
    for r in ranks:
        last = conn.last_message(job, subjects.end_subject(job, channel, r), stream=layout.stream(r))
        out[r] = 0 if last is None else Marker.decode(last.data, last.seq, f"job {job}").end
    return out


def remote_offsets(conn: Transport, job: str) -> List[Dict[str, Any]]:
    """Every remote consumer's stored positions (``name``, ``channel``, ``ranks``: rank -> ``pos``, ``time``)."""
    out = []
    for key, (value, _) in conn.kv_entries(job, subjects.OFFSETS).items():
        d = codec.unpack(value, f"remote offsets {key}")
        if isinstance(d, dict):
            out.append(d)
    return out


def describe_remote(server: ServerSpec, job: str, options: Optional[ConnectOptions] = None,
                    stall_after_s: Optional[float] = None) -> Dict[str, List[Any]]:
    """Every remote consumer (per rank: offset, the stream's end, lag in batches, last commit,
    whether a process holds it now, health) and every shipper (statistics) of ``job``.

    Args:
        server: the NATS server(s).
        job: the job.
        options: connection options.
        stall_after_s: the health rule's least silence before ``stalled`` (default:
            :func:`persistent_delta.config.stall_after_s`).
    """
    conn = open_transport(server, options)
    try:
        return describe_stream(conn, job, stall_after_s)
    finally:
        conn.close()


def describe_stream(conn: Transport, job: str, stall_after_s: Optional[float] = None) -> Dict[str, List[Any]]:
    """:func:`describe_remote` over an open transport (left open)."""
    layout = read_layout(conn, job, None)  # display only: the consumers verify it
    locks = set(conn.kv_entries(job, subjects.LOCKS))
    consumers: List[RemoteConsumerRow] = []
    now = time.time()
    for d in remote_offsets(conn, job):
        stored = d.get("ranks")
        ranks = {int(r): v for r, v in (stored.items() if isinstance(stored, dict) else [])
                 if str(r).isdigit() and isinstance(v, dict)}
        when = d.get("time")
        when = float(when) if isinstance(when, (int, float)) and not isinstance(when, bool) else None
        ends = stream_ends(conn, job, str(d.get("channel")), sorted(ranks), layout)
        for r, v in sorted(ranks.items()):
            raw = v.get("pos")
            pos = raw if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0 else None
            state = health(stored_history(v), pos or 0, ends[r], now, when or 0.0,
                           stall_after_s=stall_after_s)
            consumers.append(RemoteConsumerRow(str(d.get("name")), str(d.get("channel")), r, pos, ends[r],
                                               None if pos is None else max(0, ends[r] - pos), when,
                                               lock_key(str(d.get("name"))) in locks, state.value))
    shippers: List[ShipperRow] = []
    for key, (value, _) in conn.kv_entries(job, subjects.META, subjects.SHIPPER_KEYS).items():
        s = codec.unpack(value, f"shipper state {key}")
        if not isinstance(s, dict):
            continue
        st = s.get("stats", {})
        shippers.append(ShipperRow(int(st.get("rank", -1)), str(st.get("channel", "")), int(st.get("position", 0)),
                                   int(st.get("log_end", 0)), int(st.get("lag_batches", 0)),
                                   int(st.get("row_bytes", 0)), int(st.get("retries", 0)),
                                   st.get("last_shipped") or None, str(s.get("host", "")), int(s.get("pid", 0)),
                                   str(st.get("last_error", ""))))
    known = [int(k[len(subjects.TABLES_KEYS):]) for k in conn.kv_entries(job, subjects.META, subjects.TABLES_KEYS)
             if k[len(subjects.TABLES_KEYS):].isdigit()]
    streams = [StreamRow(name, ranks, layout.describe()) for name, ranks in layout.streams(known).items()]
    return {"consumers": consumers, "shippers": sorted(shippers, key=lambda x: (x.rank, x.channel)), "streams": streams}


__all__ = ["RemoteConsumerRow", "ShipperRow", "StreamRow", "describe_remote", "describe_stream", "remote_offsets", "stream_ends"]
