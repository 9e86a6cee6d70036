"""Per-rank body of the test of the publish's unread ids (module level, so spawned ranks can import it)."""

from __future__ import annotations

from typing import Any, Dict, List

from torchrec.distributed.model_tracker.types import TrackingMode

from harness import build_sharded_model, make_batches, train_step
from persistent_delta import DeltaConsumer, PersistentTrackerConfig, attach


def publish_vs_log_case(rank: int, world_size: int, root: str, mode_name: str) -> Dict[str, Any]:
    """Publish consumers ``a``, ``b`` (and ``c``, registered later) while their twins ``a_log``,
    ``b_log``, ``c_log`` read the same batches with ``get_unique`` (the consume rule on the log)
    at the same moments: each publish must carry exactly the twin's ids. Across publishes right
    after training (steps still queued for the writer), a publish with nothing new,
    ``delete_on_read`` retention, a checkpoint, a restart (the tracker rebuilt on the same log)
    and a restore from that checkpoint. A row-wise and a column-wise table."""
    mode = TrackingMode[mode_name]
    dmp = build_sharded_model(rank, world_size, "ec", "row_wise,column_wise", "EXACT_ROWWISE_ADAGRAD")
    cfg = PersistentTrackerConfig(tracking_mode=mode, consumers=["a", "a_log", "b", "b_log"], path=root,
                                  delete_on_read=True)
    t = attach(dmp, cfg)
    watch = DeltaConsumer(root, "watch", channel="snapshots", ranks=[rank])
    batches = make_batches("ec", 60, 8, seed=7, world_size=world_size, rank=rank)
    out: Dict[str, Any] = {"differ": [], "publishes": 0, "rows": 0, "log_reads": []}
    step = 0

    def train(n: int) -> None:
        nonlocal step
        for b in batches[step:step + n]:
            train_step(dmp, b)
        step += n

    def check(name: str, label: str) -> None:
        t.publish(name)
        t.flush()
        got: Dict[str, List[int]] = {}
        for d in watch.poll():
            if d.ids.numel():
                got.setdefault(d.fqn, []).extend(d.ids.tolist())
        watch.commit()
        want = {fqn: rows.ids.tolist() for fqn, rows in t.get_unique(f"{name}_log").items() if rows.ids.numel()}
        got = {fqn: sorted(ids) for fqn, ids in got.items()}
        out["publishes"] += 1
        out["rows"] += sum(len(v) for v in got.values())
        if got != want:
            out["differ"].append({"at": label, "consumer": name, "published": got, "log": want})
        offsets = t.per_consumer_batch_idx
        if offsets[name] != offsets[f"{name}_log"]:
            out["differ"].append({"at": label, "positions": offsets})

    train(3)
    check("a", "first publish of a")
    train(4)
    check("a", "a again")
    check("b", "first publish of b")
    check("a", "nothing new")
    train(2)
    check("a", "a after 2 steps")
    train(3)
    check("b", "b after 9 steps")
    ckpt = t.state_dict()
    train(3)
    check("a", "a after the checkpoint")
    out["log_reads"].append(t.stats()["publish_log_reads"])
    # restart: the tracker rebuilt on the same log, the consumers where they were
    t.close()
    t = attach(dmp, cfg)
    train(2)
    check("a", "a after the restart")
    train(3)
    check("a", "a again after the restart")
    check("b", "b after the restart")
    t.add_consumer("c", from_latest=True)
    t.add_consumer("c_log", from_latest=True)
    train(2)
    check("c", "first publish of c")
    train(4)
    check("a", "a after 4 steps")
    check("c", "c again")
    out["log_reads"].append(t.stats()["publish_log_reads"])
    # restore from the checkpoint: rows touched since are re-delivered to every consumer
    t.load_state_dict(ckpt)
    check("a", "a after the restore")
    train(3)
    check("a", "a again after the restore")
    check("b", "b after the restore")
    check("c", "c after the restore")
    train(2)
    check("b", "b again after the restore")
    out["log_reads"].append(t.stats()["publish_log_reads"])
    watch.close()
    t.close()
    return out
