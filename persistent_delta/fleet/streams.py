"""A job's streams: how its ranks are laid out over JetStream streams.

Owns: :class:`Layout` (which stream holds each rank's messages), its record in the job's
``meta`` bucket (key :data:`~persistent_delta.fleet.subjects.LAYOUT_KEY`), reading it
(:func:`read_layout`) and the rule that fixes it (:func:`settle_layout`, the shipper side).

Design note
-----------
Every write of a stream goes through its one Raft leader, so a job shipped into one stream is
capped by one leader (``docs/scaling.md``). A job can instead be laid out over a stream per
**rank group**: ranks ``[g * G, (g + 1) * G)`` ship into stream
:func:`~persistent_delta.fleet.subjects.group_stream_name` ``(job, g)`` whose subjects are
those ranks' subjects (``pd.<job>.*.<rank>.>``), with ``G`` = ``ranks_per_stream``. Subject
names do not change, only which stream captures them; the groups need no world size (a
rank's group is ``rank // G``), and a group's stream is created by the first shipper of one
of its ranks, before that rank's table metadata (so a remote consumer that knows a rank finds
its stream). The job's buckets and base store stay one per job (they carry kilobytes).

The default layout (``ranks_per_stream`` 0) is the single stream ``PD_<job>`` with subjects
``pd.<job>.>``, and stores no key: a job without a ``layout`` key is laid out that way, so
every job shipped before layouts existed reads as it did.

A layout is fixed for the job's life: the first shipper that asks for one records it
(``kv_create``, atomic); a shipper asking for another, or for a layout over groups when the
job already ships into its single stream (or the reverse), gets :class:`StreamLayoutError`
and ships nothing. JetStream itself refuses two streams with overlapping subjects, so the
single stream and a group stream of one job can never both capture a subject; a shipper that
races another layout's first shipper is refused by one of the two checks (each writes its
side, then looks for the other's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional

from persistent_delta.errors import (
    CorruptRecordError,
    FormatMismatchError,
    InvalidInputError,
    KeyConflictError,
    StreamDataError,
    StreamLayoutError,
)
from persistent_delta.fleet import subjects
from persistent_delta.fleet.auth import Keyring, open_value, seal_value
from persistent_delta.fleet.transport import StreamOptions, Transport
from persistent_delta.log import codec

#: The format version of a stored layout.
LAYOUT_VERSION = 1
#: The most ranks one stream of a group layout takes (its subject list has one filter per rank).
MAX_RANKS_PER_STREAM = 4096


def check_ranks_per_stream(value: object) -> Optional[int]:
    """``ranks_per_stream`` as a shipper takes it: None (the job's layout; one stream for a new
    job) or an int in ``[1, MAX_RANKS_PER_STREAM]``.

    Raises:
        InvalidInputError: anything else.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RANKS_PER_STREAM:
        raise InvalidInputError(f"ranks_per_stream must be None or an int in [1, {MAX_RANKS_PER_STREAM}], got {value!r}")
    return value


@dataclass(frozen=True)
class Layout:
    """Which stream holds each rank's messages.

    Attributes:
        job: the job.
        ranks_per_stream: ranks per stream group; 0: the single stream ``PD_<job>`` (the default).
    """

    job: str
    ranks_per_stream: int = 0

    def __post_init__(self) -> None:
        subjects.check_job(self.job)
        if self.ranks_per_stream != 0:
            check_ranks_per_stream(self.ranks_per_stream)

    @property
    def single(self) -> bool:
        """Whether every rank ships into the job's single stream ``PD_<job>``."""
        return self.ranks_per_stream == 0

    def group(self, rank: int) -> int:
        """The stream group of ``rank`` (0 for every rank of the single stream)."""
        return 0 if self.single else int(rank) // self.ranks_per_stream

    def stream(self, rank: int) -> str:
        """The name of the stream that holds ``rank``'s messages."""
        return subjects.stream_name(self.job) if self.single else subjects.group_stream_name(self.job, self.group(rank))

    def stream_subjects(self, rank: int) -> List[str]:
        """The subjects of ``rank``'s stream (every rank of its group)."""
        if self.single:
            return [subjects.stream_subjects(self.job)]
        g = self.group(rank)
        return subjects.rank_subjects(self.job, range(g * self.ranks_per_stream, (g + 1) * self.ranks_per_stream))

    def spec(self, rank: int) -> Dict[str, List[str]]:
        """``{stream: subjects}`` of ``rank``'s stream, for :meth:`Transport.ensure_job`."""
        return {self.stream(rank): self.stream_subjects(rank)}

    def streams(self, ranks: Iterable[int]) -> Dict[str, List[int]]:
        """stream name -> the ones of ``ranks`` it holds (sorted), in group order."""
        out: Dict[str, List[int]] = {}
        for r in sorted({int(r) for r in ranks}, key=lambda r: (self.group(r), r)):
            out.setdefault(self.stream(r), []).append(r)
        return out

    def describe(self) -> str:
        """A line for messages and ``offsets --server``."""
        if self.single:
            return f"one stream ({subjects.stream_name(self.job)})"
        return f"{self.ranks_per_stream} ranks per stream ({subjects.group_stream_name(self.job, 0)}, ...)"

    def encode(self) -> bytes:
        """The body of the ``layout`` key."""
        return codec.pack({"version": LAYOUT_VERSION, "ranks_per_stream": self.ranks_per_stream})

    @classmethod
    def decode(cls, job: str, body: bytes) -> "Layout":
        """A layout from the body of the ``layout`` key.

        Raises:
            FormatMismatchError: another layout format version (a newer shipper).
            StreamDataError: not a layout.
        """
        where = f"job {job} {subjects.META}/{subjects.LAYOUT_KEY}"
        try:
            d = codec.unpack(body, where)
        except CorruptRecordError as exc:
            raise StreamDataError(f"{where}: {exc}", subject=subjects.LAYOUT_KEY) from exc
        if not isinstance(d, dict):
            raise StreamDataError(f"{where}: not a layout", subject=subjects.LAYOUT_KEY)
        if d.get("version") != LAYOUT_VERSION:
            raise FormatMismatchError(f"{where}: layout format {str(d.get('version'))[:20]}, this version reads "
                                      f"{LAYOUT_VERSION}: upgrade persistent_delta")
        g = d.get("ranks_per_stream")
        if isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= MAX_RANKS_PER_STREAM:
            raise StreamDataError(f"{where}: ranks_per_stream {str(g)[:20]} is out of range", subject=subjects.LAYOUT_KEY)
        return cls(job, g)


