"""Damaged files: truncations and byte flips on copies of a real log,
opened by every tool and by a consumer, in a process apart from the test's (one for all the cases of a
fuzz run, so that torch imports once): never a death by signal, never
an exception that is not the library's, and a poll that succeeds returns exactly the undamaged
rows unless verify reports damage."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from typing import Dict, List

import pytest
import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta import DeltaReader, LmdbDeltaStore
from persistent_delta.log.layout import DATA_FILE
from procs import REPO


PROBE = r"""
import json, sys, traceback
from persistent_delta import DeltaReader, PersistentDeltaError
from persistent_delta.cli import main
roots, whats = json.loads(sys.argv[1]), sys.argv[2:]
for root, what in [(root, what) for root in roots for what in whats]:
    out = {"root": root, "what": what}
    print("START " + json.dumps(out), flush=True)
    try:
        if what == "poll":
            with DeltaReader(root) as r:
                p = r.poll()
                out["rows"] = {d.fqn: sorted(d.ids.tolist()) for d in p}
        else:
            args = {"verify": ["verify", root], "offsets": ["offsets", root], "vacuum": ["vacuum", root, "--execute"],
                    "replay": ["replay", root, "--from-batch", "0", "--to-batch", "50", "--dry-run"]}[what]
            out["rc"] = main(args)
    except PersistentDeltaError as exc:
        out["error"] = type(exc).__name__
    except BaseException:
        out["foreign"] = traceback.format_exc()
    print("RESULT " + json.dumps(out), flush=True)
"""


def _make(path: str) -> dict:
    with LmdbDeltaStore(path, UpdateMode.NONE) as s:
        for b in range(1, 40):
            for t in ("a", "b"):
                s.append(b, t, torch.arange(b, b + 30) % 97)
    with DeltaReader(path) as r:
        return {d.fqn: sorted(d.ids.tolist()) for d in r.poll()}


def _probe_cases(roots: List[str], *whats: str) -> Dict[str, dict]:
    """Run the probes on every root in one process (torch imports once: a process per case
    cost seconds each); root -> what -> result. A death by signal fails the test naming the
    case and probe it was in."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(roots), *whats], capture_output=True, text=True,
                          env=env, timeout=300 * len(roots))
    results: Dict[str, dict] = {root: {} for root in roots}
    last = None
    for ln in proc.stdout.splitlines():
        if ln.startswith("START "):
            last = json.loads(ln[len("START "):])
        elif ln.startswith("RESULT "):
            out = json.loads(ln[len("RESULT "):])
            results[out.pop("root")][out.pop("what")] = out
    assert proc.returncode >= 0, (f"died by signal {-proc.returncode} in {last}: {proc.stderr[-2000:]}")
    for root, res in results.items():
        assert set(res) == set(whats), f"no result for {set(whats) - set(res)} on {root}: {proc.stderr[-2000:]}"
        for what, out in res.items():
            assert "foreign" not in out, f"{what} raised a foreign exception on {root}:\n{out['foreign']}"
    return results


def _probe(root: str, *whats: str) -> dict:
    """The probes on one root, in a process of their own; what -> result."""
    return _probe_cases([root], *whats)[root]


def _check_cases(roots: List[str], truth: dict) -> None:
    for root, res in _probe_cases(roots, "verify", "offsets", "replay", "poll").items():
        damaged = res["verify"].get("rc", 1) != 0 or "error" in res["verify"]
        if "rows" in res["poll"] and not damaged:
            assert res["poll"]["rows"] == truth, f"a poll returned other rows than written, and verify said OK: {root}"


@pytest.mark.parametrize("fraction", [0.5, 8192])
def test_truncated_data_files_give_typed_errors_never_a_signal(tmp_path, fraction):
    src = str(tmp_path / "log")
    truth = _make(src)
    case = str(tmp_path / "case")
    shutil.copytree(src, case)
    data = os.path.join(case, DATA_FILE)
    size = os.path.getsize(data)
    keep = int(size * fraction) if fraction < 1 else int(fraction)
    with open(data, "r+b") as f:
        f.truncate(keep)
    res = _probe(case, "verify", "offsets", "replay", "poll", "vacuum")
    assert res["verify"].get("rc") == 1
    for what in ("offsets", "replay", "poll", "vacuum"):
        assert res[what].get("error") == "DamagedLogError" or res[what].get("rc") == 1, (what, res[what])
    assert not any(n.startswith(".vacuum-") for n in os.listdir(case))


