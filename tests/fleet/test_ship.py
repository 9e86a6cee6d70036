"""Across hosts: shipper -> NATS JetStream -> remote consumers, against real servers started on
127.0.0.1 (the ``nats_server`` fixtures), real trainer ranks (gloo), real SIGKILLs."""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List

import pytest
import torch
from torchrec.distributed.model_tracker.types import UniqueRows, UpdateMode

from harness import run_spawn
from persistent_delta import LmdbDeltaStore, apply_poll
from persistent_delta.cli import main as cli_main
from persistent_delta.read.consumer import DeltaReader
from persistent_delta.errors import FormatMismatchError, InvalidInputError, LogLockedError, OffsetOutOfRangeError
from persistent_delta.fleet.remote import RemoteConsumer
from persistent_delta.log.schema import SNAPSHOTS
from persistent_delta.fleet.ship import Shipper
from persistent_delta.fleet.auth import resolve_keyring, sign_message
from persistent_delta.fleet import nats, subjects, wire
from persistent_delta.fleet.transport import StreamOptions
from procs import REPO, SUPPORT, other_uid
from ship_cases import assemble, stream_caught_up, trainer, wait_for


def _env() -> Dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + SUPPORT + os.pathsep + env.get("PYTHONPATH", "")
    return env


_STARTED: List[subprocess.Popen] = []
_DIRS: List[str] = []


@pytest.fixture(autouse=True)
def _no_process_left():
    """Every shipper and replica a test started is gone after it, whatever happened."""
    yield
    while _STARTED:
        p = _STARTED.pop()
        if p.poll() is None:
            p.kill()
            p.wait()
    while _DIRS:
        shutil.rmtree(_DIRS.pop(), ignore_errors=True)


def replica_dir(tmp_path) -> str:
    """The replica's output folder (the trainer writes its results there too). Under root the
    replica runs as ``nobody`` (procs.other_uid): its folder is then a fresh one it owns, outside
    pytest's owner-only temporary tree, which holds the log it must not read."""
    ou = other_uid()
    if ou is None:
        out = str(tmp_path / "out")
        os.makedirs(out)
        return out
    out = tempfile.mkdtemp(prefix="pd-replica-")
    _DIRS.append(out)
    os.chown(out, ou.uid, ou.gid)
    return out


def _popen(argv: List[str], log: str, **kw: Any) -> subprocess.Popen:
    kw.setdefault("env", _env())
    with open(log, "ab") as f:  # a file, not a pipe: nobody has to drain it
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, **kw)
    p.log = log  # type: ignore[attr-defined]
    _STARTED.append(p)
    return p


def start_shipper(root: str, url: str, job: str, *extra: str) -> subprocess.Popen:
    log = os.path.join(os.path.dirname(root), "shipper.log")
    return _popen([sys.executable, "-m", "persistent_delta", "ship", root, "--server", url, "--job", job, *extra], log)


def start_replica(url: str, job: str, forbid: str, out: str, stop: str, *extra: str) -> subprocess.Popen:
    """The replica script, unable to read ``forbid`` (the log root): under root it runs as
    ``nobody`` (the log root is owner-only), otherwise an audit hook fails every open under it."""
    args = [os.path.join(SUPPORT, "ship_replica.py"), "--server", url, "--job", job, "--forbid", forbid,
            "--out", out, "--stop-file", stop, *extra]
    log = os.path.join(out, "replica.log")
    ou = other_uid()
    if ou is None:
        return _popen([sys.executable, *args, "--forbid-by", "hook"], log)
    env = ou.env(out)
    key = os.path.join(out, "stream.key")  # the job's stream key, given to the replica's user (owner-only)
    if not os.path.exists(key):
        shutil.copyfile(os.environ["PERSISTENT_DELTA_STREAM_KEY_FILE"], key)
        os.chown(key, ou.uid, ou.gid)
        os.chmod(key, 0o600)
    env["PERSISTENT_DELTA_STREAM_KEY_FILE"] = key
    return _popen([ou.python, *args, "--forbid-by", "uid"], log, env=env, user=ou.uid, group=ou.gid,
                  extra_groups=[])


