"""Retention of bases (``checkpoint.consolidate.removable_bases``/``remove_old_bases``) and the
``persistent-delta consolidate`` command: what goes is every base older than the newest
complete one(s) -- never the newest complete base, nor a newer save still under way -- and only
with ``--execute``."""

from __future__ import annotations

import io
import json
import os

import pytest

from persistent_delta.checkpoint.consolidate import removable_bases, remove_old_bases
from persistent_delta.checkpoint.format import BaseInfo, RankInfo, base_dir, write_base_info
from persistent_delta.cli import main
from persistent_delta.errors import IncompleteBaseError, InvalidInputError


def _base(root: str, step: int, complete: bool = True) -> str:
    """A base directory: complete (DCP's .metadata and the info file) or a save under way."""
    path = base_dir(root, step)
    os.makedirs(os.path.join(path, "increments", "00000001"))
    if complete:
        open(os.path.join(path, ".metadata"), "wb").close()
        write_base_info(path, BaseInfo(f"id{step}", step, 1, [RankInfo(0, "log", 1, {})], False, False))
    return path


def test_older_bases_go_the_newest_complete_and_a_save_under_way_stay(tmp_path) -> None:
    root = str(tmp_path)
    old, older_incomplete = _base(root, 0), _base(root, 3, complete=False)
    mid, new, under_way = _base(root, 5), _base(root, 9), _base(root, 12, complete=False)
    assert removable_bases(root) == [old, older_incomplete, mid]
    assert removable_bases(root, keep=2) == [old, older_incomplete]
    assert remove_old_bases(root) == [old, older_incomplete, mid] and os.path.isdir(old)  # a dry run
    remove_old_bases(root, keep=1, execute=True)
    assert sorted(os.listdir(root)) == [os.path.basename(new), os.path.basename(under_way)]
    assert removable_bases(root) == []


def test_retention_refuses_bad_keep_and_a_root_without_a_complete_base(tmp_path) -> None:
    _base(str(tmp_path), 4, complete=False)
    with pytest.raises(IncompleteBaseError):
        removable_bases(str(tmp_path))
    with pytest.raises(InvalidInputError):
        removable_bases(str(tmp_path), keep=0)


def test_the_command_lists_then_removes_with_execute(tmp_path) -> None:
    root = str(tmp_path)
    old, new = _base(root, 0), _base(root, 7)
    out = io.StringIO()
    assert main(["consolidate", root, "--remove-older", "--format", "json"], stdout=out) == 0
    data = json.loads(out.getvalue())
    assert data["consolidated"]["increments"] == 0 and data["consolidated"]["path"] == new  # nothing to fold
    assert (data["removed"], data["dry_run"]) == ([old], True) and os.path.isdir(old)
    assert main(["consolidate", root, "--remove-older", "--execute"], stdout=io.StringIO()) == 0
    assert not os.path.exists(old) and os.path.isdir(new)
    assert main(["consolidate", str(tmp_path / "none")], stdout=io.StringIO()) == 1  # no complete base
