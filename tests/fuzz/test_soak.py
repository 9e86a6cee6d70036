"""Concurrency soak, bounded in time: a real trainer process writes while two consumer processes
poll and commit and the offsets tool reads, all at once: every row reaches each consumer exactly
once and in order, and the file stays bounded.

The trainer is a 1-rank gloo DMP with ``persistent_delta.attach`` (ID_ONLY, ``delete_on_read``);
at batch_idx ``b`` it feeds ``make_batches(...)[(b - 1) % NUM_BATCHES]`` (as ``crash_trainer.py``
does), so the ids each batch recorded are known here, and its own consumer reads every few steps
(compaction and retention run all the time). Two ``DeltaConsumer`` processes register after the
tracker attached and before the first batch, so the writer's window filter is off for them
(exactly-once); they poll random numbers of batches and commit after random sleeps, and poll once
more after the trainer closed (its last batch becomes visible then). A fourth process runs the
offsets tool in a loop (``cli.main(["offsets", ROOT, "--format", "json"])``, what
``python -m persistent_delta`` runs, without paying the interpreter start each time); the real
command line runs once mid-soak. A fifth reads at the log start over and over, where retention
deletes next (an unregistered ``DeltaReader`` moved below it and reset to it, a few batches a
poll).

Checked: every process exits 0 with no traceback; each consumer's polls tile
``[0, final log end)`` in order (every batch exactly once); every id a batch fed reaches each
consumer in a poll that could hold it, and no poll holds an id its batches did not feed; the
union per table is exactly the ids fed; each poll at the log start holds exactly the ids its
range fed; every offsets output is valid JSON, with no offset moving
backwards or below the log start; the file stays bounded (retention); ``verify`` passes.

Delivery is checked per id with a window: an id fed in batch ``b`` must be in a poll with
``start <= b <= log end seen by that poll`` (a compacted record stamped at a range start would be
read early by a consumer behind it). Losses are raised last, as :class:`LostRowsError`, after
every other check. (This soak found that compaction merged records across a consumer's polled
but uncommitted position; the tracker no longer compacts while an out-of-process lookups
consumer is registered. The reader at the log start catches a poll that reads its records after
retention deleted the batches at the position it checked a transaction earlier: 6 losses in one
run before that was fixed.)
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import time
from typing import Any, Dict, List, Set, Tuple

import pytest

from harness import SPARSE_FQN, feature_names, make_batches
from persistent_delta.cli import main as cli_main
from persistent_delta.log import position_rules
from persistent_delta.log.deltalog import DeltaLog
from procs import REPO, SUPPORT

ROWS = 1000
NUM_BATCHES = 256  # batch_idx b feeds batch (b - 1) % NUM_BATCHES
BATCH_SIZE = 16
SEED = 11
CONSUMERS = ("ext-a", "ext-b")
TABLES = {f"{SPARSE_FQN}.embeddings.{t}": feats for t, feats in feature_names(2).items()}

TRAINER = r"""
import json, os, sys, time
tests, root, ready, go, seconds, rows, num_batches, batch_size, seed = sys.argv[1:10]
sys.path.insert(0, tests)
import torch.distributed as dist
from torchrec.distributed.model_tracker.types import TrackingMode
from harness import build_sharded_model, init_gloo, make_batches, train_step
from persistent_delta import PersistentTrackerConfig, attach

init_gloo()
dmp = build_sharded_model(0, 1, "ec", "row_wise", "EXACT_SGD", rows=int(rows))
tracker = attach(dmp, PersistentTrackerConfig(
    tracking_mode=TrackingMode.ID_ONLY, path=root, consumers=["trainer"], delete_on_read=True))
tracker.flush()
n = int(num_batches)
batches = make_batches("ec", n, int(batch_size), seed=int(seed), world_size=1, rank=0, rows=int(rows))
open(ready, "w").close()
deadline = time.time() + 120
while not os.path.exists(go):
    assert time.time() < deadline, "no go file"
    time.sleep(0.02)
stop = time.time() + float(seconds)
steps = 0
while time.time() < stop:
    # the batch fed at index b is a function of b (DMP.forward steps the tracker to b first)
    train_step(dmp, batches[tracker.curr_batch_idx % n])
    steps += 1
    if steps % 4 == 0:
        tracker.get_unique("trainer")  # compaction from the largest offset, delete_on_read
    time.sleep(0.005)
last = tracker.curr_batch_idx
stats = tracker.stats()
tracker.close()
dist.destroy_process_group()
print(json.dumps({"steps": steps, "last_batch_idx": last, "bytes_written": stats.get("bytes_written", 0),
                  "closed_at": time.time()}))
"""

CONSUMER = r"""
import json, os, random, sys, time
root, name, out, ready, done, seed = sys.argv[1:7]
from persistent_delta import DeltaConsumer

