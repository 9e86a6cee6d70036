"""The offline rules of bases and increments (``persistent_delta.checkpoint``): a base counts
only with DCP's ``.metadata`` and its info file; the increments after it form one chain, and a
gap, a duplicate, a part of another base, job or run, or another layout is a typed error;
trailing incomplete increments (a crash mid-increment) are left out, the previous one latest."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from persistent_delta.checkpoint import chain as chains
from persistent_delta.checkpoint.format import (BASE_INFO, FORMAT_VERSION, BaseInfo, PartHeader, RankInfo, base_dir,
                                                decode_part, encode_part, increment_dir, newest_rows, part_paths,
                                                read_part, row_ids, write_base_info, write_part, write_rows)
from persistent_delta.errors import (CheckpointError, FormatMismatchError, IncompleteBaseError, IncrementChainError,
                                     InvalidInputError, ShardLayoutError, WorldSizeMismatchError)

LAYOUT = {"sparse.embeddings.t0": [0, 0, 50, 8]}


def _base(root: str, step: int, world: int = 2, base_id: str = "b1", metadata: bool = True,
          info: bool = True) -> str:
    path = base_dir(root, step)
    os.makedirs(path)
    if metadata:
        open(os.path.join(path, ".metadata"), "wb").close()
    if info:
        ranks = [RankInfo(r, f"log{r}", 100 + r, dict(LAYOUT)) for r in range(world)]
        write_base_info(path, BaseInfo(base_id, step, world, ranks, True, True))
    return path


def _increment(base: str, seq: int, step: int, prev: int, ranks=(0, 1), base_id: str = "b1", run: str = "r1",
               log: str = "log", world: int = 2) -> None:
    for r in ranks:
        h = PartHeader(base_id, seq, step, prev, run, r, world, f"{log}{r}", 100 + r, dict(LAYOUT), 0, 0)
        write_part(increment_dir(base, seq), h, {"rows": {"t": torch.arange(3) + seq}, "rank": r})


def test_a_chain_lists_complete_increments_in_order_and_parts_read_back(tmp_path):
    base = _base(str(tmp_path), 0)
    _increment(base, 1, 3, 0)
    _increment(base, 2, 6, 3)
    c = chains.latest_chain(str(tmp_path))
    assert [i.seq for i in c.increments] == [1, 2] and c.step == 6 and c.leftovers == []
    part = read_part(c.increments[1].path, c.increments[1].headers[1])
    assert part["rank"] == 1 and torch.equal(part["rows"]["t"], torch.arange(3) + 2)


def test_a_crash_mid_increment_leaves_the_previous_one_the_latest(tmp_path):
    base = _base(str(tmp_path), 0)
    _increment(base, 1, 3, 0)
    _increment(base, 2, 6, 3, ranks=(0,))  # rank 1's header never written
    c = chains.latest_chain(str(tmp_path))
    assert c.step == 3 and c.leftovers == [increment_dir(base, 2)]


def test_a_base_without_metadata_or_info_does_not_count(tmp_path):
    root = str(tmp_path)
    old = _base(root, 0)
    _base(root, 8, metadata=False)  # a crash inside dcp.save
    assert chains.latest_chain(root).base == old
    with pytest.raises(IncompleteBaseError, match=r"\.metadata"):
        chains.open_base(base_dir(root, 8))
    _base(root, 16, info=False)  # dcp.save finished, the info file never came
    with pytest.raises(IncompleteBaseError, match="persistent_delta_base.json"):
        chains.open_base(base_dir(root, 16))
    assert chains.latest_chain(root).base == old
    with pytest.raises(IncompleteBaseError, match="no complete base"):
        chains.latest_chain(str(tmp_path / "nothing"))


@pytest.mark.parametrize("damage, match", [
    ("gap", "gap"),
    ("hole", "gap"),
    ("duplicate", "duplicate"),
    ("other_base", "of base"),
    ("other_job", "another job"),
    ("mixed_runs", "different increments"),
    ("other_timeline", "another timeline"),
])
def test_a_broken_chain_is_refused(tmp_path, damage, match):
    base = _base(str(tmp_path), 0)
    _increment(base, 1, 3, 0)
    if damage == "gap":
        _increment(base, 3, 9, 6)
    elif damage == "hole":  # an incomplete increment before a complete one
        _increment(base, 2, 6, 3, ranks=(1,))
        _increment(base, 3, 9, 6)
    elif damage == "duplicate":
        _increment(base, 2, 3, 3)
    elif damage == "other_base":
        _increment(base, 2, 6, 3, base_id="b0")
    elif damage == "other_job":
        _increment(base, 2, 6, 3, log="other")
    elif damage == "mixed_runs":
        _increment(base, 2, 6, 3, ranks=(0,), run="r1")
        _increment(base, 2, 6, 3, ranks=(1,), run="r2")
    elif damage == "other_timeline":
        _increment(base, 2, 9, 5)
    with pytest.raises(IncrementChainError, match=match):
        chains.latest_chain(str(tmp_path))


def test_another_world_size_or_shard_layout_is_a_typed_error(tmp_path):
    info = chains.open_base(_base(str(tmp_path), 0))
    chains.check_layout(info, 1, 2, dict(LAYOUT))
    with pytest.raises(ShardLayoutError, match="saved by 2 ranks and this job runs 4"):
        chains.check_layout(info, 1, 4, dict(LAYOUT))
    with pytest.raises(ShardLayoutError, match="column-wise") as exc:
        chains.check_layout(info, 0, 2, {"sparse.embeddings.t0": [0, 4, 50, 4]})
    assert isinstance(exc.value, CheckpointError) and not isinstance(exc.value, WorldSizeMismatchError)
    _increment(info_base := base_dir(str(tmp_path), 0), 1, 3, 0, world=1, ranks=(0, 1))
    with pytest.raises(ShardLayoutError, match="world size 1"):
        chains.chain_of(info_base, info)


def test_a_damaged_part_is_detected_by_its_checksum(tmp_path):
    base = _base(str(tmp_path), 0)
    _increment(base, 1, 3, 0)
    inc = chains.latest_chain(str(tmp_path)).increments[0]
    part, _ = part_paths(inc.path, 0)
    data = bytearray(open(part, "rb").read())
    data[-5] ^= 0xFF
    open(part, "wb").write(bytes(data))
    with pytest.raises(IncrementChainError, match="CRC-32C"):
        read_part(inc.path, inc.headers[0])
    open(part, "wb").write(bytes(data[:-1]))
    with pytest.raises(IncrementChainError, match=f"{len(data) - 1} bytes, the header records {len(data)}"):
        read_part(inc.path, inc.headers[0])
    os.remove(part)
    with pytest.raises(IncrementChainError, match="cannot read rank 0's part"):
        read_part(inc.path, inc.headers[0])


@pytest.mark.parametrize("sizes", [[0, 3, 5], [3, 0, 5], [3, 5, 0], [0, 0, 0], [0], [], [4, 4, 4]])
def test_newest_rows_writes_each_row_once_with_empty_parts_anywhere(sizes):
    """Parts of a chain (ids per part, overlapping), empty ones first, in the middle, last, all:
    each row is kept in the newest part holding it and nowhere else."""
    g = torch.Generator().manual_seed(len(sizes) * 7 + sum(sizes))
    rows = 8
    ids = [torch.randperm(rows, generator=g)[:n] for n in sizes]
    masks = newest_rows(ids, rows)
    assert [m.shape for m in masks] == [i.shape for i in ids]
    owner = {}
    for j, i in enumerate(ids):
        for r in i.tolist():
            owner[r] = j  # the newest part holding r
    kept = [(r, j) for j, (i, m) in enumerate(zip(ids, masks)) for r in i[m].tolist()]
    assert sorted(kept) == sorted(owner.items())


@pytest.mark.parametrize("bad", [-1, 8, 1 << 62])
def test_row_ids_outside_the_shard_are_refused_before_anything_is_sized(bad):
    with pytest.raises(IncrementChainError, match="outside the shard's 8 rows"):
        newest_rows([torch.tensor([0, 1]), torch.tensor([2, bad])], 8)
    with pytest.raises(IncrementChainError, match="outside the shard's 8 rows"):
        row_ids(torch.tensor([bad]), 8, "t")
    assert row_ids(torch.empty(0, dtype=torch.int32), 0, "t").dtype == torch.int64


def test_the_chain_reaching_the_furthest_step_wins_over_a_newer_base(tmp_path):
    # a trainer went on writing increments into base 0's chain after it was consolidated at step 6
    root = str(tmp_path)
    old = _base(root, 0)
    _increment(old, 1, 3, 0)
    _increment(old, 2, 6, 3)
    _increment(old, 3, 9, 6)
    _base(root, 6, base_id="b2")
    c = chains.latest_chain(root)
    assert c.base == old and c.step == 9 and [i.seq for i in c.increments] == [1, 2, 3]
    newer = _base(root, 9, base_id="b3")  # a tie: the newer base
    c = chains.latest_chain(root)
    assert c.base == newer and c.step == 9 and c.increments == []


def test_retention_keeps_an_older_base_whose_chain_reaches_further(tmp_path):
    from persistent_delta.checkpoint.consolidate import removable_bases

    root = str(tmp_path)
    old = _base(root, 0)
    _increment(old, 1, 3, 0)
    _increment(old, 2, 9, 3)
    _base(root, 6, base_id="b2")  # consolidated at step 6; the trainer went on in base 0's chain
    assert removable_bases(root) == []
    _base(root, 9, base_id="b3")
    assert removable_bases(root) == [old, base_dir(root, 6)]


def _payload():
    """A part's kinds of values: rows of several dtypes, an empty and a 0-d tensor, a non-contiguous
    one, optimizer-like state with int and str keys, tuples, None, bools, exact floats, big ints."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(6, 8, generator=g)
    return {"rows": {"t": {"ids": torch.tensor([5, 0, 3]), "weights": w[[5, 0, 3]],
                           "states": [torch.rand(3, generator=g), w.t()[:2].to(torch.bfloat16)]},
                     "empty": {"ids": torch.empty(0, dtype=torch.int64), "weights": torch.empty(0, 8), "states": []}},
            "dense": {"m.bias": torch.randn(4, generator=g).half(), "m.mask": torch.tensor([True, False]),
                      "m.count": torch.tensor(7, dtype=torch.int32)},
            "dense_optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(4)}},
                                "param_groups": [{"lr": 0.1 / 3, "betas": (0.9, 0.999), "foreach": None,
                                                  "maximize": False, "params": [0]}]},
            "fused_groups": [], "tracker": {"curr_batch_idx": 2 ** 40 + 1, "offsets": {"increments": 12},
                                            "eps": float("inf"), "tiny": 5e-324},
            "names": {"a/b": torch.tensor([1]), "a": {"b": torch.tensor([2])}, "a/b#2": torch.tensor([3])},
            "__metadata__": torch.tensor([4.0])}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(_same(v, b[k]) for k, v in a.items())
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and (a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)))


