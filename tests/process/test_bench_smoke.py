"""Every benchmark in ``benchmarks/`` runs at its smallest size without crashing: a smoke run
(``python -m benchmarks.<name> --quick``) in a child process, which must exit 0, print no
traceback and leave nothing in its scratch directory. Nothing is timed: the figures of a smoke
run mean nothing, so the runs share the machine, two at a time. The list of benchmarks is read
from the folder, so a new benchmark without an entry in ``SMOKE`` (or ``VIA``: run by another's
smoke run, or ``ELSEWHERE``: by another test) fails here."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, Iterator, List, Tuple

import pytest

from procs import REPO

BENCHMARKS = os.path.join(REPO, "benchmarks")
# Modules of benchmarks/ that are not benchmarks: shared helpers.
HELPERS = {"__init__", "_common", "_cpu", "_model"}
# Benchmark -> the arguments of its smoke run after ``python -m benchmarks.<name>``; "{tmp}" is a
# fresh directory of the run (what a benchmark writes goes there, never into the repository).
# The longest runs first: they start first.
SMOKE: Dict[str, List[str]] = {
    "ship": ["--quick"],
    "scaling": ["--smoke", "--out", "{tmp}/scaling"],
    "freshness": ["--quick"],
    "stream_leaders": ["--quick", "--out", "{tmp}/stream_leaders.jsonl"],
    "serving_latency": ["--quick"],
    "get_unique_latency": ["--quick"],
    "append_throughput": ["--quick"],
    "step_cpu": ["--quick"],
    "step_overhead": ["--quick"],
    "reopen_time": ["--quick"],
    "disk_steady_state": ["--quick"],
    "read_path": ["--quick"],
    # run_all drives the others, each in a process of its own: the smoke run of one of them (VIA).
    "run_all": ["--quick", "--only", "poll_wait", "--out", "{tmp}/bench-out"],
    "publish_cost_formats": ["--quick", "--out", "{tmp}/publish_cost_formats.jsonl"],
    "zch_write_cost": ["--quick"],
    "profile_step": ["--quick", "--cprofile", "{tmp}/profile.prof"],
    "writer_commit": ["--quick"],
    "inference_apply": ["--quick"],
    "stream_model": ["--quick"],
    "checkpoint_increments": ["--quick", "--plot", "{tmp}/restore-curve.png"],
    # every 2 steps: crosses the steps that do not publish, and the profile
    "replica_cpu": ["--quick", "--every", "2", "--cprofile", "{tmp}/replica.prof"],
}
# Benchmark -> the benchmark whose smoke run runs its smoke run too.
VIA: Dict[str, str] = {"poll_wait": "run_all"}
# Benchmark -> (test file in this folder, test) that runs its smoke run already, in ``make test``.
ELSEWHERE: Dict[str, Tuple[str, str]] = {
    # The CPU dry run of the GPU check at its smallest (--device cpu --quick), with what it reports checked.
    "gpu_check": ("test_gpu_check.py", "test_the_dry_run_passes_every_check"),
}
TIMEOUT_S = 240.0  # per run, two runs at a time on a machine shared with other tests
PARALLEL = 2
_RUNNING: Dict[str, "subprocess.Popen[str]"] = {}  # name -> its smoke run while it runs


def benchmark_modules() -> List[str]:
    """Every module of benchmarks/ but the helpers: what must have a smoke run."""
    return sorted(f[:-3] for f in os.listdir(BENCHMARKS) if f.endswith(".py") and f[:-3] not in HELPERS)


@dataclass
class Run:
    cmd: List[str]
    returncode: int
    output: str
    seconds: float
    scratch_left: List[str]


def smoke_run(name: str, tmp: str) -> Run:
    """``python -m benchmarks.<name> <SMOKE args>`` with its scratch directory
    ($PERSISTENT_DELTA_BENCH_DIR) under ``tmp``; killed, with everything it started, past
    :data:`TIMEOUT_S`."""
    scratch = os.path.join(tmp, "scratch")
    os.makedirs(scratch)
    args = [a.replace("{tmp}", tmp) for a in SMOKE[name]]
    # One intra-op thread: runs that share the cores would otherwise spin in each other's thread pools.
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PERSISTENT_DELTA_BENCH_DIR=scratch, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = [sys.executable, "-m", f"benchmarks.{name}", *args]
    t0 = time.monotonic()
    # A session of its own: whatever it started (servers, replicas, ranks) is killed with it.
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    _RUNNING[name] = proc
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n[smoke] killed after {TIMEOUT_S:.0f} s"
        code = -signal.SIGKILL
    finally:
        _RUNNING.pop(name, None)
    _kill_session(proc)  # anything it left running
    return Run(cmd, code, out, time.monotonic() - t0, sorted(os.listdir(scratch)))


def _kill_session(proc: "subprocess.Popen[str]") -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def smoke_runs(request, tmp_path_factory) -> Iterator[Dict[str, Future]]:
    """The smoke runs of the benchmarks this session selected, started at once, PARALLEL at a time."""
    wanted = {item.callspec.params["name"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")}
    names = [n for n in SMOKE if n in wanted] + sorted(wanted - set(SMOKE))
    pool = ThreadPoolExecutor(PARALLEL, thread_name_prefix="bench-smoke")
    futures = {n: pool.submit(smoke_run, n, str(tmp_path_factory.mktemp(f"smoke-{n}"))) for n in names if n in SMOKE}
    try:
        yield futures
    finally:
        for f in futures.values():
            f.cancel()
        for proc in list(_RUNNING.values()):  # the session ended early: do not wait for their timeouts
            _kill_session(proc)
        pool.shutdown(wait=True)


def test_every_benchmark_has_a_smoke_run():
    """A benchmark added to benchmarks/ without a smoke run (or an entry left behind by a removed
    one) fails here: SMOKE, VIA and ELSEWHERE together list exactly the folder's benchmarks."""
    assert not set(SMOKE) & set(ELSEWHERE) and not set(VIA) & (set(SMOKE) | set(ELSEWHERE))
    assert set(SMOKE) | set(VIA) | set(ELSEWHERE) == set(benchmark_modules())
    for name, via in VIA.items():
        assert name in SMOKE[via][SMOKE[via].index("--only") + 1].split(","), (name, via)


