"""One rank of a 2-rank job that trains several models side by side, each with a tracker, a
dense Adam (a TorchRec ``KeyedOptimizerWrapper``) and ``Checkpoints`` taking an increment every
``K`` steps and a base every ``BASE_EVERY`` steps; started again, it restores each model with
the one call and trains on.

Usage: python increments_trainer_ranks.py ROOT RANK PORT TOTAL CASE [CASE ...]

A CASE is ``<sharding>:<fused optimizer>`` (an EC of 2 tables, both sharded so). Model i keeps
its log in ``ROOT/case-i/log`` and its bases in ``ROOT/case-i/ckpt``. With no base there yet,
it takes one at step 0; else it restores (prints ``RESTORED i <step>``). It trains every model
to step TOTAL on the same batches (the learning rates decaying every step), printing ``STEP i <steps done>`` after each step. At the end
it builds an uninterrupted twin of each model in this process (same threads), trains it to
TOTAL, and prints ``MATCH i`` or ``DIFF i <what differs>``, then ``DONE``.

``PD_KILL_AT``: ``base:<step>`` kills this process (SIGKILL) inside DCP's save of model 0's
base at that step (after the data files, before ``.metadata``: what a kill there leaves);
``increment:<step>``: inside the write of model 0's increment part at that step, after the
part file and before its header.
"""

import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import build_sharded_model, init_gloo, make_batches, train_step, use_dense_optimizer  # noqa: E402
from torch.distributed.checkpoint.filesystem import FileSystemWriter  # noqa: E402
from torchrec.distributed.model_tracker.types import TrackingMode  # noqa: E402
from torchrec.optim.keyed import KeyedOptimizerWrapper  # noqa: E402
from torchrec.optim.optimizers import in_backward_optimizer_filter  # noqa: E402

from persistent_delta import PersistentTrackerConfig, attach  # noqa: E402
from persistent_delta.checkpoint import format as fmt  # noqa: E402
from persistent_delta.checkpoint.chain import list_bases  # noqa: E402
from persistent_delta.trainer.increments import Checkpoints  # noqa: E402

K, BASE_EVERY, ROWS, BATCH = 3, 8, 100, 16


def dense_adam(dmp):  # type: ignore[no-untyped-def]
    params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    opt = KeyedOptimizerWrapper(params, lambda ps: torch.optim.Adam(ps, lr=0.01))
    use_dense_optimizer(dmp, opt)
    return opt


def build(rank: int, case: str):  # type: ignore[no-untyped-def]
    """``case``: ``sharding:optimizer[:tracking mode]`` (the mode is the tracker's, ID_ONLY by default)."""
    sharding, optimizer = case.split(":")[:2]
    dmp = build_sharded_model(rank, 2, "ec", sharding, optimizer, rows=ROWS)
    return dmp, dense_adam(dmp)


def step(dmp, dense, batch) -> None:  # type: ignore[no-untyped-def]
    """A training step, then a learning-rate decay of both optimizers (as a scheduler's): a
    restore must bring back their param_groups too."""
    train_step(dmp, batch)
    for opt in (dense, dmp.fused_optimizer):
        for group in opt.param_groups:
            group["lr"] *= 0.9
    dmp.fused_optimizer.zero_grad()  # TorchRec's fused optimizer hands its lr to the TBE here


def final_state(dmp, dense) -> dict:  # type: ignore[no-untyped-def]
    """Every tensor a continued run must match: the model's local state (shards, dense
    parameters), the fused optimizer's state and the dense optimizer's."""
    out = {}
    for k, v in dmp.state_dict().items():
        if isinstance(v, torch.Tensor):
            local = v.local_shards() if hasattr(v, "local_shards") else None
            out["model." + k] = [s.tensor.clone() for s in local] if local is not None else v.detach().clone()
    for k, v in dmp.fused_optimizer.state_dict()["state"].items():
        for name, t in v.items():
            local = t.local_shards() if hasattr(t, "local_shards") else None
            out[f"fused.{k}.{name}"] = [s.tensor.clone() for s in local] if local is not None else t
    for k, v in dense.state_dict()["state"].items():
        for name, t in v.items():
            out[f"dense.{k}.{name}"] = t.clone() if isinstance(t, torch.Tensor) else t
    return out


