"""Hypothesis state machine: the position rules (:mod:`persistent_delta.log.position_rules`) on a plain
LMDB log, without a DMP, against a simple reference.

The log is driven the way the tracker drives it -- batches appended through
``writer.commit_operations`` with one shared :class:`WindowFilter`, TorchRec's in-transaction
``get_unique`` (``consume.consume``), ``DeltaConsumer``-style poll/commit reads, compaction
through ``position_rules.safe_compact``, retention through ``position_rules.enforce_retention`` and the model
checkpoint mark -- and every read is compared with the update-mode rule applied to the raw
batches (plain Python dicts, not :mod:`persistent_delta.log.rows`).

The reference for a read at position ``p`` up to ``end`` whose read start is ``s``
(``position_rules.read_start``, reported by polls) on a log starting at ``L``:

* ``s <= p`` and never a lost row: every row touched in ``[max(p, L), end)`` is returned, and
  only rows touched in ``[max(s, L), end)`` are;
* a read that did not move back (``s == p``) is exact: the update mode's rule over
  ``[max(p, L), end)``, FIRST keeping the first state and LAST the last one. LAST never moves
  back; neither does a read where no batch at or after ``p`` was written while the window filter
  could drop rows (a ``POLL_COMMIT`` consumer was registered): successive polls then cover
  adjacent ranges, each batch reaching a poller exactly once, in order;
* a read that moved back into a filtered window (FIRST/NONE) delivers ``[s, p)`` again, at
  least partially (``s`` may itself lie inside an older window that dropped ids of ``[s, p)``),
  and each FIRST state is the first occurrence from some batch in ``[max(s, L), max(p, L)]``.

Compaction must not change any registered consumer's next read (nor what a restore re-delivers
from the checkpoint floor), and retention must delete nothing at or above a non-expired
consumer's position or the checkpoint floor. Minimal cases the machine found stay at the end of
the file as regression tests, one rule each.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torchrec.distributed.model_tracker.types import UniqueRows, UpdateMode

from persistent_delta.log import position_rules
from persistent_delta.trainer import consume
from persistent_delta.read import fetch
from persistent_delta.config import RetentionBound
from persistent_delta.errors import OffsetOutOfRangeError
from persistent_delta.log.deltalog import DeltaLog, ReadTxn
from persistent_delta.log.records import AppendRecord, log_start, read_unique
from persistent_delta.trainer.restore import mark_checkpoint
from persistent_delta.log.schema import (
    LOOKUPS,
    META_CHECKPOINT_FLOOR,
    META_CURR_BATCH,
    META_TRACKER,
    ConsumerEntry,
    Delivery,
    TrackerMeta,
)
from persistent_delta.trainer.window import WindowFilter
from persistent_delta.trainer.operations import StepWrite
from persistent_delta.trainer.writer import commit_operations

TABLES = ("t0", "t1")
ROWS = 20  # small id range: ids repeat across batches, so the filter and FIRST/LAST matter
ITX, POLL = Delivery.IN_TRANSACTION, Delivery.POLL_COMMIT

# table -> id -> state (a tuple, or None in NONE mode)
Rows = Dict[str, Dict[int, Optional[Tuple[float, ...]]]]
Raw = List[Tuple[int, str, List[int], Optional[List[Tuple[float, float]]]]]


def reference(raw: Raw, mode: UpdateMode, start: int, end: int) -> Rows:
    """The update-mode rule over the raw batches in ``[start, end)``, in append order."""
    out: Rows = {}
    for b, fqn, ids, states in raw:
        if not start <= b < end:
            continue
        rows = out.setdefault(fqn, {})
        for i, x in enumerate(ids):
            if mode == UpdateMode.LAST or x not in rows:
                rows[x] = None if states is None else states[i]
    return {fqn: rows for fqn, rows in out.items() if rows}


def as_rows(rows: Dict[str, UniqueRows], mode: UpdateMode) -> Rows:
    """A read result in the reference's shape (tables with nothing dropped)."""
    out: Rows = {}
    for fqn, u in rows.items():
        ids = u.ids.tolist()
        assert ids == sorted(set(ids)), f"{fqn}: ids not ascending and unique: {ids}"
        if mode == UpdateMode.NONE:
            assert u.states is None
            got = {x: None for x in ids}
        else:
            assert u.states is not None and u.states.shape == (len(ids), 2)
            got = {x: tuple(s) for x, s in zip(ids, u.states.tolist())}
        if got:
            out[fqn] = got
    return out


