"""DeltaLog: process rules (one writer, many readers, fork), crash atomicity, map growth."""

import os
import signal
import time

import pytest
import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta.errors import ForkedProcessError
from persistent_delta import LmdbDeltaStore, LogLockedError
from persistent_delta.config import LogOptions
from persistent_delta.log.deltalog import DeltaLog

from procs import SUPPORT, popen_python, run_python


def test_second_writer_process_refused_while_reader_reads(log_dir):
    with LmdbDeltaStore(log_dir) as store:
        store.append(0, "t", torch.tensor([1, 2]))
        store.flush()
        # A reader process reads while this process writes ...
        reader = run_python(
            """
            import sys
            from persistent_delta import LmdbDeltaStore
            with LmdbDeltaStore(sys.argv[1], readonly=True) as ro:
                print(ro.get_unique()["t"].ids.tolist())
            """,
            log_dir,
        )
        assert reader.stdout.strip() == "[1, 2]"
        # ... and a second writer process is refused, with our pid in the message.
        writer = run_python(
            """
            import sys
            from persistent_delta import LmdbDeltaStore, LogLockedError
            try:
                LmdbDeltaStore(sys.argv[1])
            except LogLockedError as e:
                print("REFUSED", e)
            """,
            log_dir,
        )
        assert writer.stdout.startswith("REFUSED") and f"pid {os.getpid()}" in writer.stdout
        # a second writer handle in this process is refused too
        with pytest.raises(LogLockedError):
            LmdbDeltaStore(log_dir)
        store.append(1, "t", torch.tensor([3]))
    # once closed, another process may write
    run_python(
        """
        import sys, torch
        from persistent_delta import LmdbDeltaStore
        with LmdbDeltaStore(sys.argv[1]) as s:
            s.append(2, "t", torch.tensor([4]))
        """,
        log_dir,
    )
    with LmdbDeltaStore(log_dir) as store:
        assert store.get_unique()["t"].ids.tolist() == [1, 2, 3, 4]


def test_writer_lock_released_when_writer_is_killed(log_dir):
    proc = popen_python(
        """
        import sys, time, torch
        from persistent_delta import LmdbDeltaStore
        s = LmdbDeltaStore(sys.argv[1])
        s.append(0, "t", torch.tensor([1]))
        print("READY", flush=True)
        time.sleep(60)
        """,
        log_dir,
    )
    assert proc.stdout.readline().strip() == "READY"
    with pytest.raises(LogLockedError, match=f"pid {proc.pid}"):
        LmdbDeltaStore(log_dir)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with LmdbDeltaStore(log_dir) as store:
        assert store.get_unique()["t"].ids.tolist() == [1]


def test_sigkill_mid_append_leaves_log_as_of_last_commit(log_dir):
    """A writer appends large multi-record groups in a loop and reports each commit; killed at a
    random instant, the log holds every reported group, whole, and nothing torn."""
    proc = popen_python(
        """
        import sys, torch
        from persistent_delta import LmdbDeltaStore
        from persistent_delta.log.records import AppendRecord
        s = LmdbDeltaStore(sys.argv[1], __import__("torchrec").distributed.model_tracker.types.UpdateMode.FIRST)
        b = 0
        while True:
            recs = [AppendRecord(b, f"t{k}", torch.full((20000,), b, dtype=torch.int64) + torch.arange(20000),
                                 torch.full((20000, 16), float(b))) for k in range(4)]
            s.append_many(recs)
            print(b, flush=True)
            b += 1
        """,
        log_dir,
    )
    committed = -1
    deadline = time.time() + 60
    while committed < 15 and time.time() < deadline:
        committed = int(proc.stdout.readline())
    time.sleep(0.05 + (os.getpid() % 7) * 0.01)
    proc.send_signal(signal.SIGKILL)
    rest = proc.stdout.read().split()
    proc.wait()
    if rest:
        committed = int(rest[-1])
    assert committed >= 15
    with LmdbDeltaStore(log_dir, UpdateMode.FIRST) as store:
        lookups = store.per_fqn_lookups
        assert sorted(lookups) == ["t0", "t1", "t2", "t3"]
        batches = [[lk.batch_idx for lk in lookups[f"t{k}"]] for k in range(4)]
        # every table has the same batches (groups are atomic), contiguous from 0
        assert all(b == batches[0] for b in batches)
        assert batches[0] == list(range(len(batches[0])))
        # all reported commits are there; at most one more (committed, not yet printed)
        assert committed + 1 <= len(batches[0]) <= committed + 2
        for k in range(4):
            for lk in lookups[f"t{k}"]:
                assert lk.ids.numel() == 20000 and bool((lk.states == float(lk.batch_idx)).all())


