"""Per-rank bodies of the tests of what bases and increments refuse (module level, so spawned
ranks can import them): a base of another sharding plan or world size than the job's, and a
sharded table the tracker skips."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

from harness import build_sharded_model, make_batches, train_step
from torchrec.distributed.model_tracker.types import TrackingMode

from persistent_delta import PersistentTrackerConfig, attach
from persistent_delta.log.deltalog import DeltaLog
from persistent_delta.trainer.increments import Checkpoints


def _restore_error(rank: int, world_size: int, root: str, sharding: str, log: str) -> Optional[str]:
    """Build a model sharded ``sharding`` with a tracker on ``log`` and restore from ``root``:
    ``"<type>: <message>"`` of what the restore raises (None: nothing)."""
    dmp = build_sharded_model(rank, world_size, "ec", sharding, "EXACT_ROWWISE_ADAGRAD")
    tracker = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, path=log))
    checkpoints = Checkpoints(dmp, None, root)
    try:
        checkpoints.restore()
    except Exception as exc:  # noqa: BLE001 - the test reads the type
        return f"{type(exc).__name__}: {exc}"
    finally:
        checkpoints.close()
        tracker.close()
    return None


def other_plan_case(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """Take a base of a column-wise model (row-wise Adagrad) after 2 steps; then restore it
    into a row-wise one. And build Checkpoints for a model whose tracker skips a table."""
    dmp = build_sharded_model(rank, world_size, "ec", "column_wise", "EXACT_ROWWISE_ADAGRAD")
    tracker = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, path=os.path.join(root, "log")))
    checkpoints = Checkpoints(dmp, None, os.path.join(root, "ckpt"))
    for batch in make_batches("ec", 2, 8, seed=3, world_size=world_size, rank=rank):
        train_step(dmp, batch)
    checkpoints.save_base()
    checkpoints.close()
    tracker.close()
    out = {"row_wise": _restore_error(rank, world_size, os.path.join(root, "ckpt"), "row_wise",
                                      os.path.join(root, "log-row-wise"))}
    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_SGD")
    tracker = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, path=os.path.join(root, "log-skip"),
                                                  fqns_to_skip=["table_1"]))
    try:
        Checkpoints(dmp, None, os.path.join(root, "ckpt-skip"))
        out["skipped"] = None
    except Exception as exc:  # noqa: BLE001 - the test reads the type
        out["skipped"] = f"{type(exc).__name__}: {exc}"
    tracker.close()
    return out


def other_world_case(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """Restore ``other_plan_case``'s base with its plan but another world size."""
    return {"column_wise": _restore_error(rank, world_size, os.path.join(root, "ckpt"), "column_wise",
                                          os.path.join(root, "log-one-rank"))}


def refused_models_case(rank: int, world_size: int, root: str) -> Dict[str, Optional[str]]:
    """Checkpoints for a model whose fused optimizer keeps a step counter, and for one with
    managed-collision tables: ``"<type>: <message>"`` of what each raises (None: nothing)."""
    from zch_cases import build_mc_model

    dmp = build_mc_model(rank, world_size)
    tracker = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, path=os.path.join(root, "log-mc")))
    try:
        Checkpoints(dmp, None, os.path.join(root, "ckpt-mc")).close()
        managed = None
    except Exception as exc:  # noqa: BLE001 - the test reads the type
        managed = f"{type(exc).__name__}: {exc}"
    tracker.close()
    return {"step_counter": _step_counter(root), "managed": managed}


def _step_counter(root: str) -> Optional[str]:
    """Checkpoints for a model whose fused optimizer keeps a step counter (EMA in-place row-wise
    Adagrad, FBGEMM's ``iter``): ``"<type>: <message>"`` of what it raises (None: nothing)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder

    from examples import tiny_model

    class EmaSharder(EmbeddingCollectionSharder):
        def __init__(self, fused_params: Optional[Dict[str, Any]] = None, **kw: Any) -> None:
            super().__init__(fused_params={**(fused_params or {}), "optimizer": EmbOptimType.EMAINPLACE_ROWWISE_ADAGRAD},
                             **kw)

    tiny_model.EmbeddingCollectionSharder = EmaSharder  # type: ignore[misc]  # the example's model, this optimizer
    dmp, _ = tiny_model.tiny_trainer()
    tracker = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, path=os.path.join(root, "log-ema")))
    try:
        Checkpoints(dmp, None, os.path.join(root, "ckpt-ema")).close()
        return None
    except Exception as exc:  # noqa: BLE001 - the test reads the type
        return f"{type(exc).__name__}: {exc}"
    finally:
        path = tracker.path
        tracker.close()
        with DeltaLog(path, readonly=True) as log:  # refused: it registered no consumer holding back retention
            assert sorted(log.read(lambda r: r.consumers())) == ["default"], log.read(lambda r: r.consumers())