@dataclass
class Consumer:
    delivery: Delivery
    committed: int
    pos: int  # the next batch a poller reads (uncommitted); == committed for in-transaction
    expired: bool = False


# One batch: (advance of the batch index -- a gap is batches that looked nothing up, records as
# (table, ids)). Several records of one table in a batch are merged by the writer's dedup.
BATCH = st.tuples(
    st.sampled_from([1, 1, 2, 3]),
    st.lists(
        st.tuples(
            st.sampled_from(TABLES),
            st.lists(st.integers(0, ROWS - 1), max_size=8),
        ),
        min_size=1,
        max_size=3,
    ),
)


class PositionRulesMachine(RuleBasedStateMachine):
    """One log, one update mode per example (see the module docs for the reference).

    The log carries the tracker's meta (``META_TRACKER`` and ``META_CURR_BATCH``), not the
    plain store's: its end is then the open batch (``curr``), the trainer's in-transaction
    consumers read *through* it (``end = curr + 1``, status "read the open batch") while
    pollers only read complete batches, and a consumer registered at the end sits *on* the
    open batch, which the window filter may already have filtered. That is the tracker's
    situation, and the one where positions land strictly inside filtered windows; a plain
    store's end (last appended + 1) never has a record at it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="pd-position-rules-")
        self.log: Optional[DeltaLog] = None

    def teardown(self) -> None:
        if self.log is not None:
            self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ setup
    @initialize(
        mode=st.sampled_from([UpdateMode.FIRST, UpdateMode.NONE, UpdateMode.LAST]),
        history=st.lists(BATCH, min_size=2, max_size=6),
    )
    def open_log(self, mode: UpdateMode, history) -> None:
        """A fresh tracker log with its default consumer at 0, and a few batches recorded."""
        self.mode = mode
        self.log = DeltaLog(self.dir, update_mode=mode.value)
        self.window = WindowFilter(mode)  # shared across steps, as the tracker's writer keeps it
        tracker = TrackerMeta("model-test", mode.value, list(TABLES), 0).to_value()

        def setup(w):
            w.set_meta(META_TRACKER, tracker)
            # the tracker registers its default consumer at 0 when it creates the log
            w.set_consumer("default", ConsumerEntry.new(0, LOOKUPS, ITX))

        self.log.write(setup)
        self.consumers: Dict[str, Consumer] = {"default": Consumer(ITX, 0, 0)}
        self.curr = 0  # META_CURR_BATCH: the open batch (0 before the first one)
        self.raw: Raw = []
        self.filterable: Set[int] = set()  # batches committed while the filter could drop rows
        self.start = 0  # the model's log start
        self.last_start = 0  # the log start seen by the last invariant check
        self.cp: Optional[int] = None  # the checkpoint floor
        self.next_state = 1
        self.registered = 0
        self.append(history)

    # ------------------------------------------------------------------ helpers
    def _names(self, kind: Delivery) -> List[str]:
        return sorted(n for n, c in self.consumers.items() if c.delivery == kind)

    def _end(self) -> int:
        return max(self.curr, self.start)  # position_rules.lookups_end of a tracker log

    def _check_read(self, what: str, p: int, s: int, end: int, got: Rows, start: int) -> None:
        """A read at position ``p`` that reports read start ``s``, up to ``end``, the log start
        being ``start``. The reference (see the module docs):

        * ``s <= p``; nothing lost: every row touched in ``[max(p, start), end)`` is returned;
          nothing foreign: every row returned was touched in ``[max(s, start), end)``;
        * exact when the read did not move back (``s == p``, or both below the log start): the
          rows are the update mode's rule over ``[max(p, start), end)``;
        * moved back into a filtered window (FIRST/NONE only): a FIRST state is the first
          occurrence from some batch ``q`` in ``[max(s, start), max(p, start)]``. (Not
          necessarily from ``s`` itself: the window start ``s`` may lie inside an older
          window whose filter dropped ids from ``[s, p)``, so ``[s, p)`` comes back partially.)
        * nothing at or after ``p`` was written while the filter could drop rows (LAST, or a
          poller registered): ``s == p`` -- polls are then exactly-once, in order.
        """
        assert s <= p, f"{what}: read start {s} above the position {p}"
        assert s >= min(p, start), f"{what}: read start {s} below the log start {start} (nothing is stored there)"
        if s < p:
            event("a read moved back into a filtered window")
        lo, hi = max(s, start), max(p, start)
        touched = reference(self.raw, UpdateMode.NONE, hi, end)
        for fqn, rows in touched.items():
            lost = sorted(set(rows) - set(got.get(fqn, {})))
            assert not lost, f"{what}: rows touched in [{hi}, {end}) never delivered: {fqn} {lost}"
        if not any(b >= p for b in self.filterable):
            assert s == p, f"{what}: nothing at or after {p} was filtered, yet the read started at {s}"
        if lo == hi:
            want = reference(self.raw, self.mode, hi, end)
            assert got == want, f"{what}: read [{hi}, {end}) differs from the reference\n got  {got}\n want {want}"
            return
        assert self.mode != UpdateMode.LAST, f"{what}: LAST moved its read start back to {s}"
        allowed = reference(self.raw, UpdateMode.NONE, lo, end)
        firsts = [reference(self.raw, self.mode, q, end) for q in range(lo, hi + 1)]
        for fqn, rows in got.items():
            for x, state in rows.items():
                assert x in allowed.get(fqn, {}), f"{what}: {fqn} id {x} not touched in [{lo}, {end})"
                cands = {f[fqn][x] for f in firsts if x in f.get(fqn, {})}
                assert state in cands, f"{what}: {fqn} id {x}: {state} is no first state from [{lo}, {hi}]: {cands}"

    def _read_positions(self, r: ReadTxn):
        """What every registered consumer's next read returns now (without committing)."""
        start, end = position_rules.bounds(r, LOOKUPS)
        out = {}
        for name, c in sorted(self.consumers.items()):
            if c.delivery == ITX:
                s = position_rules.read_start(r, c.committed)
                out[name] = (s, as_rows(read_unique(r, self.mode, from_idx=s), self.mode))
                continue
            for which, pos in (("committed", c.committed), ("uncommitted", c.pos)):
                try:
                    p = position_rules.serve_position(pos, start, end, LOOKUPS, None, name, "model")
                except OffsetOutOfRangeError:
                    out[name, which] = "out of range"
                    continue
                d = fetch.read_range(r, 0, self.log.path, p, end)
                rows = as_rows({t.fqn: t.rows for t in d.tables.values()}, self.mode)
                out[name, which] = (d.start_idx, d.end_idx, rows)
        if self.cp is not None:  # what a restore re-delivers: the records from the checkpoint floor on
            out["checkpoint floor"] = as_rows(read_unique(r, self.mode, from_idx=self.cp), self.mode)
        return out

    def _keys_from(self, r: ReadTxn, start: int):
        return {(fqn, b, s) for fqn, e in r.tables().items() for b, s, _ in r.iter_record_keys(e.table_id, start)}

    def _retention_start(self, k: Optional[int]) -> Tuple[Set[str], int]:
        """The model of enforce_retention: the consumers expired afterwards, and the log start."""
        committed = {n: c.committed for n, c in self.consumers.items()}
        expired = {n for n, c in self.consumers.items() if c.expired}
        if k is not None:
            end = self._end()
            expired |= {n for n, off in committed.items() if end - off > k}
        live = [off for n, off in committed.items() if n not in expired]
        if not live:
            return expired, self.start
        floor = min(live) if self.cp is None else min(min(live), self.cp)
        # a position inside a filtered window (or a compacted record) reads from further back:
        # retention keeps what that read needs
        floor = self.log.read(lambda r: position_rules.read_start(r, floor))
        return expired, max(self.start, floor)

    def _retain(self, k: Optional[int]) -> None:
        expired, self.start = self._retention_start(k)
        for name in expired:
            self.consumers[name].expired = True

    def _check_retention(self, before_start: int) -> None:
        """Nothing at or above a live position or the checkpoint floor was deleted; expired
        consumers below the log start are refused by serve_position."""
        start, end = self.log.read(lambda r: position_rules.bounds(r, LOOKUPS))
        assert start == self.start, f"log start {start}, expected {self.start}"
        if start > before_start:
            for name, c in self.consumers.items():
                if not c.expired:
                    assert start <= c.committed, f"retention deleted at/above {name}'s position {c.committed}"
            assert self.cp is None or start <= self.cp, f"retention deleted at/above the checkpoint floor {self.cp}"
        entries = self.log.read(lambda r: r.consumers())
        for name, c in self.consumers.items():
            assert entries[name].expired == c.expired, f"{name}: expired {entries[name].expired}, expected {c.expired}"
            if c.committed < start:  # (expired, or a poller that committed a stale position)
                try:
                    position_rules.serve_position(c.committed, start, end, LOOKUPS, None, name, "model")
                except OffsetOutOfRangeError:
                    pass
                else:
                    raise AssertionError(f"{name} at {c.committed} below the log start {start} was served")
            else:
                assert position_rules.serve_position(c.committed, start, end, LOOKUPS, None, name, "model") == c.committed

    # ------------------------------------------------------------------ rules: the writer
    @rule(batches=st.lists(BATCH, min_size=1, max_size=4))
    def append(self, batches) -> None:
        """A few batches, each as the tracker's writer commits it: the window filter, then
        per-(table, batch) dedup of its records, with the batch index as meta."""
        for advance, recs in batches:
            self._append_batch(self.curr + advance, recs)

    def _append_batch(self, b: int, recs) -> None:
        records = []
        for fqn, ids in recs:
            states = None
            if self.mode != UpdateMode.NONE:  # distinct values: FIRST and LAST differ visibly
                states = [(float(self.next_state + i), self.next_state + i + 0.5) for i in range(len(ids))]
                self.next_state += len(ids)
            t_states = None if states is None else torch.tensor(states, dtype=torch.float32).reshape(len(ids), 2)
            records.append(AppendRecord(b, fqn, torch.tensor(ids, dtype=torch.int64), t_states))
            self.raw.append((b, fqn, list(ids), states))
        if self.mode != UpdateMode.LAST and not self._names(POLL):
            self.filterable.add(b)
        commit_operations(self.log, self.mode, [StepWrite(records=records, curr_batch_idx=b)], self.window)
        self.curr = b

    @rule()
    def checkpoint(self) -> None:
        """tracker.state_dict(): records from the batch after the checkpoint on are kept."""
        self.log.write(lambda w: mark_checkpoint(w, self.curr))
        self.cp = self.curr + 1
        assert self.log.read(lambda r: r.meta(META_CHECKPOINT_FLOOR)) == self.cp

    # ------------------------------------------------------------------ rules: consumers
    @precondition(lambda self: self.registered < 4)
    @rule(poll=st.booleans(), latest=st.booleans())
    def register(self, poll: bool, latest: bool) -> None:
        kind = POLL if poll else ITX
        name = f"{'poll' if poll else 'itx'}{self.registered}"
        self.registered += 1

        def add(w):
            offset = position_rules.registration_offset(w, LOOKUPS, latest)
            w.set_consumer(name, ConsumerEntry.new(offset, LOOKUPS, kind))
            return offset

        offset = self.log.write(add)
        assert offset == (self._end() if latest else self.start)
        self.consumers[name] = Consumer(kind, offset, offset)

    @rule(
        idx=st.integers(0, 9),
        delete_on_read=st.booleans(),
        k=st.one_of(st.none(), st.integers(1, 4)),
    )
    def consume(self, idx: int, delete_on_read: bool, k: Optional[int]) -> None:
        """TorchRec's get_unique, as the tracker runs it (one write transaction)."""
        names = self._names(ITX)
        name = names[idx % len(names)]
        c = self.consumers[name]
        end = self.curr + 1  # through the open batch
        bound = None if k is None else RetentionBound(max_batches=k)
        start_before = self.start

        def txn(w):
            s = position_rules.read_start(w, w.consumer(name).offset)
            rows = consume.consume(w, name, end, self.mode, compact=not self.window.enabled,
                                    delete_on_read=delete_on_read, bound=bound)
            return s, as_rows(rows, self.mode)

        s, got = self.log.write(txn)
        self._check_read(f"consume {name} at {c.committed}", c.committed, s, end, got, start_before)
        c.committed = c.pos = end
        c.expired = False
        if delete_on_read:
            self._retain(k)
            self._check_retention(start_before)

    @precondition(lambda self: any(c.delivery == POLL for c in self.consumers.values()))
    @rule(idx=st.integers(0, 9))
    def poll(self, idx: int) -> None:
        """DeltaConsumer.poll: a read transaction from the in-memory position to the end."""
        names = self._names(POLL)
        name = names[idx % len(names)]
        c = self.consumers[name]
        pos = c.pos

        def read(r):
            start, end = position_rules.bounds(r, LOOKUPS)
            try:
                p = position_rules.serve_position(pos, start, end, LOOKUPS, None, name, "model")
            except OffsetOutOfRangeError:
                return None
            d = fetch.read_range(r, 0, self.log.path, p, end)
            return d.start_idx, d.end_idx, as_rows({t.fqn: t.rows for t in d.tables.values()}, self.mode)

        out = self.log.read(read)
        end = self._end()
        if pos < self.start:
            assert out is None, f"poll {name} at {pos} below the log start {self.start} was served"
            event("a poll below the log start was refused")
            return
        assert out is not None, f"poll {name} at {pos} in [{self.start}, {end}] refused"
        s, e, got = out
        assert e == max(end, s)
        self._check_read(f"poll {name} at {pos}", pos, s, e, got, self.start)
        c.pos = e

    @precondition(lambda self: any(c.delivery == POLL for c in self.consumers.values()))
    @rule(idx=st.integers(0, 9))
    def commit(self, idx: int) -> None:
        """DeltaConsumer.commit: the polled position, in a later write transaction."""
        names = self._names(POLL)
        name = names[idx % len(names)]
        c = self.consumers[name]
        self.log.write(lambda w: w.set_consumer(name, w.consumer(name).committed(c.pos)))
        c.committed = c.pos
        c.expired = False

    @precondition(lambda self: any(c.delivery == POLL and c.pos != c.committed for c in self.consumers.values()))
    @rule(idx=st.integers(0, 9))
    def restart_poller(self, idx: int) -> None:
        """A poller that dies before committing restarts from its committed position."""
        names = [n for n in self._names(POLL) if self.consumers[n].pos != self.consumers[n].committed]
        c = self.consumers[names[idx % len(names)]]
        c.pos = c.committed

    # ------------------------------------------------------------------ rules: compaction, retention
    @rule(start=st.integers(0, 40), length=st.integers(1, 40))
    def compact(self, start: int, length: int) -> None:
        """safe_compact over an arbitrary range (below the log start, across positions, the
        checkpoint floor, the open batch, past the end): no registered consumer's next read
        changes, nor what a restore re-delivers."""
        start %= self.curr + 2
        length = 1 + length % (self.curr + 3 - start)
        before = self.log.read(self._read_positions)
        merged = self.log.write(lambda w: position_rules.safe_compact(w, self.mode, start, start + length))
        event(f"compaction merged records: {bool(merged)}")
        after = self.log.read(self._read_positions)
        for key in before:
            assert after[key] == before[key], (
                f"compaction of [{start}, {start + length}) changed the next read of {key}\n"
                f" before {before[key]}\n after  {after[key]}"
            )

    @rule(k=st.one_of(st.none(), st.integers(1, 4)))
    def retention(self, k: Optional[int]) -> None:
        """delete_on_read's retention, with or without a bound."""
        bound = None if k is None else RetentionBound(max_batches=k)
        start_before = self.start
        expired, _ = self._retention_start(k)
        live = [c.committed for n, c in self.consumers.items() if n not in expired]
        floor = min(live + ([self.cp] if self.cp is not None else []), default=0)  # (none live: nothing goes)
        kept = self.log.read(lambda r: self._keys_from(r, floor))
        self.log.write(lambda w: position_rules.enforce_retention(w, LOOKUPS, bound))
        self._retain(k)
        self._check_retention(start_before)
        event(f"retention raised the log start: {self.start > start_before}")
        # nothing at or above a live (non-expired) position or the checkpoint floor went
        assert self.log.read(lambda r: self._keys_from(r, floor)) == kept

    # ------------------------------------------------------------------ invariants
    @invariant()
    def bounds_and_positions(self) -> None:
        def look(r):
            return position_rules.bounds(r, LOOKUPS), log_start(r), r.consumers()

        (start, end), ls, entries = self.log.read(look)
        assert start <= end
        assert ls == start
        assert ls >= self.last_start, "the log start decreased"
        self.last_start = ls
        assert (start, end) == (self.start, self._end())
        assert set(entries) == set(self.consumers)
        for name, entry in entries.items():
            c = self.consumers[name]
            assert (entry.offset, entry.delivery, entry.expired) == (c.committed, c.delivery, c.expired), name
            status = position_rules.position_status(entry, start, end)
            assert status != position_rules.PAST_END, f"{name} at {entry.offset} past the log end {end}"
            assert (status == position_rules.EXPIRED) == c.expired
            assert c.pos <= end + 1


PositionRulesMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=15, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestPositionRules = PositionRulesMachine.TestCase


# ---------------------------------------------------------------------------------------------
# Minimal cases the machine found, each a regression test of one rule.


def _tracker_log(tmp_path, mode: UpdateMode):
    log = DeltaLog(str(tmp_path / "log"), update_mode=mode.value)

    def setup(w):
        w.set_meta(META_TRACKER, TrackerMeta("model-test", mode.value, ["t"], 0).to_value())
        w.set_consumer("default", ConsumerEntry.new(0, LOOKUPS, ITX))

    log.write(setup)
    return log, WindowFilter(mode)


def _append(log, mode, window, b: int, ids: List[int]) -> None:
    states = torch.tensor([[float(b), float(x)] for x in ids]).reshape(len(ids), 2)
    rec = AppendRecord(b, "t", torch.tensor(ids, dtype=torch.int64), None if mode == UpdateMode.NONE else states)
    commit_operations(log, mode, [StepWrite(records=[rec], curr_batch_idx=b)], window)


def _consume(log, mode, window, name: str, end: int, delete_on_read: bool = False) -> List[int]:
    rows = log.write(lambda w: consume.consume(w, name, end, mode, compact=not window.enabled,
                                                delete_on_read=delete_on_read))
    return rows["t"].ids.tolist()