def replica_starts(out: str) -> List[Dict[str, Any]]:
    """The replica's start lines: under root each says it ran as another uid that could not
    read the log."""
    starts = [p for p in read_polls(os.path.join(out, "replica.polls")) if "start" in p]
    assert starts
    if other_uid() is not None:
        for s in starts:
            assert s["uid"] != 0 and s["log_readable"] is False, s
    return starts


def stop_proc(p: subprocess.Popen, sig: int = signal.SIGTERM) -> str:
    """Stop ``p`` (if running) and return the tail of its output."""
    if p.poll() is None:
        p.send_signal(sig)
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    with open(p.log) as f:  # type: ignore[attr-defined]
        return f.read()[-4000:]


def read_polls(path: str) -> List[Dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_trainer_in_thread(*args: Any) -> Dict[str, Any]:
    box: Dict[str, Any] = {}

    def go() -> None:
        try:
            box["result"] = run_spawn(trainer, *args, timeout=240)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            box["error"] = exc

    box["thread"] = threading.Thread(target=go, daemon=True)
    box["thread"].start()
    return box


def join_trainer(box: Dict[str, Any]) -> List[Dict[str, Any]]:
    box["thread"].join(300)
    if "error" in box:
        raise box["error"]
    return box["result"]


def check_contiguous(polls: List[Dict[str, Any]], killed_at: int) -> None:
    """Per rank, each poll starts where the previous one ended (nothing applied twice, nothing
    skipped), except that the first poll after the replica was killed between poll and commit
    starts where the killed poll started (re-delivered)."""
    last: Dict[str, List[int]] = {}
    n = 0
    redelivered = False
    after_restart = False
    for entry in polls:
        if "start" in entry:
            after_restart = n > 0
            continue
        if "ranges" not in entry:
            continue
        n += 1
        for rank, (s, e) in entry["ranges"].items():
            if e <= s:
                continue
            if rank in last:
                prev_s, prev_e = last[rank]
                if after_restart:
                    assert s == prev_s, f"rank {rank}: after the kill the poll starts at {s}, not {prev_s} (re-delivery)"
                    redelivered = True
                else:
                    assert s == prev_e, f"rank {rank}: poll [{s}, {e}) after [{prev_s}, {prev_e})"
            last[rank] = [s, e]
        after_restart = False
    assert n > killed_at
    assert redelivered or killed_at == 0


# ----------------------------------------------------------------------------- the main path


@pytest.mark.dist
def test_remote_replica_is_bit_exact_through_shipper_and_consumer_kills(tmp_path, nats_server):
    """2-rank trainer (column-wise shards) + shipper process + a replica process that cannot
    read the log directory (under root it runs as ``nobody``, otherwise an audit hook). The shipper is SIGKILLed twice mid-stream and
    restarted; the replica SIGKILLs itself between a poll and its commit and is restarted.
    The replica ends bit-exact with the trainer's tables; every batch was applied once, except
    the killed poll's, which was re-delivered."""
    root, out, job = str(tmp_path / "log"), replica_dir(tmp_path), "job-a"
    stop = os.path.join(out, "stop")
    go = os.path.join(out, "go")
    box = run_trainer_in_thread(2, root, out, 80, 1, "column_wise", 0.05, None, go, 0, f"{nats_server.url} {job} 30")
    wait_for(lambda: all(os.path.exists(os.path.join(root, f"rank-{r}", "data.mdb")) for r in (0, 1)), 120, "the logs")
    shipper = start_shipper(root, nats_server.url, job, "--channels", "snapshots", "--max-batches", "4")
    replica = start_replica(nats_server.url, job, root, out, stop, "--die-after-polls", "3")
    wait_for(lambda: os.path.exists(os.path.join(out, "replica.polls")), 60, "the replica")
    open(go, "w").close()
    rng = random.Random(15)
    for _ in range(2):
        time.sleep(rng.uniform(0.8, 2.0))
        shipper.kill()
        shipper.wait()
        shipper = start_shipper(root, nats_server.url, job, "--channels", "snapshots", "--max-batches", "4")
    try:
        replica.wait(120)
    finally:
        err = stop_proc(replica)
    assert replica.returncode == -signal.SIGKILL, err
    replica = start_replica(nats_server.url, job, root, out, stop)
    join_trainer(box)
    wait_for(lambda: stream_caught_up(root, nats_server.url, job, SNAPSHOTS), 60, "the shipper to catch up")
    open(stop, "w").close()
    try:
        replica.wait(120)
    finally:
        err = stop_proc(replica)
    assert replica.returncode == 0, err
    got = torch.load(os.path.join(out, "replica.pt"))
    want = assemble(out, 2)
    assert set(got) == set(want)
    for fqn in want:
        assert torch.equal(got[fqn], want[fqn]), f"{fqn}: {int((got[fqn] != want[fqn]).any(1).sum())} rows differ"
    check_contiguous(read_polls(os.path.join(out, "replica.polls")), killed_at=3)
    assert len(replica_starts(out)) == 2  # started, SIGKILLed, started again

    # a replica joining late starts from the base uploaded at step 30, then follows
    with RemoteConsumer(nats_server.url, job, "late", channel=SNAPSHOTS, wait=30) as late:
        tables = late.bootstrap()
        assert set(late.position().values()) == {31}  # just past the base's publish
        while late.position() != late.end_offsets():
            apply_poll(tables, late.poll(timeout=1.0), complete_only=True)
    for fqn in want:
        assert torch.equal(tables[fqn], want[fqn]), f"late replica: {fqn}"

    # the offsets tool shows the remote consumer and the shippers
    import io

    buf = io.StringIO()
    assert cli_main(["offsets", "--server", nats_server.url, "--job", job, "--format", "json"], stdout=buf) == 0
    data = json.loads(buf.getvalue())
    assert {c["consumer"] for c in data["consumers"]} == {"replica"}
    assert all(c["lag"] == 0 for c in data["consumers"])
    assert {(s["rank"], s["channel"]) for s in data["shippers"]} == {(0, "snapshots"), (1, "snapshots")}
    stop_proc(shipper)


# ----------------------------------------------------------------------------- server failures


@pytest.mark.dist
def test_server_restart_mid_run_and_catch_up(tmp_path, nats_server):
    """The single file-backed server is stopped mid-run and SIGKILLed twice later, at random
    instants, each time started again on its store: the trainer is never held, the shipper
    retries and catches up, and the replica ends bit-exact."""
    root, out, job = str(tmp_path / "log"), replica_dir(tmp_path), "job-b"
    stop = os.path.join(out, "stop")
    go = os.path.join(out, "go")
    box = run_trainer_in_thread(2, root, out, 100, 1, "row_wise", 0.05, None, go)
    wait_for(lambda: all(os.path.exists(os.path.join(root, f"rank-{r}", "data.mdb")) for r in (0, 1)), 120, "the logs")
    shipper = start_shipper(root, nats_server.url, job, "--channels", "snapshots", "--nice", "5")
    replica = start_replica(nats_server.url, job, root, out, stop)
    wait_for(lambda: os.path.exists(os.path.join(out, "replica.polls")), 60, "the replica")
    open(go, "w").close()
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    for i in range(3):  # stopped once, SIGKILLed twice, at random instants
        time.sleep(rng.uniform(0.3, 1.5))
        nats_server.stop() if i == 0 else nats_server.kill()
        time.sleep(rng.uniform(0.2, 1.2))
        nats_server.start()
    join_trainer(box)
    wait_for(lambda: stream_caught_up(root, nats_server.url, job, SNAPSHOTS), 90, "the shipper to catch up")
    open(stop, "w").close()
    try:
        replica.wait(120)
    finally:
        err = stop_proc(replica)
    assert replica.returncode == 0, err
    got, want = torch.load(os.path.join(out, "replica.pt")), assemble(out, 2)
    for fqn in want:
        assert torch.equal(got[fqn], want[fqn]), f"{fqn} (seed {seed})"
    check_contiguous(read_polls(os.path.join(out, "replica.polls")), killed_at=0)
    replica_starts(out)
    assert os.getpriority(os.PRIO_PROCESS, shipper.pid) == 5  # --nice: the shipper yields the CPU to the trainer
    stop_proc(shipper)
    buf = io.StringIO()
    assert cli_main(["ship", root, "--server", nats_server.url, "--job", job, "--nice", "20"], stdout=buf) == 2


@pytest.mark.dist
def test_unreachable_stream_never_holds_the_trainer_and_the_bound_gives_out_of_range(tmp_path, nats_server):
    """With the server down the trainer trains on (it finishes while the stream is still
    unreachable); within the retention bound nothing is lost, past it the trainer expires the
    shipper and the remote consumer gets OffsetOutOfRangeError, or its reset policy."""
    root, out, job = str(tmp_path / "log"), str(tmp_path / "out"), "job-c"
    os.makedirs(out)
    flag = os.path.join(out, "go")
    box = run_trainer_in_thread(1, root, out, 60, 1, "row_wise", 0.02, 8, flag)
    wait_for(lambda: os.path.exists(os.path.join(root, "rank-0", "data.mdb")), 120, "the log")
    shipper = Shipper(root, nats_server.url, job, channels=["lookups"], max_batches=4).start()
    time.sleep(1.0)  # the shipper registers before training starts
    consumer = RemoteConsumer(nats_server.url, job, "reader", wait=30)
    open(flag, "w").close()
    wait_for(lambda: consumer.poll(timeout=0.2).ranges[0][1] >= 4, 30, "the first batches on the stream")
    consumer.commit()
    seen = consumer.position()[0]
    consumer.close()
    nats_server.stop()
    t0 = time.monotonic()
    join_trainer(box)  # the trainer finishes while the stream is unreachable
    assert time.monotonic() - t0 < 60
    assert shipper.stats()[0]["position"] < 60 - 8
    nats_server.start()
    wait_for(lambda: stream_caught_up(root, nats_server.url, job, "lookups"), 60, "the shipper to catch up")
    shipper.close()
    with RemoteConsumer(nats_server.url, job, "reader", wait=30) as c:
        assert c.position()[0] == seen
        got = c.poll(max_batches=100)  # what the shipper shipped before the outage, up to the gap
        end = got.ranges[0][1]
        with pytest.raises(OffsetOutOfRangeError):
            while True:
                p = c.poll(timeout=0.5)
                assert not p.empty or c.position()[0] < c.end_offsets()[0], "no error at the gap"
                end = p.ranges[0][1]
    assert end < 60
    with RemoteConsumer(nats_server.url, job, "reader2", reset="earliest", wait=30) as c2:
        c2.seek(end)
        p = c2.poll(timeout=1.0)
        assert p.ranges[0][0] > end  # moved over the gap, by the policy
        with DeltaReader(root) as local:
            assert p.ranges[0][0] == local.position()[0]  # the log start: the first batch shipped after the gap


# ----------------------------------------------------------------------------- format, chunks, ids


def test_a_64_mib_record_is_chunked_and_arrives_bit_exact(tmp_path, nats_server):
    root = str(tmp_path / "log")
    with LmdbDeltaStore(os.path.join(root, "rank-0"), updateMode=UpdateMode.FIRST) as store:
        ids = torch.arange(1 << 20, dtype=torch.int64)
        store.append(0, "big.table", ids, torch.randn(1 << 20, 16))  # 64 MiB of states
        store.append(1, "small", torch.tensor([3, 1]), torch.randn(2, 16))
    with Shipper(root, nats_server.url, "job-d", channels=["lookups"]).start() as s:
        wait_for(lambda: bool(s.stats()) and s.stats()[0]["position"] == 2, 60, "the shipper")
        stats = s.stats()[0]
    assert stats["messages"] > 64  # chunked: the server's max payload is 1 MiB
    with RemoteConsumer(nats_server.url, "job-d", "r", wait=10) as c, DeltaReader(root) as local:
        got, want = c.poll(), local.poll()
        assert got.ranges == want.ranges == {0: (0, 2)}
        for fqn, w in want.ranks[0].tables.items():
            g = got.ranks[0].tables[fqn]
            assert torch.equal(g.ids, w.ids) and torch.equal(g.states, w.states), fqn
            assert torch.equal(g.global_ids, w.global_ids)


def test_the_streams_own_limit_drops_old_ranges_and_a_consumer_is_told(tmp_path, nats_server):
    """A stream created with a byte limit (discard=old) drops its oldest messages: a remote
    consumer whose next range was dropped gets OffsetOutOfRangeError, never a silent gap; with
    reset="earliest" it moves to the first range still whole on the stream and reads exactly the
    rows of the log over the range it reports. A new consumer starts at the first range there."""
    root = str(tmp_path / "log")
    limit = StreamOptions(max_bytes=256 << 10)

    def write_and_ship(batches: range) -> None:
        with LmdbDeltaStore(os.path.join(root, "rank-0"), updateMode=UpdateMode.LAST) as store:
            for b in batches:
                store.append(b, "t", torch.arange(b, b + 256), torch.full((256, 16), float(b)))  # 16 KiB per batch
        with Shipper(root, nats_server.url, "job-lim", channels=["lookups"], max_batches=1, stream=limit) as s:
            s.run(idle_exit_s=0.3)
            assert s.stats()[0]["position"] == batches.stop

    write_and_ship(range(0, 5))
    for name in ("strict", "lenient"):
        with RemoteConsumer(nats_server.url, "job-lim", name, wait=10) as c:
            assert c.poll().ranges == {0: (0, 5)}
            c.commit()
    write_and_ship(range(5, 40))  # 35 x 16 KiB more than the stream keeps: [5, ...) is dropped
    conn = nats.Connection(nats_server.url)
    try:
        info = conn.stream_state("job-lim")
    finally:
        conn.close()
    assert info["first_seq"] > 1 and info["bytes"] <= 256 << 10, info  # the server dropped the oldest
    with RemoteConsumer(nats_server.url, "job-lim", "strict", wait=10) as c:
        with pytest.raises(OffsetOutOfRangeError, match="dropped by its limits"):
            c.poll()
    for name, reset in (("lenient", "earliest"), ("newcomer", None)):
        with RemoteConsumer(nats_server.url, "job-lim", name, reset=reset, wait=10) as c:
            got = c.poll()
            (start, end), = got.ranges.values()
            assert 5 < start < end == 40, (name, got.ranges)
            with DeltaReader(root, start=start) as local:
                want = local.poll()
            assert want.ranges == {0: (start, 40)}
            g, w = got.ranks[0].tables["t"], want.ranks[0].tables["t"]
            assert torch.equal(g.ids, w.ids) and torch.equal(g.states, w.states), name


def test_key_listings_are_complete_while_keys_are_written(nats_server):
    """`offsets --server` and a consumer's metadata scan list a bucket's keys while shippers
    rewrite their statistics every second. Every listing holds every live key, and a deleted
    key is not listed. (nats-py's own ``keys()`` returned partial or empty listings here: 7 of
    300 with one key written every millisecond, which once emptied `offsets`' shipper table.)"""
    conn, writer = nats.Connection(nats_server.url), nats.Connection(nats_server.url)
    stop = threading.Event()

    def rewrite() -> None:
        i = 0
        while not stop.is_set():
            writer.kv_put("job-k", "meta", f"ship.{i % 2}.snapshots", b"s" * 300)
            i += 1

    try:
        conn.ensure_job("job-k", StreamOptions())
        for key in ("ship.0.snapshots", "ship.1.snapshots", "tables.0", "gone"):
            conn.kv_put("job-k", "meta", key, b"v" * 200)
        conn.kv_delete("job-k", "meta", "gone")
        t = threading.Thread(target=rewrite)
        t.start()
        try:
            listings = [list(conn.kv_entries("job-k", "meta")) for _ in range(400)]
        finally:
            stop.set()
            t.join()
        bad = [k for k in listings if sorted(k) != ["ship.0.snapshots", "ship.1.snapshots", "tables.0"]]
        assert not bad, f"{len(bad)} of {len(listings)} listings wrong, e.g. {bad[0]}"
        assert list(conn.kv_entries("job-k", "offsets")) == []
    finally:
        conn.close()
        writer.close()


@pytest.mark.dist
def test_a_replicated_tables_publishes_reach_a_remote_replica_bit_exact(tmp_path, nats_server):
    """A data-parallel table is published by every rank, each its own lookups: the remote replica
    takes, per row, the newest publish (per-row stamps shipped with the rows). One publish holds
    140,000 replicated rows, whose stamps alone outgrow the server's 1 MiB payload: they travel
    as chunked parts, not in the range marker."""
    from harness import global_table_weights
    from ship_cases import DP_ROWS, SEED, dp_trainer

    root, out, job = str(tmp_path / "log"), str(tmp_path / "out"), "job-dp"
    os.makedirs(out)
    run_spawn(dp_trainer, 2, root, out)
    want = assemble(out, 2)
    with DeltaReader(root, channel=SNAPSHOTS) as local:  # read before the shipper thread opens the logs to write
        ends = local.end_offsets()
    with Shipper(root, nats_server.url, job, channels=["snapshots"]).start() as s:
        wait_for(lambda: len(s.stats()) == 2 and all(st["position"] == ends[st["rank"]] for st in s.stats()), 60,
                 "the shipper")
        assert all(not st.get("last_error") for st in s.stats()), s.stats()
    init = global_table_weights(2, DP_ROWS, 4, SEED)
    tables = {fqn: init[fqn.rsplit(".", 1)[1]].clone() for fqn in want}
    with RemoteConsumer(nats_server.url, job, "r", channel=SNAPSHOTS, wait=30) as c:
        while c.position() != c.end_offsets():
            apply_poll(tables, c.poll(timeout=1.0), complete_only=True)
    for fqn in want:
        assert torch.equal(tables[fqn], want[fqn]), f"{fqn}: {int((tables[fqn] != want[fqn]).any(1).sum())} rows differ"


def test_remote_poll_max_bytes_cuts_at_range_ends_and_reads_at_least_one(tmp_path, nats_server):
    """RemoteConsumer.poll(max_bytes=) (a replica catching up): each poll stops at the range end
    after which the rows would exceed the limit, never splits a range, reads at least one, and
    the polls are contiguous and equal to a local read of the same ranges."""
    root = str(tmp_path / "log")
    with LmdbDeltaStore(os.path.join(root, "rank-0"), updateMode=UpdateMode.LAST) as store:
        for b in range(12):
            store.append(b, "t", torch.arange(100 * b, 100 * b + 100), torch.full((100, 16), float(b)))
    with Shipper(root, nats_server.url, "job-mb", channels=["lookups"], max_batches=2) as s:
        s.run(idle_exit_s=0.3)
    per_range = 2 * 100 * (8 + 16 * 4)  # two batches of 100 rows: int64 ids + 16 fp32
    for limit, want in ((2 * per_range, [(0, 4), (4, 8), (8, 12)]), (1, [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10),
                                                                           (10, 12)])):
        with RemoteConsumer(nats_server.url, "job-mb", f"r{limit}", wait=10) as c:
            got = []
            while c.position()[0] < 12:
                p = c.poll(max_bytes=limit)
                got.append(p.ranges[0])
                with DeltaReader(root, start=got[-1][0]) as local:
                    w = local.poll(max_batches=got[-1][1] - got[-1][0]).ranks[0].tables["t"]
                assert torch.equal(p.ranks[0].tables["t"].ids, w.ids) and torch.equal(p.ranks[0].tables["t"].states,
                                                                                     w.states)
            assert got == want, (limit, got)
    with RemoteConsumer(nats_server.url, "job-mb", "bad", wait=10) as c:
        with pytest.raises(InvalidInputError):
            c.poll(max_bytes=0)


