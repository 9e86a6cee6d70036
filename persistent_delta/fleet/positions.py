"""A remote consumer's stored positions and their history, in the job's ``offsets`` bucket.

Owns: what a remote consumer's position is per rank (:class:`RankPosition`: the next batch,
the stream sequence to resume from, the shipper epoch and the log the batches count in, the
commit history that feeds the health rule) and the bytes it is stored as under
:func:`persistent_delta.fleet.subjects.offsets_key` (:func:`encode_offsets`,
:func:`decode_offsets`, :func:`parse_entry`, :func:`stored_history`). The remote consumer
(:mod:`persistent_delta.fleet.remote`) keeps and commits them; ``offsets --server`` and the
exporter (:mod:`persistent_delta.ops.remote_positions`, :mod:`persistent_delta.cli.remote`)
read them.

A stored value is a map ``{"name", "channel", "time", "ranks": {rank: entry}, "stream" |
"streams"}``; an entry is ``{"pos", "seq", "epoch", "hist", "log_id", "log_stamp"}`` (``pos``
None: reset to earliest; ``hist``: :func:`stored_history`; the log fields are absent in a
position stored before log identities). ``"stream"`` (the job's one stream) or ``"streams"``
(stream name -> identity) hold the identity of each stream at the commit: a stream deleted and
created again since is read from its start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from persistent_delta.fleet import subjects
from persistent_delta.fleet.wire import MAX_BATCH_IDX
from persistent_delta.log import codec
from persistent_delta.log.schema import COMMIT_HISTORY, CommitPoint, LogIdentity, valid_commit_time

#: The key of a rank's commit history in its stored position entry.
HISTORY_KEY = "hist"


@dataclass
class RankPosition:
    """Where a remote consumer is on one rank.

    Attributes:
        rank: the rank.
        pos: the next batch_idx a poll delivers (None: not known yet -- a new consumer at
            ``"earliest"`` before any range).
        epoch: the shipper epoch the position counts in (None: not known).
        resume_seq: the stream sequence to resume from at the position (stored by commit).
        history: its last commits (the health window), stored with the position.
        deferred: snapshots: the newest delivered range's count of deferred rows.
        log: the rank's log the position counts batches of (None: not known).
        stale: why the stored position is of an older log than the rank's newest ("": it is
            not; with no reset policy the next poll raises).
    """

    rank: int
    pos: Optional[int] = None
    epoch: Optional[str] = None
    resume_seq: int = 1
    history: Tuple[CommitPoint, ...] = ()
    deferred: Optional[int] = None
    log: Optional[LogIdentity] = None
    stale: str = ""

    def entry(self, history: Tuple[CommitPoint, ...]) -> Dict[str, Any]:
        """The stored entry of this position with ``history``."""
        return {"pos": self.pos, "seq": self.resume_seq, "epoch": self.epoch,
                HISTORY_KEY: [[p.time, p.offset, p.end] for p in history],
                **(self.log.to_value() if self.log is not None else {})}


def stored_history(entry: object) -> Tuple[CommitPoint, ...]:
    """The commit history kept in a rank's stored position entry (``"hist"``: a list of
    ``[time, pos, end]``, oldest first; ``end`` -1 when unknown), at most the last
    :data:`~persistent_delta.log.schema.COMMIT_HISTORY`.

    The history only feeds the health rule, so a missing one (an entry written before it) and a
    malformed one (not a list, or a point that is not ``[time, int, int]``, the time as
    :func:`~persistent_delta.log.schema.valid_commit_time` bounds it) read as no history
    rather than failing the consumer or the tools.
    """
    raw = entry.get(HISTORY_KEY) if isinstance(entry, dict) else None
    if not isinstance(raw, list):
        return ()
    out: List[CommitPoint] = []
    for p in raw[-COMMIT_HISTORY:]:
        if not (isinstance(p, list) and len(p) == 3 and valid_commit_time(p[0])
                and all(isinstance(v, int) and not isinstance(v, bool) and -1 <= v < MAX_BATCH_IDX for v in p[1:])
                and p[1] >= 0):
            return ()
        out.append(CommitPoint(float(p[0]), int(p[1]), int(p[2])))
    return tuple(out)


def parse_entry(entry: object) -> Tuple[Optional[int], int, Optional[str]]:
    """``(pos, seq, epoch)`` of a stored position entry, checked.

    Raises:
        ValueError: malformed (what is wrong).
    """
    try:
        if not isinstance(entry, dict):
            raise ValueError("not a map")
        pos, seq, epoch = entry.get("pos"), entry["seq"], entry.get("epoch")
    except KeyError as exc:
        raise ValueError(f"no {exc}") from exc
    for v, lo in ((pos, 0), (seq, 1)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v < MAX_BATCH_IDX):
            raise ValueError(f"{str(v)[:40]} is not a position")
    if epoch is not None and not isinstance(epoch, str):
        raise ValueError("epoch is not a string")
    return pos, int(seq), epoch


def decode_offsets(value: bytes, job: str) -> Tuple[Dict[str, Any], Optional[Dict[Any, Any]]]:
    """``(ranks, streams)`` of a stored value: rank (a string) -> its entry (a malformed
    ``ranks`` reads as ``{"": ranks}``, refused by :func:`parse_entry` when read), and stream
    name -> its identity at the commit (None: not stored)."""
    d = codec.unpack(value, "remote offsets")
    stored = d.get("ranks", {}) if isinstance(d, dict) else {}
    if not isinstance(stored, dict):
        stored = {"": stored}
    was: Optional[Dict[Any, Any]] = None
    if isinstance(d, dict) and isinstance(d.get("streams"), dict):
        was = d["streams"]
    elif isinstance(d, dict) and isinstance(d.get("stream"), str):
        was = {subjects.stream_name(job): d["stream"]}
    return stored, was


def encode_offsets(name: str, channel: str, entries: Mapping[int, Dict[str, Any]], now: float,
                   stream_ids: Mapping[str, str], single: Optional[str]) -> bytes:
    """The stored value of a commit: each rank's entry (:meth:`RankPosition.entry`), the time,
    and the identity of each stream read (``single``: the job's one stream's name, stored as
    ``"stream"``; None: a layout over several, stored as ``"streams"``)."""
    streams: Dict[str, Any] = ({"stream": stream_ids.get(single, "")} if single is not None
                               else {"streams": dict(stream_ids)})
    return codec.pack({"name": name, "channel": channel, "ranks": {str(r): e for r, e in entries.items()},
                       "time": now, **streams})


__all__ = ["HISTORY_KEY", "RankPosition", "decode_offsets", "encode_offsets", "parse_entry", "stored_history"]
