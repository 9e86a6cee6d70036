"""Position rules: what a consumer position means. The one home of the rule.

Owns: channel bounds, where a read at a position starts, whether a position or a range can be
served (exactly), the retention floor and the retention bound, which compactions are safe, and
consumer registration. The tracker (its consume operations: :mod:`persistent_delta.trainer.consume`),
:class:`~persistent_delta.DeltaConsumer`, replay, the offsets tool and verify all ask this module;
none of them decides it on its own.

Design note
-----------
**Positions.** A position is the next batch_idx to read. A read at ``p`` covers
``[read_start(p), end)``, half-open, where ``end`` is the channel end:

* lookups: one past the last *complete* batch. For a tracker's log that is its persisted batch
  index (the batch being recorded is open), or ``closed_end`` once the tracker closed or was
  restarted after a crash (a dead writer's open batch is complete: nothing more can come).
  A plain store's end is one past its last append. The end is never below ``log_start``.
* snapshots: one past the newest *closed* publish stamp. A publish is stamped with the batch
  being recorded (or, when that stamp is closed already, the first stamp after the closed
  ones): every publish of a rank in one batch shares its stamp, which stays **open** --
  stored, not readable (:func:`open_stamp`) -- until the batch ends (the writer's commit of
  the next step), ``flush()`` or ``close()`` closes it (:func:`close_stamps`), or a restart
  does (the dead writer's publishes are complete). So a stamp a reader has read never gets
  more records, and the ranks' stamps follow their batches, however many times each publishes
  in a batch. The snapshots end never moves back: a restart keeps every publish (a reader of
  one rank, such as a shipper, may have read it), and agrees the ranks' ends over the batches
  it drops (the trainer's restart rule). Positions from where retention deleted up to
  (:func:`served_from`) can be served, so a snapshots consumer whose publishes were deleted
  (the retention bound expired it) is told, never silently served only the later ones.
* a rank is **behind** on the snapshots channel (:func:`snapshots_behind`) when another
  rank's snapshots end is above its own while the batches it ended (:func:`batches_ended`) already pass that rank's
  newest stamp: it completed that batch without publishing in it (``publish()`` called on
  some ranks only, or at other steps), and a poll of the job stops at its end for good.

Positions in ``[start, end]`` can be served; ``end + 1`` too, on the lookups channel: the
trainer's own consumers read *through* the open batch (TorchRec's ``get_unique`` includes the
current batch), so while the trainer runs they sit one past the end. That is legal, not
damage, and the tools show it as "read the open batch".

**Read start.** For ``UpdateMode.FIRST``/``NONE`` the writer's window filter stores each id once
per read window (it cannot change any answer of a reader whose position is at or below the
window start). A position strictly inside such a window reads from the window start instead:
``[window_start, p)`` is delivered again (at-least-once, never a lost row), and the result
reports the range it actually read. A range whose start moves back cannot be answered exactly
(:func:`check_exact`), which replay reports instead of mislabelling the rows.

**Retention.** ``delete_on_read`` deletes a channel below its *retention floor*: the smallest
committed position of the channel's consumers that are not expired, and for lookups also the
checkpoint floor (a restore of the latest model checkpoint re-reads what came after it). This
is a durable subscription (Pulsar), not a Kafka group: Kafka retention is by time and size.
A :class:`~persistent_delta.config.RetentionBound` (off by default) expires consumers that
fall too far behind, loudly; an expired consumer no longer holds retention back, and its next
read below the log start raises :class:`OffsetOutOfRangeError` or applies its reset policy.
A reader checks its position against the bounds in one transaction and reads the records in
another: the read checks it again in its own (:func:`check_served`), so retention committed in
between raises too, rather than leave a gap the read does not report.

**Compaction** merges records of a range into one record stamped at the range start, which
changes what a read starting strictly inside the range returns. :func:`safe_compact` therefore
splits a range at every committed position, at the checkpoint floor, at the log start and at
every filtered window's start (where the reads of positions above it begin), never reaches
into the open batch, and leaves alone everything at or above the lowest position
of a ``POLL_COMMIT`` lookups consumer (its uncommitted position may be anywhere up to the end).
The merged record says which batches it covers, so a position that later lands inside them
(a reset, a seek) reads from the merged record: at-least-once, never a lost row.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Collection, Dict, List, Optional, Tuple

from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta.log import codec
from persistent_delta.config import RetentionBound
from persistent_delta.errors import InexactRangeError, InvalidInputError, OffsetOutOfRangeError, UnknownConsumerError
from persistent_delta.log.deltalog import ReadTxn, WriteTxn
from persistent_delta.log.records import (
    compact_range,
    delete_below,
    last_appended,
    log_start,
    snapshot_start,
)
from persistent_delta.log.schema import (
    LOOKUPS,
    META_CHECKPOINT_FLOOR,
    META_CLOSED_END,
    META_CURR_BATCH,
    META_RESTART_GEN,
    META_SNAPSHOT_END,
    META_SNAPSHOT_OPEN,
    META_TRACKER,
    META_UPDATE_MODE,
    SNAPSHOTS,
    ConsumerEntry,
    Delivery,
)

logger = logging.getLogger(__name__)

RESET_POLICIES = ("earliest", "latest")

# Position statuses (the offsets tool's STATUS column).
OK = "ok"
OPEN_BATCH = "read the open batch"
BELOW_START = "below log start"
PAST_END = "past log end"
EXPIRED = "expired"


# ------------------------------------------------------------------------------ bounds


def update_mode(r: ReadTxn, channel: str = LOOKUPS) -> UpdateMode:
    """The merge rule of a channel: the log's update mode for lookups, LAST for snapshots
    (the newest value of a row wins)."""
    if channel == SNAPSHOTS:
        return UpdateMode.LAST
    value = r.meta(META_UPDATE_MODE)
    return UpdateMode(value) if value is not None else UpdateMode.NONE


def lookups_end(r: ReadTxn) -> int:
    """One past the last complete lookups batch (see the module docs); never below the start."""
    return max(batches_ended(r), log_start(r))


def batches_ended(r: ReadTxn) -> int:
    """One past the last batch the trainer ended: :func:`lookups_end` before it is raised to
    the log start (retention may delete up to the trainer's own consumers' positions, past the
    open batch). What :func:`snapshots_behind` compares publish stamps with."""
    if r.meta(META_TRACKER) is not None:
        return max(int(r.meta(META_CURR_BATCH, 0)), int(r.meta(META_CLOSED_END, 0)))
    return last_appended(r) + 1


def restart_generation(r: ReadTxn) -> int:
    """The restart generation of a tracker's log: agreed over the job's ranks and written by
    each rank in the transaction where a multi-rank restart (which drops the batches not every
    rank completed) or restore (which replaces the lost timeline) changes its records. The
    ranks write one after the other: while their generations differ, some ranks' records are
    changed and others' not yet, and a poll must read none of them (:func:`settled`)."""
    return int(r.meta(META_RESTART_GEN, 0))


