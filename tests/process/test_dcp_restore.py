"""Checkpoints written with torch.distributed.checkpoint (DCP): ``dcp.save`` of
``{"model": dmp.state_dict()}`` on two gloo ranks, both ranks SIGKILLed, then a restart that
loads it the DCP way (the target from ``dmp.state_dict()``, ``dcp.load``,
``dmp.load_state_dict``). Each rank restores its own tracker state, building the load target
marks nothing in the log, and a replica reading the snapshots ends bit-exact with the trainer."""

import os
import random
import signal
import time

import pytest
import torch

from dcp_cases import other_world_case, refusals_case, saved_case
from harness import global_table_weights, run_spawn
from persistent_delta import DeltaConsumer, apply_poll
from procs import RankProcs

pytestmark = pytest.mark.dist

ROWS = 300  # dcp_trainer_ranks.ROWS


class Ranks(RankProcs):
    """The two trainer processes of one run, their stdout lines read as they come."""

    def __init__(self, tmp_path, steps: int, sharding: str, run: int) -> None:
        super().__init__("dcp_trainer_ranks.py",
                         lambda r, port: [str(tmp_path / "log"), str(r), str(port), str(steps), sharding,
                                          str(tmp_path / "out")],
                         str(tmp_path / f"stderr-{run}"))

    def wait_for(self, word: str, timeout: float = 180.0) -> list:
        """The first line starting with ``word`` of each rank; fails if a rank exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [next((ln for ln in lines if ln[:1] == [word]), None) for lines in self.lines]
            if all(found):
                return found
            assert all(p.poll() is None for p in self.procs), (word, self.lines, self.stderr())
            time.sleep(0.05)
        raise AssertionError(f"no {word} line in {timeout}s: {self.lines}\n{self.stderr()}")

    def kill(self, rng: random.Random) -> None:
        """SIGKILL both ranks, one first and the other a moment later; both must still be running."""
        assert all(p.poll() is None for p in self.procs), (self.lines, self.stderr())
        first = rng.randrange(2)
        self.procs[first].send_signal(signal.SIGKILL)
        time.sleep(rng.uniform(0.0, 0.2))
        self.procs[1 - first].send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait(timeout=60)


def _trainer_tables(out: str) -> dict:
    full: dict = {}
    for r in (0, 1):
        for fqn, (w, info) in torch.load(os.path.join(out, f"rank-{r}.pt")).items():
            t = full.setdefault(fqn, torch.zeros(info["global_rows"], info["global_cols"], dtype=w.dtype))
            t[info["row_offset"]:info["row_offset"] + w.shape[0], info["col_offset"]:info["col_offset"] + w.shape[1]] = w
    return full


@pytest.mark.parametrize("sharding", ["row_wise", "column_wise"])
def test_dcp_checkpoint_restores_each_rank_after_sigkill(tmp_path, sharding):
    """Two runs SIGKILLed at a random instant after a DCP checkpoint, each restart restoring the
    newest one with DCP, then a run that ends: no rank loads another's tracker state (it would
    stop at its first step with a ConfigMismatchError), building the load target leaves the
    checkpoint floor alone, every save marks its checkpoint, and a replica applying every
    publish from the initial tables holds the trainer's final tables bit for bit."""
    (tmp_path / "out").mkdir()
    rng = random.Random(17)
    for run in range(3):
        ranks = Ranks(tmp_path, 400 if run < 2 else 7, sharding, run)
        starts = ranks.wait_for("START")
        if run > 0:  # restored: the floor before the load target is the checkpoint's, and stays
            assert all(s[2] == s[3] and int(s[2]) >= 0 for s in starts), starts
        if run < 2:
            ranks.wait_for("SAVED")
            time.sleep(rng.uniform(0.1, 0.8))  # training on after the checkpoint
            ranks.kill(rng)
        else:
            for p in ranks.procs:
                p.wait(timeout=180)
            assert [p.returncode for p in ranks.procs] == [0, 0], (ranks.lines, ranks.stderr())
    tables = {f"sparse.embeddings.{name}": w for name, w in global_table_weights(2, ROWS, 8, seed=0).items()}
    with DeltaConsumer(str(tmp_path / "log"), "replica", channel="snapshots") as consumer:
        while True:
            poll = consumer.poll()
            if poll.empty:
                break
            apply_poll(tables, poll, complete_only=True)
            consumer.commit()
    want = _trainer_tables(str(tmp_path / "out"))
    assert set(want) == set(tables)
    bad = {fqn: int((w != tables[fqn]).any(dim=1).sum()) for fqn, w in want.items()}
    assert all(v == 0 for v in bad.values()), bad


def test_state_dict_marks_when_written_and_refuses_other_ranks_state(tmp_path):
    """``dmp.state_dict()`` holds one opaque value under a key of its rank's and marks nothing;
    writing it (``dcp.save``, ``torch.save``, ``dcp.async_save``) marks the checkpoint. On a restart, another rank's
    file and a DCP checkpoint without this rank's state are refused with a typed error (never
    loaded in its place), and a checkpoint in the older layout still restores."""
    out = str(tmp_path)
    saved = run_spawn(saved_case, 2, str(tmp_path / "log"), out, timeout=240)
    for r, s in enumerate(saved):
        assert s["keys"] == [f"persistent_delta_tracker.rank_{r}"], s
        assert s["value_type"] == "TrackerState", s
        assert s["floor_taken"] == s["floor_before"], s  # taking it marked nothing
        assert s["floor_dcp_saved"] == s["dcp_batch"] + 1, s
        assert s["floor_taken_again"] == s["floor_dcp_saved"], s
        assert s["floor_torch_saved"] == s["torch_batch"] + 1, s
        assert s["floor_async_saved"] == s["async_batch"] + 1, s
    loaded = run_spawn(refusals_case, 2, str(tmp_path / "log"), out, timeout=240)
    for r, res in enumerate(loaded):
        assert (res["other_rank_file"] or "").startswith("WorldSizeMismatchError"), res
        assert f"persistent_delta_tracker.rank_{1 - r}" in res["other_rank_file"], res
        assert "Missing key" in (res["dcp_strict"] or ""), res
        assert f"persistent_delta_tracker.rank_{r}" in res["dcp_strict"], res
        assert (res["dcp_partial"] or "").startswith("WorldSizeMismatchError"), res
        assert res["floor_after_targets"] == saved[r]["floor_async_saved"], res  # load targets marked nothing
        assert res["old_layout_unexpected"] == [] and res["old_layout_step"] is None, res
        assert res["after_step"] == res["last"] + 2, res  # the re-delivery batch, then the step


def test_restore_with_another_world_size_is_refused(tmp_path):
    """A DCP checkpoint of two ranks loaded by one: the model reshards, the tracker refuses its
    state (saved by a rank of another layout) at the first step, with a typed error."""
    out = str(tmp_path)
    run_spawn(saved_case, 2, str(tmp_path / "log"), out, timeout=240)
    (res,) = run_spawn(other_world_case, 1, str(tmp_path / "log"), out, timeout=240)
    assert (res["step"] or "").startswith("WorldSizeMismatchError"), res
    assert "world size 2" in res["step"], res