@pytest.mark.parametrize("age", ["just-wiped", "old"])
def test_a_rank_wiped_to_zero_bytes_is_damage_to_every_tool(tmp_path, age):
    """One rank's data file of a 2-rank job wiped to 0 bytes: every one-shot tool (verify,
    offsets, replay, vacuum) exits 1 on it at once, even just after the wipe, when it might be a
    creation in progress; a live reader skips it for the grace (it looks again at each poll) and
    then refuses it."""
    src, root = str(tmp_path / "log"), str(tmp_path / "job")
    _make(src)
    for r in range(2):
        shutil.copytree(src, os.path.join(root, f"rank-{r}"))
    data = os.path.join(root, "rank-1", DATA_FILE)
    with open(data, "r+b") as f:
        f.truncate(0)
    if age == "old":
        os.utime(data, (1, 1))
    res = _probe(root, "verify", "offsets", "replay", "vacuum", "poll")
    for what in ("verify", "offsets", "replay", "vacuum"):
        assert res[what].get("rc") == 1 or res[what].get("error") == "DamagedLogError", (what, res[what])
    if age == "old":
        assert res["poll"].get("error") == "DamagedLogError", res["poll"]
    assert not any(n.startswith(".vacuum-") for r in ("rank-0", "rank-1") for n in os.listdir(os.path.join(root, r)))


def _fuzz(tmp_path, flips: int, truncations: int, seed: int) -> None:
    src = str(tmp_path / "log")
    truth = _make(src)
    size = os.path.getsize(os.path.join(src, DATA_FILE))
    rng = random.Random(seed)
    cases: List[str] = []
    for i in range(flips + truncations):
        case = str(tmp_path / f"case-{i}")
        shutil.copytree(src, case)
        data = os.path.join(case, DATA_FILE)
        with open(data, "r+b") as f:
            if i < flips:
                off = rng.randrange(size)
                f.seek(off)
                byte = f.read(1)
                f.seek(off)
                f.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))
            else:
                f.truncate(rng.randrange(size))
        cases.append(case)
    _check_cases(cases, truth)


def test_damage_fuzz_small(tmp_path):
    _fuzz(tmp_path, flips=8, truncations=3, seed=1)


@pytest.mark.slow
def test_damage_fuzz(tmp_path):
    _fuzz(tmp_path, flips=80, truncations=20, seed=2)


WRITER = r"""
import lmdb, os, sys, time
env = lmdb.open(sys.argv[1], map_size=1 << 31, sync=False, metasync=False)
stop = time.time() + float(sys.argv[2])
i = 0
print("READY", flush=True)
while time.time() < stop:
    with env.begin(write=True) as txn:  # every commit grows the file by a few pages
        txn.put(b"%012d" % i, os.urandom(3 * 4096))
    i += 1
print("COMMITS", i, flush=True)
"""


def test_the_file_check_never_takes_a_live_writer_for_damage(tmp_path):
    """A consumer opens a log while its writer commits (a replica started beside a trainer): the
    check of the file must not pair a meta page read before a commit with a size or a twin meta
    page read after it and call the live file damaged."""
    from persistent_delta.log.lmdbenv import check_file

    path = str(tmp_path / "live")
    os.makedirs(path)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, path, "4"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        checks, failures = 0, []
        while proc.poll() is None:
            try:
                check_file(path)
            except Exception as exc:  # noqa: BLE001 - every failure is collected and reported
                failures.append(repr(exc))
            checks += 1
        commits = int(proc.stdout.read().split()[-1])
    finally:
        proc.kill()
        proc.wait()
    assert commits > 1000 and checks > 1000, (commits, checks)
    assert not failures, f"{len(failures)} of {checks} checks failed against {commits} commits: {failures[:3]}"
