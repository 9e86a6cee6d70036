"""A rank's shipped ranges as a reader finds them on the stream: what is genuine and latest.

Owns: the rule that a rank's ranges only move forward, for readers that ask "how far has this
rank been shipped" (a shipper catching up after a restart, a remote consumer starting at
``"latest"``, ``end_offsets()``): :func:`scan_markers` reads a rank's range markers in stream
order and keeps the latest genuine one. The stream's last message on the marker subject is not
trusted: another client may have published after it, and a genuine old marker re-published
later (a replay) authenticates.

Design note
-----------
Markers are read forward from where the previous scan stopped (:class:`MarkerScan` keeps it,
so repeated calls read only what is new). A marker that does not authenticate or decode is
reported (``on_reject``) and skipped. Within an epoch, a marker whose end is not past the
latest one is a re-send or a replay and changes nothing, unless it ends there and says the
rank ended more batches (a snapshots progress marker: :mod:`persistent_delta.fleet.wire`). Another epoch takes over only by an
explicit, authenticated epoch start (a marker with ``prev`` None: its shipper registered
afresh); once left, an epoch never comes back (its markers are replays). Across logs the
order is the logs' (:class:`~persistent_delta.log.schema.LogIdentity`): a marker of an older
log of the rank than the newest seen (the scan's ``floor``, or the latest marker's) is the
previous run's, replayed, and is reported and skipped; a newer log's marker takes over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Set

from persistent_delta.errors import (
    CorruptRecordError,
    FormatMismatchError,
    OlderLogError,
    PersistentDeltaError,
    RejectedMessageError,
)
from persistent_delta.fleet import subjects
from persistent_delta.fleet.auth import Keyring, verify_message
from persistent_delta.fleet.transport import Transport
from persistent_delta.fleet.wire import Marker, check_format
from persistent_delta.log.schema import LogIdentity

_BATCH = 512
_BYTES = 8 << 20


@dataclass
class MarkerScan:
    """Where a scan of one rank's markers stands.

    Attributes:
        seq: the next stream sequence to read.
        latest: the latest genuine range marker found (None: none yet).
        left: epochs a later epoch start replaced (their markers are replays).
        rejected: markers that did not authenticate or decode.
        floor: the newest log identity of the rank seen (its table metadata's, the latest
            marker's): markers of an older log are skipped.
    """

    seq: int = 1
    latest: Optional[Marker] = None
    left: Set[str] = field(default_factory=set)
    rejected: int = 0
    floor: Optional[LogIdentity] = None

    def adopt(self, ident: Optional[LogIdentity]) -> None:
        """Raise the floor to ``ident`` when it is newer (never back)."""
        if ident is not None and (self.floor is None or self.floor.older_than(ident)):
            self.floor = ident


def accept(scan: MarkerScan, m: Marker) -> bool:
    """Whether genuine marker ``m`` moves ``scan`` forward (and move it); False for a re-send,
    a replay, a marker of an older log than the scan's floor, or a marker of another epoch
    that does not start it."""
    if m.log is not None and m.log.older_than(scan.floor):
        return False
    scan.adopt(m.log)
    cur = scan.latest
    if cur is not None and cur.log is not None and cur.log.older_than(m.log):
        scan.left.add(cur.epoch)  # a newer log of the rank (started afresh): its markers take over
        scan.latest = m
        return True
    if cur is None:
        scan.latest = m
        return True
    if m.epoch == cur.epoch:
        # a progress marker (or a range) at the same end says the rank's batches ended moved
        if m.end > cur.end or (m.end == cur.end and m.batches_ended > cur.batches_ended):
            scan.latest = m
            return True
        return False
    if m.epoch in scan.left or m.prev is not None:
        return False
    scan.left.add(cur.epoch)
    scan.latest = m
    return True


def scan_markers(conn: Transport, ring: Keyring, job: str, channel: str, rank: int, scan: MarkerScan,
                 on_reject: Callable[[PersistentDeltaError], None], stream: Optional[str] = None) -> MarkerScan:
    """Read rank ``rank``'s markers of ``channel`` from ``scan.seq`` to the stream's end.

    Args:
        conn: the transport.
        ring: the keyring that verifies them.
        job: the job.
        channel: the channel.
        rank: the rank.
        scan: where the previous scan stopped (updated in place).
        on_reject: called with the typed error of each marker that does not authenticate or decode.
        stream: the stream that holds the rank's messages (default: the job's single stream).

    Returns:
        ``scan``.

    Raises:
        TransportError: the server cannot be reached.
        FormatMismatchError: an authenticated marker of another format version.
    """
    subject = subjects.end_subject(job, channel, rank)
    where = f"rank {rank} of job {job} ({channel})"
    while True:
        msgs, more = conn.get_batch(job, subject, scan.seq, _BATCH, _BYTES, stream=stream)
        for seq, subj, headers, data in msgs:
            scan.seq = seq + 1
            try:
                verify_message(ring, job, subj, headers, data, seq)
                check_format(headers, where)
                m = Marker.decode(data, seq, where, headers)
            except FormatMismatchError as exc:
                if not ring.insecure:
                    raise  # authenticated: a newer shipper, not noise
                scan.rejected += 1
                on_reject(exc)
                continue
            except (RejectedMessageError, CorruptRecordError) as exc:  # not authentic, or malformed
                scan.rejected += 1
                on_reject(exc)
                continue
            if m.log is not None and m.log.older_than(scan.floor):
                on_reject(OlderLogError(
                    f"{where}: range marker {seq} [{m.start}, {m.end}) is of {m.log.describe()}, older than the rank's "
                    f"{scan.floor.describe() if scan.floor else '?'}: the previous run's, replayed", subject=subj, seq=seq))
            accept(scan, m)
        if not msgs or not more:
            return scan


__all__ = ["MarkerScan", "accept", "scan_markers"]