def differences(a: dict, b: dict) -> list:
    if set(a) != set(b):
        return [f"keys {sorted(set(a) ^ set(b))}"]
    bad = []
    for k in a:
        x, y = a[k], b[k]
        xs, ys = (x, y) if isinstance(x, list) else ([x], [y])
        if not all(torch.equal(p, q) if isinstance(p, torch.Tensor) else p == q for p, q in zip(xs, ys)):
            bad.append(k)
    return bad


def install_kill(where: str, at: int, root0: str) -> None:
    """SIGKILL this process inside model 0's save of the base of step ``at`` (``base``), or
    inside the write of its ``at``-th increment part of this run (``increment``)."""
    if where == "base":
        original = FileSystemWriter.finish
        target = fmt.base_dir(root0, at)

        def finish(self, metadata, results):  # type: ignore[no-untyped-def]
            if os.path.abspath(str(self.path)) == os.path.abspath(target):
                os.kill(os.getpid(), signal.SIGKILL)  # the data files are written, .metadata is not
            return original(self, metadata, results)

        FileSystemWriter.finish = finish  # type: ignore[method-assign]
        return
    original_write, parts = fmt.atomic_write_chunks, [0]

    def write(path: str, chunks: Any) -> None:
        original_write(path, chunks)
        if path.startswith(root0) and path.endswith(fmt.PART_SUFFIX):
            parts[0] += 1
            if parts[0] == at:
                os.kill(os.getpid(), signal.SIGKILL)  # the part is durable, its header is not written

    fmt.atomic_write_chunks = write  # type: ignore[assignment]


def main() -> None:
    root, rank, port, total, cases = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
    init_gloo(rank, 2, port, timeout=60)
    models, ckpts, steps = [], [], []
    for i, case in enumerate(cases):
        dmp, dense = build(rank, case)
        mode = TrackingMode[case.split(":")[2]] if case.count(":") == 2 else TrackingMode.ID_ONLY
        tracker = attach(dmp, PersistentTrackerConfig(tracking_mode=mode, path=f"{root}/case-{i}/log"))
        ckpt = Checkpoints(dmp, dense, f"{root}/case-{i}/ckpt", every=K)
        if list_bases(ckpt.root):
            steps.append(ckpt.restore())
            print("RESTORED", i, steps[-1], flush=True)
        else:
            ckpt.save_base()
            steps.append(0)
        models.append((dmp, dense, tracker))
        ckpts.append(ckpt)
    kill = os.environ.get("PD_KILL_AT")
    if kill:
        where, at = kill.split(":")
        install_kill(where, int(at), f"{root}/case-0/ckpt")
    batches = make_batches("ec", total, BATCH, seed=5, world_size=2, rank=rank, rows=ROWS)
    while any(s < total for s in steps):
        for i, (dmp, _dense, _t) in enumerate(models):
            if steps[i] >= total:
                continue
            if steps[i] % BASE_EVERY == 0 and ckpts[i].base != fmt.base_dir(ckpts[i].root, steps[i]):
                ckpts[i].save_base()
            step(dmp, _dense, batches[steps[i]])
            steps[i] += 1
            print("STEP", i, steps[i], flush=True)
    for ckpt in ckpts:
        ckpt.close()
    for i, case in enumerate(cases):
        dmp, dense, tracker = models[i]
        got = final_state(dmp, dense)
        tracker.close()
        twin, twin_dense = build(rank, case)
        for b in batches:
            step(twin, twin_dense, b)
        bad = differences(got, final_state(twin, twin_dense))
        print("MATCH" if not bad else "DIFF", i, *bad, flush=True)
    dist.barrier()
    print("DONE", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