def settled(generations: Dict[int, int]) -> bool:
    """Whether the ranks' restart generations (rank -> :func:`restart_generation`) agree: no
    restart or restore is half-way through, so a poll over these ranks holds no batch that one
    rank already dropped or replaced and another still holds (a column half)."""
    return len(set(generations.values())) <= 1


def bounds(r: ReadTxn, channel: str) -> Tuple[int, int]:
    """``(start, end)`` of a channel, ``start <= end``: a read at a position covers up to
    ``end`` (exclusive). Lookups: the log start and end. Snapshots: the first stored stamp
    (``end`` when none is stored) and one past the newest stamp."""
    if channel == LOOKUPS:
        return log_start(r), lookups_end(r)
    end = int(r.meta(META_SNAPSHOT_END, 0))
    firsts = [r.first_batch_idx(e.table_id, channel=SNAPSHOTS) for e in r.tables().values()]
    present = [f for f in firsts if f is not None]
    return min(min(present), end) if present else end, end


def open_stamp(w: WriteTxn, stamp: int) -> None:
    """Store that a publish wrote records stamped ``stamp``, not readable yet (see the module
    docs); an open stamp below it is closed first.

    Raises:
        InvalidInputError: ``stamp`` is closed already (a reader may have read past it).
    """
    end = int(w.meta(META_SNAPSHOT_END, 0))
    if stamp < end:
        raise InvalidInputError(f"{w.path}: a publish stamped {stamp}, below the snapshots end {end}: that stamp is "
                                "closed and may have been read")
    close_stamps(w, stamp)
    w.set_meta(META_SNAPSHOT_OPEN, stamp)


