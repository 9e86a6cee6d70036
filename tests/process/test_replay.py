"""replay: exports read back equal the log's unique rows over the same range (plain stores, and a
real 2-rank trainer's get_unique, row- and column-wise); consumer ranges and --commit; the
incremental snapshot from a shard checkpoint; retention held back by an external consumer."""

from __future__ import annotations

import glob
import io
import json
import os
import threading
import time
from typing import Any, Dict, List, Tuple

import pytest
import torch
from torchrec.distributed.model_tracker.types import TrackingMode, UpdateMode

from logs import Record, fill_ranks
from persistent_delta import DeltaConsumer, LmdbDeltaStore
from persistent_delta.cli import main
from persistent_delta.log import records
from persistent_delta.log.deltalog import DeltaLog
from persistent_delta.serve.replay import load_export, replay
from persistent_delta.log.records import read_unique


def _revisits(rank: int, b: int) -> List[Record]:
    """Batch b of rank r touches ids {b % 7, (3b) % 11} (+50r) of "t" and {b} of "u"."""
    ids = torch.tensor([b % 7, (3 * b) % 11]) + 50 * rank
    return [("t", ids, torch.stack([ids.double() * 10 + b] * 2, dim=1)),
            ("u", torch.tensor([b]), torch.tensor([[float(b)]]))]


