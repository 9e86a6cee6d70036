"""Hypothesis state machine: LmdbDeltaStore against TorchRec's DeltaStoreTrec as the model,
for all three update modes, with close + reopen as a step."""

import shutil
import tempfile
from typing import Dict

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from torchrec.distributed.model_tracker.delta_store import DeltaStoreTrec
from torchrec.distributed.model_tracker.types import UniqueRows, UpdateMode

from persistent_delta import LmdbDeltaStore

TABLES = ["ec.t0", "ec.t1", "ebc.t2"]


def model_unique(ref: DeltaStoreTrec, from_idx: int) -> Dict[str, UniqueRows]:
    """DeltaStoreTrec.get_unique per table, with TorchRec's two differences normalised:
    a table with nothing left raises there (empty here), and ids are not sorted there."""
    out = {}
    for fqn, lookups in ref.per_fqn_lookups.items():
        kept = [lk for lk in lookups if lk.batch_idx >= from_idx]
        if not kept:
            out[fqn] = None
            continue
        single = DeltaStoreTrec(ref.updateMode)
        single.per_fqn_lookups = {fqn: kept}
        rows = single.get_unique(0)[fqn]
        order = torch.argsort(rows.ids)
        out[fqn] = UniqueRows(rows.ids[order], None if rows.states is None else rows.states[order])
    return out


class StoreMachine(RuleBasedStateMachine):
    mode = UpdateMode.NONE

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="pd-hyp-")
        self.store = LmdbDeltaStore(self.dir, self.mode)
        self.ref = DeltaStoreTrec(self.mode)
        self.batch = 0

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(
        fqn=st.sampled_from(TABLES),
        ids=st.lists(st.integers(0, 30), min_size=0, max_size=12),
        advance=st.integers(0, 2),
        seed=st.integers(0, 2**16),
    )
    def append(self, fqn, ids, advance, seed):
        self.batch += advance
        t_ids = torch.tensor(ids, dtype=torch.int64)
        g = torch.Generator().manual_seed(seed)
        states = None if self.mode == UpdateMode.NONE else torch.randn(len(ids), 3, generator=g)
        self.store.append(self.batch, fqn, t_ids, states)
        self.ref.append(self.batch, fqn, t_ids, states)

    @rule(up_to=st.one_of(st.none(), st.integers(0, 40)))
    def delete(self, up_to):
        self.store.delete(up_to)
        self.ref.delete(up_to)

    @rule(start=st.integers(0, 40), length=st.integers(1, 15))
    def compact(self, start, length):
        self.store.compact(start, start + length)
        self.ref.compact(start, start + length)

    @rule()
    def reopen(self):
        self.store.close()
        self.store = LmdbDeltaStore(self.dir, self.mode)

    @rule(from_idx=st.integers(0, 40))
    def get_unique_agrees(self, from_idx):
        self._check(from_idx)

    @invariant()
    def same_records(self):
        ours = self.store.per_fqn_lookups
        assert set(ours) == set(self.ref.per_fqn_lookups)
        for fqn, lookups in self.ref.per_fqn_lookups.items():
            got = ours[fqn]
            assert [lk.batch_idx for lk in got] == [lk.batch_idx for lk in lookups]
            for a, b in zip(got, lookups):  # compaction order may differ: compare as sorted multisets
                assert torch.equal(a.ids.sort().values, b.ids.sort().values)

    @invariant()
    def get_unique_from_zero_agrees(self):
        self._check(0)

    def _check(self, from_idx):
        got = self.store.get_unique(from_idx)
        want = model_unique(self.ref, from_idx)
        assert set(got) == set(want)
        for fqn, rows in want.items():
            ours = got[fqn]
            assert torch.all(ours.ids[1:] > ours.ids[:-1]), "ids must be ascending and unique"
            if rows is None:
                assert ours.ids.numel() == 0
                continue
            assert torch.equal(ours.ids, rows.ids)
            if self.mode == UpdateMode.NONE:
                assert ours.states is None
            else:
                assert torch.equal(ours.states, rows.states)


def _machine(mode: UpdateMode):
    return type(f"Store{mode.name}", (StoreMachine,), {"mode": mode})


SETTINGS = settings(max_examples=30, stateful_step_count=25, deadline=None)
TestStoreNone = _machine(UpdateMode.NONE).TestCase
TestStoreNone.settings = SETTINGS
TestStoreFirst = _machine(UpdateMode.FIRST).TestCase
TestStoreFirst.settings = SETTINGS
TestStoreLast = _machine(UpdateMode.LAST).TestCase
TestStoreLast.settings = SETTINGS


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(UpdateMode))
def test_long_state_machine(mode):
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(_machine(mode), settings=settings(max_examples=300, stateful_step_count=50, deadline=None))
