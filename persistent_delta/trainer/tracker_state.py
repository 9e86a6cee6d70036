"""The tracker's state across restarts and model checkpoints on one rank.

Owns: what :class:`~persistent_delta.trainer.tracker.PersistentDeltaTracker` does with its log
when it opens (:func:`resume`) and closes (:func:`close_batches`), and in ``state_dict`` and
``load_state_dict`` (:class:`TrackerCheckpoints`), on the rules of
:mod:`persistent_delta.trainer.restore` (the state's fields, the checkpoint mark, the agreement
between ranks, the re-delivery); and what is due before the first step: the restore a
``dmp.load_state_dict`` brought, or the warning to give when none came although the log runs
past its latest checkpoint.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torchrec.distributed.model_tracker.model_delta_tracker import UPDATE_MODE_MAP
from torchrec.distributed.model_tracker.types import TrackingMode

from persistent_delta.errors import LogClosedError
from persistent_delta.log import position_rules
from persistent_delta.log.deltalog import DeltaLog, WriteTxn
from persistent_delta.log.lmdbenv import ConsumerClaims
from persistent_delta.log.schema import META_CLOSED_END, META_CURR_BATCH, TrackerMeta
from persistent_delta.trainer import restore
from persistent_delta.trainer.sharding import LocalTable
from persistent_delta.trainer.window import WindowFilter
from persistent_delta.trainer.zch_capture import ZchCapture


def resume(log: DeltaLog, claims: ConsumerClaims, want: TrackerMeta, shards: Dict[str, Dict[str, Any]],
           consumers: List[str], fresh: bool, shapes: Dict[str, Dict[str, Any]]) -> Tuple[int, Dict[str, torch.Tensor]]:
    """Open the tracker's log (:func:`~.restore.open_tracker_log`), agree with the other ranks
    where to continue (:func:`~.restore.resume_at`, a collective) and claim ``consumers``;
    on failure, release the claims and close the log. Returns the batch index to continue at
    and fqn -> ids of the batches the restart dropped (a restore re-delivers them)."""
    dropped: Dict[str, torch.Tensor] = {}
    try:
        start = restore.resume_at(log, *log.write(
            lambda w: restore.open_tracker_log(w, want, shards, consumers, fresh, shapes)), dropped_ids=dropped)
        for c in consumers:
            claims.claim(c, "track it")
    except BaseException:
        claims.release_all()
        log.close()
        raise
    return start, dropped


def close_batches(w: WriteTxn, end: int) -> None:
    """At close: every batch below ``end`` (the open one included) is complete, and so are its publishes."""
    w.set_meta(META_CLOSED_END, end)
    position_rules.close_stamps(w)


class TrackerCheckpoints:
    """One tracker's checkpoints: takes its state, marks checkpoints in its log, restores.

    Thread-safety: the training thread calls every method, except :meth:`mark` (any thread: a
    DCP writer's, when the state is written). The tracker commits what it recorded before
    :meth:`state` and :meth:`restore`.

    Args:
        log: this rank's log.
        path: its directory, as messages name it.
        rank: this rank.
        mode: the tracking mode.
        tables: fqn -> this rank's shard of each tracked table (a restore reads their states).
        zch: the managed-collision tables' capture (a mark rebases their raw-id map; a restore
            re-delivers their slots).
        window: the writer's window filter (reset when a restore rewrites the log).
        dropped_ids: fqn -> ids of the batches the (re)start dropped
            (:func:`~persistent_delta.trainer.restore.resume_at`), re-delivered by a restore.
    """

    def __init__(self, log: DeltaLog, path: str, rank: int, mode: TrackingMode, tables: Dict[str, LocalTable],
                 zch: ZchCapture, window: WindowFilter, dropped_ids: Dict[str, torch.Tensor]) -> None:
        self._log, self._path, self._rank, self._mode = log, path, rank, mode
        self._tables, self._zch, self._window = tables, zch, window
        self._dropped_ids = dropped_ids
        # a restore the first step must see (dmp.load_state_dict), or a warning that it never came
        self.pending: Optional[Dict[str, Any]] = None
        self._unrestored = log.read(restore.unrestored)
        self._hooks: List[Any] = []

    @property
    def due(self) -> bool:
        """Whether :meth:`first_step` has something to do before the next step."""
        return self.pending is not None or self._unrestored is not None

    def hook(self, model: nn.Module, save: Callable[[], restore.TrackerState],
             load: Callable[[Dict[str, Any]], None]) -> None:
        """Make the tracker's state part of ``model``'s state dict (:func:`~.restore.hook_model_state`)."""
        self._hooks = restore.hook_model_state(model, self._rank, save, load)

    def unhook(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def state(self, curr_batch_idx: int) -> Dict[str, Any]:
        """The state a checkpoint taken at ``curr_batch_idx`` holds; marks nothing."""
        info = self._log.read(restore.checkpoint_info)
        return {"version": restore.STATE_VERSION, "log_id": info["log_id"], "rank": self._rank,
                "world_size": restore.world_size(), "tracking_mode": self._mode.value,
                "curr_batch_idx": curr_batch_idx, "offsets": info["offsets"]}

    def model_state(self, curr_batch_idx: int) -> restore.TrackerState:
        """What ``dmp.state_dict()`` carries: :meth:`state`, which marks the checkpoint once written."""
        return restore.TrackerState(self.state(curr_batch_idx), restore.CheckpointMark(self.mark, curr_batch_idx))

    def mark(self, batch: int) -> None:
        """Mark a checkpoint of ``batch`` in the log, durably (any thread: a DCP writer's).

        Raises:
            LogClosedError: the tracker was closed (its log with it).
        """
        if self._log.closed:
            raise LogClosedError(f"{self._path}: the tracker was closed before its state was saved, so the checkpoint "
                                 "cannot be marked; save dmp.state_dict() before tracker.close()")
        self._zch.rebase()  # a replica that starts after the checkpoint gets the whole raw-id map
        self._log.write(lambda w: restore.mark_checkpoint(w, batch))
        self._log.flush()

    def restore(self, state: Dict[str, Any], curr_batch_idx: int) -> Tuple[int, Dict[str, int]]:
        """Restore ``state`` (see ``PersistentDeltaTracker.load_state_dict``), the tracker being at
        ``curr_batch_idx``: a collective with a process group. Returns the batch index to
        continue at and fqn -> rows re-delivered.

        Raises:
            ConfigMismatchError, WorldSizeMismatchError, OffsetOutOfRangeError: as
                ``load_state_dict``.
        """
        self.pending = self._unrestored = None
        log_id = self._log.read(lambda r: r.meta("log_id"))
        ckpt = restore.check_state(state, log_id, self._rank, self._mode.value, self._path, restore.world_size())
        # A kill can leave ranks one step apart: all continue from the same batch index.
        dropped, any_dropped = restore.share_dropped_ids(self._tables, self._dropped_ids)  # (before the agreement)
        self._dropped_ids = {}
        last, gen = restore.agree_batch_idx(self._log, curr_batch_idx)
        if ckpt >= last and not any_dropped:
            self._log.write(lambda w: w.set_meta(META_CURR_BATCH, ckpt))
            return ckpt, {}
        # (a restart that dropped lookups of the checkpoint's batch: their rows are re-delivered all the same)
        last = max(last, ckpt)
        update_mode = UPDATE_MODE_MAP[self._mode]
        redelivered = self._log.write(
            lambda w: restore.redeliver(w, self._mode, update_mode, self._tables, ckpt, last, self._zch.redeliver, gen,
                                        dropped))
        self._window.reset()
        self._log.flush()
        return last + 1, redelivered

    def first_step(self, load: Callable[[Dict[str, Any]], Any]) -> Optional[str]:
        """Before the first step: ``load`` the state a ``dmp.load_state_dict`` brought (now that
        the optimizer state is loaded too); or, when the log runs past the latest checkpoint and
        nothing restored the tracker, return the warning to give (once)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            load(pending)
            return None
        floor, last = self._unrestored or (0, 0)
        self._unrestored = None
        return (f"{self._path}: the log holds batches {floor}..{last} recorded after the latest model checkpoint "
                f"(taken at batch {floor - 1}) and training continues without a tracker restore: if the model was "
                "restored from that checkpoint, every replica keeps the rows of those lost steps. Restore the tracker "
                "with the model: dmp.load_state_dict(checkpoint) with a checkpoint from dmp.state_dict() (it carries "
                "the tracker's state), or tracker.load_state_dict(state) before the first step")


__all__ = ["TrackerCheckpoints", "close_batches", "resume"]