def _register(log, name: str, kind: Delivery, latest: bool) -> int:
    def add(w):
        offset = position_rules.registration_offset(w, LOOKUPS, latest)
        w.set_consumer(name, ConsumerEntry.new(offset, LOOKUPS, kind))
        return offset

    return log.write(add)


def _poll(log, pos: int) -> Tuple[int, int, List[int]]:
    def read(r):
        start, end = position_rules.bounds(r, LOOKUPS)
        at = position_rules.serve_position(pos, start, end, LOOKUPS, None, "p", "test")
        d = fetch.read_range(r, 0, log.path, at, end)
        return d.start_idx, d.end_idx, d.tables["t"].ids.tolist()

    return log.read(read)


def test_compaction_keeps_the_window_start_a_position_reads_from(tmp_path):
    """safe_pieces cuts at the window start that a position inside a filtered window reads from,
    so a compaction across it loses none of that position's rows."""
    mode = UpdateMode.FIRST
    log, window = _tracker_log(tmp_path, mode)
    _append(log, mode, window, 1, [5])
    _consume(log, mode, window, "default", 2)  # default at 2: the window starts at 2
    _append(log, mode, window, 2, [0])
    _append(log, mode, window, 3, [0])  # 0 is in the window already: batch 3's record is empty
    assert _register(log, "late", ITX, latest=True) == 3  # on the open batch 3, inside the window
    assert log.read(lambda r: position_rules.read_start(r, 3)) == 2  # reads from the window start
    _consume(log, mode, window, "default", 4)  # positions {late: 3, default: 4}
    assert log.read(lambda r: position_rules.safe_pieces(r, 1, 3)) == [(1, 2), (2, 3)]  # 2: no position, a window start
    log.write(lambda w: position_rules.safe_compact(w, mode, 1, 3))  # batch 2 now lives in a record at 1
    # id 0, touched in batch 3 (>= late's position), still reaches late, which reads from 2
    assert 0 in _consume(log, mode, window, "late", 4)


