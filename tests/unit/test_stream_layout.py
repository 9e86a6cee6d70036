"""A job's stream layout (``persistent_delta.fleet.streams``) over the in-process transport: which
stream holds each rank, the record in the job's ``meta`` bucket (typed errors for a damaged,
newer or forged one), the rule that fixes a job's layout for its life, and a remote consumer of
a job over two streams whose polls equal a local reader's, bit for bit, across a reopen."""

from __future__ import annotations

import os

import pytest
import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta import DeltaReader, LmdbDeltaStore
from persistent_delta.errors import (
    AuthenticationError,
    FormatMismatchError,
    InvalidInputError,
    StreamDataError,
    StreamLayoutError,
)
from persistent_delta.fleet import subjects
from persistent_delta.fleet.auth import Keyring, generate_key, resolve_keyring, seal_value
from persistent_delta.fleet.memory import MemoryBroker
from persistent_delta.fleet.remote import RemoteConsumer
from persistent_delta.fleet.ship import Shipper
from persistent_delta.fleet.streams import Layout, read_layout, recorded_layout, settle_layout
from persistent_delta.fleet.transport import StreamOptions
from persistent_delta.log import codec

RING = resolve_keyring(None, False, "test")


def test_a_layout_places_each_rank_and_round_trips():
    one, two = Layout("j"), Layout("j", 2)
    assert one.single and one.stream(7) == "PD_j" and one.stream_subjects(7) == ["pd.j.>"]
    assert [two.stream(r) for r in range(5)] == ["PDG_j_0", "PDG_j_0", "PDG_j_1", "PDG_j_1", "PDG_j_2"]
    assert two.stream_subjects(3) == ["pd.j.*.2.>", "pd.j.*.3.>"]
    assert two.streams([4, 0, 3, 1]) == {"PDG_j_0": [0, 1], "PDG_j_1": [3], "PDG_j_2": [4]}
    assert Layout.decode("j", two.encode()) == two
    assert subjects.group_stream_name("j_1", 2) != subjects.group_stream_name("j", 12)  # injective
    for bad in (-1, 4097, True, 1.5):
        with pytest.raises(InvalidInputError):
            Layout("j", bad)  # type: ignore[arg-type]
    with pytest.raises(StreamDataError):
        Layout.decode("j", b"\x00not msgpack")
    with pytest.raises(StreamDataError):
        Layout.decode("j", codec.pack({"version": 1, "ranks_per_stream": 0}))
    with pytest.raises(FormatMismatchError):
        Layout.decode("j", codec.pack({"version": 2, "ranks_per_stream": 2}))


def test_a_jobs_layout_is_fixed_by_its_first_shipper():
    conn = MemoryBroker().connect()
    opts = StreamOptions()
    assert settle_layout(conn, "a", opts, None, RING) == Layout("a")  # a new job: today's single stream
    assert conn.job_exists("a") and recorded_layout(conn, "a", RING) is None  # nothing stored for it
    with pytest.raises(StreamLayoutError, match="already ships into one stream"):
        settle_layout(conn, "a", opts, 2, RING)
    assert settle_layout(conn, "a", opts, None, RING) == Layout("a")
    assert settle_layout(conn, "b", opts, 2, RING) == Layout("b", 2)
    assert read_layout(conn, "b", RING) == Layout("b", 2) and not conn.job_exists("b")
    assert settle_layout(conn, "b", opts, None, RING) == Layout("b", 2)  # unset: follow the job's
    assert settle_layout(conn, "b", opts, 2, RING) == Layout("b", 2)
    with pytest.raises(StreamLayoutError, match="2 ranks per stream"):
        settle_layout(conn, "b", opts, 1, RING)
    conn.ensure_job("b", opts, streams=Layout("b", 2).spec(0))
    with pytest.raises(StreamLayoutError):  # the server side refuses the single stream over a group's subjects
        conn.ensure_job("b", opts)
    other = Keyring([generate_key("other")])
    conn.ensure_job("c", opts, streams={})
    conn.kv_put("c", subjects.META, subjects.LAYOUT_KEY,
                seal_value(other, "c", subjects.META, subjects.LAYOUT_KEY, Layout("c", 1).encode()))
    with pytest.raises(AuthenticationError):  # a layout written without the job's key
        read_layout(conn, "c", RING)
    assert read_layout(conn, "c", None) == Layout("c", 1)  # display only: unverified


def _write(root: str, rank: int, batches: range) -> None:
    with LmdbDeltaStore(os.path.join(root, f"rank-{rank}"), updateMode=UpdateMode.LAST) as store:
        for b in batches:
            n = 20 + 11 * ((b + rank) % 3)
            ids = torch.randperm(500, generator=torch.Generator().manual_seed(b * 7 + rank))[:n] * 3 + rank
            store.append(b, "t", ids, torch.randn(n, 4, generator=torch.Generator().manual_seed(b)))


def test_a_remote_consumer_of_a_job_over_two_streams_reads_what_a_local_reader_reads(tmp_path):
    root = str(tmp_path / "log")
    broker = MemoryBroker()
    for rank in range(3):
        _write(root, rank, range(0, 9))
    with Shipper(root, None, "g", channels=["lookups"], max_batches=2, transport=broker.connect("s"),
                 ranks_per_stream=2) as s:
        s.run(idle_exit_s=0.2)
        assert all(not st["last_error"] for st in s.stats()), s.stats()
    assert sorted(broker.streams) == ["PDG_g_0", "PDG_g_1"]
    assert {m.msg.subject.split(".")[3] for m in broker.streams["PDG_g_1"].messages} == {"2"}
    start = 0
    for reopen in range(2):
        with RemoteConsumer(None, "g", "r", wait=5, transport=broker.connect("r")) as c:
            assert c.position() == {r: start for r in range(3)}  # committed before the reopen
            while c.position() != c.end_offsets() and (reopen or start < 4):
                got = c.poll(max_batches=2)
                (lo, hi), = set(got.ranges.values())
                assert lo == start
                with DeltaReader(root, start=lo) as local:
                    want = local.poll(max_batches=hi - lo)
                for rank, w in want.ranks.items():
                    assert got.ranks[rank].path.endswith(f"/{Layout('g', 2).stream(rank)}/lookups/rank-{rank}")
                    for fqn, wt in w.tables.items():
                        gt = got.ranks[rank].tables[fqn]
                        assert torch.equal(gt.ids, wt.ids) and torch.equal(gt.states, wt.states), (rank, fqn)
                start = hi
                c.commit()
    assert start == 9
