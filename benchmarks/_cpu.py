"""CPU-time and memory probes shared by the CPU-time benchmarks (``step_cpu``, ``scaling``).

On a machine shared with other jobs, wall-clock ratios mostly measure the neighbours; the CPU a
thread or a process used is much less sensitive to them (it still moves with cache and frequency
effects). These helpers read:

* a thread's CPU clock by its ``threading.Thread`` (``pthread_getcpuclockid``), so a benchmark
  can charge the library's writer thread separately from the training thread;
* the process's CPU (``time.process_time``: every thread of the process);
* the resident set size now (``/proc/self/statm``) and its peak (``ru_maxrss``);
* the bytes TorchRec's in-memory ``DeltaStoreTrec`` holds (its ``per_fqn_lookups`` tensors).
"""

from __future__ import annotations

import os
import resource
import threading
import time
from typing import Any, Dict, Iterable, Optional

_PAGE = os.sysconf("SC_PAGE_SIZE")


def thread_cpu_s(t: threading.Thread) -> float:
    """CPU seconds ``t`` has used so far (0.0 once it has ended or before it started)."""
    if t.ident is None or not t.is_alive():
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(t.ident))
    except (OSError, ProcessLookupError):
        return 0.0


def threads_named(prefix: str) -> Iterable[threading.Thread]:
    """The live threads of this process whose name starts with ``prefix``."""
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def writer_threads_of(tracker: Any) -> Iterable[threading.Thread]:
    """The background writer thread(s) of a persistent tracker (matched by the log path in the
    writer thread's name, so several trackers in one process are told apart)."""
    path = getattr(tracker, "path", None)
    return [t for t in threads_named("persistent-delta-writer:") if path is None or t.name.endswith(str(path))]


def rss_bytes() -> int:
    """Resident set size of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def torchrec_store_bytes(tracker: Any) -> Optional[int]:
    """Bytes of the ids and states TorchRec's ``ModelDeltaTrackerTrec`` holds in memory (its
    ``DeltaStoreTrec.per_fqn_lookups``), or None when it is not that tracker."""
    store = getattr(tracker, "store", None)
    lookups: Optional[Dict[str, Any]] = getattr(store, "per_fqn_lookups", None)
    if lookups is None:
        return None
    total = 0
    for items in lookups.values():
        for it in items:
            for name in ("ids", "states", "raw_ids", "runtime_meta"):
                t = getattr(it, name, None)
                if t is not None:
                    total += t.numel() * t.element_size()
    return total


class CpuClock:
    """Training-thread CPU, process CPU and wall time since :meth:`start` (or creation)."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self.th0 = time.thread_time()
        self.p0 = time.process_time()

    def read(self) -> Dict[str, float]:
        return {
            "wall_s": time.perf_counter() - self.t0,
            "thread_s": time.thread_time() - self.th0,
            "process_s": time.process_time() - self.p0,
        }
