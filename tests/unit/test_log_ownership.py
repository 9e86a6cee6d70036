"""Directories the library creates get the mode it intends whatever the umask, and a rank
directory or data file that another uid than the log root owns is refused, not read."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from persistent_delta import DeltaReader
from persistent_delta.errors import LogOwnershipError
from logs import fill_ranks


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _records(r, b):
    return [("t", torch.tensor([b, r]), torch.ones(2, 4))]


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
@pytest.mark.parametrize("group", [False, True])
def test_the_log_root_and_rank_directories_get_the_intended_mode_under_any_umask(tmp_path, monkeypatch, umask, group):
    """Owner-only by default (0700 / 0600), group-readable and writable with group access
    (0770 / 0660), under umask 000 (nothing widened) and 077 (nothing narrowed): the log root
    too, not only the rank directories."""
    monkeypatch.setenv("PERSISTENT_DELTA_GROUP_ACCESS", "1" if group else "0")
    root = tmp_path / "jobs" / "log"
    old = os.umask(umask)
    try:
        fill_ranks(str(root), _records, ranks=1, batches=2)
    finally:
        os.umask(old)
    d, f = (0o770, 0o660) if group else (0o700, 0o600)
    assert _mode(root) == d and _mode(root.parent) == d
    assert _mode(root / "rank-0") == d and _mode(root / "rank-0" / "data.mdb") == f
    assert _mode(root / "rank-0" / "writer.lock") == f


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another uid")
def test_a_rank_planted_by_another_uid_is_refused(tmp_path):
    """Another user renamed rank-1 away and planted a log of their own (their uid), or a
    symbolic link: a reader refuses the job with a typed permission error, reading nothing."""
    root = tmp_path / "log"
    fill_ranks(str(root), _records, ranks=2, batches=2)
    with DeltaReader(str(root)) as r:
        assert sorted(r.poll().ranks) == [0, 1]
    os.chown(root / "rank-1", 65534, 65534)
    with pytest.raises(LogOwnershipError, match="uid 65534"):
        DeltaReader(str(root))
    os.chown(root / "rank-1", 0, 0)
    os.chown(root / "rank-1" / "data.mdb", 65534, 65534)
    with pytest.raises(PermissionError):
        DeltaReader(str(root))
    os.chown(root / "rank-1" / "data.mdb", 0, 0)
    os.rename(root / "rank-1", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", root / "rank-1")
    with pytest.raises(LogOwnershipError, match="symbolic link"):
        DeltaReader(str(root))


def test_an_out_of_range_max_readers_is_a_typed_error(tmp_path, monkeypatch):
    """``PERSISTENT_DELTA_MAX_READERS=99999999999`` is refused with InvalidInputError naming the
    setting, not an OverflowError from LMDB."""
    from persistent_delta.errors import InvalidInputError

    monkeypatch.setenv("PERSISTENT_DELTA_MAX_READERS", "99999999999")
    with pytest.raises(InvalidInputError, match="PERSISTENT_DELTA_MAX_READERS"):
        fill_ranks(str(tmp_path / "log"), _records, ranks=1, batches=1)

