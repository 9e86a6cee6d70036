"""Freshness and cost of ``publish()`` (issue 14): from the ``publish()`` call in a training
process to the rows applied by a replica in another process, and what publishing costs the
trainer.

    python -m benchmarks.freshness [--quick] [--only cost,cost_trainer,cost_shared,every1,every10]
                                   [--every1-steps 600] [--every10-steps 5000]
                                   [--rounds 12] [--block 50] [--replica-nice N]
                                   [--replica-read-threads N]

Workload (one rank, the trainer at torch's default thread count): an EmbeddingCollection of 4
tables x 100,000 rows x dim 64, batch 1024 x pooling 8, Zipf ids, fused row-wise Adagrad,
ID_ONLY tracking with one consumer ``serving``. The replica is a separate process: a
``DeltaConsumer(root, "replica", channel="snapshots")`` polling with a timeout and applying each
poll to its own full tables with :func:`persistent_delta.apply_poll`, then committing, at the
library's ``read_threads`` (1; ``--replica-read-threads N`` sets ``PERSISTENT_DELTA_READ_THREADS``
for it: 0 is torch's default count).

Phases, each printing one JSON line:

* ``cost``: four tracked models in this process, trained in interleaved blocks of
  ``--block`` steps (in a shuffled order every round): ``publish`` publishes every 10 steps
  (at step 5 of every 10, so that each publish's background work falls inside a block; its
  replica running), ``read`` reads its consumer's ids every 10 steps (``get_unique_ids``: the
  same consume, no snapshot), ``a`` and ``b`` are never read (their read window never resets,
  so their writer records fewer and fewer rows: a cheaper baseline than any model that is
  read). After a ``publish`` block the trainer waits, untimed, for the replica to apply every
  publish, so that the replica's work lands in the blocks it overlaps and not in the next
  variant's; the replica's CPU per publish is reported beside (a serving replica runs on
  other hosts). Per round, the throughput ratios publish/a, publish/read and the A/A ratio
  b/a (the noise floor); medians over ``--rounds`` rounds. Target: publish/a <= 1.05.
* ``cost_trainer``: as ``cost``, with the replica stopped (SIGSTOP) during every timed block
  and continued for the wait: what publishing costs the training process alone (its
  ``publish()`` calls and its writer thread), the replica's CPU per publish reported beside
  (a serving replica runs on other hosts). A fifth variant, ``floor``, is a model like ``a``
  that does, at the same steps, only what any durable publish of these rows must do, without
  the library: gather the rows of the last 10 steps' ids (precomputed from the batches,
  outside the timing) into reused buffers, then on a background thread CRC32C them, put them
  into a plain LMDB environment (no sync, as the library's default) and delete the previous
  ones, one transaction per publish. ``floor/a`` is the cost of a publish's bytes alone on
  this machine; ``publish/floor`` what the library adds to it.
* ``cost_shared``: the same without the wait: the replica competes for the trainer's two
  cores throughout (what a replica on the training host costs).
* ``every1`` and ``every10``: one model publishing every step / every 10 steps while it
  trains; per publish, lag = the replica's ``applied_at`` - the time of the ``publish()`` call
  (stored with the publish, header ``"t"``; one clock, ``time.time()``, on one machine;
  ``polled_*``: to the return of the poll that held it, before it was applied), after
  ``--warmup`` steps (50) whose publishes are not counted (the first carries every row touched
  so far and faults the map in).
  Each publish's lag is split into its parts (:func:`breakdown`, ``breakdown_ms``: the call,
  the writer's queue, its lock wait and transaction, the batch end, the replica noticing, its
  poll, apply and commit).
  Targets (issue 49): every step p50 <= 5 ms and p99 <= 10 ms; every 10 steps p99 <= 50 ms over
  >= 200 publishes; max shown. Also: the trainer's mean step time and ``publish()`` call time,
  the replica's CPU use (share of one core), the bytes applied, and the raw memcpy of a
  publish's bytes (``copy_floor_ms``, the same run).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from benchmarks._common import emit, init_single_rank_pg, log, machine, median, pct, rmtree, workdir

CONSUMER = "serving"


# ------------------------------------------------------------------------------- replica


def replica_main(root: str, out: str, stop: str, from_stamp: int = 0) -> int:
    """Poll, apply, commit until ``stop`` exists and nothing is left; write the lags of the
    publishes stamped ``from_stamp`` or later to ``out`` (earlier ones: the warm-up), and the
    replica's side of the breakdown (:class:`ReplicaTrace`)."""
    import torch

    from persistent_delta import DeltaConsumer, apply_poll

    trace = ReplicaTrace()
    tables: Dict[str, torch.Tensor] = {}
    lags: List[float] = []
    polled: List[float] = []  # publish() call -> the poll holding it returned (before apply)
    polls = rows = nbytes = 0
    t0, c0 = time.time(), _cpu_s()
    with DeltaConsumer(root, "replica", channel="snapshots", wait=60.0) as consumer:
        consumer.poll()
        consumer.commit()
        open(stop + ".ready", "w").close()  # the trainer starts now: no start-up time in the lags
        while True:
            stopping = os.path.exists(stop)
            trace.begin_poll()
            poll = consumer.poll(timeout=0.2)
            polled_at = time.time()
            a0 = time.monotonic_ns()
            add_tables(tables, poll)
            applied = apply_poll(tables, poll, complete_only=True)
            a1 = time.monotonic_ns()
            consumer.commit()
            a2 = time.monotonic_ns()
            if not poll.empty:
                polls += 1
                rows += applied.rows
                nbytes += applied.nbytes
                counted = [t for stamp, t in applied.publishes.items() if stamp >= from_stamp]
                lags.extend(applied.applied_at - t for t in counted)
                polled.extend(polled_at - t for t in counted)
                trace.end_poll(sorted(s for s in applied.publishes if s >= from_stamp), a0, a1, a2)
            elif stopping:
                break
    trace.uninstall()
    wall, cpu = time.time() - t0, _cpu_s() - c0
    with open(out, "w") as f:
        json.dump({"lags": lags, "polled": polled, "polls": polls, "rows": rows, "bytes": nbytes, "cpu_s": cpu,
                   "wall_s": wall, "trace": trace.records}, f)
    return 0