def test_subjects_are_injective_and_valid_for_any_fqn():
    fqns = ["a.b", "a_b", "a b", "a*b", "a>b", "ü.ß", "x" * 400, "", "A.B", "a..b", "t"]
    names = [subjects.data_subject("j", "lookups", 0, f) for f in fqns]
    assert len(set(names)) == len(fqns)
    for f, s in zip(fqns, names):
        tokens = s.split(".")
        assert len(tokens) == 5 and all(t and all(c.isalnum() or c in "-_" for c in t) for t in tokens), s
        assert subjects.fqn_of_subject(s) == f
    with pytest.raises(Exception):
        subjects.check_job("a.b")


def test_resends_are_applied_once_format_is_checked_and_a_name_has_one_user(tmp_path, nats_server):
    """A range re-sent after the server's duplicate window (another epoch, the same batches)
    is dropped by the consumer; a message of another format version is refused; a second
    process with the same name is refused until the first one's claim expires (SIGKILL)."""
    root = str(tmp_path / "log")
    with LmdbDeltaStore(os.path.join(root, "rank-0"), updateMode=UpdateMode.LAST) as store:
        for b in range(6):
            store.append(b, "t", torch.tensor([b, 10 + b]), torch.full((2, 4), float(b)))
    with Shipper(root, nats_server.url, "job-e", channels=["lookups"], max_batches=2) as s:
        s.run(idle_exit_s=0.3)
    conn = nats.Connection(nats_server.url)
    try:
        rows = {"t": UniqueRows(ids=torch.tensor([0]), states=torch.full((1, 4), 99.0))}
        ring = resolve_keyring(None, False, "test")  # the session's stream key: a genuine (re-)send
        parts, marker, _ = wire.encode_range("job-e", "other-epoch", "lookups", 0, 0, 2, rows, 1 << 20, {"log_end": 6},
                                             ring=ring)
        assert not conn.send_all(parts + [marker])
        with RemoteConsumer(nats_server.url, "job-e", "r", wait=10) as c:
            p = c.poll()
            assert p.ranges == {0: (0, 6)}
            assert float(p.ranks[0].tables["t"].states[0, 0]) == 0.0  # the re-send was not applied over it
            c.commit()
            with pytest.raises(LogLockedError):
                RemoteConsumer(nats_server.url, "job-e", "r")
        headers = {**marker.headers, "PD-Format": "999"}
        sign_message(ring, "job-e", marker.subject, headers, marker.payload)  # signed: a newer shipper, not noise
        bad = wire.Message(subjects.end_subject("job-e", "lookups", 0), marker.payload, headers, "x")
        assert not conn.send_all([bad])
        with RemoteConsumer(nats_server.url, "job-e", "r", wait=10) as c:
            with pytest.raises(FormatMismatchError):
                c.poll()
            with pytest.raises(FormatMismatchError):
                c.poll()  # refused again, never skipped
    finally:
        conn.close()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from persistent_delta.fleet.remote import RemoteConsumer; "
        f"c = RemoteConsumer({nats_server.url!r}, 'job-e', 'held', wait=10); print('held', flush=True); time.sleep(60)")],
        env=_env(), stdout=subprocess.PIPE, text=True)
    _STARTED.append(holder)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(LogLockedError, match="pid"):
            RemoteConsumer(nats_server.url, "job-e", "held")
        holder.kill()
        holder.wait()
        with RemoteConsumer(nats_server.url, "job-e", "held", wait=20) as c:  # the dead holder's claim expired
            assert c.position() == {0: 0}
    finally:
        holder.kill()