@pytest.mark.parametrize("name", sorted(ELSEWHERE))
def test_a_smoke_run_made_by_another_test_runs_in_make_test(name):
    """The test named in ELSEWHERE exists and is not marked slow (``make test`` runs it)."""
    path, test = ELSEWHERE[name]
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), path)) as f:
        tree = ast.parse(f.read())
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == test]
    assert found, f"{path} has no {test}: give benchmarks/{name}.py an entry in SMOKE"
    marks = [ast.unparse(d) for d in found[0].decorator_list]
    assert not any("slow" in m for m in marks), f"{path}::{test} is marked slow: make test does not run it"


@pytest.mark.parametrize("name", [n for n in benchmark_modules() if n not in ELSEWHERE and n not in VIA])
def test_the_benchmark_runs_at_its_smallest_size(name, smoke_runs):
    """``python -m benchmarks.<name>`` at its smoke size exits 0 with no traceback, and leaves
    nothing in its scratch directory."""
    if name not in smoke_runs:
        pytest.fail(f"benchmarks/{name}.py has no smoke run: add it to SMOKE in {__file__}")
    run = smoke_runs[name].result()
    print(f"{name}: {run.seconds:.1f} s")
    shown = " ".join(run.cmd[1:])
    assert run.returncode == 0, f"{shown} exited {run.returncode} after {run.seconds:.0f} s:\n{run.output[-6000:]}"
    assert "Traceback" not in run.output, f"{shown}:\n{run.output[-6000:]}"
    assert not run.scratch_left, f"{shown} left {run.scratch_left} in its scratch directory"
