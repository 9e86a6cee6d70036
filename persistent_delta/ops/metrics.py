"""Prometheus metrics of a job: trainer, consumers, shippers, logs.

Owns: the metric names, their labels and the collectors that read them; ``serve_metrics``.

Every collector *reads* what already exists when Prometheus scrapes, and computes nothing on the
training thread:

* :class:`TrackerCollector` -- a tracker's ``stats()`` (its writer's counters, kept by the writer
  thread) and ``curr_batch_idx``; only the process that owns the tracker sees these.
* :class:`ShipperCollector` -- ``Shipper.stats()`` in the shipper's process.
* :class:`LogCollector` -- a log root, opened read-only at each scrape through
  :func:`persistent_delta.ops.positions.describe` (the numbers ``persistent-delta offsets``
  shows): log start/end per channel, file size, each consumer's offset, lag (batches, bytes,
  seconds), last commit and health.
* :class:`StreamCollector` -- a job's stream (``--server``) through
  :func:`persistent_delta.ops.remote_positions.describe_remote`: remote consumers and the
  statistics every shipper stores.

Labels are ``job``, ``rank``, ``consumer`` and ``channel`` only (``table`` only with
``tables=True``). A consumer's health is a number (0 ok, 1 lagging, 2 stalled, 3 expired; a remote
consumer's also 4 malformed, its stored entry unreadable) so an
alert is ``persistent_delta_consumer_health > 0`` (``remote_consumer_health`` the same for a
remote consumer). Prometheus renames a ``job`` label that
clashes with its scrape job's to ``exported_job`` unless the scrape config says
``honor_labels: true``.

Needs ``prometheus_client`` (``pip install persistent_delta[ops]``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Optional, Protocol, Sequence, Tuple

from prometheus_client import make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from persistent_delta.fleet.auth import KeySpec
from persistent_delta.fleet.transport import ConnectOptions, ServerSpec
from persistent_delta.log.layout import DATA_FILE, EMPTY_RANK_GRACE_S, PathLike
from persistent_delta.log.schema import LOOKUPS, SNAPSHOTS
from persistent_delta.ops.endpoint import BoundedWSGIServer
from persistent_delta.ops.health import Health
from persistent_delta.ops.positions import describe
from persistent_delta.ops.remote_positions import describe_remote, stream_ends_of

logger = logging.getLogger(__name__)

PREFIX = "persistent_delta_"
#: The number each health status is exported as.
HEALTH_CODES: Dict[str, int] = {Health.OK.value: 0, Health.LAGGING.value: 1, Health.STALLED.value: 2,
                                Health.EXPIRED.value: 3, Health.MALFORMED.value: 4}

HEALTH_CODES[Health.BEHIND.value] = 5  # a snapshots consumer held back by a rank behind (not its fault)


class TrackerLike(Protocol):
    """What :class:`TrackerCollector` reads of a ``PersistentDeltaTracker`` (ops never imports
    the trainer)."""

    rank: int
    curr_batch_idx: int

    def stats(self) -> Dict[str, float]: ...


class ShipperLike(Protocol):
    """What :class:`ShipperCollector` reads of a :class:`~persistent_delta.fleet.ship.Shipper`."""

    def stats(self) -> List[Dict[str, object]]: ...


class _Families:
    """Metric families under construction, one per name, with fixed label names."""

    def __init__(self) -> None:
        self._m: Dict[str, Metric] = {}

    def add(self, kind: str, name: str, doc: str, labels: Sequence[Tuple[str, str]], value: float) -> None:
        fam = self._m.get(name)
        if fam is None:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            fam = cls(PREFIX + name, doc, labels=[k for k, _ in labels])
            self._m[name] = fam
        fam.add_metric([v for _, v in labels], float(value))

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._m.values())


# name in stats() -> (kind, metric name, help); counters get Prometheus' _total suffix
_WRITER: Dict[str, Tuple[str, str, str]] = {
    "queue_depth": ("gauge", "writer_queue_depth", "Operations queued for the writer thread, in flight included."),
    "queue_bytes": ("gauge", "writer_queue_bytes", "Bytes held by operations queued for the writer thread."),
    "commits": ("counter", "writer_commits", "Write transactions the writer committed."),
    "commit_time_s": ("counter", "writer_commit_seconds", "Seconds the writer spent in its transactions."),
    "records_written": ("counter", "writer_records", "Records the writer appended."),
    "bytes_written": ("counter", "writer_bytes", "Record bytes the writer appended."),
    "total_wait_s": ("counter", "training_wait_seconds", "Seconds the training thread waited for queue room."),
    "max_wait_s": ("gauge", "training_wait_max_seconds", "The longest single wait of the training thread."),
    "publishes": ("counter", "publishes", "Publishes committed."),
    "publish_s": ("counter", "publish_seconds", "Seconds from each publish's hand-off to its commit, summed."),
    "failed": ("gauge", "writer_failed", "1 while the writer holds an error (see WriterError)."),
}


class TrackerCollector(Collector):
    """A tracker's batch index and writer statistics, read at each scrape.

    Thread-safety: ``collect`` runs on the metrics server's thread; ``tracker.stats()`` takes
    the writer's lock briefly, ``curr_batch_idx`` is a plain read.
    """

    def __init__(self, tracker: TrackerLike, job: str = "") -> None:
        self.tracker = tracker
        self.job = job

    def collect(self) -> Iterable[Metric]:
        fams = _Families()
        labels = [("job", self.job), ("rank", str(self.tracker.rank))]
        fams.add("gauge", "batch_index", "The batch being recorded (curr_batch_idx).", labels,
                 self.tracker.curr_batch_idx)
        for key, value in sorted(self.tracker.stats().items()):
            known = _WRITER.get(key)
            if known is not None:
                fams.add(known[0], known[1], known[2], labels, float(value))
        return fams


def _shipper_metrics(fams: _Families, job: str, rows: Iterable[Dict[str, object]]) -> None:
    for s in rows:
        labels = [("job", job), ("rank", str(s.get("rank", -1))), ("channel", str(s.get("channel", "")))]
        for key, kind, name, doc in (
            ("position", "gauge", "shipper_position", "Next batch the shipper sends (its committed offset)."),
            ("log_end", "gauge", "shipper_log_end", "The local log's end the shipper last saw."),
            ("lag_batches", "gauge", "shipper_lag_batches", "Batches in the local log not yet on the stream."),
            ("row_bytes", "counter", "shipper_row_bytes", "Record bytes shipped."),
            ("payload_bytes", "counter", "shipper_payload_bytes", "Message bytes sent."),
            ("retries", "counter", "shipper_retries", "Sends retried."),
            ("last_shipped", "gauge", "shipper_last_shipped_timestamp_seconds", "When the shipper last sent."),
        ):
            value = s.get(key)
            if isinstance(value, (int, float)):
                fams.add(kind, name, doc, labels, value)
        fams.add("gauge", "shipper_failing", "1 when the shipper's last send or commit failed (see offsets --server).",
                 labels, 1.0 if s.get("last_error") else 0.0)


class ShipperCollector(Collector):
    """A :class:`~persistent_delta.fleet.ship.Shipper`'s statistics, in its own process."""

    def __init__(self, shipper: ShipperLike, job: str = "") -> None:
        self.shipper = shipper
        self.job = job

    def collect(self) -> Iterable[Metric]:
        fams = _Families()
        _shipper_metrics(fams, self.job, self.shipper.stats())
        return fams


