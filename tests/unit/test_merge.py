"""merge: the FIRST/LAST rule against TorchRec's _compute_unique_rows, dense and sparse ids."""

import pytest
import torch
from torchrec.distributed.model_tracker.delta_store import _compute_unique_rows
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta.log import rows
from persistent_delta.log.rows import compute_unique_rows


@pytest.mark.parametrize("mode", list(UpdateMode))
@pytest.mark.parametrize("high", [50, 10**12])  # dense (direct-address) and sparse (sort) paths
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("positions", ["int32", "int64"])  # the direct-address table's, either side of its limit
def test_matches_torchrec(mode, high, dtype, positions, monkeypatch):
    if positions == "int64":
        monkeypatch.setattr(rows, "_INT32_POSITIONS", 1)  # (2**31 ids at full size)
    g = torch.Generator().manual_seed(high % 97 + len(mode.value))
    high = min(high, torch.iinfo(dtype).max)
    ids = [torch.randint(0, high, (n,), generator=g).to(dtype) for n in (40, 0, 25, 60)]
    states = None if mode == UpdateMode.NONE else [torch.randn(i.numel(), 3, generator=g) for i in ids]
    got = compute_unique_rows(ids, states, mode)
    want = _compute_unique_rows(ids, states, mode)
    order = torch.argsort(want.ids)
    assert got.ids.dtype == dtype
    assert torch.equal(got.ids, want.ids[order])
    if mode == UpdateMode.NONE:
        assert got.states is None
    else:
        assert torch.equal(got.states, want.states[order])


def test_results_own_their_memory():
    ids = torch.tensor([3, 1, 3])
    states = torch.tensor([[1.0], [2.0], [3.0]])
    got = compute_unique_rows([ids], [states], UpdateMode.FIRST)
    got.ids += 100
    got.states += 100
    assert ids.tolist() == [3, 1, 3] and states[:, 0].tolist() == [1.0, 2.0, 3.0]
    assert compute_unique_rows([ids], None, UpdateMode.NONE).ids.data_ptr() != ids.data_ptr()


@pytest.mark.parametrize("mode", [UpdateMode.FIRST, UpdateMode.LAST])
@pytest.mark.parametrize("high", [10**4, 10**12])
def test_disjoint_records_match_torchrec(mode, high):
    """Records with no id in common (what the window filter writes) take the scatter path."""
    g = torch.Generator().manual_seed(7)
    pool = torch.unique(torch.randint(0, high, (400,), generator=g))
    pool = pool[torch.randperm(pool.numel(), generator=g)]
    ids = list(pool.split([100, 0, 150, pool.numel() - 250]))
    states = [torch.randn(i.numel(), 4, generator=g) for i in ids]
    got = compute_unique_rows(ids, states, mode)
    want = _compute_unique_rows(ids, states, mode)
    order = torch.argsort(want.ids)
    assert torch.equal(got.ids, want.ids[order])
    assert torch.equal(got.states, want.states[order])
