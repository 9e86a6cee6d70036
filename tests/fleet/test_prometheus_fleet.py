"""A real Prometheus scrapes the exporter with ``--server`` while a log is written, shipped and
read by two remote consumers (one stops reading): the remote lags and the shipper's numbers it
stores are those ``offsets --server`` reports."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from procs import REPO
from prometheus_server import BINARY, MISSING, prometheus

pytest.importorskip("prometheus_client")

from persistent_delta import LmdbDeltaStore, RemoteConsumer, Shipper  # noqa: E402
from persistent_delta.fleet.ship import shipper_name  # noqa: E402
from persistent_delta.ops.remote_positions import describe_remote  # noqa: E402
from persistent_delta.testing import free_port  # noqa: E402

JOB = "job-prom"


@pytest.mark.skipif(BINARY is None, reason=MISSING)
def test_prometheus_sees_remote_lag_and_shippers(tmp_path, nats_server):
    root = str(tmp_path / "log")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    exporter = subprocess.Popen([sys.executable, "-m", "persistent_delta", "exporter", root, "--server",
                                 nats_server.url, "--job", JOB, "--port", str(port)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        with LmdbDeltaStore(os.path.join(root, "rank-0"), updateMode=UpdateMode.NONE) as store, \
                Shipper(root, nats_server.url, JOB, channels=["lookups"], max_batches=2) as shipper:
            store.append(0, "t", torch.tensor([0]))
            shipper.start()
            with RemoteConsumer(nats_server.url, JOB, "live", wait=10) as live, \
                    RemoteConsumer(nats_server.url, JOB, "gone", wait=10) as gone:
                for c in (live, gone):
                    c.poll(timeout=5)
                    c.commit()
                for b in range(1, 20):  # written and shipped while "live" reads and "gone" does not
                    store.append(b, "t", torch.tensor([b, b + 1]))
                    live.poll(timeout=0.05)
                    live.commit()
                deadline = time.monotonic() + 30
                while live.position() != {0: 20} and time.monotonic() < deadline:
                    live.poll(timeout=0.5)
                live.commit()
            shipper.stop()
        with prometheus(str(tmp_path / "prom"), {"exporter": f"127.0.0.1:{port}"}) as prom:
            found = describe_remote(nats_server.url, JOB)
            want = {(("channel", c.channel), ("consumer", c.consumer), ("job", JOB), ("rank", str(c.rank))): float(c.lag)
                    for c in found["consumers"]}
            assert sorted(v for v in want.values()) == [0.0, 19.0], found
            prom.wait_for(f'persistent_delta_remote_consumer_lag_batches{{job="{JOB}"}}', want)
            (ship,) = found["shippers"]
            feed = (("channel", "lookups"), ("job", JOB), ("rank", "0"))
            prom.wait_for(f'persistent_delta_shipper_position{{job="{JOB}"}}', {feed: float(ship.position)})
            # the shipper is a registered consumer of the local log: the exporter shows it caught up
            local = prom.wait_for(f'persistent_delta_consumer_lag_batches{{job="{JOB}",consumer="{shipper_name(JOB, "lookups")}"}}')
            assert list(local.values()) == [0.0]
    finally:
        exporter.terminate()
        exporter.wait(60)