def test_offsets_server_resets_and_deletes_remote_consumers(tmp_path, nats_server):
    import io

    root = str(tmp_path / "log")
    with LmdbDeltaStore(os.path.join(root, "rank-0"), updateMode=UpdateMode.NONE) as store:
        for b in range(5):
            store.append(b, "t", torch.tensor([b]))
    with Shipper(root, nats_server.url, "job-f", channels=["lookups"], max_batches=1) as s:
        s.run(idle_exit_s=0.3)
    with RemoteConsumer(nats_server.url, "job-f", "r", wait=10) as c:
        c.poll()
        c.commit()
    base = ["offsets", "--server", nats_server.url, "--job", "job-f"]
    buf = io.StringIO()
    assert cli_main(base + ["--reset", "r", "--to-batch", "2"], stdout=buf) == 0
    assert "DRY RUN" in buf.getvalue()
    with RemoteConsumer(nats_server.url, "job-f", "r", wait=10) as c:
        assert c.position() == {0: 5}
    assert cli_main(base + ["--reset", "r", "--to-batch", "2", "--execute"], stdout=io.StringIO()) == 0
    with RemoteConsumer(nats_server.url, "job-f", "r", wait=10) as c:
        assert c.position() == {0: 2}
        assert c.poll().ranges == {0: (2, 5)}
    assert cli_main(base + ["--delete", "r", "--execute"], stdout=io.StringIO()) == 0
    buf = io.StringIO()
    assert cli_main(base + ["--format", "json"], stdout=buf) == 0
    assert json.loads(buf.getvalue())["consumers"] == []


