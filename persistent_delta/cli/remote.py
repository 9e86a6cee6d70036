"""``persistent-delta offsets --server``: remote consumers and shippers of a job's stream.

Owns: the data functions that reset and delete remote consumers' positions (in the job's
``offsets`` bucket); describing them and the shippers' statistics lives in
:mod:`persistent_delta.ops.remote_positions` (re-exported here). A reset or a
delete is refused while the consumer runs (its claim is held) and is a dry run unless
``execute``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from persistent_delta.log import codec
from persistent_delta.fleet import subjects
from persistent_delta.errors import InvalidInputError, LogLockedError, UnknownConsumerError
from persistent_delta.fleet.auth import KeySpec
from persistent_delta.fleet.subjects import lock_key, offsets_key
from persistent_delta.fleet.connect import open_transport
from persistent_delta.fleet.transport import ConnectOptions, ServerSpec
from persistent_delta.ops.remote_positions import (RemoteConsumerRow, ShipperRow, behind_note, describe_remote,
                                                   rejected_note, remote_offsets, stream_ends_of)


@dataclass
class RemoteChange:
    consumer: str
    channel: str
    rank: int
    action: str
    old: Optional[int]
    new: Optional[int]


def change_remote(server: ServerSpec, job: str, name: str, action: str, target: Optional[str] = None,
                  batch: Optional[int] = None, channel: Optional[str] = None, execute: bool = False,
                  options: Optional[ConnectOptions] = None, key: KeySpec = None,
                  insecure: bool = False) -> List[RemoteChange]:
    """Reset (``target``: ``earliest``, ``latest`` or ``batch``) or delete a remote
    consumer's stored positions; a dry run unless ``execute``. ``latest`` is each rank's latest
    genuine range (read under the job's stream key ``key``, default
    ``PERSISTENT_DELTA_STREAM_KEY_FILE``; ``insecure``: without one), as a consumer starting at
    ``reset="latest"`` finds it: a marker another client published never becomes a position.

    Raises:
        UnknownConsumerError: nothing stored for ``name`` (and ``channel``).
        LogLockedError: a process holds the consumer now.
        StreamKeyError: ``latest`` without a key and not ``insecure``.
    """
    ends = stream_ends_of(key, insecure, f"resetting {name!r} of job {job} to latest") if target == "latest" else None
    conn = open_transport(server, options)
    try:
        if conn.kv_get(job, subjects.LOCKS, lock_key(name)) is not None:
            raise LogLockedError(f"remote consumer {name!r} of job {job!r} is running; stop it first")
        found = [d for d in remote_offsets(conn, job) if d.get("name") == name and (channel is None or d.get("channel") == channel)]
        if not found:
            raise UnknownConsumerError(f"no remote consumer {name!r} in job {job!r}")
        changes: List[RemoteChange] = []
        for d in found:
            ch = str(d["channel"])
            ranks = {int(r): v for r, v in d.get("ranks", {}).items()}
            new_ranks: Dict[str, Dict[str, Any]] = {}
            if action == "reset":
                latest = {} if ends is None else ends.latest(conn, job, ch, sorted(ranks))
                for r, v in sorted(ranks.items()):
                    nv: Dict[str, Any]
                    if target == "latest":
                        m = latest[r]  # (where a consumer at reset="latest" starts: RemoteConsumer._to_latest)
                        nv = {"pos": 0 if m is None else m.end, "seq": 1 if m is None else m.seq + 1,
                              "epoch": None if m is None else m.epoch}
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


__all__ = ["RemoteChange", "RemoteConsumerRow", "ShipperRow", "behind_note", "change_remote", "describe_remote",
           "rejected_note"]