def test_get_unique_does_not_compact_the_open_batch(tmp_path):
    """TorchRec's get_unique compacts below the open batch only: a consumer registered at the end
    (on the open batch) still reads that batch."""
    mode = UpdateMode.LAST  # the window filter is off: get_unique compacts
    log, window = _tracker_log(tmp_path, mode)
    _append(log, mode, window, 1, [1])
    _append(log, mode, window, 2, [2])  # batch 2 is open: the lookups end is 2
    _consume(log, mode, window, "default", 3)  # compacts [0, 3): batches 1 and 2 -> one record at 0
    assert _register(log, "p", POLL, latest=True) == 2  # a DeltaConsumer with reset="latest"
    _append(log, mode, window, 3, [3])
    start, end, ids = _poll(log, 2)
    assert (start, end) == (2, 3)
    # the poll of [2, 3) holds id 2 of batch 2 (not merged into the record at 0)
    assert ids == [2]


def test_retention_keeps_the_filtered_window_a_position_reads_from(tmp_path):
    """Retention's floor is the read start of the lowest position, so it deletes no part of the
    filtered window that position reads from."""
    mode = UpdateMode.FIRST
    log, window = _tracker_log(tmp_path, mode)
    _append(log, mode, window, 1, [0])
    _append(log, mode, window, 2, [0])  # filtered (window 0): batch 2's record is empty
    assert _register(log, "p", POLL, latest=True) == 2  # a DeltaConsumer with reset="latest"
    assert log.read(lambda r: position_rules.read_start(r, 2)) == 0
    _consume(log, mode, window, "default", 3, delete_on_read=True)  # floor min(2, 3) = 2: [0, 2) deleted
    _append(log, mode, window, 3, [7])
    start, end, ids = _poll(log, 2)
    assert start <= 2 and end == 3  # (reads from the window start it needs, and says so)
    # id 0, touched in batch 2 (at p's position), reaches p
    assert 0 in ids


