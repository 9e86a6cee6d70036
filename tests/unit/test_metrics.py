"""The Prometheus metrics of a log root read from outside are the numbers ``offsets`` shows
(offset, lag in batches and bytes, health, log bounds), with low-cardinality labels, and a
metrics endpoint serves them over HTTP."""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.request
from typing import Dict, Tuple

import pytest
import torch

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from logs import fill_ranks  # noqa: E402
from persistent_delta import DeltaConsumer  # noqa: E402
from persistent_delta.ops.metrics import HEALTH_CODES, build_registry, serve_metrics  # noqa: E402
from persistent_delta.ops.positions import describe  # noqa: E402

Series = Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]


def _series(text: str) -> Series:
    out: Series = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _records(rank: int, b: int):
    return [("t0", torch.tensor([b, b + 1 + rank]), None)]


@pytest.fixture
def root(tmp_path):
    path = str(tmp_path / "job")
    fill_ranks(path, _records, ranks=2, batches=12)
    with DeltaConsumer(path, "fast") as c:
        c.poll()
        c.commit()
    with DeltaConsumer(path, "slow") as c:
        c.poll(max_batches=3)
        c.commit()
    return path


def test_log_metrics_are_what_offsets_shows(root):
    got = _series(generate_latest(build_registry(root=root, job="j")).decode())
    ranks = describe(root)
    assert len(ranks) == 2
    for r in ranks:
        base = (("job", "j"), ("rank", str(r.rank)))
        assert got[("persistent_delta_log_end", tuple(sorted(base + (("channel", "lookups"),))))] == r.log_end
        assert got[("persistent_delta_log_file_bytes", base)] == os.path.getsize(os.path.join(r.path, "data.mdb"))
        for c in r.consumers:
            labels = tuple(sorted(base + (("consumer", c.name), ("channel", c.channel))))
            assert got[("persistent_delta_consumer_offset", labels)] == c.offset
            assert got[("persistent_delta_consumer_lag_batches", labels)] == c.lag
            assert got[("persistent_delta_consumer_lag_bytes", labels)] == c.pending_bytes
            assert got[("persistent_delta_consumer_health", labels)] == HEALTH_CODES[c.health]
    slow = tuple(sorted((("job", "j"), ("rank", "0"), ("consumer", "slow"), ("channel", "lookups"))))
    assert got[("persistent_delta_consumer_lag_batches", slow)] == 9
    assert got[("persistent_delta_consumer_lag_bytes", slow)] > 0
    labels = {k for _, ls in got for k, _ in ls}
    assert labels <= {"job", "rank", "consumer", "channel"}, labels
    assert got[("persistent_delta_log_scrape_error", ())] == 0


def test_tables_only_on_request(root):
    plain = generate_latest(build_registry(root=root, job="j")).decode()
    assert 'table="' not in plain
    wide = _series(generate_latest(build_registry(root=root, job="j", tables=True)).decode())
    assert wide[("persistent_delta_table_records", (("job", "j"), ("rank", "0"), ("table", "t0")))] == 12


def test_a_missing_root_is_a_scrape_error_not_a_dead_endpoint(tmp_path):
    got = _series(generate_latest(build_registry(root=str(tmp_path / "nothing"), job="j")).decode())
    assert got[("persistent_delta_log_scrape_error", ())] == 1


def test_the_endpoint_serves_them(root):
    with serve_metrics(root=root, job="j", port=0) as srv:
        text = urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=10).read().decode()
    assert 'persistent_delta_consumer_lag_batches{channel="lookups",consumer="slow",job="j",rank="1"} 9.0' in text


def _endpoint_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("pd-metrics") or "process_request" in t.name)


def test_idle_connections_cost_no_thread_and_time_out(root):
    """300 loopback connections that send nothing: the endpoint keeps its threads bounded (an
    acceptor and a fixed pool; prometheus_client's server kept one per connection, forever),
    a scrape succeeds while they are open and after, and they are closed after the read
    timeout (the client reads EOF)."""
    before = threading.active_count()
    with serve_metrics(root=root, job="j", port=0, read_timeout_s=1.0) as srv:
        url = f"http://127.0.0.1:{srv.port}/metrics"
        idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(300)]
        try:
            time.sleep(0.2)
            assert urllib.request.urlopen(url, timeout=5).read().decode().count("persistent_delta_log_end") >= 1
            grown = threading.active_count() - before
            assert grown <= 1 + 4, f"{grown} threads for 300 idle connections"
            assert _endpoint_threads() <= 1 + 4
            # a request sent slowly (headers never finished) holds a handler at most the timeout
            slow = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            slow.sendall(b"GET /metrics HTTP/1.1\r\n")
            began = time.monotonic()
            closed = 0
            for s in idle[-40:] + [slow]:  # the newest idle ones survived the cap; all time out
                closed += s.recv(1) == b""
            assert closed == 41 and time.monotonic() - began < 5
        finally:
            for s in idle:
                s.close()
        for _ in range(3):
            assert "persistent_delta_log_end" in urllib.request.urlopen(url, timeout=5).read().decode()
        assert threading.active_count() - before <= 1 + 4
