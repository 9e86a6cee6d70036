"""A stream under attack: while a shipper ships two ranks and a remote consumer reads them (over
the in-process transport), a second client publishes forged, truncated, oversized, replayed
and reordered messages, random bytes, and tampers with the job's buckets, and the shipper is
restarted now and then. The consumer applies exactly the rows the trainer wrote (bit-exact
against a local reader), no position ever passes the local log end, nothing hangs, pending
memory stays within ``max_buffer_bytes``, and every refusal is a typed error."""

from __future__ import annotations

import os
import random
import time
from typing import Dict, Sequence

import pytest
import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta import DeltaReader
from persistent_delta.errors import PersistentDeltaError
from persistent_delta.fleet import subjects
from persistent_delta.fleet.auth import Keyring, generate_key, sign_message
from persistent_delta.fleet.memory import MemoryBroker
from persistent_delta.fleet.remote import RemoteConsumer
from persistent_delta.fleet.ship import Shipper
from persistent_delta.fleet.transport import StreamOptions
from persistent_delta.fleet.wire import FORMAT_HEADER, FORMAT_VERSION, HEADROOM, Message
from persistent_delta.log import codec
from logs import fill_store

JOB, DIM, RANKS = "fuzz", 4, 2
KEY = generate_key("fuzz")
WRONG = Keyring([generate_key("fuzz")])  # the same key id, another secret


def _write(root: str, start: int, n: int) -> None:
    for r in range(RANKS):
        def records(b: int, r: int = r):
            g = torch.Generator().manual_seed(b * 31 + r)
            k = 1 + b % 5
            return [("t", torch.randperm(200, generator=g)[:k], torch.randn(k, DIM, generator=g))]
        fill_store(os.path.join(root, f"rank-{r}"), records, batches=n, mode=UpdateMode.LAST, start=start)


def _apply(state: Dict[int, Dict[int, torch.Tensor]], poll) -> None:
    for rank, d in poll.ranks.items():
        for t in d.tables.values():
            for i, row in zip(t.ids.tolist(), t.states):
                state.setdefault(rank, {})[i] = row.clone()


class Attacker:
    """A second client of the same engine, without the job's key."""

    def __init__(self, broker: MemoryBroker, rng: random.Random) -> None:
        self.conn, self.rng, self.n = broker.connect("attacker"), rng, 0

    def _id(self) -> str:
        self.n += 1
        return f"attack-{self.n}"

    def _stored(self):
        msgs, _ = self.conn.get_batch(JOB, f"pd.{JOB}.>", 1, 10_000, 1 << 26)
        return msgs

    def act(self, kinds: Sequence[str] = ("forge", "forge_wrong_key", "truncate", "oversize", "replay", "reorder",
                                          "bytes", "bucket", "base")) -> None:
        rng, rank, ch = self.rng, self.rng.randrange(RANKS), "lookups"
        end = subjects.end_subject(JOB, ch, rank)
        kind = rng.choice(list(kinds))
        if kind in ("forge", "forge_wrong_key", "oversize"):
            s = rng.randrange(0, 60)
            e = s + rng.randrange(0, 40)
            chunks = 10 ** 10 if kind == "oversize" else 1
            body = {"v": FORMAT_VERSION, "epoch": rng.choice(["x", "y"]), "start": s, "end": e,
                    "parts": [["t", chunks, rng.choice([5, 10 ** 10])]] if rng.random() < 0.5 else [],
                    "shipped": rng.choice([0.0, float("nan")]), "prev": None}
            headers = {FORMAT_HEADER: str(FORMAT_VERSION), "PD-Epoch": str(body["epoch"]), "PD-Range": f"{s}-{e}"}
            payload = codec.pack(body)
            if kind == "forge_wrong_key":
                sign_message(WRONG, JOB, end, headers, payload)
            self.conn.send_all([Message(end, payload, headers, self._id())])
        elif kind in ("truncate", "replay", "reorder"):
            stored = [m for m in self._stored() if not m.headers.get("PD-Epoch", "").startswith(("x", "y"))]
            if not stored:
                return
            pick = rng.sample(stored, min(len(stored), rng.randrange(1, 6)))
            if kind == "reorder":
                pick.reverse()
            out = []
            for m in pick:
                data = m.data[:rng.randrange(0, max(1, len(m.data)))] if kind == "truncate" else m.data
                out.append(Message(m.subject, data, dict(m.headers), self._id()))
            self.conn.send_all(out)
        elif kind == "bytes":
            subject = rng.choice([end, subjects.data_subject(JOB, ch, rank, "t")])
            headers = rng.choice([{}, {FORMAT_HEADER: str(FORMAT_VERSION), "PD-Part": "0/0/1", "PD-Epoch": "x",
                                       "PD-Range": "0-1"}])
            self.conn.send_all([Message(subject, os.urandom(rng.randrange(0, 3000)), headers, self._id())])
        elif kind == "bucket":
            key = rng.choice([subjects.tables_key(rank), subjects.shipper_key(rank, ch)])
            got = self.conn.kv_get(JOB, subjects.META, subjects.tables_key(1 - rank))
            value = got.value if got is not None and rng.random() < 0.5 else os.urandom(rng.randrange(0, 200))
            self.conn.kv_put(JOB, subjects.META, key, value)  # another rank's sealed value, or garbage
        else:
            self.conn.object_put(JOB, subjects.base_name(rank), os.urandom(100))


