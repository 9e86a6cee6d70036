"""verify finds damage precisely (a flipped byte in data.mdb, bad keys, offsets, meta) and exits
nonzero; vacuum refuses while a writer or another process has the log open, and afterwards
rewrites it smaller with identical contents."""

from __future__ import annotations

import io
import json
import os
import re
import struct
from typing import Any, Dict, List, Tuple

import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from logs import Record, fill_store
from persistent_delta import LmdbDeltaStore
from persistent_delta.log import codec
from persistent_delta.cli import main
from persistent_delta.log.deltalog import DeltaLog
from persistent_delta.log.schema import LOOKUPS, SNAPSHOTS, ConsumerEntry
from persistent_delta.cli.verify import verify
from procs import popen_python

MARK = 12345.6789


def _fill_overflowing(path: str, batches: int = 6, rows: int = 400) -> None:
    """Records of "t" are big enough for LMDB overflow pages (written once, never copied), and
    every state value is unique: MARK + 1000 * batch + row + col / 10."""
    def batch(b: int) -> List[Record]:
        states = MARK + 1000 * b + torch.arange(rows, dtype=torch.float64).unsqueeze(1) + torch.tensor([0.0, 0.1], dtype=torch.float64)
        return [("t", torch.arange(rows) + b, states), ("u", torch.tensor([b]), torch.full((1, 2), float(b), dtype=torch.float64))]

    fill_store(path, batch, batches=batches, mode=UpdateMode.FIRST)


def _report(root: str) -> Tuple[int, Dict[str, Any]]:
    buf = io.StringIO()
    code = main(["verify", root, "--format", "json"], stdout=buf)
    return code, json.loads(buf.getvalue())


def _problems(data: Dict[str, Any]) -> List[Tuple[str, str, str]]:
    return [(p["severity"], p["where"], p["message"]) for r in data["ranks"] for p in r["problems"]]


def test_clean_log_verifies(tmp_path):
    root = str(tmp_path / "log")
    _fill_overflowing(os.path.join(root, "rank-0"))
    code, data = _report(root)
    assert code == 0 and data["ok"] and _problems(data) == []
    assert data["ranks"][0]["records"] == 12


def test_flipped_byte_in_data_file(tmp_path, capsys):
    root = str(tmp_path / "log")
    path = os.path.join(root, "rank-0")
    _fill_overflowing(path)
    marker = struct.pack("<d", MARK + 3000 + 7)  # batch 3, row 7, column 0
    with open(os.path.join(path, "data.mdb"), "r+b") as f:
        raw = f.read()
        # the live record and, in about one file of ten, stale copies in pages LMDB no longer
        # uses (4 in all, seen in 4 of 40 fills): flip the byte in every copy, so the live one
        # is hit
        found = [m.start() for m in re.finditer(re.escape(marker), raw)]
        assert found
        for i in found:
            f.seek(i + 5)
            f.write(bytes([raw[i + 5] ^ 0x10]))
    code, data = _report(root)
    assert code == 1 and not data["ok"]
    assert _problems(data) == [(
        "error", "records record (table 't', batch 3, seq 0)",
        "record checksum mismatch (the stored bytes or the record's key were altered)",
    )]
    capsys.readouterr()
    assert main(["verify", root]) == 1
    out = capsys.readouterr()
    assert "DAMAGED: 1 error(s)" in out.out and "batch 3" in out.out
    assert out.err.startswith("persistent-delta: verify:")


