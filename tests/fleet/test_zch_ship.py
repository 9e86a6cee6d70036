"""Issue 16 across hosts: the side records of managed-collision tables travel with the shipped
ranges, so a remote replica builds the trainer's (admitted raw id -> slot) map from the
stream alone, and a remote poll's ``zch()`` equals a local one over the same range. Real
trainer ranks (gloo), a real shipper and a real nats-server on 127.0.0.1."""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, List

import pytest
import torch

from harness import run_spawn
from persistent_delta import RawIdMap
from persistent_delta.log import codec
from persistent_delta.read.consumer import DeltaReader
from persistent_delta.fleet.remote import RemoteConsumer
from persistent_delta.fleet.ship import Shipper
from persistent_delta.log.zch_records import ZchDelta, reduce_raw_ids, side_delta
from ship_cases import stream_caught_up, wait_for
from zch_cases import ship_case

FIELDS = ("raw_ids", "slot_ids", "unadmitted_raw_ids", "slots", "taken", "given", "evicted_raw_ids")


def _same(got: ZchDelta, want: ZchDelta) -> List[str]:
    """The fields in which two deltas differ."""
    bad = [f for f in FIELDS if not torch.equal(getattr(got, f), getattr(want, f))]
    if (got.states is None) != (want.states is None) or (got.states is not None and not torch.equal(got.states, want.states)):
        bad.append("states")
    if (got.fqn, got.start_idx, got.end_idx, got.ranks) != (want.fqn, want.start_idx, want.end_idx, want.ranks):
        bad.append("range")
    return bad


def test_reduced_raw_id_records_read_the_same_over_any_split():
    """What the shipper ships per range (raw-id records reduced) reads, concatenated over
    consecutive ranges, as the log's records themselves."""
    g = torch.Generator().manual_seed(3)
    for trial in range(30):
        n = int(torch.randint(1, 8, (1,), generator=g))
        recs = []
        for _ in range(n):
            k = int(torch.randint(0, 12, (1,), generator=g))
            raw = torch.randint(0, 10, (k,), generator=g)
            admitted = torch.randint(0, 2, (k,), generator=g)
            slots = torch.where(admitted == 1, torch.randint(0, 6, (k,), generator=g), torch.full((k,), 7))
            recs.append((codec.KIND_RAW_IDS, slots, torch.stack([raw, admitted], 1)))
        want = side_delta("t", 0, n, recs, row_offset=100)
        cuts = sorted({0, n, *torch.randint(0, n + 1, (2,), generator=g).tolist()})
        shipped = []
        for a, b in zip(cuts, cuts[1:]):
            part = recs[a:b]
            shipped.append(reduce_raw_ids(torch.cat([r[1] for r in part]), torch.cat([r[2] for r in part])))
        got = side_delta("t", 0, n, shipped, row_offset=100)
        assert not _same(got, want), (trial, _same(got, want))


@pytest.mark.dist
def test_remote_replica_raw_id_map_equals_the_trainers(tmp_path, nats_server):
    """2-rank MCH trainer (16 slots per rank and table, evictions every 2 steps) shipped live
    in ranges of 4 batches; a remote consumer applies every poll, in order, to a RawIdMap and
    ends with exactly the trainer's map. A remote poll of the whole stream gives the same
    ``zch()`` as a local reader of the whole log."""
    root, job = str(tmp_path / "log"), "job-zch"
    box: Dict[str, Any] = {}

    def train() -> None:
        try:
            box["result"] = run_spawn(ship_case, 2, root, 24, 0.05, timeout=240)
        except BaseException as exc:  # noqa: BLE001 - reported below
            box["error"] = exc

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    shipper = Shipper(root, nats_server.url, job, channels=["lookups"], max_batches=4).start()
    try:
        replica = RawIdMap()
        evicted = polls = 0
        with RemoteConsumer(nats_server.url, job, "replica", wait=120) as c:
            def drain() -> None:
                nonlocal evicted, polls
                poll = c.poll(max_batches=4, timeout=0.3)
                for z in poll.zch().values():
                    replica.apply(z)
                    evicted += int(z.evicted_raw_ids.numel())
                polls += 0 if poll.empty else 1
                c.commit()

            while trainer.is_alive():
                drain()
            trainer.join()
            if "error" in box:
                raise box["error"]
            wait_for(lambda: stream_caught_up(root, nats_server.url, job, "lookups"), 60, "the shipper")
            deadline = time.monotonic() + 60
            while c.position() != c.end_offsets():
                assert time.monotonic() < deadline, (c.position(), c.end_offsets())
                drain()
        trainer_maps = box["result"][0]["maps"]
        assert len(replica.tables()) == 2 and polls > 3 and evicted > 5, (replica.tables(), polls, evicted)
        for fqn in replica.tables():
            want = trainer_maps[fqn.rsplit(".", 1)[1]]
            assert len(want) > 10, want
            assert replica.as_dict(fqn) == want, f"{fqn}: the remote replica's raw-id map differs from the trainer's"

        with RemoteConsumer(nats_server.url, job, "whole", wait=10) as remote, DeltaReader(root) as local:
            got, want_poll = remote.poll(), local.poll()
            assert got.ranges == want_poll.ranges
            gz, wz = got.zch(), want_poll.zch()
            assert set(gz) == set(wz) == set(replica.tables())
            for fqn in wz:
                assert not _same(gz[fqn], wz[fqn]), f"{fqn}: remote zch() differs from local in {_same(gz[fqn], wz[fqn])}"
    finally:
        shipper.close()
        trainer.join(300)
