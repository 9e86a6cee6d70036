"""Bases, increments and the one-call restore (``persistent_delta.trainer.increments``) on two
gloo ranks: a job training several models side by side (one per sharding and fused optimizer,
each with a dense Adam) is SIGKILLed inside a base's ``dcp.save``, inside an increment's write
or at random instants, restored with ``Checkpoints.restore()`` each time and trained on with the
same batches; at the end every model's weights and optimizer states (fused and dense) equal an
uninterrupted twin's bit for bit, and no restore lost more than ``K`` steps."""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Dict, List, Optional

import pytest

from harness import run_spawn
from increments_cases import other_plan_case, other_world_case, refused_models_case
from persistent_delta.checkpoint.chain import latest_chain
from persistent_delta.checkpoint.format import base_dir
from procs import RankProcs

pytestmark = pytest.mark.dist

K, BASE_EVERY, TOTAL = 3, 8, 20  # increments_trainer_ranks.K, .BASE_EVERY; steps of the final run


class Job(RankProcs):
    """The two rank processes of one run, their stdout lines read as they come."""

    def __init__(self, tmp_path, cases: List[str], total: int, run: int, kill_at: Optional[str] = None) -> None:
        super().__init__("increments_trainer_ranks.py",
                         lambda r, port: [str(tmp_path / "job"), str(r), str(port), str(total), *cases],
                         str(tmp_path / f"stderr-{run}"),
                         env=lambda r: {"PD_KILL_AT": kill_at if kill_at and r == 0 else ""})  # ("": none)

    def steps_done(self) -> Dict[int, int]:
        """Model -> the most steps any rank printed done."""
        out: Dict[int, int] = {}
        for ln in self.words("STEP"):
            out[int(ln[1])] = max(out.get(int(ln[1]), 0), int(ln[2]))
        return out

    def restored(self) -> Dict[int, int]:
        return {int(ln[1]): int(ln[2]) for ln in self.words("RESTORED")}

    def wait_killed(self, timeout: float = 180.0) -> None:
        """Rank 0 kills itself (PD_KILL_AT); then rank 1, stuck in a collective, is killed."""
        self.procs[0].wait(timeout=timeout)
        assert self.procs[0].returncode == -signal.SIGKILL, (self.procs[0].returncode, self.stderr())
        self.procs[1].send_signal(signal.SIGKILL)
        self.procs[1].wait(timeout=60)

    def kill_after(self, model_steps: int, rng: random.Random, timeout: float = 180.0) -> None:
        """SIGKILL both ranks a random moment after model 0 did ``model_steps`` steps."""
        deadline = time.monotonic() + timeout
        while self.steps_done().get(0, 0) < model_steps:
            assert all(p.poll() is None for p in self.procs), (self.lines, self.stderr())
            assert time.monotonic() < deadline, self.stderr()
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.6))
        first = rng.randrange(2)
        self.procs[first].send_signal(signal.SIGKILL)
        time.sleep(rng.uniform(0.0, 0.1))
        self.procs[1 - first].send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait(timeout=60)

    def finish(self, timeout: float = 300.0) -> None:
        for p in self.procs:
            p.wait(timeout=timeout)
        assert [p.returncode for p in self.procs] == [0, 0], self.stderr()


def _check_lost(before: Dict[int, int], after: Dict[int, int], cases: List[str]) -> None:
    """Every model restored to at most ``K`` steps before the last step a rank printed done."""
    assert set(after) == set(range(len(cases))), after
    for i, step in after.items():
        assert before.get(i, 0) - K <= step <= before.get(i, 0) + 1, (i, before, after)


def _check_match(job: Job, cases: List[str]) -> None:
    for r in (0, 1):
        got = {int(ln[1]): ln for ln in job.lines[r] if ln[:1] in (["MATCH"], ["DIFF"])}
        assert sorted(got) == list(range(len(cases))), (job.lines[r], job.stderr())
        bad = {cases[i]: ln[2:] for i, ln in got.items() if ln[0] != "MATCH"}
        assert not bad, f"rank {r} differs from the uninterrupted twin: {bad}"


CASES = ["row_wise:EXACT_SGD", "column_wise:EXACT_ROWWISE_ADAGRAD", "table_wise:EXACT_ADAGRAD"]


