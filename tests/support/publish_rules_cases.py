"""Per-rank bodies of the tests of publish's rules: a consumer reads or publishes, and the
ranks' publishes (module level, so spawned ranks can import them)."""

from __future__ import annotations

import warnings
from typing import Any, Dict

from torchrec.distributed.model_tracker.types import TrackingMode

from harness import build_sharded_model, make_batches, train_step
from persistent_delta import PersistentTrackerConfig, attach
from persistent_delta.errors import ConsumerRoleError


def _refused(call: Any) -> str:
    try:
        call()
    except ConsumerRoleError as exc:
        return str(exc)
    return ""


def role_case(rank: int, world_size: int, root: str) -> Dict[str, Any]:
    """``get_unique`` then ``publish`` of one consumer, and the reverse, across a restart; and
    the documented path (one consumer reads, another publishes), with warnings as errors."""
    dmp = build_sharded_model(rank, world_size, "ec", "row_wise", "EXACT_SGD")
    batches = make_batches("ec", 8, 8, seed=5, world_size=world_size, rank=rank)
    cfg = PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["mixed", "pub", "ckpt", "serving"],
                                  path=root)
    t = attach(dmp, cfg)
    out: Dict[str, Any] = {}
    for b in batches[:2]:
        train_step(dmp, b)
    read = t.get_unique("mixed")
    out["read_rows"] = sum(int(r.ids.numel()) for r in read.values())
    out["publish_after_read"] = _refused(lambda: t.publish("mixed"))
    t.publish("pub")
    out["read_after_publish"] = _refused(lambda: t.get_unique("pub"))
    t.close()
    t = attach(dmp, cfg)  # the roles are in the log: a restarted trainer refuses the same mixes
    train_step(dmp, batches[2])
    out["read_after_restart"] = _refused(lambda: t.get_unique("pub"))
    out["publish_after_restart"] = _refused(lambda: t.publish("mixed"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        published = 0
        for b in batches[3:]:
            train_step(dmp, b)
            t.get_unique("ckpt")
            published += sum(t.publish("serving").values())
        out["documented_published"] = published
    t.remove_consumer("pub")  # a consumer's role changes by registering it again
    t.add_consumer("pub")
    t.get_unique("pub")
    out["reregistered_reads"] = True
    t.close()
    return out