class LogCollector(Collector):
    """A log root read from outside (read-only, at each scrape): logs and local consumers.

    Args:
        root: the log root.
        job: the ``job`` label.
        tables: also per-table metrics (a ``table`` label: one series per table and rank).
        stall_after_s: the health rule's least silence (see :mod:`persistent_delta.ops.health`).
    """

    def __init__(self, root: PathLike, job: str = "", tables: bool = False,
                 stall_after_s: Optional[float] = None) -> None:
        self.root = root
        self.job = job
        self.tables = tables
        self.stall_after_s = stall_after_s

    def collect(self) -> Iterable[Metric]:
        fams = _Families()
        # a live reader: a rank being created is not a scrape error (a wiped one is, after the grace)
        ranks = describe(self.root, tables=self.tables, stall_after_s=self.stall_after_s,
                         empty_grace_s=EMPTY_RANK_GRACE_S)
        for r in ranks:
            rank = [("job", self.job), ("rank", str(r.rank))]
            try:
                size = os.path.getsize(os.path.join(r.path, DATA_FILE))
            except OSError:
                size = 0
            fams.add("gauge", "log_file_bytes", "Size of the rank's LMDB data file.", rank, size)
            fams.add("gauge", "log_start", "First batch a read of the channel can get.", rank + [("channel", LOOKUPS)],
                     r.log_start)
            fams.add("gauge", "log_end", "One past the channel's last complete batch.", rank + [("channel", LOOKUPS)],
                     r.log_end)
            fams.add("gauge", "log_start", "First batch a read of the channel can get.", rank + [("channel", SNAPSHOTS)],
                     r.snapshot_start)
            fams.add("gauge", "log_end", "One past the channel's last complete batch.", rank + [("channel", SNAPSHOTS)],
                     r.snapshot_end)
            fams.add("gauge", "snapshots_behind", "1 when the rank completed a batch the other ranks published in "
                     "without publishing in it: the job's snapshots polls stop at its end.", rank,
                     0 if r.snapshots_behind is None else 1)
            for c in r.consumers:
                labels = rank + [("consumer", c.name), ("channel", c.channel)]
                fams.add("gauge", "consumer_offset", "The consumer's committed offset (next batch to read).", labels,
                         c.offset)
                fams.add("gauge", "consumer_lag_batches", "Batches between the offset and the channel's end.", labels,
                         c.lag)
                fams.add("gauge", "consumer_lag_bytes", "Record bytes a poll at the offset would read.", labels,
                         c.pending_bytes)
                fams.add("gauge", "consumer_lag_rows", "Rows (as stored) a poll at the offset would read.", labels,
                         c.pending_rows)
                if c.lag_s is not None:
                    fams.add("gauge", "consumer_lag_seconds", "Age of the oldest unread publish (snapshots).",
                             labels, c.lag_s)
                if c.commit_time is not None:
                    fams.add("gauge", "consumer_last_commit_timestamp_seconds", "When the consumer last committed.",
                             labels, c.commit_time)
                fams.add("gauge", "consumer_health", "Health over its last commits: 0 ok, 1 lagging, 2 stalled, "
                         "3 expired.", labels, HEALTH_CODES.get(c.health, 0))
            for t in r.tables or []:
                labels = rank + [("table", t.fqn)]
                fams.add("gauge", "table_records", "Lookups records stored for the table.", labels, t.records)
                fams.add("gauge", "table_bytes", "Lookups record bytes stored for the table.", labels, t.bytes)
        return fams


