"""The remote replica process of tests/fleet/test_remote_fresh_base.py: it follows a job from
the stream only (a ``RemoteConsumer`` and a ``Follower`` without checkpoints), unable to read
the trainer's log or checkpoint directories (an audit hook fails every open under them), and
prints ``APPLIED <rank 0's end>`` after each poll that moved."""

from __future__ import annotations

import sys

from ship_replica import forbid


def replica_main(url: str, job: str, name: str, *forbidden: str) -> None:
    from persistent_delta import RemoteConsumer
    from persistent_delta.serve import Follower

    for path in forbidden:
        forbid(path)
    consumer = RemoteConsumer(url, job, name, channel="snapshots", wait=60)
    follower = Follower(consumer, wait=60)
    print("STARTED", " ".join(f"{r}:{b}" for r, b in sorted(follower.tables.batches.items())), flush=True)
    while True:
        applied = follower.step(timeout=0.5)
        if applied is not None and applied.ranges:
            print("APPLIED", applied.ranges[0][1], flush=True)


if __name__ == "__main__":
    replica_main(*sys.argv[1:])