deadline = time.time() + 120
while not os.path.exists(ready):
    assert time.time() < deadline, "trainer never attached"
    time.sleep(0.02)
c = DeltaConsumer(root, name)  # registers in the log before the trainer's first batch
open(out + ".started", "w").close()
rng = random.Random(int(seed))
deadline = time.time() + 600
with open(out, "w") as f:
    while time.time() < deadline:
        finished = os.path.exists(done)  # seen before the poll: the last poll follows the trainer's close
        p = c.poll(max_batches=rng.choice([None, rng.randint(1, 40)]))
        seen_end = c.end_offsets()[0]  # >= the log end this poll read up to
        if p.empty:
            if finished:
                break
            time.sleep(rng.uniform(0, 0.05))
            continue
        (start, end), = p.ranges.values()
        ids = {fqn: m.global_ids.tolist() for fqn, m in p.merged().items()}
        time.sleep(rng.uniform(0, 0.03))  # the trainer runs between a poll and its commit
        committed = c.commit()[0]
        f.write(json.dumps({"start": start, "end": end, "seen_end": seen_end, "committed": committed,
                            "ids": ids}) + "\n")
        f.flush()
        time.sleep(rng.uniform(0, 0.05))
c.close()
"""

EARLIEST = r"""
import json, logging, os, random, sys, time
root, out, go, done = sys.argv[1:5]
from persistent_delta.read.consumer import DeltaReader

logging.getLogger("persistent_delta").setLevel(logging.ERROR)  # each poll's reset is logged as a warning

deadline = time.time() + 120
while not os.path.exists(go):
    assert time.time() < deadline, "no go file"
    time.sleep(0.02)
r = DeltaReader(root, reset="earliest")  # unregistered: it holds no retention back
rng = random.Random(5)
with open(out, "w") as f:
    while not os.path.exists(done):
        r.seek(0)  # below the log start: reset to it, the batch retention deletes next
        p = r.poll(max_batches=rng.randint(1, 8))
        (start, end), = p.ranges.values()
        ids = {fqn: m.global_ids.tolist() for fqn, m in p.merged().items()}
        f.write(json.dumps({"start": start, "end": end, "ids": ids}) + "\n")
        time.sleep(rng.uniform(0, 0.01))
r.close()
"""

TOOL = r"""
import io, json, os, random, sys, time
root, out, go, done = sys.argv[1:5]
from persistent_delta.cli import main

deadline = time.time() + 120
while not os.path.exists(go):
    assert time.time() < deadline, "no go file"
    time.sleep(0.02)
rng = random.Random(3)
with open(out, "w") as f:
    while not os.path.exists(done):
        buf = io.StringIO()
        rc = main(["offsets", root, "--format", "json"], stdout=buf)  # what `python -m persistent_delta` runs
        f.write(json.dumps({"rc": rc, "out": buf.getvalue()}) + "\n")
        time.sleep(rng.uniform(0.02, 0.1))
"""


def _start(tmp_path: Any, name: str, code: str, *args: str) -> subprocess.Popen:
    """``code`` in a separate interpreter, stdout/stderr to files (a pipe could fill and block)."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(tmp_path / f"{name}.stdout", "w") as out, open(tmp_path / f"{name}.stderr", "w") as err:
        return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args],
                                stdout=out, stderr=err, text=True, env=env)


