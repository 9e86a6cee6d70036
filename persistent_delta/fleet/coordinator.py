"""A remote consumer's positions against the job's ``offsets`` bucket: loaded at open,
stored by ``commit``, read back by ``committed``.

Owns: where a remote consumer starts on each rank (its stored position, checked against the
rank's newest log and the identity of the stream it was committed on, or the reset policy
when it has none: :meth:`Coordinator.load`) and what a commit stores
(:meth:`Coordinator.commit`: each rank's position with its commit history). The stored bytes
are :mod:`persistent_delta.fleet.positions`'; where a rank is on the stream is the
:class:`~persistent_delta.fleet.fetcher.Fetcher`'s.

A stored position counts batches of one log of the rank: when the rank's table metadata is of
a newer log (the job was started afresh since the commit), the position is reset by the reset
policy, or (``reset=None``) marked stale, and the next poll raises
:class:`~persistent_delta.errors.OffsetOutOfRangeError`. A position stored on a stream since
deleted and created again is read from the new stream's start.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, Optional, Tuple

from persistent_delta.errors import OlderLogError, StreamDataError, UnknownConsumerError
from persistent_delta.fleet import subjects
from persistent_delta.fleet.fetcher import Fetcher, RankFetch
from persistent_delta.fleet.positions import RankPosition, decode_offsets, encode_offsets, parse_entry, stored_history
from persistent_delta.log import codec
from persistent_delta.log.schema import COMMIT_HISTORY, CommitPoint, LogIdentity

logger = logging.getLogger(__name__)


class Coordinator:
    """The stored positions of remote consumer ``name`` on ``fetcher``'s job and channel.
    Called by the consumer's thread.

    Args:
        fetcher: the consumer's fetcher (its ranks, positions, transport and newest logs).
        name: the consumer name.
        reset: the reset policy (None, ``"earliest"``, ``"latest"``).
    """

    def __init__(self, fetcher: Fetcher, name: str, reset: Optional[str]) -> None:
        self.fetch, self.name, self.reset = fetcher, name, reset
        self.key = subjects.offsets_key(name, fetcher.channel)

    def _what(self, rank: int) -> str:
        return f"the stored position of remote consumer {self.name!r} ({self.fetch.channel}) for {self.fetch.where(rank)}"

    def load(self) -> None:
        """Set every rank's position from the stored one, or by the reset policy.

        Raises:
            StreamDataError: a stored position is malformed.
            TransportError: the server stayed unreachable for ``retry_s``.
        """
        fetch = self.fetch
        got = fetch.retrying(lambda: fetch.conn.kv_get(fetch.job, subjects.OFFSETS, self.key))
        stored, was = decode_offsets(got.value, fetch.job) if got is not None else ({}, None)
        for rank, f in fetch.fetches.items():
            p = fetch.positions[rank]
            entry = stored.get(str(rank))
            if entry is not None:
                p.pos, f.seq, p.epoch = self.parse(entry, rank)  # pos None: reset to earliest
                p.history = stored_history(entry)
                stream = fetch.layout.stream(rank)
                if was is not None and was.get(stream) != fetch.stream_ids.get(stream):
                    f.seq = 1  # committed on a stream since deleted and created again: read the new one from its start
                p.resume_seq = f.seq
                self._stored_log(f, p, entry)
            elif self.reset == "latest":
                fetch.to_latest(f, p)
            else:
                fetch.to_earliest(f, p)

    def _stored_log(self, f: RankFetch, p: RankPosition, entry: Dict[str, Any]) -> None:
        """The identity stored with a rank's position: adopted when it is the newest seen;
        when the rank is now of a newer log, the position is reset or marked stale (see the
        module docs). A position stored before identities has none (nothing to compare)."""
        try:
            p.log = LogIdentity.from_value(entry)
        except ValueError as exc:
            raise StreamDataError(f"{self._what(p.rank)} is malformed ({exc}); reset it with `persistent-delta "
                                  "offsets --server ... --reset`") from exc
        newest = self.fetch.logs.get(p.rank)
        if p.log is None or not p.log.older_than(newest):
            try:
                self.fetch.newest(p.rank, p.log, "the stored position")
            except OlderLogError:  # not reached: checked above
                pass
            return
        assert newest is not None
        p.stale = (f"remote consumer {self.name!r} committed batch {p.pos} of {p.log.describe()}, and "
                   f"{self.fetch.where(p.rank)} is now {newest.describe()} (the job was started afresh): that "
                   "position counts batches of a log that is gone")
        if self.reset is None:
            return
        logger.warning("%s; reset to %s", p.stale, self.reset)
        p.stale = ""
        if self.reset == "latest":
            self.fetch.to_latest(f, p)
        else:
            self.fetch.to_earliest(f, p)

    def parse(self, entry: object, rank: int) -> Tuple[Optional[int], int, Optional[str]]:
        """(pos, seq, epoch) of a stored position entry, checked.

        Raises:
            StreamDataError: malformed (reset it with ``offsets --server`` or ``seek``).
        """
        try:
            return parse_entry(entry)
        except ValueError as exc:
            raise StreamDataError(f"{self._what(rank)} is malformed ({exc}); seek() and commit(), or reset it: "
                                  f"persistent-delta offsets --server {self.fetch.server} --job {self.fetch.job} "
                                  f"--reset {self.name} --to-earliest --execute") from exc

    def commit(self) -> Dict[int, int]:
        """Store every known position with its commit history; returns the positions.

        Raises:
            TransportError: the server stayed unreachable for ``retry_s`` (nothing is stored).
        """
        fetch = self.fetch
        positions = {r: int(p.pos) for r, p in fetch.positions.items() if p.pos is not None}
        now = time.time()
        # each rank's commit joins its history, with the stream's end as far as this consumer has
        # read it (its buffered ranges' end): what the health rule judges the lag at each commit by
        histories = {r: (*fetch.positions[r].history, CommitPoint(now, pos, fetch.fetches[r].seen_end(pos))
                         )[-COMMIT_HISTORY:] for r, pos in positions.items()}
        entries = {r: fetch.positions[r].entry(histories[r]) for r in positions}
        value = encode_offsets(self.name, fetch.channel, entries, now, fetch.stream_ids,
                               subjects.stream_name(fetch.job) if fetch.layout.single else None)
        fetch.retrying(lambda: fetch.conn.kv_put(fetch.job, subjects.OFFSETS, self.key, value))
        for r, h in histories.items():
            fetch.positions[r].history = h
        return positions

    def committed(self) -> Dict[int, int]:
        """rank -> the position stored now.

        Raises:
            UnknownConsumerError: nothing stored for this name and channel.
        """
        fetch = self.fetch
        got = fetch.retrying(lambda: fetch.conn.kv_get(fetch.job, subjects.OFFSETS, self.key))
        if got is None:
            raise UnknownConsumerError(f"remote consumer {self.name!r} ({fetch.channel}) of job {fetch.job!r} has no "
                                       "committed position")
        d = codec.unpack(got.value, "remote offsets")
        ranks = d.get("ranks") if isinstance(d, dict) else None
        out: Dict[int, int] = {}
        for r, v in (ranks.items() if isinstance(ranks, dict) else []):
            if str(r).isdigit() and int(r) in fetch.fetches:
                pos = self.parse(v, int(r))[0]
                if pos is not None:
                    out[int(r)] = pos
        return out


__all__ = ["Coordinator"]
