"""Per-rank bodies of the torch.distributed.checkpoint (DCP) tests of the tracker's state in
``dmp.state_dict()`` (module level, so spawned ranks can import them).

``saved_case`` trains and saves (DCP and ``torch.save``) and reports the log's checkpoint floor
around each step; the load cases start again on the same log and load what it saved in the
ways that must fail loudly, and in the layout of older checkpoints, which must still load.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torchrec.distributed.model_tracker.types import TrackingMode

from harness import build_sharded_model, make_batches, train_step
from persistent_delta import PersistentTrackerConfig, attach
from persistent_delta.log import position_rules
from persistent_delta.trainer.restore import STATE_KEY, TrackerState, state_key


def _config(root: str) -> PersistentTrackerConfig:
    return PersistentTrackerConfig(tracking_mode=TrackingMode.EMBEDDING, path=root)


def _floor(tracker: Any) -> Optional[int]:
    return tracker.log.read(position_rules.checkpoint_floor)


def _error(fn: Any) -> Optional[str]:
    """``"<type>: <message>"`` of what ``fn()`` raises, None if nothing."""
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the test reads the type (DCP's CheckpointException is one)
        return f"{type(exc).__name__}: {exc}"
    return None


def saved_case(rank: int, world_size: int, root: str, out: str) -> Dict[str, Any]:
    """Train 3 steps; take ``dmp.state_dict()`` (the floor must not move) and ``dcp.save`` it to
    ``out/dcp`` (now it must), the same without the tracker's key to ``out/dcp-untracked``;
    train 2 more steps, ``torch.save(dmp.state_dict())`` to ``out/ckpt.<rank>`` (it must mark; its tracker entry
    alone to ``out/tracker.<rank>``);
    train 2 more, ``dcp.async_save`` the tracker's entry to ``out/dcp-async`` (its staged copy
    marks)
    and close. Returns the floors and the state dict's tracker keys."""
    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_SGD")
    batches = make_batches("ec", 12, 8, seed=9, world_size=world_size, rank=rank)
    t = attach(dmp, _config(root))
    for b in batches[:3]:
        train_step(dmp, b)
    out_: Dict[str, Any] = {"floor_before": _floor(t)}
    sd = dmp.state_dict()
    out_["keys"] = sorted(k for k in sd if k.startswith(STATE_KEY))
    out_["value_type"] = type(sd[state_key(rank)]).__name__
    out_["floor_taken"] = _floor(t)
    dcp.save({"model": sd}, checkpoint_id=os.path.join(out, "dcp"))
    out_["dcp_batch"], out_["floor_dcp_saved"] = t.curr_batch_idx, _floor(t)
    untracked = {k: v for k, v in dmp.state_dict().items() if not k.startswith(STATE_KEY)}
    dcp.save({"model": untracked}, checkpoint_id=os.path.join(out, "dcp-untracked"))
    for b in batches[3:5]:
        train_step(dmp, b)
    sd = dmp.state_dict()
    out_["floor_taken_again"] = _floor(t)
    torch.save(sd, os.path.join(out, f"ckpt.{rank}"))
    torch.save({k: v for k, v in sd.items() if k.startswith(STATE_KEY)}, os.path.join(out, f"tracker.{rank}"))
    out_["torch_batch"], out_["floor_torch_saved"] = t.curr_batch_idx, _floor(t)
    for b in batches[5:7]:
        train_step(dmp, b)
    # the tracker's entry alone: DCP's async staging (torch 2.13) cannot copy TorchRec's ShardedTensors
    entry = {k: v for k, v in dmp.state_dict().items() if k.startswith(STATE_KEY)}
    future = dcp.async_save({"model": entry}, checkpoint_id=os.path.join(out, "dcp-async"))
    out_["async_batch"] = t.curr_batch_idx
    future.result()  # staged (a copy of the entry) and written on DCP's thread: that copy marked
    out_["floor_async_saved"] = _floor(t)
    t.close()
    return out_


def refusals_case(rank: int, world_size: int, root: str, out: str) -> Dict[str, Any]:
    """Start again on ``saved_case``'s log with as many ranks, and load what it saved wrongly:
    the other rank's ``torch.save`` file; the untracked DCP checkpoint into a target that asks
    for the tracker's key (strict: DCP refuses; ``allow_partial_load``: the tracker refuses the
    target's own, unloaded state). Then load this rank's file in the layout of older
    checkpoints (the tracker's dict under ``"persistent_delta_tracker"``) and take a step:
    that restore must go through. Returns each error (None: none) and the batch indices."""
    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_SGD", seed=1)
    batches = make_batches("ec", 12, 8, seed=9, world_size=world_size, rank=rank)
    t = attach(dmp, _config(root))
    res: Dict[str, Any] = {"last": t.curr_batch_idx}
    # the other rank's file (its tracker's entry: its tables' shards load on their own rank only)
    other = torch.load(os.path.join(out, f"tracker.{1 - rank}"), weights_only=True)  # a safe global
    res["other_rank_file"] = _error(lambda: dmp.load_state_dict(other))
    target = {"model": dmp.state_dict()}
    res["dcp_strict"] = _error(lambda: dcp.load(target, checkpoint_id=os.path.join(out, "dcp-untracked")))
    target = {"model": dmp.state_dict()}
    dcp.load(target, checkpoint_id=os.path.join(out, "dcp-untracked"),
             planner=DefaultLoadPlanner(allow_partial_load=True))
    res["dcp_partial"] = _error(lambda: dmp.load_state_dict(target["model"]))
    res["floor_after_targets"] = _floor(t)
    old = torch.load(os.path.join(out, f"ckpt.{rank}"), weights_only=False)
    value = old.pop(state_key(rank))
    assert isinstance(value, TrackerState) and value.loaded
    old[STATE_KEY] = value.state  # as checkpoints before one key per rank held it
    res["old_layout_unexpected"] = list(dmp.load_state_dict(old).unexpected_keys)
    res["old_layout_step"] = _error(lambda: train_step(dmp, batches[7]))
    res["after_step"] = t.curr_batch_idx
    t.close()
    return res


def other_world_case(rank: int, world_size: int, root: str, out: str) -> Dict[str, Any]:
    """Start again on ``saved_case``'s log with another world size and restore its DCP
    checkpoint: the model loads (DCP reshards it), and the tracker refuses at the first step."""
    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_SGD", seed=1)
    batches = make_batches("ec", 12, 8, seed=9, world_size=world_size, rank=rank)
    t = attach(dmp, _config(root))
    target = {"model": dmp.state_dict()}
    dcp.load(target, checkpoint_id=os.path.join(out, "dcp"))
    dmp.load_state_dict(target["model"])
    res = {"step": _error(lambda: train_step(dmp, batches[0]))}
    t.close()
    return res
