"""The on-disk vocabulary of bases and increments: a dataclass per stored entry, the paths.

Owns: the layout of a checkpoint root, the base's and each increment part's header, and the
bytes of a part (written atomically, fsynced; read back with its checksum checked). What counts
as a complete base and a valid chain is :mod:`.chain`'s.

Layout (``<step>`` 12 digits, ``<seq>`` 8 digits, so name order is numeric order)::

    <root>/base-<step>/                       a torch.distributed.checkpoint (DCP) directory:
                                              {"model": dmp.state_dict(), "fused": ..., "dense": ...}
                                              (an optimizer without state left out), and
                                              "persistent_delta_param_groups": {"fused": [...], "dense": [...]}
                                              (their param_groups, which TorchRec's state_dict() leaves out)
    <root>/base-<step>/.metadata              DCP's, written last: the base is complete with it
    <root>/base-<step>/persistent_delta_base.json   BaseInfo, written once the DCP save returned
    <root>/base-<step>/increments/<seq>/rank-<r>.safetensors   rank r's part of increment seq
    <root>/base-<step>/increments/<seq>/rank-<r>.json   its PartHeader, written after the part is durable

An increment is complete when every rank's header is present, agrees with the others and with
its base, and names a part file of the size and checksum (CRC-32C of the whole file) it
records. A part holds, for every table sharded on its rank, the shard-local ids of the rows
changed since the previous increment (or the base), their weights and each fused optimizer
state's rows (in the state's own layout: ``(n, cols)`` for Adagrad, ``(n,)`` for row-wise
Adagrad), the dense parameters and buffers and the dense optimizer's state whole, the
optimizers' ``param_groups``, and the rank's tracker state.

A part file is in the safetensors layout, written and read here without pickling: an 8-byte
little-endian header length ``n``; ``n`` bytes of JSON (space-padded so the data starts at a
multiple of 8) naming each tensor's dtype, shape and ``[start, end)`` byte range in the data;
then the tensors' raw bytes, largest element size first so that each starts aligned. The JSON's
``"__metadata__"`` holds ``"format"`` (:data:`PART_FORMAT`), ``"version"`` (:data:`FORMAT_VERSION`)
and ``"tree"``: the payload's structure as JSON, every container tagged (``{"dict": {...}}``,
``{"intdict": [[k, v], ...]}``, ``{"list": [...]}``, ``{"tuple": [...]}``), a tensor as
``{"tensor": <name>}``, and ``None``, bools, ints, floats and strings as themselves. Writing
copies each tensor's bytes once into the file; reading memory-maps the file (copy-on-write) and
the tensors are views of it.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Sequence, Tuple, Union

import crc32c
import torch

from persistent_delta.errors import FormatMismatchError, IncrementChainError, InvalidInputError
from persistent_delta.log.layout import atomic_write_bytes, atomic_write_chunks
from persistent_delta.log.rows import scatter_rows

# 2: parts in the safetensors layout with a CRC-32C (1: torch.save files with a CRC-32)
FORMAT_VERSION = 2
PART_FORMAT = "persistent_delta.increment_part"
PART_SUFFIX = ".safetensors"
BASE_INFO = "persistent_delta_base.json"
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's, written last by its save
INCREMENTS = "increments"
# The start of rank r's tracker state key in ``dmp.state_dict()`` ("<TRACKER_STATE_KEY>.rank_<r>"),
# and the whole key of a checkpoint taken before one key per rank
TRACKER_STATE_KEY = "persistent_delta_tracker"
# A base's key for the optimizers' param_groups, {"fused": [...], "dense": [...]} (one opaque value)
GROUPS_KEY = "persistent_delta_param_groups"
# safetensors' dtype names of the dtypes a part stores
_DTYPES: Dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_NAMED: Dict[str, torch.dtype] = {v: k for k, v in _DTYPES.items()}
_ALIGN = 8  # the data starts at a multiple of the largest element size
# A part at least this share of whose rows no newer part holds is written whole, not gathered
# first (write_rows): the few rows a newer part holds are written again by it, later, which
# costs less than the gather's extra copy of every row kept.
_WHOLE_PART_SHARE = 0.5

# fqn -> [row_offset, col_offset, local_rows, local_cols] of a rank's shard
Layout = Dict[str, List[int]]


def base_dir(root: str, step: int) -> str:
    """The directory of the base taken at ``step``."""
    return os.path.join(root, f"base-{step:012d}")


def increment_dir(base: str, seq: int) -> str:
    """The directory of increment ``seq`` (1, 2, ...) of the base in ``base``."""
    return os.path.join(base, INCREMENTS, f"{seq:08d}")


def part_paths(increment: str, rank: int) -> Tuple[str, str]:
    """(part file, header file) of ``rank`` in an increment's directory."""
    return os.path.join(increment, f"rank-{rank}{PART_SUFFIX}"), os.path.join(increment, f"rank-{rank}.json")


