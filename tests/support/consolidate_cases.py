"""Rank functions (for ``harness.run_spawn``) of the consolidate tests: a 2-rank job writes a
base and increments of several real sharded TorchRec models, and a plain TorchRec job (no
tracker, no persistent_delta) loads a base into fresh models with ``dcp.load``."""

from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from harness import build_sharded_model, make_batches, train_step, use_dense_optimizer
from torchrec.distributed.model_tracker.types import TrackingMode
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

ROWS, BATCH, K = 100, 16, 3


def build(rank: int, case: str) -> Any:
    """A DMP of 2 EC tables sharded and optimized as ``case`` (``<sharding>:<fused optimizer>``)
    and its dense Adam (a ``KeyedOptimizerWrapper``)."""
    sharding, optimizer = case.split(":")
    dmp = build_sharded_model(rank, 2, "ec", sharding, optimizer, rows=ROWS)
    params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    dense = KeyedOptimizerWrapper(params, lambda ps: torch.optim.Adam(ps, lr=0.01))
    use_dense_optimizer(dmp, dense)
    return dmp, dense


def local_state(dmp: Any, dense: Any) -> Dict[str, Any]:
    """Every tensor of this rank a restore must give back: local shards of the model (and
    dense parameters), the fused optimizer's state and the dense optimizer's."""
    out: Dict[str, Any] = {}

    def local(t: Any) -> Any:
        if hasattr(t, "local_shards"):
            return [s.tensor.clone() for s in t.local_shards()]
        return t.detach().clone() if isinstance(t, torch.Tensor) else t

    for k, v in dmp.state_dict().items():
        if isinstance(v, torch.Tensor):
            out["model." + k] = local(v)
    for k, v in dmp.fused_optimizer.state_dict()["state"].items():
        for name, t in v.items():
            out[f"fused.{k}.{name}"] = local(t)
    for k, v in dense.state_dict()["state"].items():
        for name, t in v.items():
            out[f"dense.{k}.{name}"] = local(t)
    return out


def train_with_increments(rank: int, world_size: int, root: str, cases: List[str], steps: int,
                          base_at: int = 0) -> List[Dict[str, Any]]:
    """Train each model ``steps`` steps with ``Checkpoints`` (a base at step ``base_at``, an
    increment every ``K`` steps and one at the end); return each model's state at the end (the
    last increment's)."""
    from persistent_delta import PersistentTrackerConfig, attach
    from persistent_delta.trainer.increments import Checkpoints

    batches = make_batches("ec", steps, BATCH, seed=5, world_size=world_size, rank=rank, rows=ROWS)
    out = []
    for i, case in enumerate(cases):
        dmp, dense = build(rank, case)
        tracker = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, path=f"{root}/case-{i}/log"))
        ckpt = Checkpoints(dmp, dense, f"{root}/case-{i}/ckpt", every=K)
        for step, batch in enumerate(batches):
            if step == base_at:
                ckpt.save_base()
            train_step(dmp, batch)
        ckpt.save_increment()
        ckpt.close()
        out.append(local_state(dmp, dense))
        tracker.close()
    return out


def load_plain(rank: int, world_size: int, bases: List[str], cases: List[str]) -> List[Dict[str, Any]]:
    """Load each base into a fresh model with TorchRec and DCP alone (no tracker): ``dcp.load``
    of ``{"model", "fused", "dense"}`` (each optimizer when the checkpoint holds its state), then
    ``load_state_dict``; return each model's state."""
    out = []
    for base, case in zip(bases, cases):
        dmp, dense = build(rank, case)
        stored = {k.split(".", 1)[0] for k in FileSystemReader(base).read_metadata().state_dict_metadata}
        target: Dict[str, Any] = {"model": dmp.state_dict()}
        if "dense" in stored:
            dense.init_state()
            target["dense"] = dense.state_dict()
        if "fused" in stored:
            target["fused"] = dmp.fused_optimizer.state_dict()
        dcp.load(target, checkpoint_id=base)
        dmp.load_state_dict(target["model"])
        if "fused" in target:
            dmp.fused_optimizer.load_state_dict(target["fused"])
        if "dense" in target:
            dense.load_state_dict(target["dense"])
        out.append(local_state(dmp, dense))
    return out


def restore_with_checkpoints(rank: int, world_size: int, root: str, cases: List[str]) -> List[Any]:
    """A restarted trainer: fresh models, trackers attached to the job's logs again, and
    ``Checkpoints.restore()``; return each model's (step restored to, state)."""
    from persistent_delta import PersistentTrackerConfig, attach
    from persistent_delta.trainer.increments import Checkpoints

    out: List[Any] = []
    for i, case in enumerate(cases):
        dmp, dense = build(rank, case)
        tracker = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, path=f"{root}/case-{i}/log"))
        ckpt = Checkpoints(dmp, dense, f"{root}/case-{i}/ckpt", every=K)
        step = ckpt.restore()
        ckpt.close()
        out.append((step, local_state(dmp, dense)))
        tracker.close()
    return out
