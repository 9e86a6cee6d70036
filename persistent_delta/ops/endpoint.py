"""The metrics endpoint's HTTP server: a bounded number of threads, idle connections timed out.

Owns: serving one WSGI app (prometheus_client's ``make_wsgi_app`` over a registry) on a TCP
port with bounded resources; what is served is :mod:`persistent_delta.ops.metrics`'.

Design note
-----------
prometheus_client's own server (``start_http_server``) starts a thread per connection and keeps
it while the connection stays open, with no read timeout: every idle connection -- a port scan,
a client that connects and waits -- costs a thread for as long as it stays open. Here:

* one **acceptor** thread holds the connections that have sent nothing yet in a selector (no
  thread each) and closes each one ``read_timeout_s`` after it was accepted;
* a connection whose request has started to arrive goes to a **fixed pool** of ``handlers``
  threads, which read it with the same socket timeout (a slow sender holds a handler at most
  that long per read), answer it and close it -- one request per connection (HTTP/1.0, as
  prometheus_client's server answers; Prometheus connects again at its next scrape);
* at most ``max_connections`` are open at once: past it the oldest idle connection is closed to
  admit the new one (a new one is refused only while every open connection is a request in
  progress), so a scrape still gets through while idle connections pile up.

Threads: the acceptor, and at most ``handlers`` more, whatever the clients do.
"""

from __future__ import annotations

import collections
import logging
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Deque, Dict, Optional, Tuple
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from persistent_delta.config import METRICS_HANDLER_THREADS, METRICS_MAX_CONNECTIONS, METRICS_READ_TIMEOUT_S
from persistent_delta.errors import InvalidInputError

logger = logging.getLogger(__name__)