@dataclass
class RankInfo:
    """One rank of a base: its log's identity and its shards' layout."""

    rank: int
    log_id: str
    log_stamp: int
    layout: Layout


@dataclass
class BaseInfo:
    """What a base records beside its DCP files (``persistent_delta_base.json``).

    Attributes:
        base_id: unique per base; every increment names it.
        step: the training steps done when it was taken.
        world_size: the ranks that saved it.
        ranks: per rank, its log identity and shard layout.
        fused_state: whether the DCP files hold ``"fused"`` (an optimizer without state, such
            as EXACT_SGD, has none: DCP stores no key for an empty state, and its load would
            refuse it as missing).
        dense_state: the same for ``"dense"`` (no state before the dense optimizer's first step).
    """

    base_id: str
    step: int
    world_size: int
    ranks: List[RankInfo]
    fused_state: bool
    dense_state: bool
    version: int = FORMAT_VERSION

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @staticmethod
    def from_json(data: bytes) -> "BaseInfo":
        """Raises: ValueError (or KeyError/TypeError) on a malformed file."""
        d = json.loads(data)
        ranks = [RankInfo(int(r["rank"]), str(r["log_id"]), int(r["log_stamp"]),
                          {str(k): [int(x) for x in v] for k, v in r["layout"].items()}) for r in d["ranks"]]
        return BaseInfo(str(d["base_id"]), int(d["step"]), int(d["world_size"]), ranks, bool(d["fused_state"]),
                        bool(d["dense_state"]), int(d["version"]))


@dataclass
class PartHeader:
    """One rank's header of one increment (``rank-<r>.json``), written after its part.

    Attributes:
        base_id: the base it follows.
        seq: its place in the chain (1 follows the base).
        step: the training steps done when it was taken (every rank's the same).
        prev_step: the step of the increment (or base) it follows.
        run_id: the training run (a process group's life) that wrote it: every part of one
            increment has the same.
        rank, world_size: who wrote it, of how many.
        log_id, log_stamp: the identity of the rank's log (the job's).
        layout: the rank's shards when it was taken.
        size, crc32c: the part file's size and CRC-32C (Castagnoli).
    """

    base_id: str
    seq: int
    step: int
    prev_step: int
    run_id: str
    rank: int
    world_size: int
    log_id: str
    log_stamp: int
    layout: Layout
    size: int
    crc32c: int
    version: int = FORMAT_VERSION
    rows: Dict[str, int] = field(default_factory=dict)  # fqn -> rows in the part (for tools)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @staticmethod
    def from_json(data: bytes, where: str = "a part header") -> "PartHeader":
        """Raises: ValueError (or KeyError/TypeError) on a malformed file; FormatMismatchError
        for a header of another format version (read before anything else of it)."""
        d = json.loads(data)
        version = d.get("version") if isinstance(d, dict) else None
        if version != FORMAT_VERSION:
            raise FormatMismatchError(
                f"{where}: increment format version {version}, this library reads {FORMAT_VERSION}: restore it with "
                "the version that wrote it, or take a new base (Checkpoints.save_base)")
        d["layout"] = {str(k): [int(x) for x in v] for k, v in d["layout"].items()}
        return PartHeader(**d)

    def agrees_with(self, other: "PartHeader") -> bool:
        """Whether two ranks' headers describe the same increment."""
        return (self.base_id, self.seq, self.step, self.prev_step, self.run_id, self.world_size) == \
            (other.base_id, other.seq, other.step, other.prev_step, other.run_id, other.world_size)


