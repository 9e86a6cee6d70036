"""``persistent-delta offsets --server``: remote consumers and shippers of a job's stream.

Owns: the data functions that describe, reset and delete remote consumers' positions (in the
job's ``offsets`` bucket) and read the shippers' statistics (``meta`` bucket). A reset or a
delete is refused while the consumer runs (its claim is held) and is a dry run unless
``execute``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from persistent_delta.log import codec
from persistent_delta.fleet import subjects
from persistent_delta.errors import InvalidInputError, LogLockedError, UnknownConsumerError
from persistent_delta.fleet.remote import lock_key, offsets_key
from persistent_delta.fleet.transport import ConnectOptions, ServerSpec, Transport, open_transport
from persistent_delta.fleet.wire import Marker


@dataclass
class RemoteConsumerRow:
    consumer: str
    channel: str
    rank: int
    offset: Optional[int]
    stream_end: int
    lag: Optional[int]
    commit_time: Optional[float]
    active: bool


@dataclass
class ShipperRow:
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
class RemoteChange:
    consumer: str
    channel: str
    rank: int
    action: str
    old: Optional[int]
    new: Optional[int]


def _ends(conn: Transport, job: str, channel: str, ranks: Sequence[int]) -> Dict[int, int]:
    out = {}
    for r in ranks:
        last = conn.last_message(job, subjects.end_subject(job, channel, r))
        out[r] = 0 if last is None else Marker.decode(last.data, last.seq, f"job {job}").end
    return out


def _offsets(conn: Transport, job: str) -> List[Dict[str, Any]]:
    out = []
    for key, (value, _) in conn.kv_entries(job, subjects.OFFSETS).items():
        d = codec.unpack(value, f"remote offsets {key}")
        if isinstance(d, dict):
            out.append(d)
    return out


def describe_remote(server: ServerSpec, job: str, options: Optional[ConnectOptions] = None
                    ) -> Dict[str, List[Any]]:
    """Every remote consumer (per rank: offset, the stream's end, lag in batches, last commit,
    whether a process holds it now) and every shipper (statistics) of ``job``."""
    conn = open_transport(server, options)
    try:
        locks = set(conn.kv_entries(job, subjects.LOCKS))
        consumers: List[RemoteConsumerRow] = []
        for d in _offsets(conn, job):
            ranks = {int(r): v for r, v in d.get("ranks", {}).items()}
            ends = _ends(conn, job, str(d["channel"]), sorted(ranks))
            for r, v in sorted(ranks.items()):
                pos = None if v.get("pos") is None else int(v["pos"])
                consumers.append(RemoteConsumerRow(str(d["name"]), str(d["channel"]), r, pos, ends[r],
                                                   None if pos is None else max(0, ends[r] - pos), d.get("time"),
                                                   lock_key(str(d["name"])) in locks))
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
        return {"consumers": consumers, "shippers": sorted(shippers, key=lambda x: (x.rank, x.channel))}
    finally:
        conn.close()


def change_remote(server: ServerSpec, job: str, name: str, action: str, target: Optional[str] = None,
                  batch: Optional[int] = None, channel: Optional[str] = None, execute: bool = False,
                  options: Optional[ConnectOptions] = None) -> List[RemoteChange]:
    """Reset (``target``: ``earliest``, ``latest`` or ``batch``) or delete a remote
    consumer's stored positions; a dry run unless ``execute``.

    Raises:
        UnknownConsumerError: nothing stored for ``name`` (and ``channel``).
        LogLockedError: a process holds the consumer now.
    """
    conn = open_transport(server, options)
    try:
        if conn.kv_get(job, subjects.LOCKS, lock_key(name)) is not None:
            raise LogLockedError(f"remote consumer {name!r} of job {job!r} is running; stop it first")
        found = [d for d in _offsets(conn, job) if d.get("name") == name and (channel is None or d.get("channel") == channel)]
        if not found:
            raise UnknownConsumerError(f"no remote consumer {name!r} in job {job!r}")
        changes: List[RemoteChange] = []
        for d in found:
            ch = str(d["channel"])
            ranks = {int(r): v for r, v in d.get("ranks", {}).items()}
            new_ranks: Dict[str, Dict[str, Any]] = {}
            if action == "reset":
                ends = _ends(conn, job, ch, sorted(ranks))
                for r, v in sorted(ranks.items()):
                    nv: Dict[str, Any]
                    if target == "latest":
                        last = conn.last_message(job, subjects.end_subject(job, ch, r))
                        m = None if last is None else Marker.decode(last.data, last.seq, f"job {job}")
                        nv = {"pos": ends[r], "seq": 1 if m is None else m.seq + 1, "epoch": None if m is None else m.epoch}
                    elif target == "earliest":
                        nv = {"pos": None, "seq": 1, "epoch": None}
                    elif target == "batch" and batch is not None:
                        nv = {"pos": int(batch), "seq": 1, "epoch": None}
                    else:
                        raise InvalidInputError("reset needs --to-earliest, --to-latest or --to-batch N")
                    new_ranks[str(r)] = nv
                    new_pos = nv["pos"]
                    changes.append(RemoteChange(name, ch, r, "reset", v.get("pos"),
                                                None if new_pos is None else int(new_pos)))
                if execute:
                    conn.kv_put(job, subjects.OFFSETS, offsets_key(name, ch),
                                codec.pack({"name": name, "channel": ch, "ranks": new_ranks, "time": time.time()}))
            elif action == "delete":
                changes += [RemoteChange(name, ch, r, "delete", v.get("pos"), None) for r, v in sorted(ranks.items())]
                if execute:
                    conn.kv_delete(job, subjects.OFFSETS, offsets_key(name, ch))
            else:
                raise InvalidInputError(f"unknown action {action!r}")
        return changes
    finally:
        conn.close()
