"""Run every benchmark, one after the other, each in its own process (``make bench``).

    python -m benchmarks.run_all [--quick] [--only step_overhead,append_throughput] [--out DIR]

Each benchmark prints one JSON line per configuration; they are passed through to stdout and
also collected in ``<out>/results-<timestamp>.jsonl`` (default ``bench-out/``). Progress goes to
stderr. ``--quick`` shrinks every benchmark for a smoke run (one to two minutes in all).
Benchmarks run sequentially on purpose: on a 2-core machine two at once measure each other.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from typing import List, Optional

BENCHMARKS = [
    "step_overhead",
    "append_throughput",
    "get_unique_latency",
    "reopen_time",
    "disk_steady_state",
    "poll_wait",
    "read_path",
    "freshness",
    "ship",
]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument("--only", default=None, help="comma-separated subset of: " + ", ".join(BENCHMARKS))
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args(argv)
    names = BENCHMARKS if not args.only else [n.strip() for n in args.only.split(",")]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        ap.error(f"unknown benchmark(s): {unknown}")
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_path = os.path.join(args.out, f"results-{stamp}{'-quick' if args.quick else ''}.jsonl")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    failed = []
    with open(out_path, "w") as sink:
        for name in names:
            cmd = [sys.executable, "-m", f"benchmarks.{name}"] + (["--quick"] if args.quick else [])
            print(f"[run_all] {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, text=True)
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                if line.startswith("{"):
                    sink.write(line)
                    sink.flush()
            rc = proc.wait()
            print(f"[run_all] {name}: exit {rc} in {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
            if rc != 0:
                failed.append(name)
    print(f"[run_all] results in {out_path}" + (f"; failed: {failed}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
