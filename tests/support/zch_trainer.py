"""One rank of a 2-rank managed-collision (MCH) trainer for the ZCH crash test.

Usage: python zch_trainer.py ROOT RANK PORT PHASE CKPT_DIR [SKIP_RESTORE]
* ``run``: a fresh model; after the step that completes batch 6 it saves a checkpoint (its MCH
  buffers, table shards, optimizer state and the tracker's state) and prints ``CKPT <batch>
  <map json>``; prints ``STEP <batch>`` after every step and trains until killed.
* ``restore``: loads the checkpoint into a fresh model, attaches, restores the tracker
  (``load_state_dict``; not with SKIP_RESTORE=1), prints ``RESTORED <batch of the re-delivery>``,
  trains 8 steps, prints ``MAP - <map json>`` and ``DONE``.
The batch fed at index b is a function of b. Map json: table name -> [[raw id, global slot], ...].
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import init_gloo  # noqa: E402
from torchrec.distributed.model_tracker.types import TrackingMode  # noqa: E402
from zch_cases import build_mc_model, mc_batches, mc_step, module_maps  # noqa: E402

from persistent_delta import PersistentTrackerConfig, attach

CKPT_AT = 6


def _mcms(dmp):
    for module in dmp.modules():
        mcms = getattr(getattr(module, "_managed_collision_collection", None), "_managed_collision_modules", None)
        if mcms is not None:
            yield from mcms.items()


def _map_json(dmp) -> str:
    return json.dumps({name: sorted(m.items()) for name, m in module_maps(dmp).items()})


def main() -> None:
    root, rank, port, phase, ckpt_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
    skip_restore = len(sys.argv) > 6 and sys.argv[6] == "1"
    init_gloo(rank, 2, port, timeout=60)
    dmp = build_mc_model(rank, 2, slots=32, eviction_interval=2)
    ckpt_path = os.path.join(ckpt_dir, f"ckpt-{rank}.pt")
    cfg = PersistentTrackerConfig(path=root, tracking_mode=TrackingMode.ID_ONLY, linger_steps=1)
    batches = mc_batches(rank, 2, 40, seed=9)
    if phase == "run":
        tracker = attach(dmp, cfg)
        while True:
            mc_step(dmp, batches[tracker.curr_batch_idx % 40])
            b = tracker.curr_batch_idx
            if b == CKPT_AT:
                state = {"mch": {n: {k: v.clone() for k, v in m.state_dict().items()} for n, m in _mcms(dmp)},
                         "tables": {f: (t.weights().detach().clone(), t.optimizer_state().detach().clone())
                                    for f, t in tracker.local_tables.items()},
                         "tracker": tracker.state_dict()}
                torch.save(state, ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
                print("CKPT", b, _map_json(dmp), flush=True)
            tracker.flush()
            print("STEP", b, flush=True)
            time.sleep(0.02)
    state = torch.load(ckpt_path, weights_only=False)
    for name, mcm in _mcms(dmp):
        mcm.load_state_dict(state["mch"][name])
    tracker = attach(dmp, cfg)
    with torch.no_grad():
        for fqn, (w, s) in state["tables"].items():
            tracker.local_tables[fqn].weights().copy_(w)
            tracker.local_tables[fqn].optimizer_state().copy_(s)
    if not skip_restore:
        tracker.load_state_dict(state["tracker"])
    print("RESTORED", tracker.curr_batch_idx, flush=True)  # the batch holding the re-delivery
    for _ in range(8):
        mc_step(dmp, batches[tracker.curr_batch_idx % 40])
    tracker.flush()
    print("MAP", "-", _map_json(dmp), flush=True)
    tracker.close()
    print("DONE", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