def close_stamps(w: WriteTxn, below: Optional[int] = None) -> int:
    """Close the open publish stamp (make its records readable: the snapshots end moves past
    it) when it lies below ``below`` (None: whatever it is); returns the snapshots end."""
    end = int(w.meta(META_SNAPSHOT_END, 0))
    stamp = int(w.meta(META_SNAPSHOT_OPEN, -1))
    if stamp >= 0 and (below is None or stamp < below):
        end = max(end, stamp + 1)
        w.set_meta(META_SNAPSHOT_END, end)
        w.set_meta(META_SNAPSHOT_OPEN, -1)
    return end


def published_end(r: ReadTxn) -> int:
    """The snapshots end once the open stamp is closed: one past the newest stamp stored."""
    stamp = snapshot_open(r)
    return max(int(r.meta(META_SNAPSHOT_END, 0)), -1 if stamp is None else stamp + 1)


def snapshot_open(r: ReadTxn) -> Optional[int]:
    """The open publish stamp (stored, not readable yet), or None."""
    stamp = int(r.meta(META_SNAPSHOT_OPEN, -1))
    return stamp if stamp >= 0 else None


def snapshots_behind(ends: Dict[int, Tuple[int, int]], proven: Optional[Dict[int, int]] = None) -> Dict[int, int]:
    """The ranks behind on the snapshots channel (see the module docs).

    Args:
        ends: rank -> ``(snapshots end, batches ended)`` of each rank of the job
            (:func:`batches_ended`).
        proven: rank -> one past the newest publish stamp the rank is known to hold, where that
            is below its snapshots end (a remote consumer's view of a range a shipper cut short:
            its end is a cut, not a publish); a rank left out: its snapshots end. Only a stamp a
            rank is known to hold makes another rank behind.

    Returns:
        rank -> the newest publish stamp another rank holds and this one completed the batch of
        without publishing in it (ranks not behind are left out).
    """
    stamps = [min(e, (proven or {}).get(rank, e)) for rank, (e, _) in ends.items()]
    out: Dict[int, int] = {}
    for rank, (snap, looked) in ends.items():
        missed = [e - 1 for e in stamps if e > snap and looked >= e]
        if missed:
            out[rank] = max(missed)
    return out


def behind_note(behind: Dict[int, int]) -> str:
    """What :func:`snapshots_behind` found, and what to do about it (one wording for the
    readers, ``apply_poll`` and the tools)."""
    ranks = "; ".join(f"rank {r} completed batch {s} without publishing in it" for r, s in sorted(behind.items()))
    return (f"ranks {sorted(behind)} are behind on the snapshots channel ({ranks}, while other ranks published in "
            "it): a poll of the job stops at their end, so the replicas keep every later publish's rows stale. Call "
            "tracker.publish(consumer) on every rank at the same steps (a publish is a per-rank call, not a "
            "collective: publishing on rank 0 only, or in a per-rank loop that stops at a different step on each "
            "rank, leaves the other ranks' shards unpublished)")


def served_from(r: ReadTxn, channel: str) -> int:
    """Positions below this cannot be served: what a read there needs was deleted. Lookups:
    the log start. Snapshots: where retention deleted up to (0 until it has), at or below the
    first stored stamp: a position between the two missed nothing (no publish was stamped
    there)."""
    return log_start(r) if channel == LOOKUPS else min(snapshot_start(r), bounds(r, channel)[0])


def check_served(r: ReadTxn, position: int, channel: str) -> None:
    """Raise unless a read at ``position`` can be served in ``r`` (:func:`served_from`). A
    reader checks its position against the bounds in one transaction and reads the records in
    the next; retention committed in between (the trainer's next publish or consume) would
    leave the read the batches after the deleted ones, reported as read from ``position``.

    Raises:
        OffsetOutOfRangeError: ``position`` is below :func:`served_from` in ``r``.
    """
    floor = served_from(r, channel)
    if position < floor:
        raise OffsetOutOfRangeError(
            f"{r.path}: a {channel} read at batch {position}: retention deleted up to batch {floor} after the position "
            "was checked; nothing was read")


def snapshots_covered_from(r: ReadTxn, start: int) -> int:
    """How far back a snapshots read starting at ``start`` misses nothing: ``start``, moved back
    over the batches below it where no publish is stored and none was deleted -- to one past
    the newest stamp stored below it, never below :func:`served_from`. A read at ``start``
    holds every publish stamped from the returned batch on: it continues a replica's base of
    any position from there up to ``start`` (:mod:`persistent_delta.read.base`)."""
    newest = -1
    for entry in r.tables().values():
        for table_id in (entry.table_id, codec.side_table_id(entry.table_id)):
            found = r.last_record_before(table_id, start, channel=SNAPSHOTS)
            if found is not None:
                newest = max(newest, found[0])
    return min(start, max(newest + 1, served_from(r, SNAPSHOTS)))