def test_map_grows_by_itself(log_dir):
    opts = LogOptions(map_size=256 << 10)  # 256 KiB: full after a few records
    with LmdbDeltaStore(log_dir, UpdateMode.LAST, options=opts) as store:
        for b in range(40):
            store.append(b, "t", torch.arange(1000) + b, torch.randn(1000, 16))
        assert store.log.stat()["map_size"] > 256 << 10
        assert len(store.per_fqn_lookups["t"]) == 40
    # reopening with the small default does not shrink the map below the data
    with LmdbDeltaStore(log_dir, UpdateMode.LAST, options=opts) as store:
        assert len(store.per_fqn_lookups["t"]) == 40


def test_reader_process_follows_map_growth(log_dir):
    """A reader process opened before the writer grows the map keeps reading correctly."""
    opts = LogOptions(map_size=256 << 10)
    expected = 1 + 59 * 2000
    with LmdbDeltaStore(log_dir, options=opts) as store:
        store.append(0, "t", torch.tensor([0]))
        reader = popen_python(
            """
            import sys, time
            from persistent_delta import LmdbDeltaStore
            with LmdbDeltaStore(sys.argv[1], readonly=True) as ro:
                print("OPEN", len(ro.get_unique()["t"].ids), flush=True)
                deadline = time.time() + 60
                n = 0
                while n < int(sys.argv[2]) and time.time() < deadline:
                    n = len(ro.get_unique()["t"].ids)
                    time.sleep(0.02)
                print("SEEN", n, flush=True)
            """,
            log_dir, str(expected),
        )
        assert reader.stdout.readline().split() == ["OPEN", "1"]
        for b in range(1, 60):
            store.append(b, "t", torch.arange(2000) + b * 2000)
        assert store.log.stat()["map_size"] > 256 << 10
        out, err = reader.communicate(timeout=90)
        assert reader.returncode == 0, err
        assert out.split() == ["SEEN", str(expected)]


def test_reader_of_several_logs_at_once_follows_map_growth(tmp_path):
    """read_all (a poll's transactions on every rank log at once) adopts a map another process
    grew, as DeltaLog.read does, and reads every log again."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    opts = LogOptions(map_size=256 << 10)
    expected = 1 + 59 * 2000
    with LmdbDeltaStore(a, options=opts) as grown, LmdbDeltaStore(b, options=opts) as other:
        grown.append(0, "t", torch.tensor([0]))
        other.append(0, "t", torch.tensor([7, 8]))
        reader = popen_python(
            """
            import sys, time
            from torchrec.distributed.model_tracker.types import UpdateMode
            from persistent_delta.log.deltalog import DeltaLog, read_all
            from persistent_delta.log.records import read_unique

            def count(txns):
                return [len(read_unique(r, UpdateMode.NONE)["t"].ids) for r in txns]

            from persistent_delta.config import LogOptions
            small = LogOptions(map_size=256 << 10)  # (so that the writer's growth passes this reader's map)
            with DeltaLog(sys.argv[1], readonly=True, options=small) as la, \\
                    DeltaLog(sys.argv[2], readonly=True, options=small) as lb:
                print("OPEN", *read_all([la, lb], count), flush=True)
                deadline = time.time() + 60
                n = [0, 0]
                while n[0] < int(sys.argv[3]) and time.time() < deadline:
                    n = read_all([lb, la], count)[::-1]
                    time.sleep(0.02)
                print("SEEN", *n, flush=True)
            """,
            a, b, str(expected),
        )
        assert reader.stdout.readline().split() == ["OPEN", "1", "2"]
        for k in range(1, 60):
            grown.append(k, "t", torch.arange(2000) + k * 2000)
        assert grown.log.stat()["map_size"] > 256 << 10
        out, err = reader.communicate(timeout=90)
        assert reader.returncode == 0, err
        assert out.split() == ["SEEN", str(expected), "2"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_cannot_use_parent_handle(log_dir):
    with DeltaLog(log_dir) as log:
        pid = os.fork()
        if pid == 0:  # child
            code = 1
            try:
                log.read(lambda r: r.consumers())
            except ForkedProcessError:
                code = 0
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
        assert log.read(lambda r: r.consumers()) == {}  # parent still fine


_OPS_CHILD = """
import sys, torch
from torchrec.distributed.model_tracker.types import UpdateMode
from persistent_delta import LmdbDeltaStore
sys.path[:0] = sys.argv[2:]  # this file's folder and tests/support, which it imports from
from test_log import ops
s = LmdbDeltaStore(sys.argv[1], UpdateMode.FIRST)
stream = ops(100000)
print("READY", flush=True)
for i, op in enumerate(stream):
    op(s)
    print(i, flush=True)