# ------------------------------------------------------------------------------- breakdown
#
# Timestamps of both processes are time.monotonic_ns(): CLOCK_MONOTONIC, one clock for the
# whole machine on Linux, so the trainer's and the replica's marks subtract. The library is not
# changed for it: the benchmark wraps, in its own processes, the writer's commit
# (BackgroundWriter._commit), the log's write transaction (DeltaLog.write), the reader's poll
# step (DeltaReader._poll_once) and its file-change wait (FileWatch.wait).


def add_tables(tables: Dict[str, Any], poll: Any) -> None:
    """Allocate (``torch.zeros``, as a user's replica would) the full table of every part of
    ``poll`` that ``tables`` lacks: the replica's tables, built from what the log says of them."""
    import torch

    for part in poll:
        if part.fqn not in tables and part.shard is not None and part.states is not None:
            tables[part.fqn] = torch.zeros(part.shard.global_rows, part.shard.global_cols or part.states.shape[1],
                                           dtype=part.states.dtype)


class _TracedWrite:
    """Wraps ``DeltaLog.write`` (on one object, or the class): per transaction, (called,
    begun: the writer lock taken and the transaction open, staged: the work done, committed)."""

    def __init__(self, target: Any, sink: List[Tuple[int, int, int, int]], thread: Optional[int] = None) -> None:
        import threading

        self.target, self.sink, self.thread = target, sink, thread
        self.orig = target.write
        get_ident, ns = threading.get_ident, time.monotonic_ns

        def write(*args: Any) -> Any:
            log, fn = (args[0], args[1]) if len(args) == 2 else (None, args[0])
            call = (lambda f: self.orig(log, f)) if log is not None else self.orig
            if self.thread is not None and get_ident() != self.thread:
                return call(fn)
            marks: List[int] = [ns()]

            def inner(w: Any) -> Any:
                if len(marks) == 1:
                    marks.append(ns())  # the first try (a map growth retries)
                result = fn(w)
                del marks[2:]
                marks.append(ns())
                return result

            result = call(inner)
            marks.append(ns())
            if len(marks) == 4:
                self.sink.append((marks[0], marks[1], marks[2], marks[3]))
            return result

        target.write = write

    def uninstall(self) -> None:
        if isinstance(self.target, type):
            self.target.write = self.orig
        else:
            del self.target.write


