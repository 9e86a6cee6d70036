"""Crash suite: a real trainer process (sharded model, tracker attached) killed with SIGKILL at
random instants. After each kill: every record decodes, everything a returned flush() covered
is present and exact, consumer offsets never move backwards nor past the log end, and a
restarted trainer continues the batch index."""

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from harness import make_batches
from persistent_delta.log import position_rules
from persistent_delta.log.deltalog import DeltaLog
from procs import REPO, SUPPORT

TABLES = {"sparse.embeddings.table_0": ["feature_0", "feature_1"], "sparse.embeddings.table_1": ["feature_2"]}


def start_trainer(root: str, steps: int) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, os.path.join(SUPPORT, "crash_trainer.py"), root, str(steps)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


_BATCHES: list = []


def expected_ids(batch_idx: int) -> dict:
    """Ids the trainer records at ``batch_idx`` (batch ``(batch_idx - 1) % 50`` was fed)."""
    if not _BATCHES:
        _BATCHES.extend(make_batches("ec", 50, 64, seed=7, world_size=1, rank=0, rows=500))
    b = _BATCHES[(batch_idx - 1) % 50].sparse
    return {fqn: torch.unique(torch.cat([b[f].values() for f in feats])) for fqn, feats in TABLES.items()}


def read_state(rank_dir: str):
    with DeltaLog(rank_dir, readonly=True) as log:
        def read(r):
            batches = {}
            for fqn, e in r.tables().items():
                for rec in r.iter_records(e.table_id):  # decodes every record, checks its crc32c
                    batches.setdefault(rec.batch_idx, {}).setdefault(fqn, []).append(rec.ids.clone())
            return batches, {k: v.offset for k, v in r.consumers().items()}, position_rules.lookups_end(r)
        return log.read(read)


def one_trial(root: str, rng: random.Random, previous_offsets: dict) -> dict:
    proc = start_trainer(root, 400)
    flushed = []
    deadline = time.time() + 60
    kill_after = rng.uniform(0.2, 2.5)
    line = proc.stdout.readline()
    assert line.startswith("START"), line + proc.stderr.read()
    start_batch = int(line.split()[1])
    lines: list = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    t0 = time.time()
    while time.time() - t0 < kill_after and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    reader.join(10)
    for ln in lines:
        fields = ln.split()
        if fields[:1] == ["FLUSHED"] and len(fields) == 3 and ln.endswith("\n"):  # (not a line cut by the kill)
            flushed.append((int(fields[1]), int(fields[2])))
    batches, offsets, end = read_state(os.path.join(root, "rank-0"))
    # offsets never move backwards, nor past the log end (+1: a trainer-side read includes the
    # batch being recorded)
    for name, off in offsets.items():
        assert off >= previous_offsets.get(name, 0), (name, off, previous_offsets)
        assert off <= end + 1, (name, off, end)
    if flushed:
        curr, off_a = flushed[-1]
        assert offsets["a"] >= off_a
        assert end >= curr
        # everything a returned flush() covered is present (consumer b never reads, so retention
        # keeps it all; compaction may have merged batches into one record stamped at the
        # range start, so compare per table the union of ids up to the flushed batch)
        for fqn in TABLES:
            got = [ids for b, per in batches.items() if b <= curr for ids in per.get(fqn, [])]
            want = [expected_ids(b)[fqn] for b in range(1, curr + 1)]
            assert torch.equal(torch.unique(torch.cat(got)), torch.unique(torch.cat(want))), fqn
    return offsets, start_batch, flushed


def run_trials(root: str, n: int, seed: int) -> None:
    rng = random.Random(seed)
    offsets: dict = {}
    last_start = -1
    last_flushed = 0
    flushes = 0
    for _ in range(n):
        offsets, start_batch, flushed = one_trial(root, rng, offsets)
        # the restarted trainer continues after every batch a flush covered
        assert start_batch >= max(last_start, last_flushed)
        last_start = start_batch
        if flushed:
            last_flushed = flushed[-1][0]
        flushes += len(flushed)
    # finally a clean run continues after the last persisted batch and completes
    proc = start_trainer(root, 8)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    first = int(out.splitlines()[0].split()[1])
    assert first >= last_start and "DONE" in out
    assert flushes > 0


def test_sigkill_trainer_a_few_times(tmp_path):
    run_trials(str(tmp_path / "log"), 3, seed=1)


@pytest.mark.slow
def test_sigkill_trainer_25_times(tmp_path):
    run_trials(str(tmp_path / "log"), 25, seed=2)