def _wait_files(paths: List[str], procs: Dict[str, subprocess.Popen], tmp_path: Any, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not all(os.path.exists(p) for p in paths):
        for name, p in procs.items():
            assert p.poll() is None, f"{name} exited {p.returncode}:\n{(tmp_path / f'{name}.stderr').read_text()}"
        assert time.time() < deadline, f"timed out waiting for {paths}"
        time.sleep(0.05)


def _fed(last_batch_idx: int) -> Dict[int, Dict[str, Set[int]]]:
    """batch_idx -> table fqn -> ids the trainer recorded in that batch (batch 0 records none)."""
    batches = make_batches("ec", NUM_BATCHES, BATCH_SIZE, seed=SEED, world_size=1, rank=0, rows=ROWS)
    per_batch = [{fqn: {int(x) for f in feats for x in b.sparse[f].values().tolist()} for fqn, feats in TABLES.items()}
                 for b in batches]
    return {b: per_batch[(b - 1) % NUM_BATCHES] for b in range(1, last_batch_idx + 1)}


class LostRowsError(AssertionError):
    """A consumer never received ids that a batch in its range fed."""


def check_consumer(name: str, polls: List[Dict[str, Any]], fed: Dict[int, Dict[str, Set[int]]], end: int) -> List[str]:
    """Assert every batch exactly once and in order, and that no poll holds an id its window
    did not feed. Returns the losses found: fed ids never delivered in a poll that could hold
    them, and ids missing from the union per table (the caller raises :class:`LostRowsError`)."""
    assert polls, f"{name} polled nothing"
    ranges = [(p["start"], p["end"]) for p in polls]
    assert ranges[0][0] == 0, (name, ranges[:3])
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, ranges[1:])), (name, ranges)
    assert ranges[-1][1] == end, (name, ranges[-3:], end)
    assert [p["committed"] for p in polls] == [p["end"] for p in polls], name
    delivered = [{fqn: set(ids) for fqn, ids in p["ids"].items()} for p in polls]
    last = max(fed, default=0)
    for p, got in zip(polls, delivered):
        # a poll holds records stamped in [start, end); a compacted record holds later batches,
        # up to the log end this poll saw (inclusive: the trainer's open batch)
        window = range(p["start"], min(p["seen_end"], last) + 1)
        for fqn in got:
            possible = set().union(*(fed[b][fqn] for b in window if b in fed))
            assert got[fqn] <= possible, (name, p["start"], p["end"], fqn, sorted(got[fqn] - possible)[:10])
    losses = []
    for b, tables in fed.items():
        candidates = [i for i, p in enumerate(polls) if p["start"] <= b <= p["seen_end"]]
        for fqn, ids in tables.items():
            missing = ids - set().union(*(delivered[i].get(fqn, set()) for i in candidates))
            if missing:
                losses.append(f"{name}: batch {b} {fqn}: ids {sorted(missing)} never delivered "
                              f"(polls {[ranges[i] for i in candidates]})")
    for fqn in TABLES:
        want = set().union(*(t[fqn] for t in fed.values()))
        got_all = set().union(*(d.get(fqn, set()) for d in delivered))
        assert got_all <= want, (name, fqn, sorted(got_all - want)[:10])
        if want - got_all:
            losses.append(f"{name}: {fqn}: ids {sorted(want - got_all)} never delivered at all")
    return losses


def check_earliest_reader(polls: List[Dict[str, Any]], fed: Dict[int, Dict[str, Set[int]]]) -> List[str]:
    """Each poll of the reader that starts at the log start (where retention deletes next)
    holds exactly the ids its range's batches fed (the window filter and compaction are off
    while the consumers are registered): a range that retention passed between the poll's
    bounds and its records would miss them. Returns the losses; extra ids are asserted."""
    losses = []
    for p in polls:
        for fqn in TABLES:
            want = set().union(*(fed[b][fqn] for b in range(p["start"], p["end"]) if b in fed))
            got = set(p["ids"].get(fqn, ()))
            assert got <= want, ("earliest", p["start"], p["end"], fqn, sorted(got - want)[:10])
            if want - got:
                losses.append(f"earliest reader: [{p['start']}, {p['end']}) {fqn}: ids {sorted(want - got)[:10]} "
                              "missing")
    return losses


def check_offsets_outputs(lines: List[str]) -> int:
    """Every offsets output is valid JSON; per rank the log start never moves back; per
    consumer the offset never moves backwards nor below the log start. Returns the last log
    start seen on rank 0."""
    log_start: Dict[int, int] = {}
    offsets: Dict[Tuple[int, str], int] = {}
    for line in lines:
        run = json.loads(line)
        assert run["rc"] == 0, run
        data = json.loads(run["out"])
        for r in data["ranks"]:
            assert r["log_start"] >= log_start.get(r["rank"], 0), (r, log_start)
            log_start[r["rank"]] = r["log_start"]
            names = {c["name"] for c in r["consumers"]}
            assert names == {"trainer", *CONSUMERS}, names
            for c in r["consumers"]:
                key = (r["rank"], c["name"])
                assert c["status"] in ("ok", "read the open batch"), c  # both legal (see delivery)
                assert c["offset"] >= offsets.get(key, 0), (c, offsets.get(key))
                offsets[key] = c["offset"]
    return log_start[0]


