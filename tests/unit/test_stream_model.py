"""The shipping model's arithmetic (``benchmarks/stream_model.py``, docs/scaling.md)."""

import math

import pytest

from benchmarks.stream_model import (
    CHUNK_BYTES,
    MESSAGE_OVERHEAD_BYTES,
    Job,
    lookups_bytes_per_window,
    main,
    need,
    rank_groups,
    shipped_bytes_per_window,
    snapshot_bytes_per_publish,
    state_bytes_per_row,
)


def test_state_bytes_per_row_follow_what_the_tracker_stores():
    assert state_bytes_per_row("ID_ONLY", 64) == 0
    assert state_bytes_per_row("EMBEDDING", 64) == 256
    assert state_bytes_per_row("EMBEDDING", 64, value_bytes=2) == 128
    assert state_bytes_per_row("MOMENTUM_LAST", 64) == 4  # the momentum's norm
    assert state_bytes_per_row("MOMENTUM_DIFF", 64) == 4
    assert state_bytes_per_row("MOMENTUM_DIFF", 64, per_element_momentum=True) == 256
    assert state_bytes_per_row("ROWWISE_ADAGRAD", 64) == 4
    with pytest.raises(ValueError):
        state_bytes_per_row("NOPE", 64)


def test_first_modes_write_a_row_once_per_window_and_last_every_step():
    job = Job(rows_per_step=1000, rows_per_window=4000, window=10, dim=16)
    assert lookups_bytes_per_window(Job(**{**job.__dict__, "mode": "EMBEDDING"})) == 4000 * (8 + 64)
    assert lookups_bytes_per_window(Job(**{**job.__dict__, "mode": "ID_ONLY"})) == 4000 * 8
    assert lookups_bytes_per_window(Job(**{**job.__dict__, "mode": "MOMENTUM_LAST"})) == 10 * 1000 * (8 + 4)
    assert snapshot_bytes_per_publish(job) == 4000 * (8 + 64)


def test_the_issue_example_needs_about_480_mb_s_and_six_streams_at_81_mb_s():
    """64 ranks publishing 18.6 MB every 10 steps at 4 steps a second (snapshots only, R=3)."""
    job = Job(ranks=64, rows_per_window=70_450, dim=64, window=10, steps_per_s=4, channels=("snapshots",), tables=4)
    rows = 70_450 * (8 + 256)
    assert rows == 18_598_800
    messages = 4 * math.ceil(rows / 4 / CHUNK_BYTES) + 1
    assert shipped_bytes_per_window(job) == rows + messages * MESSAGE_OVERHEAD_BYTES
    per_rank = (rows + messages * MESSAGE_OVERHEAD_BYTES) / 10 * 4
    n = need(job, stream_bps=81e6)
    assert n.per_rank_bps == pytest.approx(per_rank)
    assert n.ingest_bps == pytest.approx(64 * per_rank) and 470e6 < n.ingest_bps < 480e6
    assert n.replication_bps == pytest.approx(2 * n.ingest_bps)
    assert n.cluster_disk_write_bps == pytest.approx(3 * n.ingest_bps)
    assert n.consumer_read_bps == pytest.approx(job.consumers * n.ingest_bps)
    assert n.streams_needed == 6 and n.ranks_per_stream == 10
    assert need(job, stream_bps=102e6).streams_needed == 5
    assert need(job, stream_bps=81e6, headroom=0.5).streams_needed == 12
    # every replica node keeps the whole retention of the stream when nodes == replicas
    assert n.stream_disk_per_node_bytes == pytest.approx(n.ingest_bps * job.retention_s)
    assert need(job, nodes=6).stream_disk_per_node_bytes == pytest.approx(n.ingest_bps * job.retention_s / 2)


def test_rank_groups_cover_every_rank_once_evenly():
    for ranks, streams in [(64, 6), (64, 12), (7, 3), (5, 8), (1, 1)]:
        groups = rank_groups(ranks, streams)
        flat = [r for g in groups for r in g]
        assert flat == list(range(ranks))
        sizes = [len(g) for g in groups]
        assert max(sizes) - min(sizes) <= 1 and len(groups) == min(ranks, streams)
    with pytest.raises(ValueError):
        rank_groups(0, 1)


def test_the_calculator_prints_its_tables(capsys):
    assert main(["--ranks", "16"]) == 0
    out = capsys.readouterr().out
    assert "| EMBEDDING | 256 |" in out and "Proposed layout" in out