class WriterTrace:
    """The trainer's side: each writer commit (taken from the queue, LMDB write, done) with
    the publishes it carried (stamp, submitted) and the batch its steps closed."""

    def __init__(self, tracker: Any) -> None:
        from persistent_delta.trainer.operations import StepWrite

        writer = tracker._writer
        self.commits: List[Dict[str, Any]] = []
        self._writes: List[Tuple[int, int, int, int]] = []
        self._writer = writer
        orig = writer._commit

        def commit(taken: List[Any]) -> None:
            t0 = time.monotonic_ns()
            del self._writes[:]
            orig(taken)
            t1 = time.monotonic_ns()
            steps = [t.op.curr_batch_idx for t in taken if isinstance(t.op, StepWrite) and t.op.curr_batch_idx is not None]
            self.commits.append(dict(
                taken=t0, done=t1, write=self._writes[-1] if self._writes else None,
                publishes=[(_stamp(t.op), int(t.submitted * 1e9)) for t in taken if t.prompt],
                closes=max(steps, default=-1)))

        writer._commit = commit
        # every thread's transactions on the log: a publish commits on the training thread
        # (WriterOptions.inline_publish), steps on the writer thread, one at a time
        self._traced = _TracedWrite(writer._log, self._writes)

    def uninstall(self) -> None:
        if self._traced is not None:
            self._traced.uninstall()
        del self._writer._commit

    def visible(self) -> Dict[int, Dict[str, Any]]:
        """stamp -> its commit (the transaction that wrote the publish) and the commit after
        which a reader sees it (its batch ended: a step of a later batch, or a later stamp)."""
        out: Dict[int, Dict[str, Any]] = {}
        waiting: Dict[int, Dict[str, Any]] = {}
        for c in self.commits:
            for stamp, submitted in c["publishes"]:
                waiting[stamp] = dict(submitted=submitted, commit=c)
            newest = max([s for s, _ in c["publishes"]], default=-1)
            for stamp in [s for s in waiting if s < c["closes"] or s < newest]:
                out[stamp] = dict(waiting.pop(stamp), visible=c["done"])
        return out


def _stamp(op: Any) -> int:
    """The stamp of a queued publish (``t.prompt``: the writer's publish operation)."""
    captured = getattr(op, "captured", None)
    return int(captured.stamp if captured is not None else op.stamp)


class ReplicaTrace:
    """The replica's side: its file-change wake-ups, its poll steps, its write transactions
    (the consumer's commit), and per poll that held publishes: the stamps, the poll step that
    found them, the apply and the commit."""

    def __init__(self) -> None:
        from persistent_delta.log.deltalog import DeltaLog
        from persistent_delta.log.watch import FileWatch
        from persistent_delta.read.consumer import DeltaReader

        self.records: List[Dict[str, Any]] = []
        self._wakes: List[Tuple[int, int]] = []
        self._steps: List[Tuple[int, int]] = []
        self._writes: List[Tuple[int, int, int, int]] = []
        ns = time.monotonic_ns
        self._orig = (FileWatch.wait, DeltaReader._poll_once)
        wait, poll_once = self._orig

        def traced_wait(watch: Any, timeout: float) -> None:
            t0 = ns()
            wait(watch, timeout)
            self._wakes.append((t0, ns()))

        def traced_poll_once(reader: Any, *args: Any, **kw: Any) -> Any:
            t0 = ns()
            result = poll_once(reader, *args, **kw)
            self._steps.append((t0, ns()))
            return result

        FileWatch.wait = traced_wait  # type: ignore[method-assign]
        DeltaReader._poll_once = traced_poll_once  # type: ignore[method-assign]
        self._write = _TracedWrite(DeltaLog, self._writes)

    def begin_poll(self) -> None:
        del self._wakes[:], self._steps[:], self._writes[:]

    def end_poll(self, stamps: List[int], applying: int, applied: int, committed: int) -> None:
        if not stamps or not self._steps:
            return
        self.records.append(dict(stamps=stamps, steps=list(self._steps), wakes=list(self._wakes),
                                 apply=(applying, applied), commit=(applied, committed),
                                 commit_write=self._writes[-1] if self._writes else None))

    def uninstall(self) -> None:
        from persistent_delta.log.watch import FileWatch
        from persistent_delta.read.consumer import DeltaReader

        FileWatch.wait, DeltaReader._poll_once = self._orig  # type: ignore[method-assign]
        self._write.uninstall()


SEGMENTS = ("call", "queue", "lock", "commit", "batch_end", "notice", "wake", "poll", "apply", "consumer_commit")


