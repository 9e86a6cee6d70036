"""Helpers shared by the benchmarks: output, timing, Zipf ids, a sharded DMP on CPU.

Every benchmark prints one JSON object per configuration on stdout (``emit``) and human
progress on stderr (``log``), so ``python -m benchmarks.X > results.jsonl`` keeps only data.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import warnings

import torch

# TorchRec/DDP deprecation chatter would drown the progress lines on stderr.
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", message=".*is_fx_tracing.*")

# --------------------------------------------------------------------------------- output


def log(msg: str, *args: object) -> None:
    """Progress for humans, on stderr."""
    print(("[bench] " + msg) % args if args else "[bench] " + msg, file=sys.stderr, flush=True)


def emit(bench: str, **fields: Any) -> Dict[str, Any]:
    """Print one JSON line (one configuration) on stdout and return it."""
    rec = {"bench": bench, **{k: _round(v) for k, v in fields.items()}}
    print(json.dumps(rec, sort_keys=False), flush=True)
    return rec


def _round(v: Any) -> Any:
    if isinstance(v, float):
        return float(f"{v:.6g}")
    if isinstance(v, dict):
        return {k: _round(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_round(x) for x in v]
    return v


def machine() -> Dict[str, Any]:
    """A small description of where the numbers come from."""
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "time": datetime.datetime.now().isoformat(timespec="seconds"),
        "loadavg_1m": os.getloadavg()[0],
        "commit": _COMMIT_AT_START,
    }


def _git_commit() -> Optional[str]:
    """HEAD of the checkout the package was imported from, with ``+dirty`` when
    ``persistent_delta/`` has uncommitted changes (others edit it concurrently)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "persistent_delta"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) or None


# Taken when the benchmark starts (close to when it imported the package), not at each emit.
_COMMIT_AT_START = _git_commit()


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def pct(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` by nearest rank (``q=0.99`` of 500 values: the 496th
    smallest); NaN for no values. Every benchmark's p50/p99 use it."""
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))] if ys else float("nan")


def mean(xs: Sequence[float]) -> float:
    return float(statistics.fmean(xs))


def ratio(a: float, b: float) -> Optional[float]:
    return None if b == 0 else a / b


# --------------------------------------------------------------------------------- files


def workdir(prefix: str, base: Optional[str] = None) -> str:
    """A fresh scratch directory (delete it with ``shutil.rmtree``)."""
    base = base or os.environ.get("PERSISTENT_DELTA_BENCH_DIR") or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"pd-bench-{prefix}-", dir=base)


def rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def free_bytes(path: str) -> int:
    return shutil.disk_usage(path).free


def dir_bytes(path: str) -> int:
    """Allocated size of the files under ``path`` (what ``du`` reports), in bytes."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def drop_file_cache(path: str) -> None:
    """Write back, then evict ``path`` from the page cache (no root needed for clean pages)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------- ids


def zipf_sampler(rows: int, s: float, seed: int) -> "ZipfIds":
    return ZipfIds(rows, s, seed)


class ZipfIds:
    """Zipf(s) ids over ``rows`` rows: rank r has probability ~ 1/r**s; ranks are mapped to
    rows through a fixed random permutation so hot rows are spread over the table."""

    def __init__(self, rows: int, s: float, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.perm = torch.randperm(rows, generator=g)
        w = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** s
        self.cdf = torch.cumsum(w / w.sum(), 0)
        self.cdf[-1] = 1.0
        self.gen = torch.Generator().manual_seed(seed + 1)

    def sample(self, n: int) -> torch.Tensor:
        u = torch.rand(n, dtype=torch.float64, generator=self.gen)
        ranks = torch.searchsorted(self.cdf, u).clamp_(max=self.perm.numel() - 1)
        return self.perm[ranks]


# --------------------------------------------------------------------------------- timing


class Timer:
    def __enter__(self) -> "Timer":
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.s = time.perf_counter() - self.t0


def repeat(fn: Any, n: int, setup: Any = None) -> List[float]:
    """Run ``fn`` n times (after ``setup`` each time, untimed); returns seconds per run."""
    out = []
    for _ in range(n):
        if setup is not None:
            setup()
        gc.collect()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# --------------------------------------------------------------------------------- process group


def init_single_rank_pg(backend: str = "gloo") -> None:
    """A one-rank process group in this process (gloo for a real DMP on CPU; ``"nccl"`` for one
    on this process's current GPU)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=600),
    )


def iter_chunks(seq: Sequence[Any], n: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(seq), n):
        yield seq[i:i + n]


@dataclass
class Stats:
    mean_s: float
    median_s: float
    p90_s: float
    n: int

    @staticmethod
    def of(xs: Sequence[float]) -> "Stats":
        ys = sorted(xs)
        return Stats(mean(ys), median(ys), ys[min(len(ys) - 1, int(0.9 * len(ys)))], len(ys))


# --------------------------------------------------------------------------------- noise


def _cpu_jiffies() -> Tuple[int, int]:
    """(busy, total) jiffies of all CPUs, from /proc/stat (Linux)."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    return sum(parts) - idle, sum(parts)


class CpuMonitor:
    """How much CPU *other* processes used while a benchmark ran (0 = a quiet machine).

    ``foreign_cpus`` is the average number of CPUs busy with anything but this process (and
    its children) over the interval: on 2 cores, 0.5 means another job took a quarter of
    the machine and the figures are suspect.
    """

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.j0 = _cpu_jiffies()
        self.r0 = _own_cpu_s()

    def foreign_cpus(self) -> Optional[float]:
        try:
            busy1, _ = _cpu_jiffies()
        except OSError:
            return None
        hz = os.sysconf("SC_CLK_TCK")
        wall = time.monotonic() - self.t0
        if wall <= 0:
            return None
        busy = (busy1 - self.j0[0]) / hz
        own = _own_cpu_s() - self.r0
        return max(0.0, (busy - own) / wall)


def _own_cpu_s() -> float:
    import resource

    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def wait_for_quiet(max_wait_s: float, threshold_cpus: float = 0.3, sample_s: float = 2.0) -> Optional[float]:
    """Wait (up to ``max_wait_s``) until other processes use less than ``threshold_cpus`` CPUs
    over ``sample_s``; returns the last reading. Benchmarks call it before timed sections.
    ``max_wait_s <= 0`` (the ``--quick`` smoke runs) returns None at once, without a reading."""
    if max_wait_s <= 0:
        return None
    deadline = time.monotonic() + max_wait_s
    reading: Optional[float] = None
    while True:
        m = CpuMonitor()
        time.sleep(sample_s)
        reading = m.foreign_cpus()
        if reading is None or reading < threshold_cpus or time.monotonic() > deadline:
            return reading
        log("machine busy (%.2f CPUs used by other processes); waiting", reading)
