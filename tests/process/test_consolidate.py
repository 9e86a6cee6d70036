"""Consolidate (``persistent_delta.checkpoint.consolidate``): a base and the increments a real
2-rank TorchRec job wrote (row-, column- and table-wise tables; Adagrad, row-wise Adagrad and
SGD fused optimizers; a dense Adam) fold, offline in this one process with no process group,
into a new base that plain TorchRec loads with ``dcp.load`` -- no persistent_delta in the
loading job -- equal bit for bit to the trained state at the last increment; the chain goes on
from it, and retention then removes the older base."""

from __future__ import annotations

import os
from typing import Any, Dict, List

import pytest
import torch
from consolidate_cases import load_plain, restore_with_checkpoints, train_with_increments
from harness import run_spawn

from persistent_delta.checkpoint.chain import latest_chain, list_bases
from persistent_delta.checkpoint.consolidate import consolidate, removable_bases, remove_old_bases
from persistent_delta.errors import IncrementChainError

pytestmark = pytest.mark.dist

CASES = ["column_wise:EXACT_ROWWISE_ADAGRAD", "row_wise:EXACT_ADAGRAD", "table_wise:EXACT_SGD"]
STEPS = 10  # increments at steps 3, 6, 9 and 10


def _differences(a: Dict[str, Any], b: Dict[str, Any]) -> List[str]:
    if set(a) != set(b):
        return [f"keys {sorted(set(a) ^ set(b))}"]
    bad = []
    for k in a:
        xs, ys = (a[k], b[k]) if isinstance(a[k], list) else ([a[k]], [b[k]])
        if len(xs) != len(ys) or not all(torch.equal(x, y) for x, y in zip(xs, ys)):
            bad.append(k)
    return bad


def test_consolidated_base_loads_in_plain_torchrec_equal_to_the_last_increment(tmp_path) -> None:
    trained = run_spawn(train_with_increments, 2, str(tmp_path), CASES, STEPS)
    roots = [str(tmp_path / f"case-{i}" / "ckpt") for i in range(len(CASES))]
    os.makedirs(tmp_path / "taken" / "base-000000000010")
    with pytest.raises(IncrementChainError):
        consolidate(roots[0], out=str(tmp_path / "taken"))  # the new base's directory exists
    done = [consolidate(root) for root in roots]
    for d in done:
        assert (d.step, d.increments) == (STEPS, 4), d
        assert os.path.basename(d.path) == "base-000000000010"
    # the chain continues from the new base: the newest complete one, with no increments yet
    for root, d in zip(roots, done):
        chain = latest_chain(root)
        assert (chain.base, chain.step, chain.increments) == (d.path, STEPS, [])
    loaded = run_spawn(load_plain, 2, [d.path for d in done], CASES)
    for rank in (0, 1):
        for i, case in enumerate(CASES):
            assert _differences(trained[rank][i], loaded[rank][i]) == [], (rank, case)
    # a restarted trainer restores from the new base (the newest), to the same state
    restored = run_spawn(restore_with_checkpoints, 2, str(tmp_path), CASES)
    for rank in (0, 1):
        for i, case in enumerate(CASES):
            step, state = restored[rank][i]
            assert step == STEPS and _differences(trained[rank][i], state) == [], (rank, case)
    # the old base alone (no increments folded) differs: the comparison can fail
    old = run_spawn(load_plain, 2, [d.source for d in done], CASES)
    assert all(_differences(trained[0][i], old[0][i]) for i in range(len(CASES)))
    # retention: the older base and its increments go, the consolidated one stays
    assert removable_bases(roots[0]) == [done[0].source]
    assert remove_old_bases(roots[0]) == [done[0].source] and os.path.isdir(done[0].source)  # a dry run
    remove_old_bases(roots[0], execute=True)
    assert [p for _s, p in list_bases(roots[0])] == [done[0].path]
    assert removable_bases(roots[0]) == []
    nothing = consolidate(roots[0])
    assert (nothing.path, nothing.increments) == (done[0].path, 0)

