"""A job laid out over rank-group streams (``ranks_per_stream``) against a real nats-server:
a remote consumer gets exactly what the single-stream layout gives (the same polls, ranges and
rows, with positions committed and resumed across a reopen), also after its shipper process was
SIGKILLed mid-stream and restarted; a layout change of a running job is refused with
``StreamLayoutError``; the offsets tool reads each rank's end from its own stream; the NATS
permissions block naming the group streams lets each side do its part; one group stream deleted
under a running shipper is created again and read again alone."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Tuple

import pytest
import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from nats_servers import nats_server  # noqa: F401 - fixture
from persistent_delta import LmdbDeltaStore
from persistent_delta.cli import main as cli_main
from persistent_delta.errors import StreamLayoutError
from persistent_delta.fleet import nats, subjects, wire
from persistent_delta.fleet.remote import RemoteConsumer
from persistent_delta.fleet.ship import Shipper
from persistent_delta.fleet.streams import Layout, read_layout
from persistent_delta.log.schema import LOOKUPS
from procs import REPO, SUPPORT
from ship_cases import wait_for

RANKS = 4
BATCHES = 40
DIM = 4
Poll = List[Tuple[int, int, int, Dict[str, Tuple[List[int], List[List[float]]]]]]


def _fill(root: str) -> None:
    for rank in range(RANKS):
        with LmdbDeltaStore(os.path.join(root, f"rank-{rank}"), updateMode=UpdateMode.LAST) as store:
            for b in range(BATCHES):
                n = (3 + 7 * ((b + rank) % 4)) if (b + rank) % 9 else 0  # some batches without records
                if n:
                    ids = torch.arange(n) * RANKS + rank
                    store.append(b, "t", ids, torch.full((n, DIM), float(b * 10 + rank)))
                    store.append(b, "u", ids[: n // 2 + 1], torch.full((n // 2 + 1, DIM), -float(b)))


def _ship(root: str, url: str, job: str, max_batches: int = 3, **kw: Any) -> Shipper:
    shipper = Shipper(root, url, job, channels=[LOOKUPS], max_batches=max_batches, **kw)
    shipper.run(idle_exit_s=0.5)
    return shipper


def _drain(url: str, job: str, name: str) -> Poll:
    """Every poll of a consumer reading the job from the start (5 batches at most a poll,
    committed after each), closed and reopened half-way: (rank, start, end, rows per table)."""
    out: Poll = []
    for half in range(2):
        with RemoteConsumer(url, job, name, wait=10) as c:
            assert c.ranks == list(range(RANKS))
            while c.position() != c.end_offsets() and (half or len(out) < 4 * RANKS):
                poll = c.poll(max_batches=5, timeout=2.0)
                for rank, rd in sorted(poll.ranks.items()):
                    tables = {fqn: (t.rows.ids.tolist(), t.rows.states.tolist()) for fqn, t in sorted(rd.tables.items())}
                    out.append((rank, rd.start_idx, rd.end_idx, tables))
                c.commit()
            if half:
                assert c.position() == {r: BATCHES for r in range(RANKS)}
    return out


def _stream_end(url: str, job: str, rank: int) -> int:
    conn = nats.Connection(url)
    try:
        last = conn.last_message(job, subjects.end_subject(job, LOOKUPS, rank),
                                 stream=read_layout(conn, job, None).stream(rank))
        return 0 if last is None else wire.Marker.decode(last.data, last.seq, "test").end
    finally:
        conn.close()


def test_two_streams_give_a_remote_consumer_what_one_stream_gives(tmp_path, nats_server):
    root = str(tmp_path / "log")
    _fill(root)
    url = nats_server.url
    _ship(root, url, "one").close()
    _ship(root, url, "two", ranks_per_stream=2).close()
    conn = nats.Connection(url)
    try:
        assert read_layout(conn, "one", None) == Layout("one")
        assert read_layout(conn, "two", None) == Layout("two", 2)
        assert conn.job_exists("one") and not conn.job_exists("two")  # no single stream PD_two
        assert conn.job_exists("two", streams=["PDG_two_0", "PDG_two_1"])
        for stream in ("PDG_two_0", "PDG_two_1"):  # each group's stream holds its ranks only
            got, _ = conn.get_batch("two", subjects.ends_filter("two", LOOKUPS), 1, 10_000, 1 << 26, stream=stream)
            assert {int(m.subject.split(".")[3]) for m in got} == ({0, 1} if stream.endswith("0") else {2, 3})
    finally:
        conn.close()
    one, two = _drain(url, "one", "c"), _drain(url, "two", "c")
    assert len(one) > 2 * RANKS and any(tables for *_, tables in one)
    assert two == one

    # the layout is fixed for the job's life: another one is refused before anything is shipped
    for job, kw in (("two", {"ranks_per_stream": 1}), ("one", {"ranks_per_stream": 2})):
        with Shipper(root, url, job, channels=[LOOKUPS], **kw) as shipper:
            with pytest.raises(StreamLayoutError):
                shipper.run_once()
    # without ranks_per_stream a shipper follows the job's recorded layout
    with Shipper(root, url, "two", channels=[LOOKUPS]) as shipper:
        shipper.run_once()
        assert shipper.layout == Layout("two", 2)

    # the offsets tool reads each rank's end from its stream, and names the streams
    buf = io.StringIO()
    assert cli_main(["offsets", "--server", url, "--job", "two", "--format", "json"], stdout=buf) == 0
    data = json.loads(buf.getvalue())
    assert [(s["stream"], s["ranks"]) for s in data["streams"]] == [("PDG_two_0", [0, 1]), ("PDG_two_1", [2, 3])]
    assert {(c["rank"], c["stream_end"], c["lag"]) for c in data["consumers"]} == {(r, BATCHES, 0) for r in range(RANKS)}
    from rich.console import Console

    from persistent_delta.cli.top import draw, snapshot

    view = snapshot(None, url, "two")
    assert [(st.stream, st.ranks) for st in view.streams] == [("PDG_two_0", [0, 1]), ("PDG_two_1", [2, 3])]
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(draw(view))
    text = console.export_text()
    assert "STREAMS" in text and "PDG_two_1" in text


@pytest.mark.slow
def test_two_streams_after_a_shipper_sigkill_give_what_one_stream_gives(tmp_path, nats_server):
    """The shipper process (``persistent-delta ship --ranks-per-stream 1``: a stream per rank)
    is SIGKILLed mid-stream and restarted without the flag (it follows the recorded layout):
    the remote consumer's polls equal the single-stream job's."""
    root = str(tmp_path / "log")
    _fill(root)
    url = nats_server.url
    _ship(root, url, "one", max_batches=1).close()  # ranges cut as the killed shipper's
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + SUPPORT + os.pathsep + env.get("PYTHONPATH", "")
    argv = [sys.executable, "-m", "persistent_delta", "ship", root, "--server", url, "--job", "kill",
            "--channels", LOOKUPS, "--max-batches", "1"]
    with open(tmp_path / "shipper.log", "ab") as log:
        p = subprocess.Popen(argv + ["--ranks-per-stream", "1"], stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_for(lambda: _stream_end(url, "kill", 0) >= 3 if _exists(url, "kill") else False, 60, "a first range")
            p.send_signal(signal.SIGKILL)
            p.wait(30)
            assert min(_stream_end(url, "kill", r) for r in range(RANKS)) < BATCHES  # killed mid-stream
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
            wait_for(lambda: all(_stream_end(url, "kill", r) == BATCHES for r in range(RANKS)), 90, "the restarted shipper")
        finally:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    conn = nats.Connection(url)
    try:
        assert read_layout(conn, "kill", None) == Layout("kill", 1)
        assert conn.job_exists("kill", streams=[f"PDG_kill_{r}" for r in range(RANKS)])
    finally:
        conn.close()
    assert _drain(url, "kill", "c") == _drain(url, "one", "c")


def _exists(url: str, job: str) -> bool:
    conn = nats.Connection(url)
    try:
        return conn.job_exists(job, streams=()) and read_layout(conn, job, None) == Layout(job, 1) and \
            conn.job_exists(job, streams=["PDG_kill_0"])
    finally:
        conn.close()


def test_the_permissions_block_of_a_job_over_two_streams_lets_each_side_do_its_part(tmp_path):
    """A server whose ``authorization`` block is :func:`authorization_block`'s with the job's two
    group streams named: the shipper user records the layout, creates both streams and ships; a
    read-only consumer user reads every rank from its stream and commits."""
    from persistent_delta.fleet.permissions import authorization_block
    from persistent_delta.fleet.transport import ConnectOptions
    from persistent_delta.testing import LocalServer

    root, job = str(tmp_path / "log"), "perm"
    _fill(root)
    streams = list(Layout(job, 2).streams(range(RANKS)))
    assert streams == ["PDG_perm_0", "PDG_perm_1"]
    block = authorization_block(job, ("shipper", "ship-pw"), {"reader": ("read-pw", ["replica"])}, streams=streams)
    server = LocalServer(str(tmp_path / "nats-auth"), extra_config=block).start()
    try:
        _ship(root, server.url, job, ranks_per_stream=2, connect=ConnectOptions(user="shipper", password="ship-pw")
              ).close()
        read_as = ConnectOptions(user="reader", password="read-pw", request_timeout=2.0)
        with RemoteConsumer(server.url, job, "replica", connect=read_as, wait=10) as c:
            while c.position() != c.end_offsets():
                c.poll(timeout=1.0)
            assert c.commit() == {r: BATCHES for r in range(RANKS)}
    finally:
        server.stop()


def _append(root: str, ranks: int, batches: range) -> None:
    for rank in range(ranks):
        with LmdbDeltaStore(os.path.join(root, f"rank-{rank}"), updateMode=UpdateMode.LAST) as store:
            for b in batches:
                ids = (b * 8 + torch.arange(5 + b % 3)) * ranks + rank  # unique ids: no row merged away
                store.append(b, "t", ids, torch.full((ids.numel(), DIM), float(b)))


def _read_all(c: RemoteConsumer) -> Dict[int, List[int]]:
    """rank -> the batch values of every row read until the stream's end."""
    out: Dict[int, List[int]] = {}
    deadline = time.monotonic() + 30
    while c.position() != c.end_offsets():
        assert time.monotonic() < deadline, f"stuck at {c.position()} of {c.end_offsets()}"
        for rank, rd in c.poll(timeout=0.5).ranks.items():
            for t in rd.tables.values():
                out.setdefault(rank, []).extend(int(v) for v in t.rows.states[:, 0].tolist())
    return {r: sorted(v) for r, v in out.items()}