def run_soak(tmp_path: Any, seconds: float) -> Dict[str, Any]:
    root = str(tmp_path / "log")
    ready, go, done = (str(tmp_path / n) for n in ("ready", "go", "done"))
    data_file = os.path.join(root, "rank-0", "data.mdb")
    procs: Dict[str, subprocess.Popen] = {}
    sizes: List[Tuple[float, int]] = []
    try:
        procs["trainer"] = _start(tmp_path, "trainer", TRAINER, SUPPORT, root, ready, go, str(seconds), str(ROWS),
                                  str(NUM_BATCHES), str(BATCH_SIZE), str(SEED))
        for i, name in enumerate(CONSUMERS):
            procs[name] = _start(tmp_path, name, CONSUMER, root, name, str(tmp_path / f"{name}.polls"), ready, done,
                                 str(i + 1))
        procs["tool"] = _start(tmp_path, "tool", TOOL, root, str(tmp_path / "offsets.jsonl"), go, done)
        procs["earliest"] = _start(tmp_path, "earliest", EARLIEST, root, str(tmp_path / "earliest.polls"), go, done)
        _wait_files([str(tmp_path / f"{n}.polls.started") for n in CONSUMERS], procs, tmp_path)
        t0 = time.time()
        open(go, "w").close()
        cli_runs = []
        while procs["trainer"].poll() is None:
            assert time.time() - t0 < seconds + 120, "the trainer did not finish"
            sizes.append((time.time() - t0, os.path.getsize(data_file)))
            if not cli_runs and time.time() - t0 > seconds / 3:
                # the real command line once, mid-soak (started, not waited for: the sizes go on)
                cli_runs.append(subprocess.Popen([sys.executable, "-m", "persistent_delta", "offsets", root,
                                                  "--format", "json"], stdout=subprocess.PIPE,
                                                 stderr=subprocess.PIPE, text=True))
            time.sleep(0.1)
        for i, run in enumerate(cli_runs):
            out, err = run.communicate(timeout=120)
            cli_runs[i] = subprocess.CompletedProcess(run.args, run.returncode, out, err)
        open(done, "w").close()
        t_exit = time.time()
        for name, p in procs.items():
            p.wait(timeout=120)
        t_all = time.time()
    finally:
        open(done, "w").close()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    for name, p in procs.items():
        err = (tmp_path / f"{name}.stderr").read_text()
        assert p.returncode == 0 and "Traceback" not in err, f"{name} exited {p.returncode}:\n{err}"
    trainer = json.loads((tmp_path / "trainer.stdout").read_text().strip().splitlines()[-1])
    with DeltaLog(os.path.join(root, "rank-0"), readonly=True) as log:
        end = log.read(position_rules.lookups_end)
    assert end == trainer["last_batch_idx"] + 1  # closed: the last batch is visible

    fed = _fed(trainer["last_batch_idx"])
    polls = {n: [json.loads(x) for x in open(tmp_path / f"{n}.polls")] for n in CONSUMERS}
    losses = []
    for name in CONSUMERS:
        losses += check_consumer(name, polls[name], fed, end)
        # it read while the trainer was writing, not only at the end
        assert sum(p["seen_end"] < end for p in polls[name]) > 5, name

    earliest = [json.loads(x) for x in open(tmp_path / "earliest.polls")]
    losses += check_earliest_reader(earliest, fed)
    assert sum(p["start"] > 1 for p in earliest) > 5, len(earliest)  # it read where retention had deleted below

    tool_runs = (tmp_path / "offsets.jsonl").read_text().splitlines()
    assert len(tool_runs) >= 5, len(tool_runs)
    log_start = check_offsets_outputs(tool_runs)
    assert log_start > end / 2, (log_start, end)  # delete_on_read ran, held back by no one for long
    assert len(cli_runs) == 1 and cli_runs[0].returncode == 0, cli_runs
    assert json.loads(cli_runs[0].stdout)["ranks"][0]["rank"] == 0

    # retention: the file stops growing once the first deletions free pages for reuse. It takes
    # one step up early (when the consumers start reading beside the trainer), then stays flat:
    # over the second half it grows by at most a quarter, or by at most half the bytes the trainer
    # wrote then (without retention it grows by every byte written then; a consumer slowed by a
    # loaded machine holds its snapshot's pages a little longer, which can take one more step up).
    final = os.path.getsize(data_file)
    early = [s for t, s in sizes if t <= seconds / 2][-1]
    second_half_bytes = trainer["bytes_written"] / 2  # the trainer is paced: it writes evenly
    assert final <= max(1.25 * early, early + 0.5 * second_half_bytes), (
        early, final, second_half_bytes, [(round(t, 1), s) for t, s in sizes[::10]])

    buf = io.StringIO()
    assert cli_main(["verify", root, "--format", "json"], stdout=buf) == 0, buf.getvalue()
    assert json.loads(buf.getvalue())["ok"]
    summary = {"batches": end, "polls": {n: len(p) for n, p in polls.items()}, "earliest_polls": len(earliest),
               "tool_runs": len(tool_runs),
               "early_size": early, "final_size": final, "max_size": max(s for _, s in sizes),
               "bytes_written": trainer["bytes_written"], "sizes": sizes[::10],
               "trainer_exit_s": t_exit - trainer["closed_at"], "others_exit_s": t_all - t_exit,
               "soak_s": t_exit - t0}
    print(summary)
    # last, so that every other check has run
    if losses:
        raise LostRowsError(f"{len(losses)} losses, first: " + "\n".join(losses[:5]))
    return summary


def test_soak_trainer_consumers_and_offsets_tool(tmp_path):
    run_soak(tmp_path, seconds=18)


@pytest.mark.slow
def test_soak_two_minutes(tmp_path):
    run_soak(tmp_path, seconds=120)