def breakdown(calls: List[Tuple[int, int]], writer: WriterTrace, replica: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per publish, in ms (p50, p99, max over the publishes the replica counted), the segments
    from the ``publish()`` call to the replica's commit, which add up to ``lag``:

    * ``call``: the ``publish()`` call, up to its transaction when it commits it itself
      (``WriterOptions.inline_publish``, ``--inline-publish``: then the call's wait for the writer
      thread's earlier commits is part of it); ``queue``: from its hand-off until the writer
      took it (the writer busy with an earlier commit, or lingering; about 0 inline);
    * ``lock``: the writer waiting for LMDB's writer lock (held by the replica's commit);
      ``commit``: the writer's transaction (filter, encode, puts, LMDB commit);
    * ``batch_end``: from that commit until the one that makes the publish readable (the
      stamp closes when its batch ends: the next step's commit, or a later publish's);
    * ``notice``: from readable until the replica's poll step that read it began: ``wake``, the
      part of it from readable to the return of the file-change wait it was sleeping in (when
      it was), the rest the replica busy with its previous publish or a poll that came too
      early; ``poll``: that poll step (read and decode);
    * ``apply``: the rows written into the replica's tables (lag ends here);
      ``consumer_commit``: the replica's commit of its position (a write transaction on the
      trainer's log), with ``consumer_lock``: its wait for the writer lock.

    ``early_polls`` (a count, not ms): poll steps of the same ``poll()`` that ran before the
    publish was readable (woken by a commit that did not make it readable, or by none).
    """
    seen = writer.visible()
    by_stamp = {s: rec for rec in replica for s in rec["stamps"]}
    out: Dict[str, List[float]] = {k: [] for k in SEGMENTS + ("lag", "consumer_lock", "early_polls")}
    for (c0, c1), stamp in zip(calls, _call_stamps(writer)):
        vis, rec = seen.get(stamp), by_stamp.get(stamp)
        if vis is None or rec is None:
            continue
        commit = vis["commit"]
        found = next((s for s in rec["steps"] if s[0] >= vis["visible"]), rec["steps"][-1])
        woke = next((w[1] for w in rec["wakes"] if w[0] <= vis["visible"] <= w[1]), None)
        ms = 1e-6
        write = commit["write"]
        # a publish committed inside its own call (WriterOptions.inline_publish): the call's part
        # ends where its transaction begins, so that the parts add up to the lag
        call_end = min(c1, commit["taken"])
        marks = dict(call=(call_end - c0), queue=max(0, commit["taken"] - max(vis["submitted"], call_end)),
                     lock=0 if write is None else write[1] - write[0],
                     commit=(commit["done"] - commit["taken"]) - (0 if write is None else write[1] - write[0]),
                     batch_end=(vis["visible"] - commit["done"]), notice=(found[0] - vis["visible"]),
                     wake=0 if woke is None else woke - vis["visible"], poll=(found[1] - found[0]),
                     apply=(rec["apply"][1] - found[1]), consumer_commit=(rec["commit"][1] - rec["commit"][0]),
                     lag=(rec["apply"][1] - c0),
                     consumer_lock=0 if rec["commit_write"] is None else rec["commit_write"][1] - rec["commit_write"][0])
        for k, v in marks.items():
            out[k].append(v * ms)
        out["early_polls"].append(sum(1 for s in rec["steps"] if s[0] < vis["visible"]))
    result: Dict[str, Any] = {k: {"p50": pct(v, 0.5), "p99": pct(v, 0.99), "max": max(v, default=float("nan"))}
                              for k, v in out.items()}
    result["publishes"] = len(out["lag"])
    return result


def _call_stamps(writer: WriterTrace) -> List[int]:
    """The stamps of the publishes, in the order they were handed to the writer."""
    return [s for c in writer.commits for s, _ in sorted(c["publishes"], key=lambda p: p[1])]


def _cpu_s() -> float:
    s = resource.getrusage(resource.RUSAGE_SELF)
    return s.ru_utime + s.ru_stime


class Replica:
    """The replica process for one log root."""

    def __init__(self, root: str, from_stamp: int = 0, nice: int = 0, read_threads: Optional[int] = None) -> None:
        self.nice = nice  # below the trainer's CPU priority (--replica-nice: diagnosis of the cost)
        self.out, self.stop = root + ".replica.json", root + ".stop"
        env = dict(os.environ)
        if read_threads is not None:  # LogOptions.read_threads of the replica's polls and apply
            env["PERSISTENT_DELTA_READ_THREADS"] = str(read_threads)
        self.proc = subprocess.Popen(["nice", "-n", str(self.nice), sys.executable, "-m", "benchmarks.freshness",
                                      "--role", "replica", "--root", root,
                                      "--replica-out", self.out, "--replica-stop", self.stop,
                                      "--replica-from-stamp", str(from_stamp)], env=env)
        deadline = time.monotonic() + 120
        while not os.path.exists(self.stop + ".ready"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the replica did not start")
            time.sleep(0.05)

    def finish(self) -> Dict[str, Any]:
        open(self.stop, "w").close()
        if self.proc.wait(timeout=300) != 0:
            raise RuntimeError(f"the replica exited with {self.proc.returncode}")
        with open(self.out) as f:
            result: Dict[str, Any] = json.load(f)
        for path in (self.out, self.stop, self.stop + ".ready"):
            os.remove(path)
        return result


# ------------------------------------------------------------------------------- trainer


_QUICK = False  # --quick: the smoke run's small tables and batches (set by main)
_INLINE_PUBLISH = False  # --inline-publish: the trainer's WriterOptions(inline_publish=True) (set by main)


def _workload() -> Any:
    from benchmarks._model import Workload

    if _QUICK:
        return Workload(num_tables=4, rows=5_000, dim=64, batch=64, pooling=8)
    return Workload(num_tables=4, rows=100_000, dim=64, batch=1024, pooling=8)


def _tracked(root: str, seed: int) -> Any:
    from torchrec.distributed.model_tracker.types import TrackingMode

    from benchmarks._model import build_dmp
    from persistent_delta import PersistentTrackerConfig, attach

    from persistent_delta.config import WriterOptions

    dmp = build_dmp(_workload(), seed=seed)
    tracker = attach(dmp, PersistentTrackerConfig(path=root, tracking_mode=TrackingMode.ID_ONLY, consumers=[CONSUMER],
                                                  delete_on_read=True, fresh=True,
                                                  writer=WriterOptions(inline_publish=_INLINE_PUBLISH)))
    return dmp, tracker


def memcpy_gbps(nbytes: int) -> float:
    import torch

    src = torch.empty(max(1, nbytes), dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / median(times) / 1e9


def run_freshness(name: str, every: int, steps: int, batches: List[Any], warmup: int,
                  read_threads: Optional[int] = None) -> Dict[str, Any]:
    from benchmarks._model import train_step

    root = workdir(f"fresh-{name}")
    dmp, tracker = _tracked(root, seed=1)
    replica = Replica(root, from_stamp=tracker.curr_batch_idx + warmup, read_threads=read_threads)
    traced = WriterTrace(tracker)
    calls: List[Tuple[int, int]] = []  # monotonic_ns of every publish() call's start and return
    step_s: List[float] = []
    publish_s: List[float] = []
    for i in range(warmup):  # first publishes carry every row touched so far, and fault in the map
        train_step(dmp, batches[i % len(batches)])
        if (i + 1) % every == 0:
            c0 = time.monotonic_ns()
            tracker.publish(CONSUMER)
            calls.append((c0, time.monotonic_ns()))
    for i in range(steps):
        t0 = time.perf_counter()
        train_step(dmp, batches[i % len(batches)])
        if (i + 1) % every == 0:
            c0 = time.monotonic_ns()
            tracker.publish(CONSUMER)
            calls.append((c0, time.monotonic_ns()))
            publish_s.append((calls[-1][1] - c0) * 1e-9)
        step_s.append(time.perf_counter() - t0)
    tracker.close()
    traced.uninstall()
    rep = replica.finish()
    rmtree(root)
    parts = breakdown(calls, traced, rep["trace"])
    gbps = memcpy_gbps(int(rep["bytes"] / max(1, len(rep["lags"]))))
    lags = rep["lags"]
    per_publish_bytes = rep["bytes"] / max(1, len(lags))
    return emit(
        "freshness", phase=name, publish_every=every, steps=steps, warmup_steps=warmup, publishes=len(lags),
        replica_read_threads=read_threads,
        lag_p50_ms=1e3 * pct(lags, 0.5), lag_p99_ms=1e3 * pct(lags, 0.99),
        lag_max_ms=1e3 * max(lags, default=0), target_p99_ms=10 if every == 1 else 50,
        target_p50_ms=5 if every == 1 else None,
        polled_p50_ms=1e3 * pct(rep["polled"], 0.5), polled_p99_ms=1e3 * pct(rep["polled"], 0.99),
        step_mean_ms=1e3 * sum(step_s) / len(step_s), publish_call_mean_ms=1e3 * sum(publish_s) / max(1, len(publish_s)),
        publish_call_p99_ms=1e3 * pct(publish_s, 0.99), replica_cpu_share=rep["cpu_s"] / max(1e-9, rep["wall_s"]),
        replica_polls=rep["polls"], bytes_per_publish=per_publish_bytes,
        memcpy_gbps_same_bytes=gbps, copy_floor_ms=per_publish_bytes / max(gbps, 1e-9) / 1e6,
        breakdown_ms={k: v for k, v in parts.items() if k != "early_polls"}, early_polls=parts["early_polls"],
        machine=machine(),
    )


def _replica_behind(log: Any) -> bool:
    """Whether the ``replica`` consumer of ``log`` (rank 0's, read-only) has not yet committed
    past the newest publish."""
    from persistent_delta.log import position_rules
    from persistent_delta.log.schema import SNAPSHOTS

    def look(r: Any) -> bool:
        return bool(position_rules.committed_offsets(r, SNAPSHOTS).get("replica", 0) < position_rules.bounds(r, SNAPSHOTS)[1])

    return bool(log.read(look))


class CopyFloor:
    """The least a durable publish of a model's rows costs: the gather of the rows changed in
    the last ``every`` steps into reused buffers (in the caller's thread), then a CRC32C and a
    plain LMDB put of each table's bytes, and the delete of the previous publish's, in one
    transaction on a background thread (phase ``cost_trainer``, variant ``floor``). No tracker
    involved: the ids are the batches' own, unique per table, computed here once."""

    def __init__(self, root: str, dmp: Any, batches: List[Any], every: int = 10) -> None:
        from concurrent.futures import ThreadPoolExecutor

        import lmdb
        import torch

        from benchmarks._model import _local_weights

        w = _workload()
        span = w.batch * w.pooling  # ids of one table in a batch (fixed pooling)
        self.weights = [t for _, t in sorted(_local_weights(dmp).items())]
        assert all(int(t.shape[0]) == w.rows for t in self.weights), "one rank holds every row"
        self.ids: Dict[int, List[Any]] = {}  # done % len(batches) at a publish -> unique ids per table
        for end in range(len(batches)):
            recent = [batches[(end - k) % len(batches)] for k in range(1, every + 1)]
            self.ids[end] = [torch.unique(torch.cat([b.values[t * span:(t + 1) * span] for b in recent]))
                             for t in range(w.num_tables)]
        self.path = os.path.join(root, "floor")
        os.makedirs(self.path, exist_ok=True)
        self.env = lmdb.open(self.path, map_size=1 << 36, sync=False, metasync=False, subdir=True)
        self.bufs: List[Any] = [None] * len(self.weights)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="copy-floor")
        self.pending: Any = None
        self.stamp = 0
        self.store_s = self.store_cpu_s = 0.0  # the background thread's, wall and CPU

    def publish(self, done: int) -> None:
        import torch

        if self.pending is not None:  # its buffers are about to be reused (the library's rule too)
            self.pending.result()
        payload = []
        for t, (weight, ids) in enumerate(zip(self.weights, self.ids[done % len(self.ids)])):
            n, row = int(ids.numel()), int(weight.shape[1]) * weight.element_size()
            size = n * (8 + row)
            buf = self.bufs[t]
            if buf is None or buf.numel() < size:
                buf = self.bufs[t] = torch.empty(int(size * 1.25), dtype=torch.uint8)
            buf[:n * 8].view(torch.int64).copy_(ids)
            torch.index_select(weight, 0, ids, out=buf[n * 8:size].view(weight.dtype).view(n, -1))
            payload.append(buf[:size])
        self.pending = self.pool.submit(self._store, self.stamp, payload)
        self.stamp += 1

    def _store(self, stamp: int, payload: List[Any]) -> None:
        import struct

        import crc32c

        t0, c0 = time.perf_counter(), time.thread_time()
        with self.env.begin(write=True) as txn:
            for t, buf in enumerate(payload):
                value = memoryview(buf.numpy())
                crc32c.crc32c(value)  # computed for its cost, as the library checksums every record
                txn.put(struct.pack(">IQ", t, stamp), value)
                if stamp:
                    txn.delete(struct.pack(">IQ", t, stamp - 1))
        self.store_s += time.perf_counter() - t0
        self.store_cpu_s += time.thread_time() - c0

    def flush(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def close(self) -> None:
        self.flush()
        self.pool.shutdown()
        self.env.close()


def run_cost(rounds: int, block: int, batches: List[Any], replica_nice: int = 0,
             read_threads: Optional[int] = None, shared: bool = False, paused: bool = False,
             floor: bool = False) -> Dict[str, Any]:
    """Throughput of publishing every 10 steps against never-read models, in interleaved blocks
    in a shuffled order each round (a fixed rotation would always put the same variant after
    ``publish``). ``shared`` False (phase ``cost``): after each block the trainer waits, untimed,
    until the replica has applied every publish, so the replica's work is counted in the
    ``publish`` blocks it overlaps and never spills into another variant's block; its CPU is
    reported beside (a serving replica runs on other hosts). ``shared`` True (phase
    ``cost_shared``): no wait; the replica competes for the trainer's 2 cores throughout.
    ``paused`` (phase ``cost_trainer``): the replica is stopped (SIGSTOP) during every timed
    block and continued (SIGCONT) for the untimed wait: what publishing costs the trainer's
    process alone, the replica's CPU reported beside (it runs on other hosts). ``floor``: a
    fifth variant, a model like ``a`` doing a :class:`CopyFloor` publish at the same steps."""
    phase = "cost_shared" if shared else "cost_trainer" if paused else "cost"
    variants = ("publish", "read", "a", "b") + (("floor",) if floor else ())
    roots = {v: workdir(f"cost-{v}") for v in variants}
    models = {v: _tracked(roots[v], seed=1) for v in variants}
    floor_root = workdir("cost-floor-lmdb")
    copies = CopyFloor(floor_root, models["floor"][0], batches) if floor else None
    replica = Replica(roots["publish"], nice=replica_nice, read_threads=read_threads)
    try:
        return _run_cost(phase, rounds, block, batches, variants, models, replica, copies, shared, paused,
                         replica_nice, read_threads, roots, floor_root)
    finally:
        if replica.proc.poll() is None:  # an error above: never leave the replica running
            replica.proc.kill()
            replica.proc.wait()


def _run_cost(phase: str, rounds: int, block: int, batches: List[Any], variants: Any, models: Dict[str, Any],
              replica: "Replica", copies: Optional[CopyFloor], shared: bool, paused: bool, replica_nice: int,
              read_threads: Optional[int], roots: Dict[str, str], floor_root: str) -> Dict[str, Any]:
    import random
    import signal

    from benchmarks._model import train_step
    from persistent_delta.log.layout import rank_dir
    from persistent_delta.log.deltalog import DeltaLog

    watch = None if shared else DeltaLog(rank_dir(roots["publish"], 0), readonly=True)
    done = {v: 0 for v in variants}
    round_s: List[Dict[str, float]] = []
    shuffle = random.Random(14)
    warm = 1
    settle_s = 0.0
    calls: Dict[str, List[float]] = {}  # variant -> seconds of each publish call (publish, floor)
    for r in range(warm + rounds):
        order = list(variants)
        shuffle.shuffle(order)
        spent: Dict[str, float] = {}
        for v in order:
            dmp, tracker = models[v]
            if paused:
                replica.proc.send_signal(signal.SIGSTOP)
            t0 = time.perf_counter()
            for _ in range(block):
                train_step(dmp, batches[done[v] % len(batches)])
                done[v] += 1
                # mid-period (step 5 of every 10), so that the writer's and the replica's work of
                # every publish lands inside a timed block, not in the untimed wait after it
                if v == "publish" and done[v] % 10 == 5:
                    t1 = time.perf_counter()
                    tracker.publish(CONSUMER)
                    calls.setdefault(v, []).append(time.perf_counter() - t1)
                elif v == "read" and done[v] % 10 == 5:
                    tracker.get_unique_ids(CONSUMER)
                elif v == "floor" and done[v] % 10 == 5:
                    assert copies is not None
                    t1 = time.perf_counter()
                    copies.publish(done[v])
                    calls.setdefault(v, []).append(time.perf_counter() - t1)
            spent[v] = time.perf_counter() - t0
            if copies is not None and v == "floor":
                copies.flush()  # untimed, as the publish variant's wait below
            if paused:
                replica.proc.send_signal(signal.SIGCONT)
            if v == "publish" and not shared:
                t1 = time.perf_counter()
                tracker.flush()
                deadline = t1 + 120
                while _replica_behind(watch):
                    if time.perf_counter() > deadline or replica.proc.poll() is not None:
                        raise RuntimeError("the replica did not catch up")
                    time.sleep(0.002)
                settle_s += time.perf_counter() - t1
        if r >= warm:
            round_s.append(spent)
            log("%s: round %d/%d %s", phase, r - warm + 1, rounds,
                {k: round(1e3 * x / block, 1) for k, x in spent.items()})
    if watch is not None:
        watch.close()
    # the writer thread's wall time in its transactions, per 10 steps (warm-up round included)
    writer_ms = {v: 1e4 * models[v][1].stats().get("commit_time_s", 0.0) / max(1, done[v]) for v in variants}
    for v in variants:
        models[v][1].close()
    floor_fields: Dict[str, Any] = {}
    if copies is not None:
        copies.close()
        floor_fields = dict(
            floor_over_unread_median=median([s["floor"] / s["a"] for s in round_s]),
            publish_over_floor_median=median([s["publish"] / s["floor"] for s in round_s]),
            floor_ratios=sorted(s["floor"] / s["a"] for s in round_s),
            floor_call_ms_median=1e3 * median(calls.get("floor", [0.0])),
            floor_store_ms_per_publish=1e3 * copies.store_s / max(1, copies.stamp),
            floor_store_cpu_ms_per_publish=1e3 * copies.store_cpu_s / max(1, copies.stamp))
    rmtree(floor_root)
    rep = replica.finish()
    for root in roots.values():
        rmtree(root)
    ratio = [s["publish"] / s["a"] for s in round_s]
    over_read = [s["publish"] / s["read"] for s in round_s]
    aa = [s["b"] / s["a"] for s in round_s]
    publishes = len(rep["lags"])
    return emit(
        "freshness", phase=phase, publish_every=10, rounds=rounds, block_steps=block,
        publish_over_unread_median=median(ratio), publish_over_read_ids_median=median(over_read),
        aa_median=median(aa), target=1.05, replica_nice=replica_nice, replica_read_threads=read_threads, ratios=sorted(ratio), over_read_ratios=sorted(over_read), aa_ratios=sorted(aa),
        step_mean_ms={v: 1e3 * sum(s[v] for s in round_s) / (block * len(round_s)) for v in variants},
        replica_cpu_share=rep["cpu_s"] / max(1e-9, rep["wall_s"]), replica_publishes=publishes,
        replica_cpu_ms_per_publish=1e3 * rep["cpu_s"] / max(1, publishes),
        publish_call_ms_median=1e3 * median(calls.get("publish", [0.0])), writer_ms_per_10_steps=writer_ms,
        settle_wait_s=settle_s, **floor_fields, machine=machine(),
    )


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: tables of 5,000 rows, batch 64, 1 round of 10-step blocks, 20 freshness steps")
    ap.add_argument("--every1-steps", type=int, default=600)
    ap.add_argument("--every10-steps", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--block", type=int, default=50)
    ap.add_argument("--only", default=None,
                    help="comma-separated phases (default: cost,cost_trainer,cost_shared,every1,every10; "
                         "--quick: cost_trainer,every10, whose code covers the others)")
    ap.add_argument("--role", default="bench", choices=["bench", "replica"], help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--replica-out", help=argparse.SUPPRESS)
    ap.add_argument("--replica-stop", help=argparse.SUPPRESS)
    ap.add_argument("--replica-from-stamp", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, default=50, help="steps (with publishes) before the measured ones")
    ap.add_argument("--replica-nice", type=int, default=0,
                    help="run the replica process at this niceness (0: as the trainer; diagnosis: what of the "
                         "cost is the replica's CPU on a machine with no core to spare)")
    ap.add_argument("--replica-read-threads", type=int, default=None,
                    help="the replica's LogOptions.read_threads (PERSISTENT_DELTA_READ_THREADS; default: the "
                         "library's, 1; 0: the process's torch threads)")
    ap.add_argument("--inline-publish", action="store_true",
                    help="the trainer's WriterOptions(inline_publish=True): publish() commits its transaction itself "
                         "(default: the library's, handed to the writer thread)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the trainer process (seconds; default: Python's 0.005)")
    args = ap.parse_args(argv)
    if args.role == "replica":
        return replica_main(args.root, args.replica_out, args.replica_stop, args.replica_from_stamp)
    global _INLINE_PUBLISH
    _INLINE_PUBLISH = args.inline_publish
    if args.quick:
        global _QUICK
        _QUICK = True
        args.every1_steps, args.every10_steps, args.rounds, args.block, args.warmup = 10, 20, 1, 10, 10
        args.only = args.only or "cost_trainer,every10"
    args.only = args.only or "cost,cost_trainer,cost_shared,every1,every10"
    from benchmarks._model import make_batches

    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    init_single_rank_pg()
    batches = make_batches(_workload(), 50, seed=1)
    phases = [p.strip() for p in args.only.split(",")]
    if "cost" in phases:
        run_cost(args.rounds, args.block, batches, args.replica_nice, args.replica_read_threads)
    if "cost_trainer" in phases:
        run_cost(args.rounds, args.block, batches, args.replica_nice, args.replica_read_threads, paused=True,
                 floor=True)
    if "cost_shared" in phases:
        run_cost(args.rounds, args.block, batches, args.replica_nice, args.replica_read_threads, shared=True)
    if "every1" in phases:
        run_freshness("every1", 1, args.every1_steps, batches, args.warmup, args.replica_read_threads)
    if "every10" in phases:
        run_freshness("every10", 10, args.every10_steps, batches, args.warmup, args.replica_read_threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