@pytest.mark.parametrize("first", [[], [500]], ids=["empty lookup", "ids beyond max_rows"])
def test_a_merged_record_keeps_the_window_start_of_its_filtered_part(tmp_path, first):
    """The writer's dedup merges a batch's records of one table; the merged record keeps the window
    start of the part the filter marked, even when the first part passed unmarked (an empty lookup,
    or ids beyond max_rows)."""
    mode = UpdateMode.FIRST
    log, window = _tracker_log(tmp_path, mode)
    window._max_rows = 100
    _append(log, mode, window, 1, [0])
    # batch 2 looks table t up twice: the first record passes the filter unmarked, the second
    # is filtered (0 is in the window already); the writer's dedup merges them, window start None
    recs = [AppendRecord(2, "t", torch.tensor(ids, dtype=torch.int64), torch.ones(len(ids), 2)) for ids in (first, [0])]
    commit_operations(log, mode, [StepWrite(records=recs, curr_batch_idx=2)], window)
    assert _register(log, "late", ITX, latest=True) == 2  # on the open batch 2, inside the window
    # read_start(2) is the window start, so id 0, touched in batch 2 at late's position, reaches late
    assert 0 in _consume(log, mode, window, "late", 3)


def test_a_compaction_from_below_the_log_start_stamps_nothing_below_it(tmp_path):
    """safe_pieces cuts at the log start: a compaction that starts below it never stamps a merged
    record below the log start, where reads from the log start would miss it."""
    mode = UpdateMode.FIRST
    log, window = _tracker_log(tmp_path, mode)
    _append(log, mode, window, 1, [1])
    _consume(log, mode, window, "default", 2, delete_on_read=True)  # log start 2
    _append(log, mode, window, 2, [2])
    _append(log, mode, window, 3, [3])
    _consume(log, mode, window, "default", 4)
    assert all(b <= 2 or a >= 2 for a, b in log.read(lambda r: position_rules.safe_pieces(r, 0, 4)))  # no piece crosses it
    log.write(lambda w: position_rules.safe_compact(w, mode, 0, 4))  # e.g. tracker.compact(0, 4)
    assert _register(log, "new", ITX, latest=False) == 2  # at the log start
    # batches 2 and 3 are read from the log start 2 (no record stamped 0 holds them)
    assert _consume(log, mode, window, "new", 4) == [2, 3]


