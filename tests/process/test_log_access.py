"""A user who may not read a log (owner-only, another owner) is told so with a permission
error, run as a real second user (``nobody``: root bypasses permission checks)."""

from __future__ import annotations

import os

import pytest
import torch

from logs import fill_ranks


def _records(r, b):
    return [("t", torch.tensor([b, r]), torch.ones(2, 4))]


def test_another_user_on_an_owner_only_log_gets_a_permission_error(tmp_path):
    """``nobody`` opening an owner-only log gets LogAccessError (a PermissionError saying how to
    share a log), not "holds no persistent_delta log"."""
    import subprocess

    from procs import other_uid

    ou = other_uid()
    if ou is None:
        pytest.skip("needs root and an interpreter the other user can run")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(shared, 0o755)  # the parent is open to everyone; the log root is owner-only
    root = shared / "log"
    fill_ranks(str(root), _records, ranks=1, batches=1)
    code = ("import sys\nfrom persistent_delta import DeltaReader\nfrom persistent_delta.errors import LogAccessError\n"
            "try:\n    DeltaReader(sys.argv[1])\nexcept LogAccessError as e:\n    print('ACCESS', e)\n")
    got = subprocess.run([ou.python, "-c", code, str(root)], capture_output=True, text=True, timeout=120,
                         env=ou.env("/tmp"), user=ou.uid, group=ou.gid, extra_groups=[])
    assert "ACCESS" in got.stdout and "PERSISTENT_DELTA_GROUP_ACCESS" in got.stdout, got.stdout + got.stderr