class _Handler(WSGIRequestHandler):
    """One request, read with the server's socket timeout; nothing logged per request."""

    server: "BoundedWSGIServer"

    def setup(self) -> None:
        self.timeout = self.server.read_timeout_s  # StreamRequestHandler.setup sets it on the socket
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Log nothing (a scrape every few seconds)."""


class BoundedWSGIServer(WSGIServer):
    """A WSGI server with an acceptor thread and a fixed pool of handler threads (see the module's
    design note). Start it with :meth:`start`; :meth:`shutdown` then :meth:`server_close` stop it.
    Thread-safe: its methods may be called from any thread.

    Args:
        addr: the address to listen on (IPv4 or IPv6).
        port: the TCP port (0: a free one; :attr:`server_port` says which).
        app: the WSGI app.
        handlers: handler threads (default :data:`persistent_delta.config.METRICS_HANDLER_THREADS`).
        read_timeout_s: how long a connection may stay silent, before its request and between its
            reads (default :data:`persistent_delta.config.METRICS_READ_TIMEOUT_S`).
        max_connections: connections open at once (default
            :data:`persistent_delta.config.METRICS_MAX_CONNECTIONS`).

    Raises:
        InvalidInputError: a bound that is not positive.
        OSError: the port is taken.
    """

    # the listen backlog: a burst of connections waits there for the acceptor (socketserver's 5 drops SYNs,
    # and a dropped SYN costs the client a second before it retries)
    request_queue_size = 128

    def __init__(self, addr: str, port: int, app: Callable[..., Any], handlers: Optional[int] = None,
                 read_timeout_s: Optional[float] = None, max_connections: Optional[int] = None) -> None:
        self.handlers = METRICS_HANDLER_THREADS if handlers is None else int(handlers)
        self.read_timeout_s = METRICS_READ_TIMEOUT_S if read_timeout_s is None else float(read_timeout_s)
        self.max_connections = METRICS_MAX_CONNECTIONS if max_connections is None else int(max_connections)
        if self.handlers < 1 or self.max_connections < 1 or not self.read_timeout_s > 0:
            raise InvalidInputError(f"handlers ({self.handlers}), max_connections ({self.max_connections}) and "
                                    f"read_timeout_s ({self.read_timeout_s}) must be positive")
        self.address_family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        super().__init__((addr, port), _Handler)
        self.set_app(app)
        self._idle: Dict[socket.socket, Tuple[float, Any]] = {}  # connection -> (deadline, peer), oldest first
        self._order: Deque[socket.socket] = collections.deque()  # the idle connections, oldest first
        self._busy = 0  # connections handed to the pool and not closed yet
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._pool = ThreadPoolExecutor(max_workers=self.handlers, thread_name_prefix="pd-metrics-handler")
        self._thread: Optional[threading.Thread] = None

    def start(self) -> threading.Thread:
        """Start the acceptor thread (a daemon); returns it."""
        self._thread = threading.Thread(target=self.serve_forever, name="pd-metrics-acceptor", daemon=True)
        self._thread.start()
        return self._thread

    def open_connections(self) -> int:
        """Connections open now: idle ones and requests in progress."""
        with self._lock:
            return len(self._idle) + self._busy

    # ------------------------------------------------------------------ the acceptor
    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """The acceptor loop, until :meth:`shutdown` (``poll_interval``: unused, the loop wakes on
        its own events)."""
        self.socket.setblocking(False)
        self._selector.register(self.socket, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _ in self._selector.select(self._next_deadline()):
                    if key.fileobj is self.socket:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._wake_r.recv(64)
                    else:
                        self._dispatch(key.fileobj)  # type: ignore[arg-type]
                self._expire()
        finally:
            self._selector.close()

    def _next_deadline(self) -> float:
        with self._lock:
            first = self._order[0] if self._order else None
            deadline = self._idle[first][0] if first is not None else None
        return 1.0 if deadline is None else max(0.0, deadline - time.monotonic())

    def _accept(self) -> None:
        """Accept every pending connection, within ``max_connections``."""
        while True:
            try:
                conn, peer = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors: the pending ones wait in the backlog
                logger.warning("metrics endpoint: accept failed: %s", exc)
                return
            conn.setblocking(True)
            with self._lock:
                full = len(self._idle) + self._busy >= self.max_connections
                oldest = self._order.popleft() if full and self._order else None
                if oldest is not None:
                    del self._idle[oldest]
                if full and oldest is None:
                    conn.close()  # every open connection is a request in progress
                    continue
                self._idle[conn] = (time.monotonic() + self.read_timeout_s, peer)
                self._order.append(conn)
            if oldest is not None:
                self._drop(oldest)
            self._selector.register(conn, selectors.EVENT_READ)

    def _dispatch(self, conn: socket.socket) -> None:
        """A connection with something to read: to a handler thread."""
        self._selector.unregister(conn)
        with self._lock:
            _, peer = self._idle.pop(conn)
            self._order.remove(conn)
            self._busy += 1
        self._pool.submit(self._serve_one, conn, peer)

    def _expire(self) -> None:
        """Close the idle connections past their deadline."""
        now = time.monotonic()
        expired = []
        with self._lock:
            while self._order and self._idle[self._order[0]][0] <= now:
                conn = self._order.popleft()
                del self._idle[conn]
                expired.append(conn)
        for conn in expired:
            self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        try:
            self._selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    # ------------------------------------------------------------------ a handler thread
    def _serve_one(self, conn: socket.socket, peer: Any) -> None:
        """Read one request, answer it, close the connection (on a handler thread)."""
        try:
            self.finish_request(conn, peer)
        except OSError as exc:  # a read timed out, the peer reset: nothing to answer
            logger.debug("metrics endpoint: %s: %s", peer, exc)
        except Exception:  # noqa: BLE001 - one bad request must not end the endpoint
            logger.exception("metrics endpoint: serving %s failed", peer)
        finally:
            self.shutdown_request(conn)
            with self._lock:
                self._busy -= 1

    # ------------------------------------------------------------------ stopping
    def shutdown(self) -> None:
        """Stop the acceptor (waits for it); requests in progress finish on their threads."""
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(10)

    def server_close(self) -> None:
        """Close the listening socket, every idle connection and the handler pool."""
        super().server_close()
        with self._lock:
            idle, self._idle, self._order = list(self._order), {}, collections.deque()
        for conn in idle:
            conn.close()
        self._pool.shutdown(wait=False)
        self._wake_r.close()
        self._wake_w.close()


__all__ = ["BoundedWSGIServer"]