def test_compaction_does_not_merge_across_a_filtered_window_start(tmp_path):
    """A consumer registered inside a filtered window reads from the window start; a compaction
    whose range holds that start keeps the window's first record apart (safe_pieces cuts at window
    starts), so the read start and the answer do not change (FIRST: the state from inside the
    window, not from before it)."""
    mode = UpdateMode.FIRST
    log, window = _tracker_log(tmp_path, mode)
    _append(log, mode, window, 1, [5])
    _append(log, mode, window, 2, [7])
    _consume(log, mode, window, "default", 3)  # the window restarts at 3
    _append(log, mode, window, 3, [7])  # 7 again, in the new window: its state at batch 3
    _append(log, mode, window, 4, [])
    assert _register(log, "late", ITX, latest=True) == 4  # inside the window that started at 3
    assert log.read(lambda r: position_rules.read_start(r, 4)) == 3
    _consume(log, mode, window, "default", 5)
    assert log.read(lambda r: position_rules.safe_pieces(r, 2, 4)) == [(2, 3), (3, 4)]
    log.write(lambda w: position_rules.safe_compact(w, mode, 2, 4))
    assert log.read(lambda r: position_rules.read_start(r, 4)) == 3
    rows = log.write(lambda w: consume.consume(w, "late", 5, mode, compact=False, delete_on_read=False))
    assert rows["t"].ids.tolist() == [7]
    assert rows["t"].states.tolist() == [[3.0, 7.0]]  # batch 3's state, not batch 2's
