"""Owns: a real Prometheus server for tests -- started on 127.0.0.1 (a free port, a fresh data
directory, a config that scrapes the given targets every second), queried over its HTTP API,
always stopped.

The binary is Debian's ``prometheus`` package (``.ci/run`` installs it when missing); tests
that need it skip, saying so, where it is absent.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from typing import Dict, Iterator, List, Mapping, Optional

from persistent_delta.testing import free_port

BINARY = shutil.which("prometheus")
MISSING = ("the prometheus binary is not installed (Debian: apt-get install -y --no-install-recommends "
           "prometheus; .ci/run does this)")


class Prometheus:
    """A running server: :meth:`query` asks its HTTP API."""

    def __init__(self, port: int, proc: subprocess.Popen, log: str) -> None:
        self.port = port
        self.proc = proc
        self.log = log

    def query(self, expr: str) -> List[Dict[str, object]]:
        """The instant query's result vector (``metric`` labels and ``value`` [time, text])."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.load(resp)
        if body.get("status") != "success":
            raise AssertionError(f"prometheus query {expr!r} failed: {body}")
        return list(body["data"]["result"])

    def values(self, expr: str) -> Dict[tuple, float]:
        """sorted label items (less ``__name__`` and the ``instance`` Prometheus adds) -> value,
        for every series ``expr`` returns now."""
        out = {}
        for r in self.query(expr):
            labels = {k: v for k, v in r["metric"].items() if k not in ("__name__", "instance")}  # type: ignore
            out[tuple(sorted(labels.items()))] = float(r["value"][1])  # type: ignore[index]
        return out

    def wait_for(self, expr: str, want: Optional[Mapping[tuple, float]] = None, timeout: float = 60.0
                 ) -> Dict[tuple, float]:
        """Poll ``expr`` until it returns series (and, with ``want``, these values for those
        label sets); the last answer, or AssertionError with it after ``timeout``."""
        deadline = time.monotonic() + timeout
        got: Dict[tuple, float] = {}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited {self.proc.returncode}:\n{self._tail()}")
            try:
                got = self.values(expr)
            except OSError:
                got = {}  # not listening yet
            if got and (want is None or all(got.get(k) == v for k, v in want.items())):
                return got
            time.sleep(0.5)
        raise AssertionError(f"prometheus: {expr!r} = {got}, wanted {want}\n{self._tail()}")

    def _tail(self) -> str:
        try:
            with open(self.log) as f:
                return f.read()[-3000:]
        except OSError:
            return ""


@contextlib.contextmanager
def prometheus(workdir: str, targets: Mapping[str, str]) -> Iterator[Prometheus]:
    """Run Prometheus scraping ``targets`` (scrape job name -> ``host:port``) every second.

    Labels the targets export win over Prometheus' own (``honor_labels``), so a metric's ``job``
    label is the persistent_delta job's.
    """
    if BINARY is None:
        raise RuntimeError(MISSING)
    os.makedirs(workdir, exist_ok=True)
    config = os.path.join(workdir, "prometheus.yml")
    lines = ["global:", "  scrape_interval: 1s", "  evaluation_interval: 1s", "scrape_configs:"]
    for name, target in targets.items():
        lines += [f"  - job_name: {name}", "    honor_labels: true", "    static_configs:",
                  f"      - targets: ['{target}']"]
    with open(config, "w") as f:
        f.write("\n".join(lines) + "\n")
    port = free_port()
    log = os.path.join(workdir, "prometheus.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [BINARY, f"--config.file={config}", f"--storage.tsdb.path={os.path.join(workdir, 'data')}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        yield Prometheus(port, proc, log)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
