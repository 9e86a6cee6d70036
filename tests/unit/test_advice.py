"""Each error's advice applies to the caller that gets it: an unregistered reader is never told
to reset a consumer name it does not have, a registered consumer is told the command with its
real root and name, and a replica asking the trainer's consumer name for snapshots is told the
name to use (tests/process/test_base.py)."""

import os

import pytest
import torch

from logs import fill_store
from persistent_delta import DeltaConsumer, DeltaReader
from persistent_delta.errors import OffsetOutOfRangeError
from persistent_delta.log.deltalog import DeltaLog
from persistent_delta.log.records import delete_below


def _store_with_deleted_start(path: str) -> None:
    fill_store(path, lambda b: [("t", torch.tensor([b, b + 1]), None)], batches=10)
    with DeltaConsumer(path, "late"):  # registered at 0, then retention deletes below 5
        pass
    with DeltaLog(path) as log:
        log.write(lambda w: delete_below(w, 5))


def test_an_unregistered_reader_is_advised_its_own_arguments(tmp_path):
    path = str(tmp_path / "store")
    _store_with_deleted_start(path)
    with DeltaReader(path, start=2) as reader:
        with pytest.raises(OffsetOutOfRangeError) as err:
            reader.poll()
    msg = str(err.value)
    assert "offsets" not in msg and "unregistered reader)" not in msg, msg
    assert "start='earliest'" in msg and "reset='earliest'" in msg and "[5, " in msg, msg
    with DeltaReader(path, start=2, reset="earliest") as reader:  # the advice works
        assert reader.poll().ranges()[0][0] == 5


def test_a_registered_consumer_is_advised_the_offsets_tool_with_its_root_and_name(tmp_path):
    path = str(tmp_path / "store")
    _store_with_deleted_start(path)
    with DeltaConsumer(path, "late", register=False) as c:
        with pytest.raises(OffsetOutOfRangeError) as err:
            c.poll()
    msg = str(err.value)
    assert f"persistent-delta offsets {os.fspath(path)} --reset late --to-earliest --execute" in msg, msg
    assert "ROOT" not in msg, msg
