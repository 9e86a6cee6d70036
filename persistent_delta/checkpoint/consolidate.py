"""Consolidate a base and its increments into a new base, offline; retention of older bases.

Owns: folding the newest complete chain under a checkpoint root into a new DCP base (its
``base-<step>`` directory and :class:`~.format.BaseInfo`, so increments continue from it), and
removing the bases (with their increments) that a newer complete base makes unneeded. No
trainer, no process group, no model: one process reads the base's DCP files and the parts.

Design note. The new base keeps the old one's DCP layout chunk for chunk: every chunk of
every tensor (each rank's shard of a sharded table or optimizer state, each whole dense
tensor) is written again at the same offsets, so whatever loaded the old base (plain
``dcp.load`` into a DMP's ``state_dict()`` of the same plan) loads the new one. One chunk is
in memory at a time: a save planner (:class:`FoldPlanner`) hands DCP's writer the chunks one by
one, each read from the old base (:class:`ChunkRead`, DCP's own reader, one chunk per plan) and
with the increments' rows written into it, each row once with its newest value (a later
increment's row wins; one ``index_copy_`` per chunk). The parts are opened memory-mapped, so
their rows are paged in as a chunk needs them.

Which chunk a part's rows go to: a table's weight under ``model.<fqn>.weight``, the rank's
shard at ``[row_offset, col_offset]`` (the base's recorded layout); its fused optimizer's
first state under ``fused.state.<fqn>.weight.<table>.momentum1``, a 2-D state at the weight's
offsets, a 1-D (row-wise) state where TorchRec puts it: at ``row_offset``, or, for a
column-wise table, at ``i * rows`` for the ``i``-th shard by column offset. Dense parameters,
buffers and data-parallel tables, the dense optimizer's state and each rank's tracker state
come whole from the last increment.

The new directory is written under a temporary name and renamed once DCP's ``.metadata`` and
the base's info file are durable: a crash leaves no ``base-<step>`` behind.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import shutil
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import _create_write_items

from persistent_delta.checkpoint import chain as chains
from persistent_delta.checkpoint.format import (GROUPS_KEY, TRACKER_STATE_KEY, BaseInfo, PartHeader, base_dir, newest_rows,
                                                part_paths, read_part, write_base_info)
from persistent_delta.errors import (CheckpointError, IncompleteBaseError, IncrementChainError, InvalidInputError,
                                     ShardLayoutError)
from persistent_delta.log.layout import fsync_path

logger = logging.getLogger(__name__)


Offsets = Tuple[int, ...]


@dataclass
class Consolidated:
    """What :func:`consolidate` did.

    Attributes:
        path: the new base's directory (the source base's when there was nothing to fold).
        step: the training step it holds.
        source: the base that was folded.
        increments: how many increments were folded into it (0: nothing written).
        bytes_written: the new base's DCP data bytes.
    """

    path: str
    step: int
    source: str
    increments: int
    bytes_written: int = 0


@dataclass
class RowTarget:
    """Rows of rank ``rank``'s parts that go into one chunk: the table ``fqn``'s weights
    (``state`` None) or its ``state``-th fused optimizer state."""

    rank: int
    fqn: str
    state: Optional[int] = None


@dataclass
class Fold:
    """Where each chunk of the new base comes from (built by :func:`plan_fold`)."""

    metadata: Metadata
    items: List[WriteItem] = field(default_factory=list)
    rows: Dict[Tuple[str, Offsets], List[RowTarget]] = field(default_factory=dict)
    whole: Dict[str, Any] = field(default_factory=dict)  # key -> the last increment's value (replaces the base's)
    tracker: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # key -> a rank's last tracker state
    mappings: Dict[str, Any] = field(default_factory=dict)  # DCP planner_data of the new base
    groups: Dict[str, Any] = field(default_factory=dict)  # the optimizers' param_groups at the last increment


# ------------------------------------------------------------------ reading
def open_part(increment: str, header: PartHeader) -> Dict[str, Any]:
    """The payload of one rank's part, memory-mapped (its tensors are paged in when read),
    after checking its size and CRC-32C against ``header`` (:func:`~.format.read_part`).

    Raises:
        IncrementChainError: the file is missing or damaged.
    """
    return read_part(increment, header)


class ChunkRead(LoadPlanner):
    """A load planner that reads one stored chunk (or one bytes entry) of a DCP checkpoint into
    ``out``, through DCP's own storage reader; no process group."""

    def __init__(self, key: str, chunk: Optional[ChunkStorageMetadata], index: Optional[int],
                 out: Optional[torch.Tensor] = None) -> None:
        self.key, self.chunk, self.index, self.out = key, chunk, index, out
        self.value: Any = None

    def set_up_planner(self, state_dict: Any, metadata: Optional[Metadata] = None, is_coordinator: bool = False) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        if self.chunk is None:
            idx = MetadataIndex(self.key)
            return LoadPlan([ReadItem(LoadItemType.BYTE_IO, idx, torch.Size([]), idx, torch.Size([]), torch.Size([]))])
        zeros = torch.Size([0] * len(self.chunk.sizes))
        return LoadPlan([ReadItem(LoadItemType.TENSOR, MetadataIndex(self.key, self.chunk.offsets), zeros,
                                  MetadataIndex(self.key, self.chunk.offsets, self.index), zeros, self.chunk.sizes)])

    def create_global_plan(self, global_plan: List[LoadPlan]) -> List[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.value = torch.load(value, weights_only=False)  # DCP's own rule for its bytes entries

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        assert self.out is not None  # a tensor item is planned only with a buffer
        return self.out

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


class BaseReader:
    """Reads a DCP checkpoint chunk by chunk (one process, no process group)."""

    def __init__(self, path: str) -> None:
        self.reader = FileSystemReader(path)
        self.metadata = self.reader.read_metadata()
        self.reader.set_up_storage_reader(self.metadata, True)

    def _read(self, planner: ChunkRead) -> None:
        plan = self.reader.prepare_local_plan(planner.create_local_plan())
        self.reader.read_data(plan, planner).wait()

    def chunk(self, key: str, index: int) -> torch.Tensor:
        """Chunk ``index`` of the tensor ``key``, as stored."""
        md = self.metadata.state_dict_metadata[key]
        assert isinstance(md, TensorStorageMetadata)
        c = md.chunks[index]
        out = torch.empty(c.sizes, dtype=md.properties.dtype)
        self._read(ChunkRead(key, c, index, out))
        return out

    def value(self, key: str) -> Any:
        """The object stored under the bytes entry ``key``."""
        planner = ChunkRead(key, None, None)
        self._read(planner)
        return planner.value


# ------------------------------------------------------------------ planning
def _chunk_index(md: TensorStorageMetadata, offsets: Sequence[int], sizes: Sequence[int]) -> Optional[int]:
    for i, c in enumerate(md.chunks):
        if list(c.offsets) == list(offsets) and list(c.sizes) == list(sizes):
            return i
    return None


def _rowwise_offset(info: BaseInfo, fqn: str, rank: int) -> int:
    """Where TorchRec puts rank ``rank``'s shard of a 1-D (row-wise) optimizer state of ``fqn``."""
    shards = sorted((lay[fqn][1], lay[fqn][0], r) for r, lay in ((ri.rank, ri.layout) for ri in info.ranks)
                    if fqn in lay)
    rows_split = len({s[1] for s in shards}) > 1
    cols_split = len({s[0] for s in shards}) > 1
    mine = info.ranks[rank].layout[fqn]
    if rows_split and cols_split:
        raise ShardLayoutError(f"{fqn} is split by rows and columns (grid sharding): consolidate cannot place its "
                               "row-wise optimizer state; restore it with the trainer instead")
    if cols_split:  # column-wise: the i-th shard by column offset at i * rows
        return [s[2] for s in shards].index(rank) * mine[2]
    return mine[0]


def _table_targets(fold: Fold, info: BaseInfo, rank: int, fqn: str, states: int) -> None:
    """Record which chunks rank ``rank``'s rows of ``fqn`` (its weights and ``states`` fused
    optimizer states) go to."""
    md = fold.metadata.state_dict_metadata
    row_off, col_off, rows, cols = info.ranks[rank].layout[fqn]
    wkey = f"model.{fqn}.weight"
    w = md.get(wkey)
    if not isinstance(w, TensorStorageMetadata) or _chunk_index(w, (row_off, col_off), (rows, cols)) is None:
        raise ShardLayoutError(f"the base has no chunk of {wkey} at rows [{row_off}, {row_off + rows}), columns "
                               f"[{col_off}, {col_off + cols}) for rank {rank}'s shard: not the layout it recorded")
    fold.rows.setdefault((wkey, (row_off, col_off)), []).append(RowTarget(rank, fqn))
    if states == 0:
        return
    prefix = f"fused.state.{fqn}.weight."
    found = sorted(k for k in md if k.startswith(prefix))
    first = [k for k in found if k.endswith(".momentum1")]
    if states > 1 or len(first) != 1:
        raise ShardLayoutError(f"{fqn}: {states} fused optimizer states per shard and {found} in the base: consolidate "
                               "folds optimizers with one state (SGD, Adagrad, row-wise Adagrad)")
    smd = md[first[0]]
    assert isinstance(smd, TensorStorageMetadata)
    if len(smd.size) == 2:
        offsets: Tuple[int, ...] = (row_off, col_off)
        sizes: Tuple[int, ...] = (rows, cols)
    else:
        offsets, sizes = (_rowwise_offset(info, fqn, rank),), (rows,)
    if _chunk_index(smd, offsets, sizes) is None:
        raise ShardLayoutError(f"the base has no chunk of {first[0]} at offsets {list(offsets)}, sizes {list(sizes)} "
                               f"for rank {rank}'s shard of {fqn}")
    fold.rows.setdefault((first[0], offsets), []).append(RowTarget(rank, fqn, 0))


def _tracker_key(metadata: Metadata, rank: int) -> str:
    name = f"{TRACKER_STATE_KEY}.rank_{rank}"
    found = [k for k, v in metadata.state_dict_metadata.items()
             if isinstance(v, BytesStorageMetadata) and (k == name or k.endswith("." + name))]
    if len(found) != 1:
        raise IncompleteBaseError(f"the base holds {found} for rank {rank}'s tracker state ({name}), not one entry")
    return found[0]


def plan_fold(chain: chains.Chain, metadata: Metadata, last: List[Dict[str, Any]]) -> Fold:
    """Plan the new base: every chunk of ``metadata`` again (bar the dense optimizer's when the
    last increment carries it), the targets of the increments' rows, and what the last
    increment's parts (``last``, index = rank) replace whole.

    Raises:
        ShardLayoutError: a part's rows have no chunk in the base (a layout it cannot place).
    """
    fold = Fold(metadata)
    info = chain.info
    headers = chain.increments[-1].headers
    for rank in range(info.world_size):
        for fqn in sorted(headers[rank].rows):
            states = len(last[rank]["rows"][fqn]["states"])
            _table_targets(fold, info, rank, fqn, states)
        fold.tracker[_tracker_key(metadata, rank)] = dict(last[rank]["tracker"])
    fold.whole = {f"model.{k}": v for k, v in last[0]["dense"].items()}
    fold.groups = {"fused": last[0]["fused_groups"], "dense": last[0]["dense_groups"]}
    dense_opt = last[0].get("dense_optimizer")
    drop_dense = bool(dense_opt and any(len(v) for v in dense_opt.get("state", {}).values()))
    fold.mappings = dict(metadata.planner_data or {})
    if drop_dense:
        flat, mappings = flatten_state_dict({"dense": dense_opt})
        fold.whole.update(flat)
        fold.mappings = {k: v for k, v in fold.mappings.items() if not k.startswith("dense.")}
        fold.mappings.update(mappings)
    for key, md in metadata.state_dict_metadata.items():
        if drop_dense and key.startswith("dense.state.") and key not in fold.whole:
            continue  # the last increment's dense optimizer state replaces the base's
        if isinstance(md, BytesStorageMetadata):
            fold.items.append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
            continue
        assert isinstance(md, TensorStorageMetadata)
        kind = WriteItemType.SHARD if len(md.chunks) > 1 else WriteItemType.TENSOR
        for c in md.chunks:
            data = TensorWriteData(ChunkStorageMetadata(c.offsets, c.sizes), md.properties, md.size)
            fold.items.append(WriteItem(index=MetadataIndex(key, c.offsets), type=kind, tensor_data=data))
    for key, value in fold.whole.items():
        if key not in metadata.state_dict_metadata:  # new in the increments (the base had no dense optimizer state)
            fold.items.extend(_create_write_items(key, value))
            fold.mappings.setdefault(key, tuple(key.split(".", 1)))
    return fold


# ------------------------------------------------------------------ writing
class FoldPlanner(DefaultSavePlanner):
    """A save planner that writes the :class:`Fold`'s chunks, each resolved when DCP's writer
    asks for it: read from the old base, with the increments' rows written in."""

    def __init__(self, fold: Fold, base: BaseReader, parts: List[List[Dict[str, Any]]]) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=False)
        self.fold, self.base, self.parts = fold, base, parts
        self.written = 0

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self.state_dict, self.mappings, self.is_coordinator = {}, self.fold.mappings, is_coordinator

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(list(self.fold.items), planner_data=self.mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Union[torch.Tensor, io.BytesIO]:
        key = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            return self._bytes(key)
        assert write_item.tensor_data is not None
        c = write_item.tensor_data.chunk
        offsets = tuple(int(x) for x in c.offsets)
        if key in self.fold.whole:
            value = self.fold.whole[key]
            for dim, (o, n) in enumerate(zip(c.offsets, c.sizes)):
                value = value.narrow(dim, o, n)
            out: torch.Tensor = value.clone()
        else:
            md = self.fold.metadata.state_dict_metadata[key]
            assert isinstance(md, TensorStorageMetadata)
            index = _chunk_index(md, c.offsets, c.sizes)
            assert index is not None
            out = self.base.chunk(key, index)
            for target in self.fold.rows.get((key, offsets), []):
                self._apply(out, target)
        self.written += out.numel() * out.element_size()
        return out

    def _apply(self, out: torch.Tensor, target: RowTarget) -> None:
        """Write rank ``target.rank``'s rows of the chain into ``out``: each row once, with its
        newest value, in one ``index_copy_``."""
        mine = [part["rows"][target.fqn] for part in self.parts[target.rank] if target.fqn in part["rows"]]
        if not mine:
            return
        values = [rows["weights"] if target.state is None else rows["states"][target.state] for rows in mine]
        if target.state is not None and values[-1].shape[:1] != mine[-1]["ids"].shape:
            out.copy_(values[-1])  # a state kept whole (not one entry per row): the newest
            return
        masks = newest_rows([rows["ids"] for rows in mine], out.shape[0])
        ids = torch.cat([rows["ids"].reshape(-1).long()[m] for rows, m in zip(mine, masks)])
        out.index_copy_(0, ids, torch.cat([v[m] for v, m in zip(values, masks)]))

    def _bytes(self, key: str) -> io.BytesIO:
        if key in self.fold.tracker:
            value = self.base.value(key)
            if not isinstance(getattr(value, "state", None), dict):
                raise IncompleteBaseError(f"{key}: the base stores a {type(value).__name__}, not a tracker state")
            value.state = self.fold.tracker[key]  # the stored type kept: the trainer's restore reads it
        elif key == GROUPS_KEY:
            value = _with_groups(self.base.value(key), self.fold.groups)
        elif key in self.fold.whole:
            value = self.fold.whole[key]
        else:
            value = self.base.value(key)
        buf = io.BytesIO()
        torch.save(value, buf)
        buf.seek(0)
        return buf


def _with_groups(stored: Any, groups: Dict[str, Any]) -> Any:
    """The base's param_groups entry with the last increment's groups (stored as the trainer
    stores it: the bytes of a ``torch.save``, which DCP pickles again)."""
    if isinstance(stored, io.BytesIO):
        stored.seek(0)
        value = torch.load(stored, weights_only=True)
        value.update(groups)
        buf = io.BytesIO()
        torch.save(value, buf)
        buf.seek(0)
        return buf
    if not isinstance(stored, dict):
        raise IncompleteBaseError(f"{GROUPS_KEY}: the base stores a {type(stored).__name__}, not param_groups")
    return {**stored, **groups}


def _folded_info(chain: chains.Chain, fold: Fold) -> BaseInfo:
    info = chain.info
    return BaseInfo(uuid.uuid4().hex, chain.step, info.world_size, [dataclasses.replace(r) for r in info.ranks],
                    info.fused_state, info.dense_state or any(k.startswith("dense.") for k in fold.whole))


def consolidate(root: str, out: Optional[str] = None) -> Consolidated:
    """Fold the chain under ``root`` that reaches the furthest step (:func:`~.chain.latest_chain`:
    its base and complete increments) into a new base ``<out>/base-<step>`` (``out`` defaults to
    ``root``), at the last increment's step. Offline:
    no trainer and no process group; it reads one chunk at a time. Run it while no trainer
    writes increments under ``root``: a trainer restoring later starts from the chain that
    reaches the furthest step (the new base, unless increments were written past it).

    Any thread of any process may call it; two at once on one root would write the same
    directory (the second finds it and raises).

    Returns:
        What was written (``increments`` 0 and the source base's path when it has none).

    Raises:
        IncompleteBaseError: no complete base under ``root``.
        IncrementChainError: its increments are not one chain, or a part is damaged;
            ``<out>/base-<step>`` exists already.
        ShardLayoutError: a part's rows have no place in the base (grid sharding, an
            optimizer with several states per row).
        FormatMismatchError: written with another format version.
    """
    chain = chains.latest_chain(root)
    if not chain.increments:
        logger.info("nothing to consolidate: %s has no complete increment", chain.base)
        return Consolidated(chain.base, chain.step, chain.base, 0)
    target = base_dir(out if out is not None else root, chain.step)
    if os.path.exists(target):
        raise IncrementChainError(f"{target} exists already: the chain was consolidated to step {chain.step} before "
                                  "(or a trainer took a base there)")
    parts = [[open_part(inc.path, inc.headers[r]) for inc in chain.increments] for r in range(chain.info.world_size)]
    base = BaseReader(chain.base)
    fold = plan_fold(chain, base.metadata, [p[-1] for p in parts])
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.tmp-{uuid.uuid4().hex[:8]}")
    planner = FoldPlanner(fold, base, parts)
    try:
        with warnings.catch_warnings():  # one process, no process group: the intent, not a mistake
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp.save({}, storage_writer=FileSystemWriter(tmp, thread_count=1), planner=planner, no_dist=True)
        write_base_info(tmp, _folded_info(chain, fold))
        os.rename(tmp, target)
        fsync_path(os.path.dirname(target))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("consolidated %s and %d increments into %s (step %d)", chain.base, len(chain.increments), target,
                chain.step)
    return Consolidated(target, chain.step, chain.base, len(chain.increments), planner.written)


# ------------------------------------------------------------------ retention
def removable_bases(root: str, keep: int = 1) -> List[str]:
    """The base directories under ``root`` (each with its increments) that retention removes:
    every base older than the ``keep`` newest complete ones. The newest complete base is never
    among them, nor a newer incomplete one (a save under way), nor the base of the chain a
    restore uses (:func:`~.chain.latest_chain`: the one reaching the furthest step).

    Raises:
        InvalidInputError: ``keep`` < 1.
        IncompleteBaseError: no complete base under ``root`` (nothing would be left to restore).
    """
    if keep < 1:
        raise InvalidInputError(f"keep must be at least 1 (the newest complete base), not {keep}")
    bases = chains.list_bases(root)
    complete: List[int] = []
    for step, path in bases:
        try:
            chains.open_base(path)
        except CheckpointError:
            continue
        complete.append(step)
    if not complete:
        raise IncompleteBaseError(f"{root}: no complete base: retention removes nothing until one exists")
    oldest_kept = sorted(complete)[-keep] if len(complete) >= keep else complete[0]
    try:  # an older base whose chain reaches further than the newest's is what a restore uses
        furthest: Optional[str] = chains.latest_chain(root).base
    except CheckpointError:
        furthest = None
    return [path for step, path in bases if step < oldest_kept and path != furthest]


def remove_old_bases(root: str, keep: int = 1, execute: bool = False) -> List[str]:
    """Remove what :func:`removable_bases` lists (only with ``execute``; else a dry run) and
    return it. Logs each removal and its reason. Run it while no trainer restores from ``root``.

    Raises:
        InvalidInputError: ``keep`` < 1.
        IncompleteBaseError: no complete base under ``root``.
    """
    paths = removable_bases(root, keep)
    for path in paths:
        if execute:
            logger.info("removing %s and its increments: a newer complete base exists", path)
            shutil.rmtree(path)
    return paths


__all__ = ["BaseReader", "ChunkRead", "Consolidated", "Fold", "FoldPlanner", "RowTarget", "consolidate", "open_part", "plan_fold", "removable_bases", "remove_old_bases"]