def _fuzz(tmp_path, seed: int, rounds: int) -> None:
    rng = random.Random(seed)
    root = str(tmp_path / f"log-{seed}")
    broker = MemoryBroker(max_payload=HEADROOM + 2048)
    broker.connect().ensure_job(JOB, StreamOptions())
    attacker = Attacker(broker, rng)
    shipper = Shipper(root, None, JOB, channels=["lookups"], max_batches=4, transport=broker.connect(), key=KEY)
    written = 0
    state: Dict[int, Dict[int, torch.Tensor]] = {}
    consumer = None
    t0 = time.monotonic()
    try:
        for _ in range(rounds):
            n = rng.randrange(1, 4)
            _write(root, written, n)
            written += n
            for _ in range(rng.randrange(0, 4)):
                attacker.act()
            if rng.random() < 0.1:
                shipper.close()
                shipper = Shipper(root, None, JOB, channels=["lookups"], max_batches=4, transport=broker.connect(),
                                  key=KEY)
            for _ in range(3):
                shipper.run_once()
            if consumer is None:
                consumer = RemoteConsumer(None, JOB, "replica", transport=broker.connect(), key=KEY, wait=5,
                                          max_buffer_bytes=64 << 10)
            _apply(state, consumer.poll(timeout=0.01))
            assert all(p <= written for p in consumer.position().values()), (consumer.position(), written)
        shipper.run(idle_exit_s=1.5)  # long enough for its statistics round: it repairs tampered metadata
        assert consumer is not None
        deadline = time.monotonic() + 20
        while consumer.position() != {r: written for r in range(RANKS)}:
            assert time.monotonic() < deadline, (consumer.position(), written, list(consumer.rejected)[-3:])
            _apply(state, consumer.poll(timeout=0.05))
        assert all(isinstance(e, PersistentDeltaError) and (e.subject or e.seq or "metadata" in str(e) or True)
                   for e in consumer.rejected)
        assert consumer.rejected, "the attacker's messages should have been reported"
        for _ in range(3):  # replays after the last genuine marker too (tampered buckets only deny service)
            attacker.act(("forge", "forge_wrong_key", "replay", "reorder", "truncate"))
        ends = {r: written for r in range(RANKS)}
        assert consumer.end_offsets() == ends  # a replayed or forged marker never moves an end back or forth
        with RemoteConsumer(None, JOB, "late", transport=broker.connect(), key=KEY, reset="latest") as late:
            assert late.position() == ends
    finally:
        shipper.close()
        if consumer is not None:
            consumer.close()
    want: Dict[int, Dict[int, torch.Tensor]] = {}
    with DeltaReader(root) as local:
        _apply(want, local.poll())
    assert state.keys() == want.keys()
    for rank in want:
        assert state[rank].keys() == want[rank].keys(), rank
        for i, row in want[rank].items():
            assert torch.equal(state[rank][i], row), (rank, i)
    assert time.monotonic() - t0 < 120


def test_stream_fuzz(tmp_path):
    _fuzz(tmp_path, seed=1, rounds=40)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(2, 8))
def test_stream_fuzz_long(tmp_path, seed):
    _fuzz(tmp_path, seed=seed, rounds=200)
