"""Remote consumers across a trainer restore: a SIGKILL between the two ranks' commits of a
publish, the shipper running, then a restart with ``tracker.load_state_dict``; a replica that
reads only the stream ends bit-exact with the trainer (issue 30's remaining note)."""

import os

import pytest
import torch

from harness import run_spawn
from persistent_delta import RemoteConsumer, apply_poll
from remote_restore_cases import JOB, killed_between_commits_shipped_case

pytestmark = pytest.mark.dist


def _trainer_tables(out: str):
    full = {}
    for r in (0, 1):
        for fqn, (w, info) in torch.load(os.path.join(out, f"rank-{r}.pt")).items():
            t = full.setdefault(fqn, torch.zeros(info["global_rows"], info["global_cols"], dtype=w.dtype))
            t[info["row_offset"]:info["row_offset"] + w.shape[0], info["col_offset"]:info["col_offset"] + w.shape[1]] = w
    return full


@pytest.mark.slow  # two ranks, two restarts, two shipper runs: about a minute
def test_remote_replica_exact_after_a_restore_that_dropped_a_shipped_batch(tmp_path, nats_server):
    out = tmp_path / "out"
    out.mkdir()
    r0, _ = run_spawn(killed_between_commits_shipped_case, 2, str(tmp_path / "log"), nats_server.url, str(out),
                      timeout=240)
    with RemoteConsumer(nats_server.url, JOB, "replica", channel="snapshots", wait=30) as consumer:
        tables = consumer.bootstrap()
        while True:
            poll = consumer.poll(timeout=2.0)
            if poll.empty:
                break
            apply_poll(tables, poll, complete_only=True)
            consumer.commit()
    want = _trainer_tables(str(out))
    bad = {fqn: int((w != tables[fqn]).any(dim=1).sum()) for fqn, w in want.items()}
    assert all(v == 0 for v in bad.values()), (bad, r0)
