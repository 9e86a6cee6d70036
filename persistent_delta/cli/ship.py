"""``persistent-delta ship``: run a shipper until stopped (SIGTERM / SIGINT).

Owns: turning command-line options into a :class:`~persistent_delta.fleet.ship.Shipper` and its
connection options; shipping itself is :mod:`persistent_delta.fleet.ship`'s.
"""

from __future__ import annotations

import argparse
import os
import threading
from typing import Any, Dict, List, Optional

from persistent_delta.cli.stopping import StopOnSignals
from persistent_delta.errors import InvalidInputError
from persistent_delta.log.schema import CHANNELS
from persistent_delta.fleet.ship import Shipper
from persistent_delta.fleet.transport import ConnectOptions, StreamOptions


def add_connect_arguments(p: argparse.ArgumentParser) -> None:
    """The server and authentication/TLS options shared by ``ship`` and ``offsets --server``."""
    p.add_argument("--server", metavar="URL", help="nats://HOST:PORT (comma-separated for a cluster)")
    p.add_argument("--job", metavar="NAME", help="the job's name on the stream")
    p.add_argument("--token", help="server token")
    p.add_argument("--user", help="user name (with --password)")
    p.add_argument("--password", help="password")
    p.add_argument("--creds", metavar="FILE", help="credentials file (JWT + nkey seed)")
    p.add_argument("--nkeys-seed", metavar="FILE", help="nkey seed file")
    p.add_argument("--tls-ca", metavar="PEM", help="CA certificate for TLS")
    p.add_argument("--tls-cert", metavar="PEM", help="client certificate for TLS")
    p.add_argument("--tls-key", metavar="PEM", help="client key for TLS")
    p.add_argument("--key-file", metavar="FILE", action="append",
                   help="the job's stream key (persistent-delta keygen); repeat during a rotation: the first signs "
                        "(default PERSISTENT_DELTA_STREAM_KEY_FILE)")
    p.add_argument("--insecure", action="store_true", help="run without a stream key: stream data not authenticated")


def connect_options(args: argparse.Namespace) -> ConnectOptions:
    return ConnectOptions(token=args.token, user=args.user, password=args.password, creds=args.creds,
                          nkeys_seed=args.nkeys_seed, tls_ca=args.tls_ca, tls_cert=args.tls_cert, tls_key=args.tls_key)


def niceness(text: str) -> int:
    """``--nice``: how much to lower the shipper's CPU priority, 0 to 19 (argparse type)."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 <= n <= 19:
        raise argparse.ArgumentTypeError(f"takes 0 to 19, got {text!r}")
    return n


def _channels(text: str) -> List[str]:
    chans = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in chans if c not in CHANNELS]
    if bad or not chans:
        raise InvalidInputError(f"--channels takes a comma-separated subset of {','.join(CHANNELS)}, got {text!r}")
    return chans


def run_ship(args: argparse.Namespace, stop: Optional[threading.Event] = None) -> List[Dict[str, Any]]:
    """Ship until SIGTERM/SIGINT (or ``stop``); returns the shipper's final statistics.

    Raises:
        CommandStoppedError: a signal came while it was blocked (see :mod:`.stopping`).
    """
    if not args.server or not args.job:
        raise InvalidInputError("ship needs --server nats://HOST:PORT and --job NAME")
    nice = getattr(args, "nice", 0)  # checked by niceness() when parsed
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else None
    stream = StreamOptions(replicas=args.replicas, max_bytes=args.max_bytes, max_age_s=args.max_age)
    if nice:
        os.nice(nice)  # the whole process: a shipper of its own, not a trainer's thread
    event = stop or threading.Event()
    with StopOnSignals(event, "ship"), \
            Shipper(args.root, args.server, args.job, channels=_channels(args.channels), ranks=ranks,
                    connect=connect_options(args), stream=stream, max_batches=args.max_batches,
                    key=getattr(args, "key_file", None), insecure=getattr(args, "insecure", False),
                    ranks_per_stream=getattr(args, "ranks_per_stream", None),
                    checkpoints=getattr(args, "checkpoints", None)) as shipper:
        shipper.run(until=event)
        return shipper.stats()