def _expected(root: str, ranks: int, start: int, end: int) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """Merged unique rows over every rank's [start, end) straight from read_unique (plain stores:
    global id = id; equal ids on two ranks keep rank 0's row)."""
    parts: Dict[str, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
    for r in range(ranks):
        with DeltaLog(os.path.join(root, f"rank-{r}"), readonly=True) as log:
            rows = log.read(lambda t: read_unique(t, UpdateMode.LAST, start, end))
        for fqn, u in rows.items():
            if u.ids.numel():
                parts.setdefault(fqn, []).append((u.ids, u.states))
    out = {}
    for fqn, ps in parts.items():
        ids = torch.cat([p[0] for p in ps])
        states = torch.cat([p[1] for p in ps])
        first: Dict[int, int] = {}
        for i, x in enumerate(ids.tolist()):
            first.setdefault(x, i)
        order = sorted(first)
        out[fqn] = (torch.tensor(order), states[[first[x] for x in order]])
    return out


def test_spans_read_back_equal_the_log(tmp_path):
    root, out = str(tmp_path / "log"), str(tmp_path / "out")
    fill_ranks(root, _revisits, ranks=2, batches=10, mode=UpdateMode.LAST)
    buf = io.StringIO()
    assert main(["replay", root, "--from-batch", "2", "--to-batch", "9", "--span", "3", "--out", out], stdout=buf) == 0
    assert "3 span(s)" in buf.getvalue()
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert [tuple(w) for w in manifest["spans"]] == [(2, 5), (5, 8), (8, 9)]
    for ws, we in manifest["spans"]:
        want = _expected(root, 2, ws, we)
        files = sorted(glob.glob(os.path.join(out, f"span-{ws:012d}-{we:012d}", "*.safetensors")))
        assert [os.path.basename(f) for f in files] == [f"{fqn}.safetensors" for fqn in sorted(want)]
        for f in files:
            tensors, meta = load_export(f)
            ids, states = want[meta["fqn"]]
            assert tensors["ids"].dtype == torch.int64
            assert torch.equal(tensors["ids"], ids) and torch.equal(tensors["states"], states)
            assert (meta["start_idx"], meta["end_idx"], meta["update_mode"]) == (str(ws), str(we), "last")


def test_dry_run_consumer_range_and_commit(tmp_path):
    root, out = str(tmp_path / "log"), str(tmp_path / "out")
    fill_ranks(root, _revisits, ranks=2, batches=10, mode=UpdateMode.LAST)
    with DeltaConsumer(root, "exp") as c:
        c.seek(4)
        c.commit()
    report = replay(root, out, consumer="exp", dry_run=True, commit=True)
    assert report.ranges == {0: (4, 10), 1: (4, 10)} and report.dry_run
    assert not os.path.exists(out) and report.committed is None
    assert {f.fqn: f.rows for f in report.files} == {fqn: int(v[0].numel()) for fqn, v in _expected(root, 2, 4, 10).items()}
    report = replay(root, out, consumer="exp")
    assert report.committed is None
    with DeltaConsumer(root, "exp") as c:
        assert c.committed() == {0: 4, 1: 4}  # no --commit: nothing moves
    report = replay(root, out, consumer="exp", commit=True)
    assert report.committed == {0: 10, 1: 10}
    assert replay(root, out, consumer="exp").spans == []  # nothing pending any more


def test_replay_refusals(tmp_path, capsys):
    root = str(tmp_path / "log")
    fill_ranks(root, _revisits, ranks=1, batches=10, mode=UpdateMode.LAST)
    with LmdbDeltaStore(os.path.join(root, "rank-0"), UpdateMode.LAST) as s:
        s.delete(3)
    capsys.readouterr()
    assert main(["replay", root, "--from-batch", "1", "--to-batch", "5", "--out", str(tmp_path / "o")]) == 1
    assert capsys.readouterr().err.startswith("persistent-delta: error: rank 0: batches [1, 3) were deleted")
    assert main(["replay", root, "--from-batch", "5", "--to-batch", "4", "--dry-run"]) == 1
    assert main(["replay", root, "--from-batch", "5", "--consumer", "x", "--dry-run"]) == 1
    assert main(["replay", root, "--from-batch", "3", "--to-batch", "5"]) == 1  # no --out
    assert "--out" in capsys.readouterr().err
    assert main(["replay", root, "--consumer", "nobody", "--dry-run"]) == 1
    assert main(["replay", root, "--from-batch", "3", "--to-batch", "5", "--tables", "t", "nope", "--dry-run"]) == 1
    assert "unknown tables ['nope']" in capsys.readouterr().err
    report = replay(root, from_batch=3, to_batch=6, tables=["u"], dry_run=True)
    assert [f.fqn for f in report.files] == ["u"]
    assert not os.path.exists(tmp_path / "o")


# --------------------------------------------- a real trainer: get_unique, retention, snapshot

STEPS = 12
READ_EVERY = 4


def _touch(path: str) -> None:
    open(path, "w").close()


def _wait(path: str, timeout: float = 180.0) -> None:
    deadline = time.time() + timeout
    while not os.path.exists(path):
        if time.time() > deadline:
            raise TimeoutError(path)
        time.sleep(0.05)


def trainer_with_external_reader(rank: int, world_size: int, base: str) -> Dict[str, Any]:
    """Row-wise and column-wise EC models, EMBEDDING tracking with delete_on_read; consumer "a"
    reads every READ_EVERY steps. Phase 1 stops (waiting) with the logs open; after the test's
    external consumer commits, one more step and read apply retention."""
    from harness import build_sharded_model, make_batches, table_shard_info, train_step

    from persistent_delta import PersistentTrackerConfig, attach
    from persistent_delta.trainer.save_shards import save_local_shards

    dmps, trackers, out = {}, {}, {}
    for name, sharding in (("rw", "row_wise"), ("cw", "column_wise")):
        dmps[name] = build_sharded_model(rank, world_size, "ec", sharding, "EXACT_SGD", rows=64)
        trackers[name] = attach(dmps[name], PersistentTrackerConfig(
            tracking_mode=TrackingMode.EMBEDDING, path=os.path.join(base, name), consumers=["a"], delete_on_read=True))
        trackers[name].flush()
        out[name] = {"reads": [], "info": table_shard_info(dmps[name])}
    _touch(os.path.join(base, f"ready-{rank}"))
    _wait(os.path.join(base, "go"))
    batches = make_batches("ec", STEPS, 8, seed=13, world_size=world_size, rank=rank, rows=64)
    for i, b in enumerate(batches):
        for name, t in trackers.items():
            train_step(dmps[name], b)
            if i % READ_EVERY == READ_EVERY - 1:
                start = t.per_consumer_batch_idx["a"]
                rows = t.get_unique("a")
                out[name]["reads"].append((start, t.curr_batch_idx + 1, {
                    fqn: (r.ids.clone(), r.states.clone()) for fqn, r in rows.items()}))
    for name, t in trackers.items():
        if rank == 0:
            with open(os.path.join(base, f"ranges-{name}.json"), "w") as f:
                json.dump([[s, e] for s, e, _ in out[name]["reads"]], f)
        save_local_shards(t, os.path.join(base, f"ckpt-{name}"))
        out[name]["weights"] = {fqn: lt.weights().detach().clone() for fqn, lt in t.local_tables.items()}
        out[name]["offset_a"] = t.per_consumer_batch_idx["a"]
    _touch(os.path.join(base, f"phase1-{rank}"))
    _wait(os.path.join(base, "committed"))
    for name, t in trackers.items():
        train_step(dmps[name], batches[0])
        t.get_unique("a")
        out[name]["log_start_after"] = t.log.read(records.log_start)
        t.close()
    return out


def _global(results: List[Dict[str, Any]], name: str, read: int) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """What the ranks' get_unique returned for one read, in global ids with full rows."""
    out = {}
    for fqn in results[0][name]["reads"][read][2]:
        parts = []
        for res in results:
            info = res[name]["info"][fqn]
            ids, states = res[name]["reads"][read][2][fqn]
            parts.append((info, ids + info["row_offset"], states))
        if name == "cw":  # the same ids on each rank, column slices side by side
            parts.sort(key=lambda p: p[0]["col_offset"])
            assert all(torch.equal(p[1], parts[0][1]) for p in parts)
            out[fqn] = (parts[0][1], torch.cat([p[2] for p in parts], dim=1))
        else:
            ids = torch.cat([p[1] for p in parts])
            order = torch.argsort(ids)
            out[fqn] = (ids[order], torch.cat([p[2] for p in parts])[order])
    return out


@pytest.mark.dist
def test_trainer_replay_equals_get_unique_and_retention_held(tmp_path, capsys):
    """While a 2-rank trainer runs (row-wise and column-wise EMBEDDING logs, delete_on_read):
    an external consumer registered through the CLI holds retention at 0; replay of each
    get_unique("a") range equals what get_unique returned (global ids, full rows); the
    checkpoint snapshot holds the saved values; vacuum is refused. After the external consumer
    commits, retention deletes exactly up to its offset."""
    from harness import run_spawn

    base = str(tmp_path)
    result: Dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(ranks=run_spawn(trainer_with_external_reader, 2, base)))
    thread.start()
    exports: Dict[str, List[Tuple[int, int, str]]] = {"rw": [], "cw": []}
    ext_end: Dict[str, Dict[int, int]] = {}
    try:
        for r in range(2):
            _wait(os.path.join(base, f"ready-{r}"))
        for name in exports:
            assert main(["offsets", os.path.join(base, name), "--register", "ext", "--execute"]) == 0
        _touch(os.path.join(base, "go"))
        for r in range(2):
            _wait(os.path.join(base, f"phase1-{r}"))
        # the trainer is alive and holds its logs: everything below reads while it runs
        capsys.readouterr()
        for name in exports:
            root = os.path.join(base, name)
            buf = io.StringIO()
            assert main(["offsets", root, "--format", "json"], stdout=buf) == 0
            for rank in json.loads(buf.getvalue())["ranks"]:
                by_name = {c["name"]: c for c in rank["consumers"]}
                assert by_name["ext"]["offset"] == 0 and by_name["a"]["offset"] > 1
                assert rank["log_start"] == 0  # retention held back by the external consumer
            assert main(["vacuum", root]) == 1
            assert "writer" in capsys.readouterr().err
            ranges = json.load(open(os.path.join(base, f"ranges-{name}.json")))
            assert len(ranges) == STEPS // READ_EVERY
            for k, (s, e) in enumerate(ranges):
                out = os.path.join(base, f"export-{name}-{k}")
                assert main(["replay", root, "--from-batch", str(s), "--to-batch", str(e), "--out", out]) == 0
                exports[name].append((s, e, out))
            snap = os.path.join(base, f"snapshot-{name}")
            assert main(["replay", root, "--from-batch", "0", "--to-batch", str(ranges[-1][1]), "--out", snap,
                         "--shard-files", os.path.join(base, f"ckpt-{name}")]) == 0
            with DeltaConsumer(root, "ext") as c:  # the external consumer catches up and commits
                c.poll()
                ext_end[name] = c.commit()
    finally:
        _touch(os.path.join(base, "committed"))
        thread.join(180)
    assert not thread.is_alive()
    results = result["ranks"]
    for name in exports:
        for k, (s, e, out) in enumerate(exports[name]):
            assert [(x[0], x[1]) for x in results[0][name]["reads"]][k] == (s, e)
            want = _global(results, name, k)
            got = {}
            for f in glob.glob(os.path.join(out, "span-*", "*.safetensors")):
                tensors, meta = load_export(f)
                got[meta["fqn"]] = (tensors["ids"], tensors["states"])
            assert sorted(got) == sorted(fqn for fqn, v in want.items() if v[0].numel())
            for fqn, (ids, states) in got.items():
                assert torch.equal(ids, want[fqn][0]), (name, k, fqn)
                assert torch.equal(states, want[fqn][1]), (name, k, fqn)
        # incremental snapshot: the checkpoint's values of every changed row, full width
        full: Dict[str, torch.Tensor] = {}
        for res in results:
            for fqn, w in res[name]["weights"].items():
                info = res[name]["info"][fqn]
                t = full.setdefault(fqn, torch.zeros(info["global_rows"], info["global_cols"]))
                t[info["row_offset"]:info["row_offset"] + info["local_rows"],
                  info["col_offset"]:info["col_offset"] + info["local_cols"]] = w
        touched: Dict[str, set] = {}
        for k in range(len(exports[name])):
            for fqn, (ids, _) in _global(results, name, k).items():
                touched.setdefault(fqn, set()).update(ids.tolist())
        snaps = glob.glob(os.path.join(base, f"snapshot-{name}", "snapshot", "*.safetensors"))
        assert len(snaps) == len([f for f, ids in touched.items() if ids])
        for f in snaps:
            tensors, meta = load_export(f)
            assert tensors["ids"].tolist() == sorted(touched[meta["fqn"]])
            assert torch.equal(tensors["values"], full[meta["fqn"]][tensors["ids"]])
        # retention: held at 0 while "ext" lagged; once it committed, deleted exactly up to it
        for rank, res in enumerate(results):
            assert ext_end[name][rank] == res[name]["offset_a"] - 1  # the log end: one below "a"
            assert res[name]["log_start_after"] == ext_end[name][rank]
