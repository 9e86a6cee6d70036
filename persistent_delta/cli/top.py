"""``persistent-delta top``: a live terminal view of a job, refreshed every second.

Owns: what the view shows (:class:`View`, read by :func:`snapshot`) and how it is drawn with
``rich`` (:func:`draw`), and the refresh loop.

Each refresh reads what ``offsets`` reads (:mod:`persistent_delta.ops.positions`, logs opened
read-only; with ``--server`` :mod:`persistent_delta.ops.remote_positions`): per rank the batch
index (the log's end) and log start, per consumer the offset, lag in batches and bytes, the
last commit and the health; remote consumers and shippers. The writer queue lives in the
trainer's memory: ``--metrics URL`` reads it from a trainer's own endpoint
(:func:`persistent_delta.ops.metrics.serve_metrics` with ``tracker=``). A source that fails is
shown as an error line, and the view keeps refreshing.
"""

from __future__ import annotations

import argparse
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from persistent_delta.cli.ship import connect_options
from persistent_delta.cli.stopping import StopOnSignals
from persistent_delta.errors import PersistentDeltaError
from persistent_delta.ops.positions import RankOffsets, describe
from persistent_delta.ops.remote_positions import (RemoteConsumerRow, ShipperRow, StreamEnds, StreamRow, behind_note,
                                                   describe_remote, rejected_note, stream_ends_of)