def checkpoint_floor(r: ReadTxn) -> Optional[int]:
    """The first batch after the latest model checkpoint (records from it on are kept)."""
    v = r.meta(META_CHECKPOINT_FLOOR)
    return None if v is None else int(v)


def read_start(r: ReadTxn, position: int, channel: str = LOOKUPS) -> int:
    """Where a read at ``position`` starts so that it misses nothing (see the module docs):
    ``position``, or earlier when it lies inside a filtered window (the window start) or inside
    a compacted record's range (the record's stamp) -- repeated until neither moves it -- and
    never below the log start (nothing is stored there)."""
    if channel != LOOKUPS:
        return position
    floor = min(log_start(r), position)
    p = position
    while p > floor:
        q = p
        for entry in r.tables().values():
            after = r.first_record_at(entry.table_id, q)
            if after is not None:
                w, _ = codec.record_bounds(after[1])
                if w is not None and w < q:
                    q = w
            before = r.last_record_before(entry.table_id, q)
            if before is not None:
                _, covers = codec.record_bounds(before[1])
                if covers is not None and covers > q:
                    q = before[0]
        if q >= p:
            break
        p = q
    return max(p, floor)


def check_exact(r: ReadTxn, start: int, what: str) -> None:
    """Raise unless a read of ``[start, ...)`` is exact (its read start is ``start``).

    Raises:
        InexactRangeError: ``start`` lies inside a filtered window; the message says how to
            get an exact answer.
    """
    begin = read_start(r, start)
    if begin < start:
        raise InexactRangeError(
            f"{r.path}: {what} starting at batch {start} cannot be answered exactly: the trainer wrote each row once "
            f"per read window (no out-of-process consumer was registered), and batch {start} lies inside a window "
            f"that started at batch {begin}. Start at batch {begin} (the window start) instead, read with a consumer "
            "(its range is reported), or register an out-of-process consumer before training so that every batch is "
            "written whole"
        )


def position_status(entry: ConsumerEntry, start: int, end: int, floor: Optional[int] = None) -> str:
    """How a committed position relates to its channel's ``[start, end]`` (see the module docs);
    ``floor``: :func:`served_from` (default ``start``, as on the lookups channel)."""
    if entry.expired:
        return EXPIRED
    if entry.offset < (start if floor is None else floor):
        return BELOW_START
    if entry.offset <= end:
        return OK
    if entry.offset == end + 1 and entry.channel == LOOKUPS:
        return OPEN_BATCH
    return PAST_END


def serve_position(
    position: int, start: int, end: int, channel: str, reset: Optional[str], name: str, where: str,
    floor: Optional[int] = None, root: Optional[str] = None,
) -> int:
    """The position a read at ``position`` may use: itself when it can be served, else moved
    by the ``reset`` policy (``"earliest"``: the start, ``"latest"``: the end). ``floor``:
    :func:`served_from` (default ``start``, as on the lookups channel). ``root``: the log root
    of a registered consumer ``name`` (its error advises the offsets tool); None for an
    unregistered reader (its position lives in memory: the advice is the reader's own
    arguments).

    Raises:
        OffsetOutOfRangeError: it cannot be served and ``reset`` is None.
    """
    below = position < (start if floor is None else floor)
    above = position > end + 1
    if not (below or above):
        return position
    if reset is None:
        why = (
            f"below the log start {start}: those batches were deleted (retention, expiry, or clear while this consumer "
            "was not registered)" if below else f"past the log end {end} (the log was started afresh?)"
        )
        if root is None:
            raise OffsetOutOfRangeError(
                f"this reader (unregistered) is at batch {position}, {why}, in {where}. Start it within the log "
                f"(start='earliest', 'latest' or a batch in [{start}, {end}]), or pass reset='earliest' or 'latest'"
            )
        raise OffsetOutOfRangeError(
            f"consumer {name!r} is at batch {position}, {why}, in {where}. Pass reset='earliest' or 'latest', or run "
            f"`persistent-delta offsets {root} --reset {name} --to-earliest --execute`"
        )
    new = start if reset == "earliest" else end
    logger.warning("consumer %r in %s: position %d out of [%d, %d]; reset to %s (%d)", name, where, position, start, end,
                   reset, new)
    return new