def test_a_part_is_a_safetensors_file_that_reads_back_exactly_without_pickle(tmp_path):
    """Every value of a part comes back with its type (a tuple stays a tuple, an int key an int)
    and its tensors bit-equal, from a memory-mapped file the safetensors library reads too."""
    from safetensors.torch import load_file

    payload = _payload()
    h = PartHeader("b1", 1, 3, 0, "r1", 0, 1, "log0", 100, dict(LAYOUT), 0, 0)
    written = write_part(str(tmp_path), h, payload)
    part, _ = part_paths(str(tmp_path), 0)
    assert part.endswith(".safetensors") and written.size == os.path.getsize(part)
    assert _same(payload, read_part(str(tmp_path), written))
    flat = load_file(part)
    assert torch.equal(flat["rows/t/weights"], payload["rows"]["t"]["weights"])
    assert torch.equal(flat["rows/t/states/1"], payload["rows"]["t"]["states"][1])


@pytest.mark.parametrize("value", [object(), {"a": 1, 2: 3}, {1.5: 0}, torch.float32,
                                   torch.zeros(2, dtype=torch.complex64), torch.eye(2).to_sparse()])
def test_a_value_a_part_cannot_store_is_refused_when_written(tmp_path, value):
    h = PartHeader("b1", 1, 3, 0, "r1", 0, 1, "log0", 100, dict(LAYOUT), 0, 0)
    with pytest.raises(InvalidInputError, match="cannot store"):
        write_part(str(tmp_path), h, {"tracker": {"x": value}})
    assert not os.path.exists(part_paths(str(tmp_path), 0)[1])


