"""The Prometheus metrics of a log root read from outside are the numbers ``offsets`` shows
(offset, lag in batches and bytes, health, log bounds), with low-cardinality labels, and a
metrics endpoint serves them over HTTP."""

from __future__ import annotations

import os
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