def test_one_group_stream_deleted_under_a_running_shipper_is_read_again_alone(tmp_path, nats_server):
    """Another client deletes rank 1's group stream while the shipper runs: the shipper creates
    it again and ships on; a consumer open all along and one reopened from its committed
    positions read the new batches of both ranks, each once: rank 1 from its new stream's
    start, rank 0 on in its own stream (its stored stream identity unchanged)."""
    from ship_cases import wait_for as wait

    root, job, url = str(tmp_path / "log"), "grp-del", nats_server.url
    _append(root, 2, range(0, 10))
    admin = nats.Connection(url)
    want_new = {r: sorted(b for b in range(10, 20) for _ in range(5 + b % 3)) for r in (0, 1)}
    try:
        with Shipper(root, url, job, channels=[LOOKUPS], max_batches=4, ranks_per_stream=1) as s:
            s.start()
            wait(lambda: _exists_rank_end(admin, job, 10), 30, "the first batches")
            with RemoteConsumer(url, job, "before", wait=10) as c:
                _read_all(c)
                c.commit()
            live = RemoteConsumer(url, job, "live", wait=10)
            _read_all(live)

            async def delete() -> None:
                await admin.js.delete_stream("PDG_grp-del_1")

            admin.call("delete a group stream", delete)
            _append(root, 2, range(10, 20))
            wait(lambda: _exists_rank_end(admin, job, 20), 30, "the shipper to create the stream again")
        with live:
            assert _read_all(live) == want_new
        with RemoteConsumer(url, job, "before", wait=10) as c:
            assert c.position() == {0: 10, 1: 10}
            assert _read_all(c) == want_new
    finally:
        admin.close()


def _exists_rank_end(conn: Any, job: str, end: int) -> bool:
    layout = Layout(job, 1)
    for rank in (0, 1):
        if not conn.job_exists(job, streams=[layout.stream(rank)]):
            return False
        last = conn.last_message(job, subjects.end_subject(job, LOOKUPS, rank), stream=layout.stream(rank))
        if last is None or wire.Marker.decode(last.data, last.seq, "test").end != end:
            return False
    return True
