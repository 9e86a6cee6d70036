"""``persistent-delta exporter``: serve a job's metrics to Prometheus, read from outside.

Owns: the exporter command (its arguments resolved, the endpoint served until SIGTERM/SIGINT).

It reads the log root (read-only, at each scrape) and, with ``--server``, the job's stream and
buckets; the metrics are :mod:`persistent_delta.ops.metrics`'. The writer queue, the training
thread's waits and publish times live in the trainer's memory: serve those from the trainer
with :func:`persistent_delta.ops.metrics.serve_metrics` (``tracker=``).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from typing import Dict, Optional

from persistent_delta.cli.ship import connect_options
from persistent_delta.cli.stopping import StopOnSignals
from persistent_delta.errors import InvalidInputError, PersistentDeltaError


def run_exporter(args: argparse.Namespace, stop: Optional[threading.Event] = None) -> Dict[str, object]:
    """Serve until SIGTERM/SIGINT (or ``stop``); returns where it served.

    Args:
        args: the parsed ``exporter`` arguments.
        stop: an event that ends serving (default: SIGTERM/SIGINT set it).

    Raises:
        InvalidInputError: neither a root nor ``--server`` (with ``--job``) was given.
        PersistentDeltaError: ``prometheus_client`` is missing (the ``ops`` extra).
        OSError: the port is taken.
        CommandStoppedError: a signal came while it was blocked (see :mod:`.stopping`).
    """
    if not args.root and not args.server:
        raise InvalidInputError("exporter needs ROOT (a log root) and/or --server URL --job NAME")
    if args.server and not args.job:
        raise InvalidInputError("exporter --server needs --job NAME")
    try:
        from persistent_delta.ops.metrics import serve_metrics
    except ImportError as exc:
        raise PersistentDeltaError("exporter needs the 'ops' extra: pip install 'persistent_delta[ops]'") from exc
    job = args.job or (os.path.basename(os.path.abspath(args.root)) if args.root else "")
    event = stop or threading.Event()
    with StopOnSignals(event, "exporter"), \
            serve_metrics(root=args.root, server=args.server or None, job=job, port=args.port, addr=args.addr,
                          options=connect_options(args) if args.server else None, tables=args.tables,
                          stall_after_s=args.stall_after, key=args.key_file, insecure=args.insecure) as srv:
        # stderr: a supervisor (and a test) learns the port when --port 0 picked one
        print(f"exporter: serving http://{srv.addr}:{srv.port}/metrics", file=sys.stderr, flush=True)
        event.wait()
    return {"addr": srv.addr, "port": srv.port, "job": job}
