"""The tracker's entry in a model state dict: one opaque value per rank that marks its
checkpoint when it is written (pickled), never when it is taken or copied; and which entry a
rank takes out of a loaded state dict (its own, or the older single key; never another
rank's)."""

import copy
import io
import pickle

import pytest
import torch

from persistent_delta.errors import ConfigMismatchError, WorldSizeMismatchError
from persistent_delta.trainer.restore import STATE_KEY, CheckpointMark, TrackerState, check_state, state_key, take_state

STATE = {"version": 2, "log_id": "L", "rank": 1, "world_size": 2, "tracking_mode": "embedding",
         "curr_batch_idx": 7, "offsets": {"serving": 3}}


def _live(marks: list) -> TrackerState:
    return TrackerState(STATE, CheckpointMark(marks.append, 7))


def _saved(value: object) -> object:
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # TrackerState is a safe global


def test_writing_marks_once_and_taking_or_copying_does_not():
    marks: list = []
    live = _live(marks)
    copies = [copy.copy(live), copy.deepcopy({"k": live})["k"]]  # DCP's async staging deep-copies
    assert marks == [] and not any(c.loaded for c in copies)
    back = _saved({"model": {state_key(1): copies[1]}})["model"][state_key(1)]
    assert marks == [7]  # the copy marked, for the tracker it came from
    assert isinstance(back, TrackerState) and back.loaded and back.state == STATE
    pickle.dumps(live)
    _saved(back)
    assert marks == [7]  # once: the copies share the mark, and a loaded state has none


def test_a_rank_takes_its_own_entry_and_every_tracker_key_out():
    sd = {"w": 1, state_key(0): TrackerState({**STATE, "rank": 0}), state_key(1): TrackerState(STATE)}
    assert take_state(sd, "", 1) == STATE
    assert sd == {"w": 1}  # nothing left to report as unexpected
    sd = {"p.w": 1, "p." + STATE_KEY: dict(STATE)}  # the layout before one key per rank
    assert take_state(sd, "p.", 1) == STATE and sd == {"p.w": 1}
    sd = {"w": 1}
    assert take_state(sd, "", 1) is None and sd == {"w": 1}


@pytest.mark.parametrize("entry", ["other rank", "None", "unloaded"])
def test_no_state_of_this_rank_is_refused(entry):
    sd = {"other rank": {state_key(0): TrackerState({**STATE, "rank": 0})},
          "None": {state_key(1): None},  # what DCP's allow_partial_load leaves
          "unloaded": {state_key(1): _live([])}}[entry]
    with pytest.raises(WorldSizeMismatchError, match="rank 1"):
        take_state(sd, "", 1)


def test_another_world_size_is_refused():
    assert issubclass(WorldSizeMismatchError, ConfigMismatchError)
    with pytest.raises(WorldSizeMismatchError, match="world size 2"):
        check_state(TrackerState(STATE), "L", 1, "embedding", "log/rank-1", world=4)
    assert check_state(TrackerState(STATE), "L", 1, "embedding", "log/rank-1", world=2) == 7
    old = {k: v for k, v in STATE.items() if k != "world_size"}  # saved before states recorded it
    assert check_state(old, "L", 1, "embedding", "log/rank-1", world=4) == 7
    with pytest.raises(ConfigMismatchError, match="rank 1"):
        check_state(TrackerState(STATE), "L", 0, "embedding", "log/rank-0", world=2)
