"""Format 2: a record's checksum covers its key; format-1 logs are refused on
open and upgraded in place by `persistent-delta upgrade`."""

from __future__ import annotations

import os

import crc32c
import lmdb
import pytest
import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta.errors import CorruptRecordError, FormatMismatchError
from persistent_delta import LmdbDeltaStore
from persistent_delta.log import codec
from persistent_delta.cli import main
from persistent_delta.log.deltalog import DeltaLog


def _store(path: str) -> None:
    with LmdbDeltaStore(path, UpdateMode.FIRST) as s:
        for b in range(1, 5):
            ids = torch.arange(b, b + 6)
            s.append(b, "t", ids, ids.float().unsqueeze(1) * b)


def _rows(path: str):
    with LmdbDeltaStore(path, UpdateMode.FIRST, readonly=True) as s:
        u = s.get_unique(0)["t"]
        return u.ids.tolist(), u.states.tolist()


def test_a_record_moved_to_another_key_is_detected(tmp_path):
    path = str(tmp_path / "log")
    _store(path)
    env = lmdb.open(path, max_dbs=8)
    db = env.open_db(b"records")
    with env.begin(write=True) as txn:
        key = codec.record_key(0, 3, 0)
        value = txn.get(key, db=db)
        txn.delete(key, db=db)
        txn.put(codec.record_key(0, 7, 0), value, db=db)  # what a flipped key byte does
    env.close()
    with LmdbDeltaStore(path, UpdateMode.FIRST, readonly=True) as s:
        with pytest.raises(CorruptRecordError, match="key"):
            s.get_unique(0)
    assert main(["verify", path]) == 1


def _downgrade_to_v1(path: str) -> None:
    """Rewrite a format-2 log as format 1 wrote it (checksum over the value only)."""
    env = lmdb.open(path, max_dbs=8)
    with env.begin(write=True) as txn:
        for name in (b"records", b"snapshots"):
            db = env.open_db(name, txn=txn)
            cur = txn.cursor(db=db)
            for key, value in list(cur):
                v = bytearray(value)
                head_len, _ = codec._PREFIX.unpack_from(v, 0)
                codec._PREFIX.pack_into(v, 0, head_len, crc32c.crc32c(bytes(v[8:])))
                txn.put(key, bytes(v), db=db)
        txn.put(b"format_version", codec.pack(1), db=env.open_db(b"meta", txn=txn))
    env.close()


def test_a_format_1_log_is_refused_then_upgraded_in_place(tmp_path, capsys):
    path = str(tmp_path / "log")
    _store(path)
    want = _rows(path)
    _downgrade_to_v1(path)
    with pytest.raises(FormatMismatchError, match="persistent-delta upgrade"):
        DeltaLog(path, readonly=True)
    assert main(["upgrade", path]) == 0
    assert "DRY RUN" in capsys.readouterr().out
    with pytest.raises(FormatMismatchError):
        DeltaLog(path, readonly=True)  # a dry run changed nothing
    assert main(["upgrade", path, "--execute"]) == 0
    assert _rows(path) == want
    assert main(["verify", path]) == 0
    assert main(["upgrade", path, "--execute"]) == 0  # idempotent


def test_an_upgrade_refuses_a_damaged_record_and_changes_nothing(tmp_path):
    path = str(tmp_path / "log")
    _store(path)
    _downgrade_to_v1(path)
    env = lmdb.open(path, max_dbs=8)
    db = env.open_db(b"records")
    with env.begin(write=True) as txn:
        key = codec.record_key(0, 2, 0)
        v = bytearray(txn.get(key, db=db))
        v[-1] ^= 0xFF
        txn.put(key, bytes(v), db=db)
    env.close()
    before = open(os.path.join(path, "data.mdb"), "rb").read()
    with pytest.raises(CorruptRecordError):
        from persistent_delta.cli.upgrade import upgrade
        upgrade(path, execute=True)
    with pytest.raises(FormatMismatchError):
        DeltaLog(path, readonly=True)  # still format 1: the transaction was not committed
    assert len(open(os.path.join(path, "data.mdb"), "rb").read()) == len(before)


def test_an_upgrade_reports_its_progress_in_records(tmp_path):
    from persistent_delta.cli.upgrade import upgrade

    path = str(tmp_path / "log")
    _store(path)
    _downgrade_to_v1(path)
    seen = []
    (result,) = upgrade(path, execute=True, progress=seen.append)
    assert result.applied and sum(seen) == result.records > 0