def _forged(kind: str) -> bytes:
    """A part's bytes, changed the way ``kind`` says (checksums agree: only the reader's checks stand)."""
    data = bytearray(b"".join(bytes(c) for c in encode_part({"rows": {"t": {"ids": torch.arange(4)}}})))
    n = int.from_bytes(data[:8], "little")
    head = json.loads(bytes(data[8:8 + n]))
    if kind == "truncated":
        return bytes(data[:5])
    if kind == "header_length":
        return (len(data)).to_bytes(8, "little") + bytes(data[8:])
    if kind == "past_the_end":
        head["rows/t/ids"]["data_offsets"] = [0, 1 << 40]
        head["rows/t/ids"]["shape"] = [1 << 37]
    elif kind == "shape":
        head["rows/t/ids"]["shape"] = [5]
    elif kind == "negative":
        head["rows/t/ids"]["shape"] = [-4, -1]
    elif kind == "dtype":
        head["rows/t/ids"]["dtype"] = "C64"
    elif kind == "version":
        head["__metadata__"]["version"] = "1"
    elif kind == "tree":
        head["__metadata__"]["tree"] = json.dumps({"dict": {"rows": {"tensor": "nowhere"}}})
    elif kind == "tag":
        head["__metadata__"]["tree"] = json.dumps({"pickle": "x"})
    raw = json.dumps(head).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return len(raw).to_bytes(8, "little") + raw + bytes(data[8 + n:])