def write_base_info(base: str, info: BaseInfo) -> None:
    """Write a base's :class:`BaseInfo` atomically (rank 0, once the DCP save returned)."""
    atomic_write_bytes(os.path.join(base, BASE_INFO), info.to_json())


def _tree(value: Any, path: Tuple[str, ...], tensors: Dict[str, torch.Tensor]) -> Any:
    """``value``'s structure as JSON (the module note's tags), its tensors put in ``tensors``
    under a name from their path."""
    if isinstance(value, torch.Tensor):
        name = first = "/".join(path) or "tensor"
        while name in tensors or name == "__metadata__":  # (a key with "/" in it; safetensors' own key)
            name = f"{first}#{len(tensors)}" if name == first else name + "#"
        tensors[name] = value
        return {"tensor": name}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {"dict": {k: _tree(v, path + (k,), tensors) for k, v in value.items()}}
        if all(isinstance(k, int) and not isinstance(k, bool) for k in value):
            return {"intdict": [[k, _tree(v, path + (str(k),), tensors)] for k, v in value.items()]}
    elif isinstance(value, (list, tuple)):
        tag = "list" if isinstance(value, list) else "tuple"
        return {tag: [_tree(v, path + (str(i),), tensors) for i, v in enumerate(value)]}
    elif value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise InvalidInputError(
        f"an increment part cannot store {'/'.join(path)} = {type(value).__name__}: parts hold tensors, None, bools, "
        "ints, floats, strings, and lists, tuples and dicts of them (str or int keys); check the optimizers' "
        "param_groups and state")


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (on the CPU, contiguous; no copy when it is already both)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def encode_part(payload: Dict[str, Any]) -> List[memoryview]:
    """The bytes of a part file holding ``payload`` (the module note's layout), as the buffers
    to write in order: the header, then each tensor's bytes, not copied.

    Raises:
        InvalidInputError: a value a part cannot store (not a tensor, None, bool, int, float,
            string, or list, tuple or str/int-keyed dict of them), or a tensor of a dtype it
            does not store.
    """
    tensors: Dict[str, torch.Tensor] = {}
    tree = _tree(payload, (), tensors)
    order = sorted(tensors, key=lambda n: -tensors[n].element_size())  # stable: the largest first stay aligned
    entries: Dict[str, Any] = {"__metadata__": {"format": PART_FORMAT, "version": str(FORMAT_VERSION),
                                                "tree": json.dumps(tree, separators=(",", ":"))}}
    data: List[memoryview] = []
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in _DTYPES or t.layout != torch.strided:
            raise InvalidInputError(f"an increment part cannot store {name}, a {t.layout} tensor of dtype {t.dtype}")
        raw = _bytes_of(t)
        entries[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        data.append(raw)
        offset += len(raw)
    head = json.dumps(entries, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % _ALIGN)
    return [memoryview(len(head).to_bytes(8, "little") + head)] + data


def write_part(increment: str, header: PartHeader, payload: Dict[str, Any]) -> PartHeader:
    """Write one rank's part (``payload`` in the module note's layout: :func:`encode_part`), then
    its header, each atomically and fsynced: the header exists only once the part is durable.
    Returns the header written (with the part's size and CRC-32C). Any thread may call it.

    Raises:
        InvalidInputError: ``payload`` holds a value a part cannot store (:func:`encode_part`).
    """
    chunks = encode_part(payload)
    crc = 0
    for chunk in chunks:
        crc = crc32c.crc32c(chunk, crc)
    header.size, header.crc32c = sum(len(c) for c in chunks), crc
    part, head = part_paths(increment, header.rank)
    atomic_write_chunks(part, chunks)
    atomic_write_bytes(head, header.to_json())
    return header


def read_part(increment: str, header: PartHeader) -> Dict[str, Any]:
    """The payload of the part ``header`` describes, memory-mapped (copy-on-write: its tensors
    are views of the file, paged in when read), after checking the file's size and CRC-32C
    against ``header``. No pickle is loaded.

    Raises:
        IncrementChainError: the file is missing or unreadable, its size or checksum differs
            from the header's, or its contents are not a part of this format (a layout,
            dtype, shape or byte range that does not hold).
    """
    part, _ = part_paths(increment, header.rank)
    try:
        with open(part, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            buf: Union[mmap.mmap, bytes] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else b""
    except (OSError, ValueError) as exc:
        raise IncrementChainError(f"{part}: cannot read rank {header.rank}'s part: {exc}") from exc
    if size != header.size:
        raise IncrementChainError(f"{part}: {size} bytes, the header records {header.size}: the part is damaged "
                                  "(truncated, or replaced)")
    crc = crc32c.crc32c(buf)
    if crc != header.crc32c:
        raise IncrementChainError(f"{part}: CRC-32C {crc:#x}, the header records {header.crc32c:#x}: the part is "
                                  "damaged")
    return decode_part(buf, part)


def decode_part(buf: Union[mmap.mmap, bytes, bytearray], where: str) -> Dict[str, Any]:
    """The payload of a part file's bytes (:func:`encode_part`'s layout); its tensors are views
    of ``buf``, which must be writable for them to be (a copy-on-write ``mmap``, a
    ``bytearray``), else they are copies. Every size read from the bytes is checked against
    their length before anything is sized by it.

    Raises:
        IncrementChainError: the bytes are not a part of this format.
    """
    try:
        if len(buf) < 8:
            raise ValueError(f"{len(buf)} bytes, shorter than the header's length")
        n = int.from_bytes(buf[:8], "little")
        if n > len(buf) - 8:
            raise ValueError(f"a header of {n} bytes in a file of {len(buf)}")
        entries = json.loads(bytes(buf[8:8 + n]))
        meta = entries.pop("__metadata__")
        if meta.get("format") != PART_FORMAT or meta.get("version") != str(FORMAT_VERSION):
            raise ValueError(f"format {meta.get('format')!r} version {meta.get('version')!r}, not {PART_FORMAT!r} "
                             f"version {FORMAT_VERSION}")
        start, room = 8 + n, len(buf) - 8 - n
        tensors = {name: _view(buf, name, e, start, room) for name, e in entries.items()}
        payload = _untree(json.loads(meta["tree"]), tensors)
        if not isinstance(payload, dict):
            raise ValueError("its payload is not a dict")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise IncrementChainError(f"{where}: not an increment part of this format: {exc}") from exc
    return payload


def _view(buf: Union[mmap.mmap, bytes, bytearray], name: str, entry: Dict[str, Any], start: int,
          room: int) -> torch.Tensor:
    """Tensor ``name`` of a part's bytes: checked (dtype, shape, a byte range inside the data
    that fits them, aligned), then a view of ``buf`` (data from ``start``, ``room`` bytes)."""
    dtype = _NAMED[entry["dtype"]]
    shape = [int(x) for x in entry["shape"]]
    begin, end = (int(x) for x in entry["data_offsets"])
    numel = 1
    for x in shape:
        if x < 0:
            raise ValueError(f"{name}: shape {shape}")
        numel *= x
    size = torch.empty((), dtype=dtype).element_size()
    if not 0 <= begin <= end <= room or end - begin != numel * size or (start + begin) % size:
        raise ValueError(f"{name}: bytes [{begin}, {end}) of {room} for shape {shape} of {dtype}")
    if not numel:
        return torch.empty(shape, dtype=dtype)
    if isinstance(buf, bytes):
        buf = bytearray(buf[start + begin:start + end])
        begin, start = 0, 0
    return torch.frombuffer(buf, dtype=dtype, count=numel, offset=start + begin).view(shape)


def _untree(node: Any, tensors: Dict[str, torch.Tensor]) -> Any:
    """The value a part's ``"tree"`` describes (:func:`_tree`'s inverse)."""
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if not isinstance(node, dict) or len(node) != 1:
        raise ValueError(f"a node of the tree is {type(node).__name__}, not one tag")
    (tag, v), = node.items()
    if tag == "tensor":
        return tensors[v]
    if tag == "dict" and isinstance(v, dict):
        return {str(k): _untree(x, tensors) for k, x in v.items()}
    if tag == "intdict" and isinstance(v, list):
        return {int(k): _untree(x, tensors) for k, x in v}
    if tag in ("list", "tuple") and isinstance(v, list):
        items = [_untree(x, tensors) for x in v]
        return items if tag == "list" else tuple(items)
    raise ValueError(f"an unknown tag {tag!r} in the tree")


def row_ids(ids: torch.Tensor, rows: int, where: str) -> torch.Tensor:
    """A part's shard-local row ids of one table, flat int64, checked to lie in the shard's
    ``[0, rows)`` before anything is sized or written by them.

    Raises:
        IncrementChainError: an id outside the shard (a part of another layout, or forged).
    """
    flat = ids.reshape(-1).long()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= rows):
        raise IncrementChainError(f"{where}: row ids [{int(flat.min())}, {int(flat.max())}] outside the shard's "
                                  f"{rows} rows: not a part of this layout")
    return flat


def newest_rows(ids: Sequence[torch.Tensor], rows: int) -> List[torch.Tensor]:
    """Which rows of each part a chain's restore writes, so that each row is written once, with
    its newest value: ``ids[j]`` are part ``j``'s shard-local ids of one table (chain order,
    each part's ids unique), ``rows`` the shard's rows; returns per part the boolean mask of its
    ids that no later part holds. Newest part first, over a bitmap of the shard's rows (no
    search, no sort).

    Raises:
        IncrementChainError: an id outside ``[0, rows)`` (a part of another layout, or forged):
            refused before anything is sized by it.
    """
    flat = [row_ids(i, rows, f"part {j} of the chain") for j, i in enumerate(ids)]
    written = torch.zeros(rows, dtype=torch.bool)
    masks: List[torch.Tensor] = [torch.empty(0, dtype=torch.bool)] * len(flat)
    for j in range(len(flat) - 1, -1, -1):
        masks[j] = ~written[flat[j]]
        written[flat[j]] = True
    return masks


def write_rows(targets: Sequence[torch.Tensor],
               parts: Sequence[Tuple[torch.Tensor, Sequence[torch.Tensor]]]) -> None:
    """Write a chain's increment rows of one shard into ``targets`` (the shard's weights and
    each row-wise optimizer state: one entry per row of the shard first), so that each row
    ends with its newest value. ``parts[j]`` is part ``j``'s (shard-local ids, its rows of each
    target), in chain order. Parts are written oldest first, a row at a time (moved to each
    target's device); a part's rows that a newer part holds (:func:`newest_rows`) are left out
    by a gather, unless they are a small share of it: then it is written whole, and the newest
    part holding those rows, written later, writes them again.

    Raises:
        IncrementChainError: an id outside the shard (:func:`newest_rows`).
    """
    for (ids, sources), keep in zip(parts, newest_rows([p[0] for p in parts], targets[0].shape[0])):
        kept = int(keep.sum())
        if not kept:
            continue
        whole = kept >= _WHOLE_PART_SHARE * keep.numel()
        flat = ids.reshape(-1).long()
        at = flat if whole else flat[keep]
        for target, saved in zip(targets, sources):
            scatter_rows(target, at, saved if whole else saved[keep])


__all__ = ["BASE_INFO", "BaseInfo", "DCP_METADATA", "FORMAT_VERSION", "GROUPS_KEY", "INCREMENTS", "Layout",
           "PART_FORMAT", "PART_SUFFIX", "PartHeader", "RankInfo", "TRACKER_STATE_KEY", "base_dir", "decode_part",
           "encode_part", "increment_dir", "newest_rows", "part_paths", "read_part", "row_ids", "write_base_info",
           "write_part", "write_rows"]
