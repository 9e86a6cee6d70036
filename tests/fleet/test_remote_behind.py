"""A rank behind on the snapshots channel, told by a remote consumer as a local one tells it:
``publish()`` on rank 0 only of two ranks, the logs shipped to a real nats-server; the remote
consumer's poll says rank 1 is behind (``poll.behind``, one ``RanksBehindWarning``),
``apply_poll(complete_only=True)`` raises ``RanksBehindError``, and ``offsets --server`` and
``top --server`` show it. Publishing on every rank (the documented path) stays quiet."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from harness import run_spawn
from persistent_delta import RemoteConsumer, Shipper, apply_poll
from persistent_delta.cli import main as cli_main
from persistent_delta.errors import RanksBehindError, RanksBehindWarning
from remote_behind_cases import cut_range_case, publish_on_case

pytestmark = pytest.mark.dist


def _trained_and_shipped(root: str, url: str, job: str, publishers: list) -> None:
    run_spawn(publish_on_case, 2, root, publishers, timeout=180)
    with Shipper(root, url, job=job, channels=["snapshots"]) as shipper:
        shipper.run(idle_exit_s=1.0)


def _replica() -> dict:
    return {f"table_{i}": torch.zeros(100, 8) for i in range(4)}


def test_publishing_on_rank_0_only_is_told_by_the_remote_consumer(tmp_path, nats_server, capsys):
    root, job = str(tmp_path / "log"), "behind"
    _trained_and_shipped(root, nats_server.url, job, [0])
    with warnings.catch_warnings(record=True) as seen, \
            RemoteConsumer(nats_server.url, job, "replica", channel="snapshots", wait=30) as consumer:
        warnings.simplefilter("always")
        poll = consumer.poll(timeout=3.0)
        assert list(poll.behind) == [1], (poll.behind, consumer.rejected)
        missed = poll.behind[1]
        assert not poll.complete
        told = [str(w.message) for w in seen if issubclass(w.category, RanksBehindWarning)]
        assert len(told) == 1 and "rank 1" in told[0], told
        with pytest.raises(RanksBehindError) as exc:
            apply_poll(_replica(), poll, complete_only=True)  # refused before anything is written
        assert exc.value.behind == {1: missed}
        consumer.poll(timeout=0.5)  # told once per rank
        assert len([w for w in seen if issubclass(w.category, RanksBehindWarning)]) == 1
        consumer.commit()
    capsys.readouterr()
    assert cli_main(["offsets", "--server", nats_server.url, "--job", job, "--format", "json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["snapshots_behind"] == {"1": missed}, found
    rows = {c["rank"]: c for c in found["consumers"] if c["consumer"] == "replica"}
    assert rows[0]["snapshots_behind"] is None, rows  # rank 1 has no position yet: nothing of it was shipped
    assert rows[0]["health"] == "behind", rows
    assert cli_main(["offsets", "--server", nats_server.url, "--job", job]) == 0
    assert "ranks [1] are behind on the snapshots channel" in capsys.readouterr().out

    from persistent_delta.cli.top import snapshot

    view = snapshot(None, nats_server.url, job)
    assert any("ranks [1] are behind" in e for e in view.errors), view.errors


def test_publishing_on_every_rank_stays_quiet_remotely(tmp_path, nats_server, capsys):
    root, job = str(tmp_path / "log"), "quiet"
    _trained_and_shipped(root, nats_server.url, job, [0, 1])
    with warnings.catch_warnings(), \
            RemoteConsumer(nats_server.url, job, "replica", channel="snapshots", wait=30) as consumer:
        warnings.simplefilter("error", RanksBehindWarning)
        polls = []
        while True:
            poll = consumer.poll(timeout=2.0)
            if poll.empty:
                break
            assert poll.behind == {} and poll.complete, poll.behind
            polls.append(poll)
        ends = consumer.position()
        assert polls and ends[0] == ends[1] > 0, ends
        consumer.commit()
    capsys.readouterr()
    assert cli_main(["offsets", "--server", nats_server.url, "--job", job, "--format", "json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["snapshots_behind"] == {} and all(c["health"] == "ok" for c in found["consumers"]), found


def test_a_range_the_shipper_cut_short_is_no_publish(tmp_path, nats_server, capsys):
    """Every rank publishes at the same steps; the shipper (``max_batches=4``) has shipped rank
    0 one range further than rank 1: a range cut at batch 8, with no publish in it, while rank 1
    had already ended batch 8. The cut is not a publish of rank 0, so rank 1 is not behind --
    not in the remote poll, nor in ``offsets --server`` (which read the cut's end as a
    publish: a false RanksBehindWarning in the fleet demo)."""
    root, job = str(tmp_path / "log"), "cut"
    r0, _ = run_spawn(cut_range_case, 2, root, nats_server.url, job, timeout=180)
    assert r0["stamps"][0] < 4 and r0["stamps"][1] >= 8, r0  # the cut at 8 lies between the two publishes
    with warnings.catch_warnings(), \
            RemoteConsumer(nats_server.url, job, "replica", channel="snapshots", wait=30) as consumer:
        warnings.simplefilter("error", RanksBehindWarning)
        poll = consumer.poll(timeout=3.0)
        assert poll.behind == {} and poll.complete, poll.behind
        assert consumer.position() == {0: 4, 1: 4}, consumer.position()  # up to the lower end, rank 1's
    capsys.readouterr()
    assert cli_main(["offsets", "--server", nats_server.url, "--job", job, "--format", "json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["snapshots_behind"] == {}, found


def test_a_remote_poll_continues_a_base_when_nothing_was_published_between(tmp_path, nats_server):
    """The shipper registers after the job's publishes, so each rank's first shipped range starts
    at its first publish, past batch 1; nothing was published before it, and the marker says so
    (``covers_from``): a replica on the tables of batch 0 (continuing from batch 1) applies the
    poll, as a local one does (it was refused with StaleBaseError)."""
    from persistent_delta.read.base import BaseTables

    root, job = str(tmp_path / "log"), "covers"
    _trained_and_shipped(root, nats_server.url, job, [0, 1])
    with RemoteConsumer(nats_server.url, job, "replica", channel="snapshots", wait=30) as consumer:
        poll = consumer.poll(timeout=3.0)
        assert sorted(poll.ranks) == [0, 1] and all(d.start_idx > 1 for d in poll.ranks.values()), poll.ranges
        assert all(d.covers_from is not None and d.covers_from <= 1 for d in poll.ranks.values()), poll.ranks
        fqns = {fqn for d in poll.ranks.values() for fqn in d.tables}
        base = BaseTables({fqn: torch.zeros(100, 8) for fqn in fqns}, positions={0: 1, 1: 1},
                          source="the tables of batch 0")
        apply_poll(base, poll, complete_only=False)  # every table of the job: rows of both ranks
        assert base.positions == {r: d.end_idx for r, d in poll.ranks.items()}
