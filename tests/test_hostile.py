"""Operator mistakes and hostile input (issue 13 items 1, 2, 8): filters that would skip data,
table names that are not file names, and row shapes that change."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta import DeltaConsumer, DeltaReader, InvalidInputError, LmdbDeltaStore
from persistent_delta.cli import main
from persistent_delta.cli.replay import file_name, load_export, replay


def _store(path: str, fqns, batches: int = 3) -> None:
    with LmdbDeltaStore(path, UpdateMode.NONE) as s:
        for b in range(batches):
            for i, fqn in enumerate(fqns):
                s.append(b, fqn, torch.arange(i, i + 5 + b))


def test_a_table_filter_that_matches_nothing_is_refused(tmp_path):
    path = str(tmp_path / "log")
    _store(path, ["emb.user", "emb.item"])
    for bad in (["emb.usr"], "emb.user", [1]):
        with pytest.raises(InvalidInputError):
            DeltaConsumer(path, "c", tables=bad)
        with pytest.raises(InvalidInputError):
            DeltaReader(path, tables=bad)
    with DeltaConsumer(path, "c", tables=["emb.user"]) as c:
        assert {d.fqn for d in c.poll()} == {"emb.user"}
    assert main(["replay", path, "--from-batch", "0", "--to-batch", "3", "--tables", "nope", "--dry-run"]) == 1


def test_replay_file_names_are_unique_and_safe_for_every_fqn(tmp_path):
    path = str(tmp_path / "log")
    fqns = ["emb/user", "emb_user", "nul\x00table", "x" * 400, "plain.name", "..hidden", "é/ü"]
    _store(path, fqns)
    names = [file_name(f) for f in fqns]
    assert len(set(names)) == len(fqns)
    assert all("/" not in n and "\x00" not in n and len(n) < 100 and not n.startswith(".") for n in names)
    assert file_name("plain.name") == "plain.name"  # plain names stay readable
    out = str(tmp_path / "out")
    report = replay(path, out, from_batch=0, to_batch=3)
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    by_fqn = {f["fqn"]: f["path"] for f in manifest["files"]}
    assert set(by_fqn) == set(fqns) and len(set(by_fqn.values())) == len(fqns)
    for fqn, rel in by_fqn.items():
        tensors, meta = load_export(os.path.join(out, rel))
        assert meta["fqn"] == fqn and tensors["ids"].numel() > 0
    assert len(report.files) == len(fqns)


def test_a_failed_replay_leaves_no_partial_output(tmp_path):
    path = str(tmp_path / "log")
    _store(path, ["a", "b"])
    out = str(tmp_path / "out")
    ckpt = str(tmp_path / "ckpt")  # a shard checkpoint without table "b": fails after the windows
    os.makedirs(ckpt)
    from safetensors.torch import save_file
    save_file({"a": torch.zeros(20, 4)}, os.path.join(ckpt, "rank-0.safetensors"),
              metadata={"format": "persistent_delta.shards/1", "rank": "0", "shards": json.dumps(
                  {"a": {"table_name": "a", "sharding_type": "table_wise", "row_offset": 0, "col_offset": 0,
                         "local_rows": 20, "local_cols": 4, "global_rows": 20, "global_cols": 3}})})
    with pytest.raises(Exception):
        replay(path, out, from_batch=0, to_batch=3, checkpoint=ckpt)
    assert not os.path.exists(out)  # it created out: it removed it
    os.makedirs(out)
    with pytest.raises(Exception):
        replay(path, out, from_batch=0, to_batch=3, checkpoint=ckpt)
    assert os.listdir(out) == []  # an existing directory is left as it was


def test_a_table_keeps_one_row_shape(tmp_path):
    path = str(tmp_path / "log")
    with LmdbDeltaStore(path, UpdateMode.FIRST) as s:
        s.append(0, "t", torch.tensor([1, 2]), torch.ones(2, 4))
        for bad in (torch.ones(1, 5), torch.ones(1, 4, dtype=torch.float64), torch.ones(1)):
            with pytest.raises(InvalidInputError, match="row shape"):
                s.append(1, "t", torch.tensor([3]), bad)
        s.delete(None)
        with pytest.raises(InvalidInputError, match="row shape"):  # fixed after delete(None) too
            s.append(2, "t", torch.tensor([3]), torch.ones(1, 5))
        s.append(2, "t", torch.tensor([3]), torch.ones(1, 4))
        assert s.get_unique(0)["t"].states.shape == (1, 4)
    assert main(["verify", path]) == 0