# ----------------------------------------------------------------------------- a 3-node cluster


def _cluster_case(tmp_path, cluster, batches: int) -> None:
    root = str(tmp_path / "log")
    store = LmdbDeltaStore(os.path.join(root, "rank-0"), updateMode=UpdateMode.LAST)
    shipper = Shipper(root, cluster.urls, "job-g", channels=["lookups"], max_batches=2,
                      stream=StreamOptions(replicas=3)).start()
    victim = random.Random(7).randrange(3)
    for b in range(batches):
        store.append(b, "t", torch.tensor([b % 7, 100 + b]), torch.full((2, 4), float(b)))
        if b == batches // 3:
            wait_for(lambda: shipper.stats() and shipper.stats()[0]["position"] > 0, 60, "the first ranges")
            cluster.servers[victim].kill()  # SIGKILL one node mid-run
        time.sleep(0.01)
    store.close()
    wait_for(lambda: shipper.stats() and shipper.stats()[0]["position"] == batches, 90, "the shipper")
    shipper.close()
    others = [s.url for i, s in enumerate(cluster.servers) if i != victim]
    with RemoteConsumer(others, "job-g", "r", wait=30) as c, DeltaReader(root) as local:
        got, want = c.poll(), local.poll()
        assert got.ranges == want.ranges == {0: (0, batches)}
        g, w = got.ranks[0].tables["t"], want.ranks[0].tables["t"]
        assert torch.equal(g.ids, w.ids) and torch.equal(g.states, w.states)


def test_cluster_of_three_loses_nothing_when_a_node_is_killed(tmp_path, nats_cluster):
    _cluster_case(tmp_path, nats_cluster, 30)


@pytest.mark.slow
def test_cluster_of_three_long(tmp_path, nats_cluster):
    _cluster_case(tmp_path, nats_cluster, 400)
