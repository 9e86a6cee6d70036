"""Publish's rules on a real trainer: a consumer either reads (``get_unique``) or publishes, and
the user is told when one is used both ways."""

from harness import run_spawn
from publish_rules_cases import inline_case, rank0_only_case, role_case, same_steps_case, uneven_publishes_case


def test_a_consumer_that_reads_cannot_publish_and_the_reverse(tmp_path):
    """``get_unique(c)`` then ``publish(c)`` would publish nothing (the read moved the one
    position both use): refused at the first mix with ``ConsumerRoleError``, in both orders and
    after a restart (the role is in the log); one consumer per use is quiet."""
    (r,) = run_spawn(role_case, 1, str(tmp_path / "log"))
    assert r["read_rows"] > 0, r
    for key in ("publish_after_read", "publish_after_restart"):
        assert "'mixed'" in r[key] and "two consumer names" in r[key], (key, r)
    for key in ("read_after_publish", "read_after_restart"):
        assert "'pub'" in r[key] and "two consumer names" in r[key], (key, r)
    assert r["documented_published"] > 0, r
    assert r["reregistered_reads"], r


def test_publishing_on_rank_0_only_is_told_to_the_replica_and_shown_by_offsets(tmp_path):
    """A rank that completes a batch the others published in, without publishing, is behind for
    good: the first poll after it says so (``poll.behind``, one ``RanksBehindWarning``), a
    complete-only apply is refused with ``RanksBehindError``, and ``offsets`` shows the rank."""
    r0, r1 = run_spawn(rank0_only_case, 2, str(tmp_path / "log"))
    assert r0["curr"] == r1["curr"], (r0, r1)
    assert list(r0["behind"]) == [1], r0
    assert not r0["complete"], r0
    assert len(r0["warned"]) == 1 and "rank 1" in r0["warned"][0], r0
    assert "every rank at the same steps" in r0["refused"] and list(r0["refused_behind"]) == [1], r0
    assert r0["third_warned"] == r0["second_warned"] == 1, r0
    assert r0["offsets"][1] == r0["behind"][1] and r0["offsets"][0] is None, r0


def test_unequal_publish_counts_keep_the_batch_indices_and_the_replica_exact(tmp_path):
    """Three publishes a step on rank 0, one on rank 1: the batch index is the step on both
    ranks, the lookups channel stays complete, the publishes of one step share a stamp, and the
    replica equals the trainer's tables."""
    r0, r1 = run_spawn(uneven_publishes_case, 2, str(tmp_path / "log"))
    assert r0["publishes"] == 3 * r1["publishes"], (r0, r1)
    assert r0["curr"] == r1["curr"] == [1, 2, 3, 4, 5], (r0, r1)
    for r in (r0, r1):
        assert r["lookups_complete"], r
        assert len({end for _, end in r["lookups_ranges"].values()}) == 1, r
        assert len({end for _, end in r["snapshot_ranges"].values()}) == 1, r
        assert all(r["replica_equal"].values()), r


def test_publishing_at_the_same_steps_on_every_rank_is_quiet_and_exact(tmp_path):
    r0, r1 = run_spawn(same_steps_case, 2, str(tmp_path / "log"))
    for r in (r0, r1):
        assert r["polls"] == 6 and r["curr"] == 6, r
        assert all(r["replica_equal"].values()), r


def test_a_publish_commits_on_the_writer_thread_by_default_and_on_the_caller_when_inline(tmp_path):
    """By default ``publish()`` hands its records and the step's to the writer thread (nothing
    of the transaction on the training thread); with ``WriterOptions(inline_publish=True)`` it
    commits them on the calling thread before it returns. A replica is exact either way."""
    (r,) = run_spawn(inline_case, 1, str(tmp_path / "log"))
    assert r["inline"]["on_caller"] == [True] * 5 and r["inline"]["committed_on_return"] == [True] * 5, r
    assert r["handed"]["on_caller"] == [False] * 5, r
    for name in ("inline", "handed"):
        assert all(r[name]["replica_equal"].values()), r
