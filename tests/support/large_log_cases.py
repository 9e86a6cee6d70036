"""A real EMBEDDING log whose reads gather more than 8 MiB per table, with empty records among
them (the window filter drops every row of a lookup whose ids were all recorded already)."""

from __future__ import annotations

from typing import Any, Dict

from torchrec.distributed.model_tracker.types import TrackingMode

from persistent_delta import PersistentTrackerConfig, attach

STEPS = 300


def large_embedding_log(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """Train ``tiny_trainer(rows=20000, dim=128, batch_size=512)`` for ``STEPS`` steps with
    consumers "trainer" and "serving"; return the trainer's own ``get_unique("trainer")``
    (global ids, states) per table, as every other reader must see it."""
    from examples.tiny_model import tiny_trainer

    dmp, batches = tiny_trainer(rows=20000, dim=128, batch_size=512)
    tracker = attach(dmp, PersistentTrackerConfig(path=root, tracking_mode=TrackingMode.EMBEDDING,
                                                  consumers=["trainer", "serving"]))
    for batch in batches(STEPS):
        dmp(batch).backward()
    tracker.flush()
    rows = tracker.get_unique("trainer")
    out = {fqn: (r.ids.clone(), r.states.clone()) for fqn, r in rows.items()}
    tracker.close()
    return out