def poll_stops(
    positions: Dict[int, int], ends: Dict[int, int], job_ranks: Optional[Collection[int]], max_batches: Optional[int]
) -> Dict[int, int]:
    """Where a poll of several ranks stops, per rank (complete batches only).

    ``positions``: rank -> where its read starts; ``ends``: rank -> how far that rank's data
    reaches (exclusive), for the ranks that have any; ``job_ranks``: the job's ranks (a
    tracker's job), or None (a plain store: each rank reads up to its own end). For a job, a
    poll reads only batches that *every* rank of the job has completed: the smallest end over
    the job's ranks, and nothing while a rank of the job has no data source at all. At most
    ``max_batches`` per rank; never below the position. Local readers and remote consumers
    (:mod:`persistent_delta.fleet.remote`) both stop here.
    """
    common: Optional[int] = None
    if job_ranks is not None:
        common = 0 if set(job_ranks) - set(ends) else min(ends[r] for r in job_ranks)
    stops: Dict[int, int] = {}
    for rank, pos in positions.items():
        end = ends[rank] if common is None else min(common, ends[rank])
        stops[rank] = max(pos, end if max_batches is None else min(end, pos + max_batches))
    return stops


def registration_offset(r: ReadTxn, channel: str, latest: bool) -> int:
    """Where a new registration starts: the channel start, or its end with ``latest``."""
    start, end = bounds(r, channel)
    return end if latest else start


# ------------------------------------------------------------------------------ retention


def lookups_consumers(consumers: Dict[str, ConsumerEntry]) -> Dict[str, ConsumerEntry]:
    return {k: v for k, v in consumers.items() if v.channel == LOOKUPS}


def has_poll_commit_reader(consumers: Dict[str, ConsumerEntry]) -> bool:
    """Whether a consumer that polls and commits separately reads the lookups channel: the
    trainer then neither filters nor compacts (each batch reaches it exactly once)."""
    return any(v.delivery == Delivery.POLL_COMMIT for v in lookups_consumers(consumers).values())


def retention_floor(r: ReadTxn, channel: str) -> Optional[int]:
    """Below this a channel may be deleted: the smallest committed position of its consumers
    that are not expired, and (lookups) at most the checkpoint floor, moved back to where a
    read there starts. None without consumers."""
    offsets = [v.offset for v in r.consumers().values() if v.channel == channel and not v.expired]
    if not offsets:
        return None
    floor = min(offsets)
    if channel == LOOKUPS:
        cp = checkpoint_floor(r)
        if cp is not None:
            floor = min(floor, cp)
        # a position inside a filtered window or a compacted record reads from further back
        floor = read_start(r, floor)
    return floor


def _expire(w: WriteTxn, bound: RetentionBound, channel: str) -> List[str]:
    """Mark a channel's consumers beyond the retention bound expired; returns their names."""
    _, end = bounds(w, channel)
    live = {k: v for k, v in w.consumers().items() if v.channel == channel and not v.expired}
    doomed: List[str] = []
    if bound.max_batches is not None:
        doomed += [k for k, v in live.items() if end - v.offset > bound.max_batches]
    if bound.max_bytes is not None:
        rest = sorted((v.offset, k) for k, v in live.items() if k not in doomed)
        while rest:
            lowest = rest[0][0]
            held = sum(n for e in w.tables().values() for _, _, n in w.iter_record_keys(e.table_id, lowest, end, channel))
            if held <= bound.max_bytes:
                break
            doomed.append(rest.pop(0)[1])
    for name in doomed:
        entry = dataclasses.replace(live[name], expired=True)
        w.set_consumer(name, entry)
        logger.warning(
            "EXPIRED consumer %r (%s) of %s: it is at batch %d, %d batches behind the channel end %d, beyond the "
            "retention bound %s; it no longer holds back retention and its next read below the channel start fails "
            "(or resets)", name, channel, w.path, entry.offset, end - entry.offset, end, bound,
        )
    return doomed


def enforce_retention(w: WriteTxn, channel: str, bound: Optional[RetentionBound] = None) -> Tuple[int, int]:
    """``delete_on_read``: expire the channel's consumers beyond ``bound``, then delete the
    channel below its retention floor. Returns (records, bytes) deleted."""
    if bound is not None and bound.enabled:
        _expire(w, bound, channel)
    floor = retention_floor(w, channel)
    if floor is None:
        return 0, 0
    n, nbytes = delete_below(w, floor, channel=channel)
    if n:
        logger.debug("retention (%s): deleted %d records (%d bytes) below batch %d in %s", channel, n, nbytes, floor,
                     w.path)
    return n, nbytes


