"""JetStream servers for the tests: started on 127.0.0.1 (free ports, fresh store directories
under pytest's tmp_path) and always stopped (persistent_delta.testing does the work)."""

from __future__ import annotations

import os
from typing import Iterator

import pytest

from persistent_delta.testing import LocalCluster, LocalServer


@pytest.fixture
def nats_server(tmp_path) -> Iterator[LocalServer]:
    server = LocalServer(str(tmp_path / "nats")).start()
    try:
        yield server
    finally:
        server.kill() if os.environ.get("PD_TEST_KILL_SERVERS") else server.stop()


@pytest.fixture
def nats_cluster(tmp_path) -> Iterator[LocalCluster]:
    cluster = LocalCluster(str(tmp_path / "cluster"), n=3).start()
    try:
        yield cluster
    finally:
        cluster.stop()
