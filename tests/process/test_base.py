"""A replica's starting tables from the trainer's shard files: ``load_base`` returns every
table whole, in global row ids, bit-exact with the ranks' shards."""

import os
import threading

import pytest
import torch

from harness import run_spawn
from persistent_delta.errors import InvalidInputError
from persistent_delta.serve.apply import load_base
from replica_cases import same_name_case, shard_files_case

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("sharding", ["column_wise", "row_wise"])
def test_load_base_assembles_full_tables(tmp_path, sharding):
    shard_dir = str(tmp_path / "shards")
    ranks = run_spawn(shard_files_case, 2, str(tmp_path / "log"), shard_dir, sharding, timeout=240)
    expected: dict = {}
    for shards in ranks:
        for fqn, (w, r0, c0, rows, cols) in shards.items():
            full = expected.setdefault(fqn, torch.full((rows, cols), float("nan"), dtype=w.dtype))
            full[r0:r0 + w.shape[0], c0:c0 + w.shape[1]] = w
    # a replica started alongside its trainer: rank 1's file comes later; wait= waits for it
    late = os.path.join(shard_dir, "rank-1.safetensors")
    os.rename(late, late + ".later")
    with pytest.raises(InvalidInputError):  # a row or a column no file holds
        load_base(shard_dir)
    arrive = threading.Timer(0.5, os.rename, (late + ".later", late))
    arrive.start()
    try:
        base = load_base(shard_dir, wait=60)
    finally:
        arrive.join()
    assert sorted(base) == sorted(expected)
    for fqn, full in expected.items():
        assert not torch.isnan(full).any(), fqn  # the ranks' shards tile the table
        assert base[fqn].shape == full.shape and torch.equal(base[fqn], full), fqn


def test_the_trainers_consumer_name_is_refused_for_snapshots_with_the_name_to_use(tmp_path):
    """``tracker.publish("serving")`` writes snapshots; a replica asking for them as "serving"
    is refused with the name to use instead (not an advice to delete the trainer's consumer),
    and that name works."""
    (r,) = run_spawn(same_name_case, 1, str(tmp_path / "log"), timeout=180)
    assert r["first"].startswith("ERROR ConfigMismatchError"), r
    assert "--delete" not in r["first"] and "tracker.publish('serving')" in r["first"], r
    assert r["second"] is not None and r["second"].startswith("ROWS ") and int(r["second"].split()[1]) > 0, r