# ------------------------------------------------------------------------------ compaction


def safe_pieces(r: ReadTxn, start: int, end: int) -> List[Tuple[int, int]]:
    """``[start, end)`` cut into pieces that no reader can be positioned strictly inside (see
    the module docs). Empty when nothing in it may be merged."""
    consumers = lookups_consumers(r.consumers())
    end = min(end, lookups_end(r))  # never the open batch: a reader registered at the end starts there
    polled = [v.offset for v in consumers.values() if v.delivery == Delivery.POLL_COMMIT]
    if polled:
        end = min(end, min(polled))  # a poller's uncommitted position may be anywhere above
    cuts = {v.offset for v in consumers.values()}
    if consumers:  # a consumer may register at the log start: nothing merged across it (a plain
        cuts.add(log_start(r))  # store without consumers compacts exactly as DeltaStoreTrec)
    cp = checkpoint_floor(r)
    if cp is not None:
        cuts.add(cp)
    if start < end:
        cuts.update(_window_starts(r, start, end))
    points = [start] + sorted(c for c in cuts if start < c < end) + [end]
    return [(a, b) for a, b in zip(points, points[1:]) if b > a]


def _window_starts(r: ReadTxn, start: int, end: int) -> Collection[int]:
    """The filtered windows' starts inside ``(start, end)``: a position at or above one of them
    reads from it (:func:`read_start`), so no piece may merge records across it (that would move
    the read start down to the piece's start, and change the read)."""
    found = set()
    for entry in r.tables().values():
        for _, _, value in r.iter_record_views(entry.table_id, start, end):
            w, _ = codec.record_bounds(value)
            if w is not None and start < w < end:
                found.add(w)
    return found


def safe_compact(w: WriteTxn, mode: UpdateMode, start: int, end: int) -> Dict[str, int]:
    """Compact ``[start, end)`` piece by piece (:func:`safe_pieces`); returns records merged
    per table. A range split or cut short is logged."""
    if start >= end:
        return {}
    pieces = safe_pieces(w, start, end)
    if pieces != [(start, end)]:
        logger.info("compaction of [%d, %d) in %s limited to %s (consumer positions / checkpoint floor)",
                    start, end, w.path, pieces)
    merged: Dict[str, int] = {}
    for a, b in pieces:
        for fqn, n in compact_range(w, mode, a, b).items():
            merged[fqn] = merged.get(fqn, 0) + n
    return merged


def compact_behind(w: WriteTxn, mode: UpdateMode, end: int) -> Dict[str, int]:
    """``auto_compact``: compact ``[largest position, end)`` (positions read inside ``w``:
    another process may have committed since)."""
    return safe_compact(w, mode, max(committed_offsets(w).values(), default=0), end)


# ------------------------------------------------------------------------------ registration


def register(w: WriteTxn, name: str, offset: int, channel: str, how: Delivery, fmt: str = "native") -> bool:
    """Register ``name`` at ``offset`` (asking for rows in ``fmt``) unless it exists; returns
    whether it was added."""
    if w.consumer(name) is not None:
        return False
    w.set_consumer(name, ConsumerEntry.new(offset, channel, how, fmt))
    return True


def unregister(w: WriteTxn, name: str) -> None:
    """Unregister ``name``: it no longer holds back retention.

    Raises:
        UnknownConsumerError: it is not registered.
    """
    if not w.delete_consumer(name):
        raise UnknownConsumerError(f"consumer {name!r} is not registered in {w.path}")


def clear(w: WriteTxn, name: Optional[str]) -> None:
    """TorchRec's ``clear``: ``None`` deletes every lookup; a consumer's name deletes all only
    when it is the only consumer (otherwise nothing).

    Raises:
        UnknownConsumerError: ``name`` is not registered.
    """
    if name is not None:
        consumers = w.consumers()
        if name not in consumers:
            raise UnknownConsumerError(f"consumer {name} not found in {sorted(consumers)} ({w.path})")
        if len(consumers) > 1:
            return
    delete_below(w, None)


def committed_offsets(r: ReadTxn, channel: str = LOOKUPS) -> Dict[str, int]:
    """name -> committed position of a channel's consumers."""
    return {k: v.offset for k, v in r.consumers().items() if v.channel == channel}