def _unverified(buf: bytes) -> bytes:
    """The body of a sealed value without checking its authenticator (display only)."""
    d = codec.unpack(buf, "layout value")
    body = d.get("body") if isinstance(d, dict) else None
    if not isinstance(body, bytes):
        raise StreamDataError(f"{subjects.META}/{subjects.LAYOUT_KEY}: not a sealed value", subject=subjects.LAYOUT_KEY)
    return body


def recorded_layout(conn: Transport, job: str, ring: Optional[Keyring]) -> Optional[Layout]:
    """The layout recorded in the job's ``meta`` bucket, or None (the single stream).

    Args:
        conn: the transport.
        job: the job.
        ring: the job's keyring, which the value must authenticate with; None: read it
            unverified (a tool that only displays it).

    Raises:
        AuthenticationError: it does not authenticate with ``ring``.
        StreamDataError / FormatMismatchError: it is not a layout this version reads.
        TransportError: the server cannot be reached (or the bucket does not exist).
    """
    got = conn.kv_get(job, subjects.META, subjects.LAYOUT_KEY)
    if got is None:
        return None
    body = _unverified(got.value) if ring is None else open_value(ring, job, subjects.META, subjects.LAYOUT_KEY, got.value)
    return Layout.decode(job, body)


def read_layout(conn: Transport, job: str, ring: Optional[Keyring]) -> Layout:
    """The job's layout (:func:`recorded_layout`; the single stream when none is recorded)."""
    return recorded_layout(conn, job, ring) or Layout(job)


def settle_layout(conn: Transport, job: str, opts: StreamOptions, ranks_per_stream: Optional[int],
                  ring: Keyring) -> Layout:
    """The layout a shipper ships a job with, creating the job's buckets (and its single stream,
    for that layout) and recording a group layout where the job has none. The shipper side
    only; idempotent.

    Args:
        conn: the transport.
        job: the job.
        opts: the stream options of what this call creates.
        ranks_per_stream: None: the job's recorded layout (the single stream for a new job);
            an int: that many ranks per stream, which must be the job's layout or become it.
        ring: signs the recorded layout.

    Raises:
        StreamLayoutError: the job has another layout.
        TransportError: the server cannot be reached.
    """
    job = subjects.check_job(job)
    want = check_ranks_per_stream(ranks_per_stream)
    conn.ensure_job(job, opts, streams={})  # the buckets
    have = recorded_layout(conn, job, ring)
    if want is None:
        if have is not None:
            return have
        conn.ensure_job(job, opts)  # today's layout: the single stream
        if recorded_layout(conn, job, ring) is not None:  # another shipper recorded a group layout meanwhile
            raise StreamLayoutError(f"job {job!r}: a shipper recorded a layout over several streams while this one "
                                    "created the single stream; stop the shippers and ship under one layout")
        return Layout(job)
    layout = Layout(job, want)
    if have is None:
        single = subjects.stream_name(job)
        if conn.job_exists(job, streams=[single]):
            raise StreamLayoutError(f"job {job!r} already ships into one stream ({single}); a job's layout is fixed "
                                    f"for its life: ship it without ranks_per_stream, or ship under a new job name")
        try:
            conn.kv_create(job, subjects.META, subjects.LAYOUT_KEY,
                           seal_value(ring, job, subjects.META, subjects.LAYOUT_KEY, layout.encode()))
            have = layout
        except KeyConflictError:  # another shipper recorded one first
            have = recorded_layout(conn, job, ring)
        if conn.job_exists(job, streams=[single]):  # a single-stream shipper created it meanwhile
            raise StreamLayoutError(f"job {job!r}: a shipper created the single stream {single} while this one "
                                    "recorded a layout over several streams; stop the shippers and ship under one layout")
    if have != layout:
        raise StreamLayoutError(f"job {job!r} is laid out as {have.describe() if have else 'one stream'}; this "
                                f"shipper asked for {layout.describe()}. A job's layout is fixed for its life: ship "
                                "with the job's layout (leave ranks_per_stream unset to follow it), or under a new job name")
    return layout


__all__ = ["Layout", "LAYOUT_VERSION", "MAX_RANKS_PER_STREAM", "check_ranks_per_stream", "recorded_layout",
           "read_layout", "settle_layout"]
