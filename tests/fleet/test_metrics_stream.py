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


def test_an_offsets_entry_with_a_commit_time_out_of_bounds_is_shown_malformed(tmp_path, nats_server, capsys):
    """Entries in the ``offsets`` bucket (any consumer user may write one) whose commit time is
    1e308, NaN, negative or a string, or whose position is out of bounds: ``offsets --server``
    (text and JSON), the exporter and ``top`` show each as ``malformed`` with no commit time, and
    the genuine consumer beside them as before; a history point at 1e308 counts as no history."""
    import json
    import math

    from persistent_delta.cli import main
    from persistent_delta.fleet import subjects
    from persistent_delta.fleet.subjects import offsets_key
    from persistent_delta.fleet.connect import open_transport
    from persistent_delta.log import codec

    root, job = str(tmp_path / "log"), "job-x"
    with LmdbDeltaStore(os.path.join(root, "rank-0"), updateMode=UpdateMode.NONE) as store:
        for b in range(4):
            store.append(b, "t", torch.tensor([b]))
    with Shipper(root, nats_server.url, job, channels=["lookups"]) as shipper:
        shipper.run(idle_exit_s=0.3)
    with RemoteConsumer(nats_server.url, job, "good", wait=10) as c:
        c.poll(max_batches=1)
        c.commit()
    conn = open_transport(nats_server.url)
    try:
        good = codec.unpack(conn.kv_get(job, subjects.OFFSETS, offsets_key("good", "lookups")).value, "entry")
        forged = {"huge": {"time": 1e308}, "nan": {"time": math.nan}, "neg": {"time": -5.0}, "str": {"time": "soon"},
                  "far": {"ranks": {"0": {**good["ranks"]["0"], "pos": 2 ** 63}}},
                  "hist": {"ranks": {"0": {**good["ranks"]["0"], "hist": [[1e308, 1, 4]]}}}}
        for name, change in forged.items():
            conn.kv_put(job, subjects.OFFSETS, offsets_key(name, "lookups"), codec.pack({**good, "name": name, **change}))
    finally:
        conn.close()
    capsys.readouterr()
    assert main(["offsets", "--server", nats_server.url, "--job", job]) == 0
    text = capsys.readouterr().out
    assert text.count("malformed") == 5, text
    assert main(["offsets", "--server", nats_server.url, "--job", job, "--format", "json"]) == 0
    rows = {c["consumer"]: c for c in json.loads(capsys.readouterr().out)["consumers"]}
    for name in ("huge", "nan", "neg", "str"):
        assert rows[name]["health"] == "malformed" and rows[name]["commit_time"] is None, rows[name]
        assert "is not a time" in rows[name]["malformed"]
    assert rows["far"]["health"] == "malformed" and rows["far"]["offset"] is None
    assert "is not a position" in rows["far"]["malformed"]
    for name in ("good", "hist"):
        assert rows[name]["health"] == "ok" and rows[name]["malformed"] == "" and rows[name]["offset"] == rows["good"]["offset"] > 0
    got = _series(generate_latest(build_registry(server=nats_server.url, job=job)).decode())
    health = {dict(k[1])["consumer"]: v for k, v in got.items() if k[0] == "persistent_delta_remote_consumer_health"}
    assert health == {"good": 0, "hist": 0, "huge": 4, "nan": 4, "neg": 4, "str": 4, "far": 4}
    assert got[("persistent_delta_stream_scrape_error", ())] == 0

    from persistent_delta.cli.top import snapshot

    view = snapshot(None, nats_server.url, job)
    assert not view.errors and {c.consumer: c.health for c in view.remote}["huge"] == "malformed"
