"""Caps across hosts: a remote snapshots poll reports the rows capped publishes left pending
(``DeltaPoll.deferred``), as a local poll of the same publish does. A real trainer rank (gloo),
a real shipper and a real nats-server on 127.0.0.1."""

import pytest

from caps_cases import shipped_caps_case
from harness import run_spawn

pytestmark = pytest.mark.dist


def test_a_remote_poll_reports_the_deferred_rows_after_every_publish(tmp_path, nats_server):
    (r,) = run_spawn(shipped_caps_case, 1, str(tmp_path / "log"), nats_server.url, "job-caps", timeout=240)
    pubs = r["publishes"]
    assert any(pending > 0 for pending, *_ in pubs), pubs  # the caps deferred rows: not vacuous
    assert all(rows > 0 for *_, rows, _ in pubs), pubs  # every publish reached the remote consumer
    for pending, local, remote, _, empty in pubs:
        assert local == pending and remote == pending and empty == pending, pubs
    assert pubs[-1][0] == 0, pubs
