"""A serving replica that reads only from the stream (run as a script by tests/fleet/test_ship.py).

It cannot read the trainer's log directory: ``--forbid-by uid`` (the tests' choice under root)
means it runs as another, unprivileged user and the log root is owner-only, checked at start;
``--forbid-by hook``: an audit hook fails every open/listdir under it. It starts from the deterministic initial tables,
applies every poll of the snapshots channel with ``apply_poll(..., complete_only=True)``, saves
its tables, then commits; it logs each poll's ranges. ``--die-after-polls K``: SIGKILL itself
after the K-th non-empty poll, before its commit. It stops once ``--stop-file`` exists and
its positions reached the stream's end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time


def forbid(root: str) -> None:
    root = os.path.realpath(root)

    def hook(event: str, args: tuple) -> None:
        if event in ("open", "os.listdir", "os.scandir", "os.stat") and args:
            path = args[0]
            if isinstance(path, (str, bytes, os.PathLike)):
                p = os.path.realpath(os.fsdecode(path))
                if p == root or p.startswith(root + os.sep):
                    raise PermissionError(f"the replica may not read the trainer's log: {p}")

    sys.addaudithook(hook)


def retry(fn):  # a real replica rides out a server restart
    from persistent_delta.errors import TransportError

    for _ in range(600):
        try:
            return fn()
        except TransportError:
            time.sleep(0.1)
    return fn()


def commit(c) -> None:
    retry(c.commit)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--forbid", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--stop-file", required=True)
    p.add_argument("--name", default="replica")
    p.add_argument("--die-after-polls", type=int, default=0)
    p.add_argument("--forbid-by", choices=("uid", "hook"), default="hook")
    args = p.parse_args()
    readable = os.access(args.forbid, os.F_OK)  # under another uid: False, the log root is owner-only
    if args.forbid_by == "hook":
        forbid(args.forbid)
    if args.forbid_by == "uid" and (os.getuid() == 0 or readable):
        print(f"not separated: uid {os.getuid()}, log readable: {readable}", file=sys.stderr)
        return 3

    import torch

    from harness import global_table_weights
    from persistent_delta import apply_poll
    from persistent_delta.fleet.remote import RemoteConsumer
    from ship_cases import DIM, ROWS, SEED, TABLES

    state = os.path.join(args.out, f"{args.name}.pt")
    if os.path.exists(state):
        tables = torch.load(state)
    else:
        tables = {f"sparse.embeddings.{k}": v for k, v in global_table_weights(TABLES, ROWS, DIM, SEED).items()}
    log = open(os.path.join(args.out, f"{args.name}.polls"), "a")
    polls = 0
    with RemoteConsumer(args.server, args.job, args.name, channel="snapshots", wait=60) as c:
        log.write(json.dumps({"start": c.position(), "pid": os.getpid(), "uid": os.getuid(),
                              "log_readable": readable}) + "\n")
        log.flush()
        while True:
            poll = c.poll(timeout=0.3)
            apply_poll(tables, poll, complete_only=True)  # every rank over the same range, or nothing applied
            if not poll.empty:
                polls += 1
                log.write(json.dumps({"ranges": {str(r): v for r, v in poll.ranges.items()}}) + "\n")
                log.flush()
                tmp = state + ".tmp"
                torch.save(tables, tmp)
                os.replace(tmp, state)
                if args.die_after_polls and polls >= args.die_after_polls:
                    os.kill(os.getpid(), signal.SIGKILL)
                commit(c)
            elif os.path.exists(args.stop_file) and c.position() == retry(c.end_offsets):
                break
    log.write(json.dumps({"done": True}) + "\n")
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