@pytest.mark.parametrize("kind", ["truncated", "header_length", "past_the_end", "shape", "negative", "dtype", "version",
                                  "tree", "tag"])
def test_a_forged_part_is_refused_before_anything_is_sized_by_it(kind):
    with pytest.raises(IncrementChainError, match="not an increment part of this format"):
        decode_part(bytearray(_forged(kind)), "forged")


def test_parts_and_bases_of_the_torch_save_format_are_a_typed_error(tmp_path):
    root = str(tmp_path)
    base = _base(root, 0)
    _increment(base, 1, 3, 0)
    head = part_paths(increment_dir(base, 1), 1)[1]
    old = json.loads(open(head).read())
    old["version"], old["crc32"] = 1, old.pop("crc32c")  # what version 1 wrote beside rank-1.pt
    open(head, "w").write(json.dumps(old))
    with pytest.raises(FormatMismatchError, match=f"increment format version 1, this library reads {FORMAT_VERSION}"):
        chains.latest_chain(root)
    info = json.loads(open(os.path.join(base, BASE_INFO)).read())
    info["version"] = 1
    open(os.path.join(base, BASE_INFO), "w").write(json.dumps(info))
    with pytest.raises(FormatMismatchError, match=f"base format version 1, this library reads {FORMAT_VERSION}"):
        chains.latest_chain(root)


@pytest.mark.parametrize("shares", [[1.0, 1.0, 1.0], [0.9, 0.2, 0.6, 1.0], [0.05, 0.5, 0.95, 0.1], [0.0, 0.3]])
def test_write_rows_leaves_each_row_with_its_newest_value(shares):
    """Parts overlapping by any share (written whole when a newer part holds few of their rows,
    gathered when it holds many) leave what writing every part in order leaves, weights and a
    row-wise state alike."""
    g = torch.Generator().manual_seed(int(sum(shares) * 100))
    rows = 1000  # each part: 20 new rows and that share of the part before's
    parts, prev = [], torch.randperm(rows, generator=g)[:20]
    for share in shares:
        n_old = int(share * len(prev))
        ids = torch.cat([prev[torch.randperm(len(prev), generator=g)[:n_old]], torch.randperm(rows, generator=g)[:20]])
        ids = torch.unique(ids)[torch.randperm(len(torch.unique(ids)), generator=g)]
        parts.append((ids, [torch.randn(len(ids), 4, generator=g), torch.rand(len(ids), generator=g)]))
        prev = ids
    got = [torch.zeros(rows, 4), torch.zeros(rows)]
    want = [torch.zeros(rows, 4), torch.zeros(rows)]
    write_rows(got, parts)
    for ids, sources in parts:
        for target, saved in zip(want, sources):
            target[ids] = saved
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
