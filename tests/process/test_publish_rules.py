"""Publish's rules on a real trainer: a consumer either reads (``get_unique``) or publishes, and
the user is told when one is used both ways."""

from harness import run_spawn
from publish_rules_cases import role_case


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