class StreamCollector(Collector):
    """A job's stream read from outside: remote consumers and every shipper's stored statistics.

    Args:
        server: the NATS server(s).
        job: the job (its stream and buckets; also the ``job`` label).
        options: connection options (credentials, TLS).
        stall_after_s: the health rule's least silence (see :mod:`persistent_delta.ops.health`).
        key: the job's stream key (default ``PERSISTENT_DELTA_STREAM_KEY_FILE``): each rank's end
            is its latest range marker that authenticates
            (:class:`~persistent_delta.ops.remote_positions.StreamEnds`, kept between scrapes).
        insecure: without a key, read unverified.

    Raises:
        StreamKeyError: no key and not ``insecure``.
    """

    def __init__(self, server: ServerSpec, job: str, options: Optional[ConnectOptions] = None,
                 stall_after_s: Optional[float] = None, key: KeySpec = None, insecure: bool = False) -> None:
        self.server = server
        self.job = job
        self.options = options
        self.stall_after_s = stall_after_s
        self.ends = stream_ends_of(key, insecure, f"the metrics of job {job}'s stream")

    def collect(self) -> Iterable[Metric]:
        fams = _Families()
        found = describe_remote(self.server, self.job, self.options, self.stall_after_s, ends=self.ends)
        fams.add("counter", "stream_markers_rejected", "Range markers on the stream that did not authenticate or "
                 "decode (skipped; never a rank's end).", [("job", self.job)], float(found["rejected_markers"]))
        for rank, stamp in sorted(found["snapshots_behind"].items()):
            fams.add("gauge", "stream_snapshots_behind", "1 when the rank completed a batch the other ranks published "
                     "in without publishing in it, as its snapshots markers on the stream say.",
                     [("job", self.job), ("rank", str(rank))], 1.0)
        for c in found["consumers"]:
            labels = [("job", self.job), ("rank", str(c.rank)), ("consumer", c.consumer), ("channel", c.channel)]
            if c.offset is not None:
                fams.add("gauge", "remote_consumer_offset", "The remote consumer's position in the stream.", labels,
                         c.offset)
            if c.lag is not None:
                fams.add("gauge", "remote_consumer_lag_batches", "Batches between its position and the stream's end.",
                         labels, c.lag)
            fams.add("gauge", "remote_consumer_active", "1 while a process holds the consumer.", labels,
                     1.0 if c.active else 0.0)
            if c.commit_time is not None:
                fams.add("gauge", "remote_consumer_last_commit_timestamp_seconds", "When it last committed.", labels,
                         float(c.commit_time))
            fams.add("gauge", "remote_consumer_health", "Health over its last commits: 0 ok, 1 lagging, 2 stalled, "
                     "3 expired, 4 malformed (its stored entry).", labels, HEALTH_CODES.get(c.health, 0))
        _shipper_metrics(fams, self.job, [vars(s) for s in found["shippers"]])
        return fams


