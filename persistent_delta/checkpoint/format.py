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
    <root>/base-<step>/increments/<seq>/rank-<r>.pt     rank r's part of increment seq (torch.save)
    <root>/base-<step>/increments/<seq>/rank-<r>.json   its PartHeader, written after the .pt is durable

An increment is complete when every rank's header is present, agrees with the others and with
its base, and names a part file of the size and checksum it records. A part holds, for every
table sharded on its rank, the shard-local ids of the rows changed since the previous
increment (or the base), their weights and each fused optimizer state's rows (in the state's
own layout: ``(n, cols)`` for Adagrad, ``(n,)`` for row-wise Adagrad), the dense parameters
and buffers and the dense optimizer's state whole, the optimizers' ``param_groups``, and the
rank's tracker state. Tensors are stored with ``torch.save`` (read back with
``weights_only=True``).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Sequence, Tuple

import torch

from persistent_delta.errors import IncrementChainError
from persistent_delta.log.layout import atomic_write_bytes

FORMAT_VERSION = 1
BASE_INFO = "persistent_delta_base.json"
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's, written last by its save
INCREMENTS = "increments"
# The start of rank r's tracker state key in ``dmp.state_dict()`` ("<TRACKER_STATE_KEY>.rank_<r>"),
# and the whole key of a checkpoint taken before one key per rank
TRACKER_STATE_KEY = "persistent_delta_tracker"
# A base's key for the optimizers' param_groups, {"fused": [...], "dense": [...]} (one opaque value)
GROUPS_KEY = "persistent_delta_param_groups"
_CRC_BLOCK = 1 << 20

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
    return os.path.join(increment, f"rank-{rank}.pt"), os.path.join(increment, f"rank-{rank}.json")


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
        size, crc32: the part file's size and CRC-32.
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
    crc32: int
    version: int = FORMAT_VERSION
    rows: Dict[str, int] = field(default_factory=dict)  # fqn -> rows in the part (for tools)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @staticmethod
    def from_json(data: bytes) -> "PartHeader":
        """Raises: ValueError (or KeyError/TypeError) on a malformed file."""
        d = json.loads(data)
        d["layout"] = {str(k): [int(x) for x in v] for k, v in d["layout"].items()}
        return PartHeader(**d)

    def agrees_with(self, other: "PartHeader") -> bool:
        """Whether two ranks' headers describe the same increment."""
        return (self.base_id, self.seq, self.step, self.prev_step, self.run_id, self.world_size) == \
            (other.base_id, other.seq, other.step, other.prev_step, other.run_id, other.world_size)


def write_base_info(base: str, info: BaseInfo) -> None:
    """Write a base's :class:`BaseInfo` atomically (rank 0, once the DCP save returned)."""
    atomic_write_bytes(os.path.join(base, BASE_INFO), info.to_json())


def write_part(increment: str, header: PartHeader, payload: Dict[str, Any]) -> PartHeader:
    """Write one rank's part (``torch.save`` of ``payload``), then its header, each atomically
    and fsynced: the header exists only once the part is durable. Returns the header written
    (with the part's size and checksum). Any thread may call it."""
    buf = io.BytesIO()
    torch.save(payload, buf)
    data = buf.getvalue()
    header.size, header.crc32 = len(data), zlib.crc32(data)
    part, head = part_paths(increment, header.rank)
    atomic_write_bytes(part, data)
    atomic_write_bytes(head, header.to_json())
    return header


def read_part(increment: str, header: PartHeader) -> Dict[str, Any]:
    """The payload of the part ``header`` describes, memory-mapped (its tensors are paged in
    when read, copy-on-write), after checking the file's size and CRC-32 against ``header``.

    Raises:
        IncrementChainError: the file is missing or unreadable, its size or checksum differs
            from the header's, or torch cannot load it.
    """
    part, _ = part_paths(increment, header.rank)
    crc, size = 0, 0
    try:
        with open(part, "rb") as f:
            while block := f.read(_CRC_BLOCK):
                crc, size = zlib.crc32(block, crc), size + len(block)
    except OSError as exc:
        raise IncrementChainError(f"{part}: cannot read rank {header.rank}'s part: {exc}") from exc
    if size != header.size or crc != header.crc32:
        raise IncrementChainError(f"{part}: {size} bytes with CRC-32 {crc:#x}, the header records "
                                  f"{header.size} bytes with CRC-32 {header.crc32:#x}: the part is damaged")
    try:
        out: Dict[str, Any] = torch.load(part, mmap=True, weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        raise IncrementChainError(f"{part}: rank {header.rank}'s part cannot be loaded: {exc}") from exc
    return out


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


__all__ = ["BASE_INFO", "BaseInfo", "DCP_METADATA", "FORMAT_VERSION", "GROUPS_KEY", "INCREMENTS", "Layout", "PartHeader",
           "RankInfo", "TRACKER_STATE_KEY", "base_dir", "increment_dir", "newest_rows", "part_paths", "read_part", "row_ids",
           "write_base_info", "write_part"]
