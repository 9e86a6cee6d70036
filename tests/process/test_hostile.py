"""Operator mistakes and hostile input: filters that would skip data,
table names that are not file names, and row shapes that change."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta import DeltaConsumer, DeltaReader, LmdbDeltaStore
from persistent_delta.errors import InvalidInputError
from persistent_delta.cli import main
from persistent_delta.serve.replay import file_name, load_export, replay
from procs import REPO


def _store(path: str, fqns, batches: int = 3) -> None:
    with LmdbDeltaStore(path, UpdateMode.NONE) as s:
        for b in range(batches):
            for i, fqn in enumerate(fqns):
                s.append(b, fqn, torch.arange(i, i + 5 + b))


def test_a_table_filter_that_matches_nothing_is_refused(tmp_path):
    path = str(tmp_path / "log")
    _store(path, ["emb.user", "emb.item"])
    for bad in (["emb.usr"], "emb.user", [1]):
        with pytest.raises(InvalidInputError):
            DeltaConsumer(path, "c", tables=bad)
        with pytest.raises(InvalidInputError):
            DeltaReader(path, tables=bad)
    with DeltaConsumer(path, "c", tables=["emb.user"]) as c:
        assert {d.fqn for d in c.poll()} == {"emb.user"}
    assert main(["replay", path, "--from-batch", "0", "--to-batch", "3", "--tables", "nope", "--dry-run"]) == 1


def test_replay_file_names_are_unique_and_safe_for_every_fqn(tmp_path):
    path = str(tmp_path / "log")
    fqns = ["emb/user", "emb_user", "nul\x00table", "x" * 400, "plain.name", "..hidden", "é/ü"]
    _store(path, fqns)
    names = [file_name(f) for f in fqns]
    assert len(set(names)) == len(fqns)
    assert all("/" not in n and "\x00" not in n and len(n) < 100 and not n.startswith(".") for n in names)
    assert file_name("plain.name") == "plain.name"  # plain names stay readable
    out = str(tmp_path / "out")
    report = replay(path, out, from_batch=0, to_batch=3)
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    by_fqn = {f["fqn"]: f["path"] for f in manifest["files"]}
    assert set(by_fqn) == set(fqns) and len(set(by_fqn.values())) == len(fqns)
    for fqn, rel in by_fqn.items():
        tensors, meta = load_export(os.path.join(out, rel))
        assert meta["fqn"] == fqn and tensors["ids"].numel() > 0
    assert len(report.files) == len(fqns)


def test_a_failed_replay_leaves_no_partial_output(tmp_path):
    path = str(tmp_path / "log")
    _store(path, ["a", "b"])
    out = str(tmp_path / "out")
    # a shard checkpoint holding only rows [10, 20) of table "a": the snapshot of the changed rows
    # (ids < 10) fails after every span file was written
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(ckpt)
    from safetensors.torch import save_file
    save_file({"a": torch.zeros(10, 4)}, os.path.join(ckpt, "rank-0.safetensors"),
              metadata={"format": "persistent_delta.shards/1", "rank": "0", "shards": json.dumps(
                  {"a": {"table_name": "a", "sharding_type": "row_wise", "row_offset": 10, "col_offset": 0,
                         "local_rows": 10, "local_cols": 4, "global_rows": 20, "global_cols": 4}})})
    with pytest.raises(InvalidInputError, match="no shard for rows"):
        replay(path, out, from_batch=0, to_batch=3, shard_files=ckpt)
    assert not os.path.exists(out)  # it created out: it removed it
    os.makedirs(out)
    with pytest.raises(InvalidInputError):
        replay(path, out, from_batch=0, to_batch=3, shard_files=ckpt)
    assert os.listdir(out) == []  # an existing directory is left as it was


def test_a_table_keeps_one_row_shape(tmp_path):
    path = str(tmp_path / "log")
    with LmdbDeltaStore(path, UpdateMode.FIRST) as s:
        s.append(0, "t", torch.tensor([1, 2]), torch.ones(2, 4))
        for bad in (torch.ones(1, 5), torch.ones(1, 4, dtype=torch.float64), torch.ones(1)):
            with pytest.raises(InvalidInputError, match="row shape"):
                s.append(1, "t", torch.tensor([3]), bad)
        s.delete(None)
        with pytest.raises(InvalidInputError, match="row shape"):  # fixed after delete(None) too
            s.append(2, "t", torch.tensor([3]), torch.ones(1, 5))
        s.append(2, "t", torch.tensor([3]), torch.ones(1, 4))
        assert s.get_unique(0)["t"].states.shape == (1, 4)
    assert main(["verify", path]) == 0


def test_cli_and_number_edges(tmp_path, capsys):
    path = str(tmp_path / "log")
    _store(path, ["t"])
    with DeltaConsumer(path, "c") as c:
        for bad in (2**63, 2**64, -1, 1.5, True):
            with pytest.raises(InvalidInputError):
                c.seek(bad)
    with LmdbDeltaStore(path, UpdateMode.NONE) as s:
        for bad in (2**64, 1.5, None):
            with pytest.raises(InvalidInputError):
                s.get_unique(bad)
        assert s.get_unique(-1)["t"].ids.numel() > 0  # TorchRec's tracker reads with -1
    assert main(["offsets", path, "--reset", "c", "--to-batch", "0", "--execute"]) == 0
    assert main(["offsets", path, "--reset", "c", "--shift-by", "0"]) == 0
    capsys.readouterr()
    with pytest.raises(InvalidInputError) as info:
        with LmdbDeltaStore(str(tmp_path / "s2"), UpdateMode.NONE) as s:
            s.append(0, "x" * 10_000, torch.tensor([1]))
    assert len(str(info.value)) < 300  # the name is not repeated whole
    regular = tmp_path / "file"
    regular.write_text("x")
    from persistent_delta.errors import NotALogError
    with pytest.raises(NotALogError, match="is a file"):
        LmdbDeltaStore(str(regular))
    bad_ckpt = tmp_path / "ckpt"
    bad_ckpt.mkdir()
    from safetensors.torch import save_file
    save_file({"t": torch.zeros(4, 2)}, str(bad_ckpt / "rank-0.safetensors"),
              metadata={"format": "persistent_delta.shards/1", "rank": "0", "shards": "{not json"})
    assert main(["replay", path, "--from-batch", "0", "--to-batch", "3", "--out", str(tmp_path / "o"),
                 "--shard-files", str(bad_ckpt)]) == 1
    assert "malformed shard file" in capsys.readouterr().err
    save_file({"t": torch.zeros(4, 2)}, str(bad_ckpt / "rank-0.safetensors"),
              metadata={"format": "persistent_delta.shards/1", "rank": "0", "shards": json.dumps(
                  {"t": {"row_offset": 0, "col_offset": 0, "global_rows": 4, "global_cols": 10**12}})})
    assert main(["replay", path, "--from-batch", "0", "--to-batch", "3", "--out", str(tmp_path / "o"),
                 "--shard-files", str(bad_ckpt)]) == 1


def test_logs_are_owner_only_unless_group_access(tmp_path):
    from persistent_delta.config import LogOptions

    old = os.umask(0o022)
    try:
        for group, dmode, fmode in ((False, 0o700, 0o600), (True, 0o770, 0o660)):
            path = str(tmp_path / f"log-{group}")
            with LmdbDeltaStore(path, UpdateMode.NONE, options=LogOptions(group_access=group)) as s:
                s.append(0, "t", torch.tensor([1]))
            assert os.stat(path).st_mode & 0o777 == dmode
            for name in ("data.mdb", "lock.mdb", "writer.lock"):
                assert os.stat(os.path.join(path, name)).st_mode & 0o777 == fmode, (group, name)
    finally:
        os.umask(old)


HOLD_OPEN = """
import sys, time
from persistent_delta import DeltaReader
r = DeltaReader(sys.argv[1])
r.poll()
print("OPEN", flush=True)
time.sleep(60)
"""


def test_a_deleted_lock_file_stops_writers_and_vacuum(tmp_path, capsys):
    import signal
    import subprocess
    import sys

    from persistent_delta import LogLockedError

    path = str(tmp_path / "log")
    _store(path, ["t"])
    s = LmdbDeltaStore(path, UpdateMode.NONE)
    os.unlink(os.path.join(path, "lock.mdb"))
    with pytest.raises(LogLockedError, match="lock.mdb was deleted"):
        s.append(9, "t", torch.tensor([1]))
    s.close()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", HOLD_OPEN, path], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "OPEN"
        os.unlink(os.path.join(path, "lock.mdb"))  # the reader's lock table is gone
        assert main(["vacuum", path]) == 1
        assert f"process {proc.pid}" in capsys.readouterr().err
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def _replay_output(tmp_path) -> str:
    path, out = str(tmp_path / "log"), str(tmp_path / "replay")
    _store(path, ["emb.user"], batches=3)
    replay(path, out, from_batch=0, to_batch=3)
    return out


def _rewrite(out: str, change) -> None:
    mpath = os.path.join(out, "manifest.json")
    manifest = json.load(open(mpath))
    change(manifest)
    with open(mpath, "w") as f:
        json.dump(manifest, f)


def _apply_refused(inputs, match: str, **kw) -> None:
    """apply (and its dry run) refuses ``inputs`` with a typed error, within seconds (a FIFO
    must not make it wait for a writer)."""
    import threading

    from persistent_delta.serve.apply_files import apply_inputs

    for dry_run in (True, False):
        got = []

        def run() -> None:
            try:
                apply_inputs(inputs, out=None if dry_run else inputs[0] + ".replica", dry_run=dry_run, **kw)
                got.append(None)
            except Exception as exc:  # noqa: BLE001 - the test looks at its type
                got.append(exc)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(20)
        assert not t.is_alive(), f"apply hung on {inputs}"
        assert isinstance(got[0], InvalidInputError), repr(got[0])
        assert match in str(got[0]), str(got[0])


def test_apply_reads_only_regular_files_inside_its_input(tmp_path):
    """Paths in a replay manifest that leave the input (absolute, ``..``, a symbolic link), a
    FIFO or device where a file or the manifest should be, and a FIFO as ``--replica``: refused
    with a typed error naming it, never read, never waited on; the dry run refuses them too."""
    out = _replay_output(tmp_path)
    assert main(["apply", out, "--dry-run"]) == 0
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    real = next(f["path"] for f in manifest["files"] if f["path"])
    outside = str(tmp_path / "outside.safetensors")
    os.rename(os.path.join(out, real), outside)

    def set_path(p):
        return lambda m: [f.update(path=p) for f in m["files"] if f["path"]]

    _rewrite(out, set_path(outside))
    _apply_refused([out], "leaves the input directory")
    _rewrite(out, set_path(os.path.join("..", "outside.safetensors")))
    _apply_refused([out], "leaves the input directory")
    os.symlink(outside, os.path.join(out, real))
    _rewrite(out, set_path(real))
    _apply_refused([out], "symbolic link")
    os.unlink(os.path.join(out, real))
    os.mkfifo(os.path.join(out, real))
    _apply_refused([out], "not a regular file")
    assert main(["apply", out, "--dry-run"]) == 1
    os.unlink(os.path.join(out, real))
    os.rename(outside, os.path.join(out, real))
    assert main(["apply", out, "--dry-run"]) == 0
    fifo = str(tmp_path / "replica.fifo")
    os.mkfifo(fifo)
    _apply_refused([out], "the replica", replica=fifo)
    mpath = os.path.join(out, "manifest.json")
    os.rename(mpath, mpath + ".real")
    os.mkfifo(mpath)
    _apply_refused([out], "the manifest")
    os.unlink(mpath)
    os.symlink(mpath + ".real", mpath)
    _apply_refused([out], "symbolic link")


@pytest.mark.parametrize("change,match", [
    (lambda m: m.clear(), "not a replay manifest"),
    (lambda m: m.update(ranges=5), "'ranges'"),
    (lambda m: m.update(ranges={"-1": [0, 3]}), "is not a rank"),
    (lambda m: m.update(ranges={"0": [5, 2]}), "ends before it starts"),
    (lambda m: m.update(ranges={"0": [0, 10 ** 30]}), "not an integer in"),
    (lambda m: m.update(ranges={"0": [0, "3"]}), "not an integer in"),
    (lambda m: m.update(ranges={"0": [0]}), "is not [start, end]"),
    (lambda m: m.update(files=[1]), "is not an object"),
    (lambda m: m.update(files={"a": 1}), "'files' must be a list"),
    (lambda m: [f.update(kind="bogus") for f in m["files"]], "invalid"),
    (lambda m: [f.update(start_idx=10 ** 30) for f in m["files"]], "start_idx"),
    (lambda m: [f.update(fqn="other") for f in m["files"]], "not the delta export of 'other'"),
    (lambda m: [f.update(path=7) for f in m["files"]], "is not a relative file name"),
])
def test_apply_validates_every_manifest_field(tmp_path, change, match):
    """Malformed manifests give a typed error naming the field (no AttributeError, KeyError,
    TypeError, SafetensorError traceback), and ``--dry-run`` exits 1 on them."""
    out = _replay_output(tmp_path)
    _rewrite(out, change)
    _apply_refused([out], match)
    assert main(["apply", out, "--dry-run"]) == 1


def test_apply_refuses_malformed_export_files(tmp_path):
    """A file the manifest names that is not a safetensors export, or whose tensors do not fit
    (a truncated file, a snapshot with negative ids): a typed error naming the file."""
    from safetensors.torch import save_file

    out = _replay_output(tmp_path)
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    real = os.path.join(out, next(f["path"] for f in manifest["files"] if f["path"]))
    data = open(real, "rb").read()
    with open(real, "wb") as f:
        f.write(data[: len(data) // 2])
    _apply_refused([out], "malformed export")
    meta = {"format": manifest["format"], "kind": "snapshot", "fqn": "emb.user", "start_idx": "0", "end_idx": "3"}
    save_file({"ids": torch.tensor([-1, 2]), "values": torch.zeros(2, 4)}, real, metadata=meta)
    _rewrite(out, lambda m: [f.update(kind="snapshot") for f in m["files"] if f["path"]])
    _apply_refused([out], "negative ids")


def test_vacuum_is_a_dry_run_without_execute(tmp_path, capsys):
    """Destructive actions need ``--execute``: ``vacuum ROOT`` checks and reports, and changes
    nothing; ``--execute`` compacts."""
    path = str(tmp_path / "log")
    _store(path, ["emb.user", "emb.item"], batches=40)
    with LmdbDeltaStore(path, UpdateMode.NONE) as s:
        s.delete(38)
    data = os.path.join(path, "data.mdb")
    size, mtime = os.path.getsize(data), os.stat(data).st_mtime_ns
    capsys.readouterr()
    assert main(["vacuum", path]) == 0, capsys.readouterr().err
    assert "DRY RUN" in capsys.readouterr().out
    assert (os.path.getsize(data), os.stat(data).st_mtime_ns) == (size, mtime)
    assert main(["vacuum", path, "--execute"]) == 0
    assert os.path.getsize(data) < size


def test_upgrade_and_vacuum_refuse_another_applications_lmdb_and_create_nothing(tmp_path, capsys):
    """An LMDB file of another application given to ``upgrade`` or ``vacuum`` (dry run or not):
    a typed error saying so, and not one file created or changed in its directory."""
    import lmdb

    path = str(tmp_path / "foreign")
    env = lmdb.open(path, max_dbs=4)
    with env.begin(write=True) as t:
        t.put(b"k", b"v", db=env.open_db(b"things", txn=t))
    env.close()
    def files() -> dict:  # lock.mdb is LMDB's own reader table, reset by every opener
        return {n: os.stat(os.path.join(path, n)).st_mtime_ns for n in os.listdir(path) if n != "lock.mdb"}

    before = files()
    for cmd in (["upgrade"], ["upgrade", "--execute"], ["vacuum"], ["vacuum", "--execute"]):
        capsys.readouterr()
        assert main([cmd[0], path] + cmd[1:]) == 1
        assert "another application" in capsys.readouterr().err
        assert files() == before, cmd


def test_a_healthy_log_whose_file_ends_in_free_pages_opens(tmp_path):
    """LMDB does not write a page a transaction allocated and freed again: a healthy file may
    end short of the committed meta's next page, by free pages only. It opens (it was refused
    as truncated); a file cut into pages in use is still refused (tests/fuzz/test_damage.py)."""
    import lmdb

    path = str(tmp_path / "log")
    _store(path, ["emb.user", "emb.item"], batches=40)
    with LmdbDeltaStore(path, UpdateMode.NONE) as s:
        s.delete(38)
    env = lmdb.open(path, readonly=True, lock=False, max_dbs=32)
    next_page_end = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    env.close()
    assert os.path.getsize(os.path.join(path, "data.mdb")) < next_page_end  # the case itself
    with DeltaReader(path) as r:
        assert not r.poll().empty
    assert main(["verify", path]) == 0


@pytest.mark.parametrize("key", ["update_mode", "closed_end"])
def test_a_damaged_meta_key_name_is_damage(tmp_path, capsys, key):
    """A flipped byte in a meta key's name would hide the setting (read as its default: a poll
    then returns other rows): an unknown meta key is refused as damage on open, and verify says
    DAMAGED."""
    from persistent_delta.errors import DamagedLogError
    from persistent_delta.log.deltalog import DeltaLog

    path = str(tmp_path / "log")
    with LmdbDeltaStore(path, UpdateMode.FIRST) as s:
        for b in range(5):
            s.append(b, "t", torch.arange(b, b + 5), torch.ones(5, 4) * b)
    with DeltaLog(path) as log:
        log.write(lambda w: w.set_meta("closed_end", 5))
    data = os.path.join(path, "data.mdb")
    raw = open(data, "rb").read()
    assert raw.count(key.encode()) >= 1
    with open(data, "wb") as f:
        f.write(raw.replace(key.encode(), key[:-1].encode() + b"\x7e"))
    with pytest.raises(DamagedLogError, match="meta database holds keys"):
        DeltaReader(path)
    capsys.readouterr()
    assert main(["verify", path]) == 1
    assert "meta database holds keys" in capsys.readouterr().out


def test_an_empty_data_file_in_one_rank_is_damage(tmp_path, capsys):
    """Rank 0's ``data.mdb`` wiped to 0 bytes in a 2-rank job: verify, offsets and replay's dry
    run exit 1 naming the file at once (a one-shot tool never calls the job healthy, even while
    the file may be a creation in progress), and once it has stayed empty past the grace a
    reader or consumer is refused instead of polling rank 1 alone as if nothing were wrong. A
    fresh empty file is a creation in progress to a live reader, which reads rank 1 meanwhile."""
    from logs import fill_ranks

    from persistent_delta.errors import DamagedLogError

    root = str(tmp_path / "log")
    fill_ranks(root, lambda r, b: [("t", torch.arange(b, b + 5) + 100 * r, None)], ranks=2, batches=6)
    DeltaConsumer(root, "c").close()
    data = os.path.join(root, "rank-0", "data.mdb")
    open(data, "wb").close()
    with DeltaReader(root) as r:  # just emptied: may be a creation in progress
        assert r.ranks == [1]
    os.utime(data)  # emptied now, however long the reader took
    for cmd in (["verify", root], ["offsets", root]):
        capsys.readouterr()
        assert main(cmd) == 1, cmd
        err = capsys.readouterr().err
        assert f"{data}: empty (0 bytes)" in err and "a creation still in progress" in err, err
    os.utime(data, (1, 1))
    for cmd in (["verify", root], ["offsets", root], ["replay", root, "--from-batch", "0", "--to-batch", "6",
                                                       "--dry-run"]):
        capsys.readouterr()
        assert main(cmd) == 1, cmd
        assert f"{data}: empty (0 bytes)" in capsys.readouterr().err
    for open_ in (lambda: DeltaReader(root), lambda: DeltaConsumer(root, "c")):
        with pytest.raises(DamagedLogError, match="empty"):
            open_()


def _shard_file(path: str, shards: dict, weights: torch.Tensor) -> None:
    from safetensors.torch import save_file

    save_file({"t": weights}, path, metadata={"format": "persistent_delta.shards/1", "rank": "0", "batch_idx": "0",
                                             "shards": json.dumps({"t": shards})})


@pytest.mark.parametrize("rows,cols", [(10 ** 12, 1), (10 ** 12, 10 ** 12), (10 ** 400, 1)], ids=["1e12", "1e12x1e12", "1e400"])
def test_a_shard_file_claiming_a_huge_table_is_refused_before_allocating(tmp_path, capsys, rows, cols):
    """A few hundred bytes of shard file that claim ``global_rows`` x ``global_cols`` far past
    the values they hold: ``apply`` and ``load_base`` refuse it with a typed error naming the
    file and the claimed size, before allocating anything of that size (no allocator error, no
    OOM kill)."""
    from persistent_delta import load_base

    base = tmp_path / "base"
    base.mkdir()
    f = str(base / "rank-0.safetensors")
    _shard_file(f, {"row_offset": 0, "col_offset": 0, "local_rows": 1, "local_cols": 1,
                    "global_rows": rows, "global_cols": cols}, torch.zeros(1, 1))
    assert os.path.getsize(f) < 1024
    with pytest.raises(InvalidInputError, match=rf"rank-0\.safetensors\) claim a table of {rows} x {cols}"):
        load_base(str(base))
    capsys.readouterr()
    assert main(["apply", str(base), "--out", str(tmp_path / "replica")]) == 1
    err = capsys.readouterr().err
    assert "rank-0.safetensors" in err and "refused before allocating" in err, err
    assert not os.path.exists(tmp_path / "replica")


def test_shard_files_of_one_table_must_claim_one_size(tmp_path):
    """Two rank files whose shards of a table claim different table sizes are refused, naming
    both files, whichever is read first."""
    from persistent_delta import load_base

    base = tmp_path / "base"
    base.mkdir()
    for r, rows in ((0, 2), (1, 10 ** 12)):
        _shard_file(str(base / f"rank-{r}.safetensors"), {"row_offset": r, "col_offset": 0, "local_rows": 1,
                                                          "local_cols": 1, "global_rows": rows, "global_cols": 1},
                    torch.zeros(1, 1))
    with pytest.raises(InvalidInputError, match=r"rank-1\.safetensors: t: the shard claims a table of 1000000000000 x 1"):
        load_base(str(base))


@pytest.mark.parametrize("when", [1e308, float("nan"), -1.0, 2.0 ** 33, "soon"], ids=["1e308", "nan", "neg", "2^33", "str"])
def test_a_local_consumer_entry_with_a_commit_time_out_of_bounds_is_corrupt(tmp_path, capsys, when):
    """A consumer entry in a log whose commit time (or a history point's) is not a time in
    ``[0, 2**33)``: the entry is refused as a corrupt record (``offsets`` and ``verify`` exit 1
    naming it) instead of an OverflowError or ValueError traceback when it is printed."""
    from persistent_delta.errors import CorruptRecordError
    from persistent_delta.log.deltalog import DeltaLog
    from persistent_delta.log.schema import LOOKUPS, CommitPoint, ConsumerEntry, Delivery

    root = str(tmp_path / "log")
    _store(os.path.join(root, "rank-0"), ["t"])
    with DeltaLog(os.path.join(root, "rank-0")) as log:
        good = ConsumerEntry.new(0, LOOKUPS, Delivery.POLL_COMMIT)
        bad = ConsumerEntry(0, LOOKUPS, Delivery.POLL_COMMIT, when)  # type: ignore[arg-type]
        in_history = ConsumerEntry(0, LOOKUPS, Delivery.POLL_COMMIT, history=(CommitPoint(when, 0, 1),))  # type: ignore[arg-type]
        log.write(lambda w: (w.set_consumer("good", good), w.set_consumer("bad", bad)))
    capsys.readouterr()
    assert main(["offsets", root]) == 1
    err = capsys.readouterr().err
    assert err.startswith("persistent-delta: error:") and "consumer entry 'bad'" in err and "is not a time" in err, err
    assert main(["verify", root]) == 1
    assert "consumer entry 'bad'" in capsys.readouterr().out
    with DeltaLog(os.path.join(root, "rank-0")) as log:
        log.write(lambda w: w.set_consumer("bad", in_history))
        with pytest.raises(CorruptRecordError, match="history point"):
            log.read(lambda r: r.consumers())