"""


def ops(n):
    """A deterministic stream of store mutations: appends, compactions, deletions."""
    import torch

    out = []
    b = 0
    while len(out) < n:
        for k in range(3):
            ids = torch.arange(b * 7, b * 7 + 3000) % 5000 + k
            out.append(lambda s, b=b, k=k, ids=ids: s.append(b, f"t{k}", ids, torch.full((ids.numel(), 8), float(b))))
        if b % 3 == 2:
            out.append(lambda s, b=b: s.compact(max(0, b - 5), b + 1))
        if b % 4 == 3:
            out.append(lambda s, b=b: s.delete(b - 6))
        b += 1
    return out[:n]


@pytest.mark.parametrize("kill_after", [0.6, 1.1, 1.7])
def test_sigkill_during_compaction_and_deletion(log_dir, kill_after):
    """Killed at a random instant of a stream of appends, compactions and deletions, the log
    equals a model (TorchRec's DeltaStoreTrec) after exactly the ops reported done, or one more."""
    import threading

    from torchrec.distributed.model_tracker.delta_store import DeltaStoreTrec

    proc = popen_python(_OPS_CHILD, log_dir, os.path.dirname(os.path.abspath(__file__)), SUPPORT)
    assert proc.stdout.readline().strip() == "READY", proc.stderr.read()
    done: list = []
    reader = threading.Thread(target=lambda: done.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    time.sleep(kill_after)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    reader.join(5)
    k = int(done[-1]) + 1 if done else 0
    assert k > 5, proc.stderr.read()
    with LmdbDeltaStore(log_dir, UpdateMode.FIRST) as store:
        got = store.get_unique(0)
        got_batches = {f: [lk.batch_idx for lk in v] for f, v in store.per_fqn_lookups.items()}
    stream = ops(k + 1)
    matched = False
    for n in (k, k + 1):
        model = DeltaStoreTrec(UpdateMode.FIRST)
        for op in stream[:n]:
            op(model)
        want_batches = {f: [lk.batch_idx for lk in v] for f, v in model.per_fqn_lookups.items()}
        if want_batches != got_batches:
            continue
        ok = True
        for fqn, lookups in model.per_fqn_lookups.items():
            if not lookups:
                ok &= got[fqn].ids.numel() == 0
                continue
            rows = model.get_unique(0)[fqn]
            order = torch.argsort(rows.ids)
            ok &= torch.equal(got[fqn].ids, rows.ids[order]) and torch.equal(got[fqn].states, rows.states[order])
        matched |= ok
    assert matched, (k, got_batches)


_MALLOC_PROBE = """
import ctypes, os, sys, tempfile
for kv in sys.argv[1:]:
    k, v = kv.split("=", 1)
    os.environ[k] = v
from persistent_delta.log import alloc
from persistent_delta.log.deltalog import DeltaLog
d = os.environ.get("PROBE_LOG") or tempfile.mkdtemp()
DeltaLog(d, readonly=bool(os.environ.get("PROBE_LOG"))).close()  # PROBE_LOG: open an existing log read-only
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = libc.sbrk.restype = ctypes.c_void_p
libc.malloc.argtypes, libc.sbrk.argtypes = [ctypes.c_size_t], [ctypes.c_ssize_t]
p = libc.malloc(8 << 20)
print(alloc._applied, p < libc.sbrk(0))  # a heap block lies below the program break
"""


@pytest.mark.parametrize(
    "env, applied",
    [
        ((), "None"),  # off by default: process-wide
        (("PERSISTENT_DELTA_TUNE_MALLOC=1",), "True"),
        (("PERSISTENT_DELTA_TUNE_MALLOC=1", "MALLOC_TRIM_THRESHOLD_=1000000"), "False"),  # the user's own tuning wins
    ],
)
def test_opted_in_writer_keeps_large_buffers_in_the_heap(env, applied):
    out = run_python(_MALLOC_PROBE, *env).stdout.split()
    assert out[0] == applied
    if applied == "True":
        assert out[1] == "True"  # an 8 MiB block came from the heap, not from its own mmap


@pytest.mark.parametrize("opt_in", [False, True])
def test_opted_in_reader_keeps_large_buffers_in_the_heap(tmp_path, opt_in):
    """A replica's polls page-fault their results in afresh without it (see LogOptions.tune_malloc: opening a
    log for reading applies the opt-in too)."""
    d = str(tmp_path / "log")
    DeltaLog(d).close()
    env = [f"PROBE_LOG={d}"] + (["PERSISTENT_DELTA_TUNE_MALLOC=1"] if opt_in else [])
    out = run_python(_MALLOC_PROBE, *env).stdout.split()
    assert out == (["True", "True"] if opt_in else ["None", "False"])