class _Guarded(Collector):
    """A collector whose failure (a log being created, a server away) costs one scrape's series,
    not the endpoint: it logs and exports ``persistent_delta_<what>_scrape_error 1``."""

    def __init__(self, inner: Collector, what: str) -> None:
        self.inner = inner
        self.what = what

    def collect(self) -> Iterable[Metric]:
        err = GaugeMetricFamily(f"{PREFIX}{self.what}_scrape_error",
                                f"1 when reading the {self.what} failed at this scrape.")
        try:
            out = list(self.inner.collect())
            err.add_metric([], 0.0)
        except Exception as exc:  # noqa: BLE001 - reported as a metric and logged; the next scrape retries
            logger.warning("metrics: reading the %s failed: %s", self.what, exc)
            out = []
            err.add_metric([], 1.0)
        return [*out, err]


@dataclass
class MetricsServer:
    """A running metrics endpoint (``http://addr:port/metrics``); :meth:`close` stops it."""

    registry: CollectorRegistry
    addr: str
    port: int
    _server: object
    _thread: object

    def close(self) -> None:
        """Stop serving (idempotent)."""
        server = self._server
        if server is not None:
            self._server = None
            server.shutdown()  # type: ignore[attr-defined]
            server.server_close()  # type: ignore[attr-defined]

    def __enter__(self) -> "MetricsServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_registry(
    tracker: Optional[TrackerLike] = None,
    shipper: Optional[ShipperLike] = None,
    root: Optional[PathLike] = None,
    server: Optional[ServerSpec] = None,
    job: str = "",
    options: Optional[ConnectOptions] = None,
    tables: bool = False,
    stall_after_s: Optional[float] = None,
    key: KeySpec = None,
    insecure: bool = False,
) -> CollectorRegistry:
    """A registry with a collector for each source given (see :func:`serve_metrics`)."""
    reg = CollectorRegistry(auto_describe=False)
    if tracker is not None:
        reg.register(TrackerCollector(tracker, job))
    if shipper is not None:
        reg.register(ShipperCollector(shipper, job))
    if root is not None:
        reg.register(_Guarded(LogCollector(root, job, tables, stall_after_s), "log"))
    if server is not None:
        reg.register(_Guarded(StreamCollector(server, job, options, stall_after_s, key, insecure), "stream"))
    return reg


def serve_metrics(
    tracker: Optional[TrackerLike] = None,
    shipper: Optional[ShipperLike] = None,
    root: Optional[PathLike] = None,
    server: Optional[ServerSpec] = None,
    job: str = "",
    port: int = 0,
    addr: str = "127.0.0.1",
    options: Optional[ConnectOptions] = None,
    tables: bool = False,
    stall_after_s: Optional[float] = None,
    key: KeySpec = None,
    insecure: bool = False,
    read_timeout_s: Optional[float] = None,
) -> MetricsServer:
    """Serve the metrics of the sources given over HTTP, from daemon threads (opt-in: nothing
    is collected until Prometheus scrapes, and then only read): an acceptor and a small fixed
    pool of handlers, whatever the clients do; a connection silent for ``read_timeout_s`` is
    closed (:class:`~persistent_delta.ops.endpoint.BoundedWSGIServer`).

    Call it in the process that owns a tracker or a shipper for their in-memory counters; give
    ``root`` (and ``server``) to also export the log and stream positions read from outside, as
    ``persistent-delta exporter`` does.

    Args:
        tracker: a ``PersistentDeltaTracker`` (batch index, writer statistics).
        shipper: a :class:`~persistent_delta.fleet.ship.Shipper`.
        root: a log root (logs and local consumers, read-only).
        server: NATS server(s) of ``job``'s stream (remote consumers, shippers).
        job: the ``job`` label (and, with ``server``, the job's stream).
        port: TCP port (0: a free one; see :attr:`MetricsServer.port`).
        addr: address to listen on (default loopback only).
        options: NATS connection options.
        tables: per-table series too.
        stall_after_s: the health rule's least silence.
        key: with ``server``, the job's stream key (default ``PERSISTENT_DELTA_STREAM_KEY_FILE``):
            the stream's ends shown are its authenticated range markers'.
        insecure: with ``server``, read the stream without a key (nothing verified).
        read_timeout_s: how long a connection may stay silent (default
            :data:`persistent_delta.config.METRICS_READ_TIMEOUT_S`).

    Returns:
        The running :class:`MetricsServer`.

    Raises:
        OSError: the port is taken.
        StreamKeyError: ``server`` without a key and not ``insecure``.
    """
    reg = build_registry(tracker, shipper, root, server, job, options, tables, stall_after_s, key, insecure)
    httpd = BoundedWSGIServer(addr, port, make_wsgi_app(reg), read_timeout_s=read_timeout_s)
    return MetricsServer(reg, addr, int(httpd.server_port), httpd, httpd.start())


__all__ = [
    "HEALTH_CODES", "LogCollector", "MetricsServer", "ShipperCollector", "StreamCollector", "TrackerCollector",
    "build_registry", "serve_metrics",
]