def test_structural_damage(tmp_path):
    root = str(tmp_path / "log")
    for r in range(2):
        _fill_overflowing(os.path.join(root, f"rank-{r}"))
    with DeltaLog(os.path.join(root, "rank-1"), writer_lock=False) as log:
        def damage(w: Any) -> None:
            w.set_consumer("far", ConsumerEntry(offset=99, commit_time=1.0))
            w.txn.put(b"odd", codec.pack({"offset": "x"}), db=w._dbs["consumers"])  # a damaged entry
            t = w.tables()["t"].table_id
            w.put_record(77, 2, codec.encode_record(torch.tensor([1]), None))  # no such table
            w.put_record(t, 40, codec.encode_record(torch.tensor([1]), torch.zeros(1, 2, dtype=torch.float64)))
            w.put_record(t, 1, codec.encode_record(torch.tensor([1]), None, codec.KIND_SNAPSHOT))
            w.txn.put(b"short", b"x", db=w._dbs["records"])
            w.put_record(t, 9, codec.encode_record(torch.tensor([1]), None, codec.KIND_SNAPSHOT), channel=SNAPSHOTS)
            w.set_meta("tracker", {"tables": ["t", "gone"], "rank": 3, "tracking_mode": "id_only"})
        log.write(damage)
    code, data = _report(root)
    assert code == 1
    assert data["ranks"][0]["problems"] == []  # rank 0 is fine
    found = {(w, m.split(" (")[0]) for _, w, m in _problems(data)}
    want = {
        ("consumer 'far'", "offset 99 is past the lookups end 0"),  # the tracker settings: curr_batch_idx (0) is the end
        ("consumer 'odd'", "consumer entry 'odd': offset is not a non-negative int: 'x'"),
        ("records record (table 77, batch 2, seq 0)", "unknown table id 77"),
        ("table 't'", "stores batch 40 but its last_batch_idx is 5"),
        ("records record (table 't', batch 1, seq 1)", "record kind 1 in the records DB"),
        ("records key 73686f7274", "record key of 5 bytes, expected 16"),
        ("snapshots record (table 't', batch 9, seq 0)", "stamped at or past snapshot_end 0"),
        ("meta tracker", "tracked tables without a table entry: ['gone']"),
        ("meta tracker", "written by rank 3 but stored in rank-1"),
        ("meta curr_batch_idx", "missing although a tracker wrote this log"),
    }
    assert want <= found, sorted(found - want)
    assert len(_problems(data)) == len(want)


# ------------------------------------------------------------------------------ vacuum


def _dump(path: str) -> Dict[str, Any]:
    """Everything stored in a log: raw records, table entries, consumers, meta."""
    with DeltaLog(path, readonly=True) as log:
        def read(r: Any) -> Dict[str, Any]:
            return {
                "records": [(k, bytes(v)) for k, v in r.iter_raw(LOOKUPS)],
                "snapshots": [(k, bytes(v)) for k, v in r.iter_raw(SNAPSHOTS)],
                "tables": {f: e.to_bytes() for f, e in r.tables().items()},
                "consumers": r.consumers(),
                "meta": r.all_meta(),
            }
        return log.read(read)


WRITER = """
import sys, time
from persistent_delta import LmdbDeltaStore
from torchrec.distributed.model_tracker.types import UpdateMode
s = LmdbDeltaStore(sys.argv[1], UpdateMode.FIRST)
print("READY", flush=True)
time.sleep(600)
"""

# A reader that opened the environment and sits idle (no transaction, no torch import).
IDLE_READER = """
import sys, time, lmdb
env = lmdb.open(sys.argv[1], readonly=True, max_dbs=8)
print("READY", flush=True)
time.sleep(600)
"""


def test_vacuum_refuses_while_open_then_compacts(tmp_path, capsys):
    root = str(tmp_path / "log")
    path = os.path.join(root, "rank-0")
    _fill_overflowing(path, batches=60, rows=1000)
    with LmdbDeltaStore(path, UpdateMode.FIRST) as s:
        s.delete(55)
    before = _dump(path)
    size = os.path.getsize(os.path.join(path, "data.mdb"))
    holders = [popen_python(WRITER, path), popen_python(IDLE_READER, path)]
    try:
        for h in holders:
            assert h.stdout.readline().strip() == "READY", h.stderr.read()
        capsys.readouterr()
        assert main(["vacuum", root]) == 1
        err = capsys.readouterr().err
        assert err.startswith("persistent-delta: error:") and f"pid {holders[0].pid}" in err and "writer" in err
        holders[0].kill()
        holders[0].wait()
        assert main(["vacuum", root]) == 1
        err = capsys.readouterr().err
        assert f"process {holders[1].pid} has the log open" in err
    finally:
        for h in holders:
            h.kill()
            h.wait()
    with DeltaLog(path, readonly=True):  # open in this very process
        assert main(["vacuum", root]) == 1
        assert "this process has the log open" in capsys.readouterr().err
    assert os.path.getsize(os.path.join(path, "data.mdb")) == size  # refusals touched nothing
    buf = io.StringIO()
    assert main(["vacuum", root, "--format", "json", "--execute"], stdout=buf) == 0
    (res,) = json.loads(buf.getvalue())["ranks"]
    assert res["bytes_before"] == size and res["bytes_after"] < size // 4
    assert os.path.getsize(os.path.join(path, "data.mdb")) == res["bytes_after"]
    assert _dump(path) == before
    assert sorted(os.listdir(path)) == ["data.mdb", "lock.mdb", "writer.lock"]
    assert verify(root).ok
    with LmdbDeltaStore(path, UpdateMode.FIRST) as s:  # a writer works on the vacuumed log
        s.append(60, "t", torch.tensor([1]), torch.zeros(1, 2, dtype=torch.float64))
        assert s.get_unique(60)["t"].ids.tolist() == [1]
