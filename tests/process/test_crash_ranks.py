"""Issue 12 item 1: a 2-rank trainer SIGKILLed at random instants and restarted plainly (no
checkpoint restore): the ranks always continue at the same batch index; a consumer polling
between the runs gets contiguous, non-overlapping ranges (equal on both ranks) and never a
merged column-wise table without states."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from persistent_delta import DeltaConsumer
from persistent_delta.testing import free_port
from procs import REPO, SUPPORT


pytestmark = pytest.mark.dist


def _start(root: str, steps: int):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    port = free_port()
    return [subprocess.Popen([sys.executable, os.path.join(SUPPORT, "crash_trainer_ranks.py"), root, str(r), str(port),
                              str(steps)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for r in (0, 1)]


def _trial(root: str, rng: random.Random, kill: bool) -> list:
    procs = _start(root, 400 if kill else 5)
    starts = [p.stdout.readline().split() for p in procs]
    assert all(s[:1] == ["START"] for s in starts), (starts, [p.stderr.read()[-2000:] for p in procs if p.poll() is not None])
    if kill:
        time.sleep(rng.uniform(0.3, 2.0))
        first = rng.randrange(2)  # one rank dies first; the other may commit a step more
        procs[first].send_signal(signal.SIGKILL)
        time.sleep(rng.uniform(0.0, 0.3))
        procs[1 - first].send_signal(signal.SIGKILL)
    for p in procs:
        p.wait(timeout=120)
    return [int(s[1]) for s in starts]


def _state(root: str) -> dict:
    from persistent_delta.log import position_rules
    from persistent_delta.log.deltalog import DeltaLog

    out = {}
    for r in (0, 1):
        with DeltaLog(os.path.join(root, f"rank-{r}"), readonly=True) as log:
            out[r] = log.read(lambda t: (position_rules.bounds(t, "lookups"), {k: v.offset for k, v in t.consumers().items()},
                                         t.meta("curr_batch_idx"), t.meta("closed_end")))
    return out


def _run(tmp_path, trials: int, seed: int) -> None:
    root = str(tmp_path / "log")
    rng = random.Random(seed)
    last_end = None
    for i in range(trials + 1):
        s0, s1 = _trial(root, rng, kill=i < trials)
        assert s0 == s1, f"trial {i}: the ranks resumed at {s0} and {s1}"
        with DeltaConsumer(root, "watch") as c:
            poll = c.poll()
            ranges = poll.ranges
            assert ranges[0] == ranges[1], (i, ranges, _state(root))
            start, end = ranges[0]
            if last_end is not None:
                assert start == last_end, (start, last_end)  # contiguous: nothing twice, nothing skipped
            last_end = end
            for fqn, m in poll.merged().items():
                assert m.states is not None, f"trial {i}: {fqn} merged without states (a column half missing)"
            c.commit()


def test_sigkill_two_ranks_a_few_times(tmp_path):
    _run(tmp_path, trials=3, seed=5)


@pytest.mark.slow
def test_sigkill_two_ranks_many_times(tmp_path):
    _run(tmp_path, trials=15, seed=6)
