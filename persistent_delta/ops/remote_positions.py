"""What every remote consumer and shipper of a job's stream has done, read from the stream.

Owns: the describe computation for a job's stream (remote consumers' positions from the
``offsets`` bucket, the stream's end per rank from its latest genuine range marker, their health
from the commit history stored with each position, shippers' statistics from the ``meta``
bucket, the job's streams and the ranks each holds) shared by ``persistent-delta offsets
--server``, the exporter and ``top``. A rank's end is read from the stream that holds it (the
job's layout, authenticated: :mod:`persistent_delta.fleet.streams`), under the job's stream key
like any reader of the stream (:class:`StreamEnds`): a marker another client of the server
published is counted and skipped, never shown as the end.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from persistent_delta.errors import PersistentDeltaError, TransportError
from persistent_delta.fleet import subjects
from persistent_delta.fleet.auth import KeySpec, Keyring, resolve_keyring
from persistent_delta.fleet.ranges import MarkerScan, scan_markers
from persistent_delta.fleet.positions import stored_history
from persistent_delta.fleet.streams import Layout, read_layout
from persistent_delta.fleet.connect import open_transport
from persistent_delta.fleet.transport import ConnectOptions, ServerSpec, Transport
from persistent_delta.fleet.wire import MAX_BATCH_IDX, Marker
from persistent_delta.log import codec, position_rules
from persistent_delta.log.schema import SNAPSHOTS, valid_commit_time
from persistent_delta.ops.health import Health, health


@dataclass
class RemoteConsumerRow:
    """One remote consumer on one rank: its position in the stream, its lag in batches and its
    ``health`` (:func:`persistent_delta.ops.health.health` over the commits stored with its
    position, as for a local consumer: ``ok``, ``lagging`` or ``stalled``). A stored entry whose
    commit time or position is out of bounds (any client with write access to the ``offsets``
    bucket can store one) is shown as ``malformed``, the field left unset (None) and
    ``malformed`` saying what was wrong, rather than failing the tool."""

    consumer: str
    channel: str
    rank: int
    offset: Optional[int]
    stream_end: int
    lag: Optional[int]
    commit_time: Optional[float]
    active: bool
    health: str = Health.OK.value
    malformed: str = ""  # what of its stored entry could not be read ("": nothing); health is then "malformed"
    # snapshots: the newest stamp this rank completed the batch of without publishing in it, as
    # the ranks' latest markers say (position_rules.snapshots_behind); None: not behind
    snapshots_behind: Optional[int] = None


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


class StreamEnds:
    """Each rank's latest genuine range marker, per job and channel, as the tools show it.

    Read forward by :func:`persistent_delta.fleet.ranges.scan_markers` under the job's keyring,
    as a remote consumer reads them: the stream's last message is not trusted (another client
    of the server may have published it, and a genuine old marker re-published later
    authenticates). The scans are kept between calls, so a tool that refreshes (``top``, the
    exporter at each scrape) reads only the markers that are new; a stream deleted and created
    again is read from its start. A marker that does not authenticate or decode is skipped and
    counted in :attr:`rejected` (the last one's error in :attr:`last_rejected`). Safe to call
    from several threads (an exporter's scrapes).

    Args:
        ring: the job's keyring (:func:`persistent_delta.fleet.auth.resolve_keyring`; an
            insecure one verifies nothing).
    """

    def __init__(self, ring: Keyring) -> None:
        self.ring = ring
        self.rejected = 0
        self.last_rejected = ""
        self._scans: Dict[Tuple[str, str, str, int], MarkerScan] = {}  # (job, stream, channel, rank)
        self._stream_ids: Dict[Tuple[str, str], str] = {}  # (job, stream) -> its identity when last read
        self._lock = threading.Lock()

    def _reject(self, exc: PersistentDeltaError) -> None:
        self.rejected += 1
        self.last_rejected = str(exc)[:500]

    def _present(self, conn: Transport, job: str, stream: str) -> bool:
        """Whether ``stream`` exists; a stream created again since the last call drops its scans."""
        try:
            sid = conn.stream_id(job, stream=stream)
        except TransportError:
            if conn.job_exists(job, streams=(stream,)):
                raise
            return False  # no stream (yet, or deleted): nothing shipped in it
        if self._stream_ids.get((job, stream)) != sid:
            self._stream_ids[(job, stream)] = sid
            for k in [k for k in self._scans if k[:2] == (job, stream)]:
                del self._scans[k]
        return True

    def latest(self, conn: Transport, job: str, channel: str, ranks: Sequence[int],
               layout: Optional[Layout] = None) -> Dict[int, Optional[Marker]]:
        """rank -> its latest genuine range marker of ``channel`` (None: none), each read from
        the stream that holds it (``layout``: default, the job's recorded one, authenticated).

        Raises:
            TransportError: the server cannot be reached.
            FormatMismatchError: an authenticated marker of another format version.
        """
        with self._lock:
            layout = layout or read_layout(conn, job, self.ring)
            present: Dict[str, bool] = {}
            out: Dict[int, Optional[Marker]] = {}
            for r in ranks:
                stream = layout.stream(r)
                if stream not in present:
                    present[stream] = self._present(conn, job, stream)
                if not present[stream]:
                    out[r] = None
                    continue
                scan = self._scans.setdefault((job, stream, channel, r), MarkerScan())
                out[r] = scan_markers(conn, self.ring, job, channel, r, scan, self._reject, stream=stream).latest
            return out

    def ends(self, conn: Transport, job: str, channel: str, ranks: Sequence[int],
             layout: Optional[Layout] = None) -> Dict[int, int]:
        """rank -> the stream's end of ``channel`` (one past the last batch of its latest genuine
        range; 0 when none): :meth:`latest`'s."""
        return {r: 0 if m is None else m.end for r, m in self.latest(conn, job, channel, ranks, layout).items()}


def stream_ends_of(key: KeySpec, insecure: bool, who: str) -> StreamEnds:
    """A :class:`StreamEnds` under the keyring of ``key`` (a key file, a key, several), else
    ``PERSISTENT_DELTA_STREAM_KEY_FILE``'s; without one, only with ``insecure`` (nothing is
    verified).

    Raises:
        StreamKeyError: no key and not ``insecure``; a key file unreadable or malformed.
    """
    return StreamEnds(resolve_keyring(key, insecure, who))


def behind_note(found: Dict[str, Any]) -> Optional[str]:
    """What ``offsets --server`` and ``top`` say of the ranks behind on the snapshots channel
    (:func:`snapshots_behind`; None: none)."""
    behind = found.get("snapshots_behind") or {}
    return position_rules.behind_note(behind) if behind else None


def rejected_note(found: Dict[str, Any]) -> Optional[str]:
    """What ``offsets --server`` and ``top`` say of the markers :func:`describe_remote` refused
    (None: none)."""
    n = found.get("rejected_markers", 0)
    if not n:
        return None
    return (f"{n} range marker(s) on the stream did not authenticate or decode and were skipped (not shown as any "
            f"rank's end); the last: {found.get('last_rejected', '')}")


def remote_offsets(conn: Transport, job: str) -> List[Dict[str, Any]]:
    """Every remote consumer's stored positions (``name``, ``channel``, ``ranks``: rank -> ``pos``, ``time``)."""
    out = []
    for key, (value, _) in conn.kv_entries(job, subjects.OFFSETS).items():
        d = codec.unpack(value, f"remote offsets {key}")
        if isinstance(d, dict):
            out.append(d)
    return out


def describe_remote(server: ServerSpec, job: str, options: Optional[ConnectOptions] = None,
                    stall_after_s: Optional[float] = None, key: KeySpec = None, insecure: bool = False,
                    ends: Optional[StreamEnds] = None) -> Dict[str, Any]:
    """Every remote consumer (per rank: offset, the stream's end, lag in batches, last commit,
    whether a process holds it now, health), every shipper (statistics) and every stream of
    ``job``, and how many range markers were refused (``"rejected_markers"``: they did not
    authenticate or decode; ``"last_rejected"``: why the last one was).

    Args:
        server: the NATS server(s).
        job: the job.
        options: connection options.
        stall_after_s: the health rule's least silence before ``stalled`` (default:
            :func:`persistent_delta.config.stall_after_s`).
        key: the job's stream key (a key file, a key, or several during a rotation); default
            ``PERSISTENT_DELTA_STREAM_KEY_FILE``.
        insecure: read without a key when none is found (nothing read is verified).
        ends: the markers' scans kept by a caller that refreshes (``key`` and ``insecure`` are
            then unused).

    Raises:
        StreamKeyError: no key and not ``insecure``.
        TransportError: the server cannot be reached.
    """
    ends = ends or stream_ends_of(key, insecure, f"reading job {job}'s stream")
    conn = open_transport(server, options)
    try:
        return describe_stream(conn, job, ends, stall_after_s)
    finally:
        conn.close()


def describe_stream(conn: Transport, job: str, ends: StreamEnds, stall_after_s: Optional[float] = None
                    ) -> Dict[str, Any]:
    """:func:`describe_remote` over an open transport (left open), the ends read by ``ends``."""
    layout = read_layout(conn, job, ends.ring)
    locks = set(conn.kv_entries(job, subjects.LOCKS))
    consumers: List[RemoteConsumerRow] = []
    now = time.time()
    entries: List[Tuple[Dict[str, Any], Dict[int, Any]]] = []
    for d in remote_offsets(conn, job):
        stored = d.get("ranks")
        entries.append((d, {int(r): v for r, v in (stored.items() if isinstance(stored, dict) else [])
                            if str(r).isdigit() and isinstance(v, dict)}))
    wanted: Dict[str, Set[int]] = {}  # channel -> every rank a consumer of it holds: each read once
    for d, ranks in entries:
        wanted.setdefault(str(d.get("channel")), set()).update(ranks)
    end_of = {ch: ends.ends(conn, job, ch, sorted(rs), layout) for ch, rs in wanted.items()}
    known = [int(k[len(subjects.TABLES_KEYS):]) for k in conn.kv_entries(job, subjects.META, subjects.TABLES_KEYS)
             if k[len(subjects.TABLES_KEYS):].isdigit()]
    behind = snapshots_behind(conn, job, ends, known, layout)
    for d, ranks in entries:
        raw_when = d.get("time")
        when = float(raw_when) if valid_commit_time(raw_when) else None  # type: ignore[arg-type]
        bad_when = "" if raw_when is None or when is not None else f"commit time {str(raw_when)[:40]} is not a time"
        end = end_of[str(d.get("channel"))]
        for r, v in sorted(ranks.items()):
            raw = v.get("pos")
            pos = raw if isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw < MAX_BATCH_IDX else None
            bad = "; ".join(b for b in (bad_when, "" if raw is None or pos is not None
                                        else f"position {str(raw)[:40]} is not a position") if b)
            snaps = str(d.get("channel")) == SNAPSHOTS
            state = (Health.MALFORMED if bad else
                     health(stored_history(v), pos or 0, end[r], now, when or 0.0, stall_after_s=stall_after_s,
                            behind=snaps and bool(behind)))
            consumers.append(RemoteConsumerRow(str(d.get("name")), str(d.get("channel")), r, pos, end[r],
                                               None if pos is None else max(0, end[r] - pos), when,
                                               subjects.lock_key(str(d.get("name"))) in locks, state.value, bad,
                                               behind.get(r) if snaps else None))
    shippers: List[ShipperRow] = []
    for key, (value, _) in conn.kv_entries(job, subjects.META, subjects.SHIPPER_KEYS).items():
        s = codec.unpack(value, f"shipper state {key}")
        if not isinstance(s, dict):
            continue
        st = s.get("stats", {})
        shippers.append(ShipperRow(int(st.get("rank", -1)), str(st.get("channel", "")), int(st.get("position", 0)),
                                   int(st.get("log_end", 0)), int(st.get("lag_batches", 0)),
                                   int(st.get("row_bytes", 0)), int(st.get("retries", 0)),
                                   (st.get("last_shipped") or None) if valid_commit_time(st.get("last_shipped")) else None,
                                   str(s.get("host", "")), int(s.get("pid", 0)),
                                   str(st.get("last_error", ""))))
    streams = [StreamRow(name, ranks, layout.describe()) for name, ranks in layout.streams(known).items()]
    return {"consumers": consumers, "shippers": sorted(shippers, key=lambda x: (x.rank, x.channel)), "streams": streams,
            "rejected_markers": ends.rejected, "last_rejected": ends.last_rejected, "snapshots_behind": behind}


def snapshots_behind(conn: Transport, job: str, ends: StreamEnds, ranks: Sequence[int],
                     layout: Optional[Layout] = None) -> Dict[int, int]:
    """The job's ranks behind on the snapshots channel, by the local readers' rule
    (:func:`persistent_delta.log.position_rules.snapshots_behind`) over each rank's latest
    genuine snapshots marker: its end and the batches ended it carries (a rank that ends
    batches without publishing ships progress markers: :mod:`persistent_delta.fleet.wire`),
    holding against other ranks only the publishes the marker shows
    (:meth:`~persistent_delta.fleet.wire.Marker.proven_end`: a range cut short ends at no publish).

    Returns:
        rank -> the newest stamp it completed the batch of without publishing in it.
    """
    latest = {r: m for r, m in ends.latest(conn, job, SNAPSHOTS, ranks, layout).items() if m is not None}
    return position_rules.snapshots_behind({r: (m.end, m.batches_ended) for r, m in latest.items()},
                                           {r: m.proven_end(0) for r, m in latest.items()})


__all__ = ["RemoteConsumerRow", "ShipperRow", "StreamEnds", "StreamRow", "behind_note", "describe_remote",
           "describe_stream", "rejected_note", "remote_offsets", "snapshots_behind", "stream_ends_of"]
