"""The metrics of a job's stream (remote consumers, shippers) read from outside, and a shipper's
own: the positions and lags ``offsets --server`` shows, and the shipper's counters; ``top``
shows the same stream."""

from __future__ import annotations

import os
from typing import Dict, Tuple

import pytest
import torch
from torchrec.distributed.model_tracker.types import UpdateMode

pytest.importorskip("prometheus_client")
from prometheus_client import generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from persistent_delta import LmdbDeltaStore, RemoteConsumer, Shipper  # noqa: E402
from persistent_delta.ops.metrics import build_registry  # noqa: E402
from persistent_delta.ops.remote_positions import describe_remote  # noqa: E402


def _series(text: str) -> Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_stream_and_shipper_metrics(tmp_path, nats_server):
    root, job = str(tmp_path / "log"), "job-m"
    with LmdbDeltaStore(os.path.join(root, "rank-0"), updateMode=UpdateMode.NONE) as store:
        for b in range(6):
            store.append(b, "t", torch.tensor([b, b + 1]))
    with Shipper(root, nats_server.url, job, channels=["lookups"], max_batches=2) as shipper:
        shipper.run(idle_exit_s=0.3)
        own = _series(generate_latest(build_registry(shipper=shipper, job=job)).decode())
        feed = (("channel", "lookups"), ("job", job), ("rank", "0"))
        assert own[("persistent_delta_shipper_position", feed)] == 6
        assert own[("persistent_delta_shipper_lag_batches", feed)] == 0
        assert own[("persistent_delta_shipper_row_bytes_total", feed)] == shipper.stats()[0]["row_bytes"] > 0
        assert own[("persistent_delta_shipper_failing", feed)] == 0
    with RemoteConsumer(nats_server.url, job, "r", wait=10) as c:
        c.poll(max_batches=2)
        c.commit()
    got = _series(generate_latest(build_registry(server=nats_server.url, job=job)).decode())
    found = describe_remote(nats_server.url, job)
    (row,) = found["consumers"]
    labels = (("channel", "lookups"), ("consumer", "r"), ("job", job), ("rank", "0"))
    assert got[("persistent_delta_remote_consumer_lag_batches", labels)] == row.lag == 4
    assert got[("persistent_delta_remote_consumer_offset", labels)] == row.offset == 2
    assert got[("persistent_delta_remote_consumer_health", labels)] == 0 and row.health == "ok"
    (ship,) = found["shippers"]  # the statistics the shipper last stored (it stores them now and then)
    feed = (("channel", "lookups"), ("job", job), ("rank", "0"))
    assert got[("persistent_delta_shipper_position", feed)] == ship.position
    assert got[("persistent_delta_shipper_lag_batches", feed)] == ship.lag_batches
    assert got[("persistent_delta_stream_scrape_error", ())] == 0

    # top's view of the same stream: the remote consumer and the shipper, drawn
    from rich.console import Console

    from persistent_delta.cli.top import draw, snapshot

    view = snapshot(None, nats_server.url, job)
    assert not view.errors
    assert [(c.consumer, c.lag) for c in view.remote] == [("r", 4)]
    assert [(x.rank, x.channel, x.position) for x in view.shippers] == [(0, "lookups", ship.position)]
    console = Console(width=160, record=True, file=open(os.devnull, "w"))
    console.print(draw(view))
    text = console.export_text()
    assert "REMOTE CONSUMERS" in text and "SHIPPERS" in text