def test_restore_after_kills_inside_a_base_and_an_increment_is_bit_exact(tmp_path):
    """Killed inside model 0's ``dcp.save`` of the base at step 8 (data files written, no
    ``.metadata``): the restore passes over that base and restores every model from the base of
    step 0 and its increments, to step 6. Killed again inside model 0's increment write at step
    12 (rank 0's part written, not its header): the restore leaves that increment out, to step 9,
    and removes what was left. The run then ends bit-exact with an uninterrupted twin."""
    first = Job(tmp_path, CASES, TOTAL, 0, kill_at=f"base:{BASE_EVERY}")
    first.wait_killed()
    base8 = base_dir(str(tmp_path / "job" / "case-0" / "ckpt"), BASE_EVERY)
    assert os.path.isdir(base8) and not os.path.exists(os.path.join(base8, ".metadata"))
    second = Job(tmp_path, CASES, TOTAL, 1, kill_at="increment:2")
    second.wait_killed()
    assert second.restored() == {0: 6, 1: 6, 2: 6}, (second.lines, second.stderr())
    _check_lost(first.steps_done(), second.restored(), CASES)
    chain = latest_chain(str(tmp_path / "job" / "case-0" / "ckpt"))
    assert chain.base == base8 and chain.step == 9 and len(chain.leftovers) == 1, chain
    last = Job(tmp_path, CASES, TOTAL, 2)
    last.finish()
    assert last.restored()[0] == 9, last.lines
    _check_lost(second.steps_done(), last.restored(), CASES)
    assert latest_chain(str(tmp_path / "job" / "case-0" / "ckpt")).leftovers == []
    _check_match(last, CASES)


@pytest.mark.slow
def test_restore_after_random_kills_is_bit_exact_for_every_sharding_and_optimizer(tmp_path):
    """Every sharding (row-, column-, table-wise) with every fused optimizer (EXACT_SGD,
    EXACT_ADAGRAD, EXACT_ROWWISE_ADAGRAD), side by side: four runs SIGKILLed at random instants
    (inside bases and increments when they fall there), each restored; the last one ends
    bit-exact with the uninterrupted twins, and no restore lost more than K steps."""
    cases = [f"{s}:{o}" for s in ("row_wise", "column_wise", "table_wise")
             for o in ("EXACT_SGD", "EXACT_ADAGRAD", "EXACT_ROWWISE_ADAGRAD")]
    rng = random.Random(48)
    before: Dict[int, int] = {}
    for run in range(4):
        job = Job(tmp_path, cases, 40, run)
        job.kill_after(min(before.get(0, 0) + rng.randrange(1, 6), 36), rng)
        if run:
            _check_lost(before, job.restored(), cases)
        before = job.steps_done()
    last = Job(tmp_path, cases, 40, 4)
    last.finish()
    _check_lost(before, last.restored(), cases)
    _check_match(last, cases)


def test_every_tracking_mode_restores_bit_exact(tmp_path):
    """The tracker's other modes (its log holds embeddings or optimizer states besides the ids):
    EMBEDDING, MOMENTUM_LAST and ROWWISE_ADAGRAD, each with an optimizer it applies to, killed
    at a random instant, restored and trained on: bit-exact with the uninterrupted twins."""
    cases = ["row_wise:EXACT_SGD:EMBEDDING", "column_wise:EXACT_ADAGRAD:MOMENTUM_LAST",
             "table_wise:EXACT_ROWWISE_ADAGRAD:ROWWISE_ADAGRAD"]
    first = Job(tmp_path, cases, TOTAL, 0)
    first.kill_after(8, random.Random(49))  # model 0 at step 8: every model past its increment of step 3
    last = Job(tmp_path, cases, TOTAL, 1)
    last.finish()
    assert min(last.restored().values()) > 0, last.lines  # restored from increments, not the first base
    _check_lost(first.steps_done(), last.restored(), cases)
    _check_match(last, cases)


def test_a_base_of_another_plan_or_world_size_is_refused_with_a_typed_error(tmp_path):
    """Increments of a model whose tracker skips a sharded table are refused (its rows would be
    missing). A base of a column-wise table with row-wise Adagrad (its momentum one value per row and
    column shard) restored into a row-wise plan, or by one rank instead of two: every rank raises
    ShardLayoutError before anything is loaded, not DCP's ValueError."""
    (res0, res1) = run_spawn(other_plan_case, 2, str(tmp_path), timeout=240)
    for r, res in enumerate((res0, res1)):
        assert (res["row_wise"] or "").startswith("ShardLayoutError"), res
        assert "sharding plan" in res["row_wise"], res
        assert (res["skipped"] or "").startswith("InvalidInputError") and "table_1" in res["skipped"], res
    (one,) = run_spawn(other_world_case, 1, str(tmp_path), timeout=240)
    assert (one["column_wise"] or "").startswith("ShardLayoutError"), one
    assert "saved by 2 ranks and this job runs 1" in one["column_wise"], one
    # a fused optimizer whose step counter no state holds, managed-collision tables whose raw-id
    # maps no increment holds: refused, a restore would not be bit-exact
    (refused,) = run_spawn(refused_models_case, 1, str(tmp_path), timeout=240)
    ema, managed = refused["step_counter"] or "", refused["managed"] or ""
    assert ema.startswith("InvalidInputError") and "step counter" in ema and "t0" in ema, ema
    assert managed.startswith("InvalidInputError") and "managed-collision" in managed and "['sparse']" in managed, managed