def printable(text: object) -> str:
    """``text`` with control characters escaped (names and error texts come from data)."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)


@dataclass
class WriterRow:
    """One rank's writer, read from a trainer's metrics endpoint."""

    source: str
    rank: str
    batch_index: Optional[float]
    queue_depth: Optional[float]
    queue_bytes: Optional[float]
    wait_s: Optional[float]


@dataclass
class View:
    """Everything one refresh shows."""

    when: float
    ranks: List[RankOffsets] = field(default_factory=list)
    remote: List[RemoteConsumerRow] = field(default_factory=list)
    shippers: List[ShipperRow] = field(default_factory=list)
    streams: List[StreamRow] = field(default_factory=list)
    writers: List[WriterRow] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)


def _writers(url: str) -> List[WriterRow]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=2) as resp:
        text = resp.read().decode()
    by_rank: Dict[str, Dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "rank" in s.labels and "consumer" not in s.labels and "channel" not in s.labels:
                by_rank.setdefault(s.labels["rank"], {})[s.name] = s.value
    return [WriterRow(url, rank, v.get("persistent_delta_batch_index"), v.get("persistent_delta_writer_queue_depth"),
                      v.get("persistent_delta_writer_queue_bytes"),
                      v.get("persistent_delta_training_wait_seconds_total"))
            for rank, v in sorted(by_rank.items()) if "persistent_delta_batch_index" in v]  # a trainer's series


def snapshot(root: Optional[str], server: Optional[str] = None, job: Optional[str] = None,
             options: Any = None, metrics: Sequence[str] = (), stall_after_s: Optional[float] = None,
             ends: Optional[StreamEnds] = None) -> View:
    """Read one :class:`View`; a source that fails adds an error line instead.

    Args:
        root: a log root (or None).
        server: NATS server(s) of ``job``'s stream (or None).
        job: the job on the stream.
        options: NATS connection options.
        metrics: trainers' metrics endpoints (``http://host:port/metrics``).
        stall_after_s: the health rule's least silence.
        ends: with ``server``, the stream's markers read under the job's key and kept between
            refreshes (default: a new one under ``PERSISTENT_DELTA_STREAM_KEY_FILE``'s key).
    """
    view = View(when=time.time())
    if root:
        try:
            view.ranks = describe(root, stall_after_s=stall_after_s)
        except (PersistentDeltaError, OSError) as exc:
            view.errors.append(f"{root}: {exc}")
    if server and job:
        try:
            found = describe_remote(server, job, options, stall_after_s, ends=ends)
            view.remote, view.shippers, view.streams = found["consumers"], found["shippers"], found["streams"]
            view.errors += [n for n in (behind_note(found), rejected_note(found)) if n]
        except Exception as exc:  # noqa: BLE001 - a server away is shown, and retried at the next refresh
            view.errors.append(f"{server}: {exc}")
    for url in metrics:
        try:
            view.writers += _writers(url)
        except Exception as exc:  # noqa: BLE001 - a trainer away is shown, and retried
            view.errors.append(f"{url}: {exc}")
    return view


def _ago(now: float, t: Optional[float]) -> str:
    return "-" if not t else f"{max(0.0, now - t):.1f}s ago"


def _num(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:g}"


_HEALTH_STYLE = {"ok": "green", "lagging": "yellow", "stalled": "bold red", "expired": "red", "behind": "red"}


def draw(view: View) -> Any:
    """The view as a ``rich`` renderable (tables: ranks, writers, consumers, remote consumers,
    shippers; then any errors)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    def table(title: str, *headers: str) -> Table:
        # a cell too narrow folds its text onto the next line instead of cutting it: names that
        # share a prefix ("serving.int8", "serving.quant") are never both drawn "serving.…"
        t = Table(title=title, title_justify="left", expand=False, header_style="bold")
        for h in headers:
            t.add_column(h, overflow="fold")
        return t

    def cell(v: object, style: str = "") -> Text:
        return Text(printable(v), style=style)  # Text: a name with [brackets] is not markup

    parts: List[Any] = [Text(f"persistent-delta top  {time.strftime('%H:%M:%S', time.localtime(view.when))}",
                             style="bold")]
    if view.ranks:
        ranks = table("RANKS", "RANK", "BATCH", "LOG-START", "SNAPSHOT-END", "CONSUMERS")
        for r in view.ranks:
            ranks.add_row(*(cell(v) for v in (r.rank, r.log_end, r.log_start, r.snapshot_end, len(r.consumers))))
        parts.append(ranks)
    if view.writers:
        w = table("WRITERS", "RANK", "BATCH", "QUEUE", "QUEUE-BYTES", "WAITED-S")
        for x in view.writers:
            w.add_row(*(cell(v) for v in (x.rank, _num(x.batch_index), _num(x.queue_depth), _num(x.queue_bytes),
                                          _num(x.wait_s))))
        parts.append(w)
    if view.ranks:
        c = table("CONSUMERS", "RANK", "CONSUMER", "CHANNEL", "OFFSET", "LAG", "LAG-BYTES", "LAST-COMMIT", "HEALTH")
        for r in view.ranks:
            for x in r.consumers:
                c.add_row(*(cell(v) for v in (r.rank, x.name, x.channel, x.offset, x.lag, x.pending_bytes,
                                              _ago(view.when, x.commit_time))),
                          cell(x.health, _HEALTH_STYLE.get(x.health, "")))
        parts.append(c)
    if view.remote:
        rc = table("REMOTE CONSUMERS", "RANK", "CONSUMER", "CHANNEL", "OFFSET", "STREAM-END", "LAG", "LAST-COMMIT",
                   "ACTIVE", "HEALTH")
        for x in view.remote:
            rc.add_row(*(cell(v) for v in (x.rank, x.consumer, x.channel, _num(x.offset), x.stream_end, _num(x.lag),
                                           _ago(view.when, x.commit_time), "yes" if x.active else "no")),
                       cell(x.health, _HEALTH_STYLE.get(x.health, "")))
        parts.append(rc)
    if len(view.streams) > 1:  # a job over rank-group streams: which stream holds which ranks
        st = table("STREAMS", "STREAM", "RANKS")
        for z in view.streams:
            st.add_row(cell(z.stream), cell(",".join(str(r) for r in z.ranks)))
        parts.append(st)
    if view.shippers:
        s = table("SHIPPERS", "RANK", "CHANNEL", "POSITION", "LOG-END", "LAG", "ROW-BYTES", "RETRIES", "LAST-ERROR")
        for y in view.shippers:
            s.add_row(*(cell(v) for v in (y.rank, y.channel, y.position, y.log_end, y.lag_batches, y.row_bytes,
                                          y.retries, y.last_error or "-")))
        parts.append(s)
    for e in view.errors:
        parts.append(Text(printable(e), style="red"))
    return Group(*parts)


def run_top(args: argparse.Namespace, stop: Optional[threading.Event] = None) -> Dict[str, object]:
    """Draw, then redraw every ``--interval`` seconds until SIGTERM/SIGINT (Ctrl-C), ``stop``
    or ``--iterations`` draws; returns how many it drew.

    Args:
        args: the parsed ``top`` arguments.
        stop: an event that ends the loop (default: SIGTERM/SIGINT set it).

    Raises:
        PersistentDeltaError: neither a root nor ``--server --job``, or ``rich`` is missing.
        StreamKeyError: ``--server`` without a stream key (``--key-file``,
            ``PERSISTENT_DELTA_STREAM_KEY_FILE``) and without ``--insecure``.
        CommandStoppedError: a signal came while it was blocked (see :mod:`.stopping`).
    """
    if not args.root and not (args.server and args.job):
        raise PersistentDeltaError("top needs ROOT (a log root) and/or --server URL --job NAME")
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError as exc:
        raise PersistentDeltaError("top needs the 'ops' extra: pip install 'persistent_delta[ops]'") from exc
    event = stop or threading.Event()
    options = connect_options(args) if args.server else None
    with StopOnSignals(event, "top"):
        ends = stream_ends_of(args.key_file, args.insecure, f"top of job {args.job}") if args.server else None

        def read() -> View:
            return snapshot(args.root, args.server, args.job, options, args.metrics or (), args.stall_after, ends)

        drawn = 0
        with Live(draw(read()), console=Console(), refresh_per_second=4, screen=False, auto_refresh=False) as live:
            live.refresh()
            drawn = 1
            while not (args.iterations and drawn >= args.iterations):
                if event.wait(args.interval):
                    break
                live.update(draw(read()), refresh=True)
                drawn += 1
    return {"refreshes": drawn}
