"""A serving replica over a TorchRec inference model: published rows applied in place.

Owns: finding the FBGEMM tables of a model quantized with TorchRec's own inference path
(:func:`torchrec.inference.modules.quantize_inference_model`, or ``quantize_embeddings`` for an
EBC), turning published rows into those tables' bytes, writing them into the weights in place,
and the lock that keeps requests from seeing a half-written row.

Design note:

* **Where the rows go.** TorchRec's quantized EC and EBC hold their tables in
  ``IntNBitTableBatchedEmbeddingBagsCodegen`` modules; ``split_embedding_weights()`` gives per
  table a view of the weights (``[rows, dim]`` uint8 values and ``[rows, 4]`` uint8 scale and
  bias for int8; ``[rows, 2 * dim]`` uint8 for fp16) over the module's ``weights_host``, which
  the forward reads. Writing through the views updates the model in place.
* **Sharded models.** ``shard_quant_model`` (TorchRec's local sharding: every shard in this
  process) gives sharded EC / EBC modules whose ``tbes_configs()`` map each FBGEMM module to
  its shards' metadata. A table-wise table is one whole shard; a row-wise table is row blocks,
  and a row goes to the block holding it at ``id - row_offset``. A column shard would need a
  row's int8 scale and bias per column slice, which a whole row's are not: refused (TorchRec's
  CPU sharding refuses column-wise too), as is a model holding only some shards of a table.
* **Which rows.** A poll is merged per table by the one rule of "applied"
  (:func:`persistent_delta.read.results.merge_table`: row-wise shards side by side, column
  halves joined into whole rows, a replicated table's newest publish per row), after the same
  checks as :func:`persistent_delta.serve.apply.apply_poll`.
* **Which bytes.** Float rows (``"native"`` float32 or ``"float32"`` records) are quantized
  here with ``torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(rows, 8)`` for int8
  tables and ``.half()`` for fp16 tables: the same bytes TorchRec's inference quantization
  gives those rows. ``"int8"`` and ``"float16"`` records already hold those bytes and are
  copied as they are. A format that would not give the same bytes (``"bfloat16"`` rows, fp16
  rows into an int8 table, int8 rows into an fp16 table) is refused. A column half alone is
  never quantized: its scale would not be the row's.
* **What a request sees.** :meth:`InferenceReplica.forward` (and :meth:`~InferenceReplica.serving`)
  run under the read side of a readers-writer lock; an apply converts every row first, with no
  lock held, then writes the rows in chunks of ``chunk_rows`` under the write side. A row is
  written whole (values, scale and bias) within one chunk, so a request never sees a row whose
  values and scale/bias come from different publishes; rows of different chunks may come from
  different polls while an apply runs. ``poll_atomic=True`` holds the write side for the whole
  poll: a request then sees all of a poll's rows or none.
* **Managed collision.** A quantized managed-collision model remaps raw ids through its MCH
  modules' buffers (:mod:`persistent_delta.serve.mch_maps`); a poll's slot reassignments
  (``poll.zch()``) are written there, and a table with a map change has its map and all of the
  poll's rows for it written under one hold of the write side: a request never looks a raw id
  up in one publish's map and reads the slot's row of another.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
from torch import nn

import persistent_delta.torchrec_internals as trec
from persistent_delta.errors import IncompletePollError, InvalidInputError, ReplicaMismatchError, ServingLockError
from persistent_delta.log import codec
from persistent_delta.serve.apply import Applied, check_poll
from persistent_delta.read.base import continuation_of
from persistent_delta.serve.mch_maps import MapUpdate, MchMap, mch_maps
from persistent_delta.read.results import DeltaPoll, MergedDelta, TableDelta, merge_table
from persistent_delta.threads import intra_op_threads

INT8 = codec.INT8
FLOAT16 = "float16"
DEFAULT_CHUNK_ROWS = 4096


@dataclass
class TableShard:
    """One block of rows of an inference table, as its FBGEMM module holds it.

    Attributes:
        row_offset: the block's first row in the whole table (rows ``[row_offset, row_offset +
            rows)``; 0 for an unsharded or table-wise sharded table).
        rows: rows of the block.
        values: the view of the block's values in the FBGEMM weights: uint8 ``[rows, dim]``
            (int8) or ``[rows, 2 * dim]`` (the fp16 bytes).
        scale_bias: int8: uint8 ``[rows, 4]`` (fp16 scale then fp16 bias); fp16: None.
    """

    row_offset: int
    rows: int
    values: torch.Tensor
    scale_bias: Optional[torch.Tensor]


@dataclass
class InferenceTable:
    """One table of the inference model, as the replica writes it.

    Attributes:
        fqn: the table's fqn in the trainer's words (``"<module path>.embeddings.<name>"`` for an
            EC, ``".embedding_bags."`` for an EBC).
        name: the table's name (its TorchRec config name).
        rows: rows of the table.
        dim: the embedding dimension.
        weight_type: ``"int8"`` or ``"float16"``.
        shards: the table's row blocks, by ``row_offset``, tiling ``[0, rows)``: one for an
            unsharded or table-wise sharded table, one per shard for a row-wise one.
        sharding: ``None`` (an unsharded quantized module), or TorchRec's sharding type of the
            table in a sharded one (``"table_wise"``, ``"row_wise"``).
    """

    fqn: str
    name: str
    rows: int
    dim: int
    weight_type: str
    shards: List[TableShard]
    sharding: Optional[str] = None


class _ServingLock:
    """A readers-writer lock that prefers the writer: requests (readers) run together; an apply
    chunk (the writer) waits for the running requests and holds new ones back.

    The read side is reentrant per thread: a thread that already reads (a ``forward`` or
    ``weights`` inside ``serving()``) reads again at once, even while a writer waits (waiting
    for that writer would wait for itself). A thread that reads cannot write: that raises
    instead of waiting forever."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        self._mine = threading.local()  # this thread's depth of read holds

    def _depth(self) -> int:
        return getattr(self._mine, "depth", 0)

    @contextmanager
    def reading(self) -> Iterator[None]:
        depth = self._depth()
        if not depth:
            with self._cond:
                while self._writer or self._writers_waiting:
                    self._cond.wait()
                self._readers += 1
        self._mine.depth = depth + 1
        try:
            yield
        finally:
            self._mine.depth = depth
            if not depth:
                with self._cond:
                    self._readers -= 1
                    if not self._readers:
                        self._cond.notify_all()

    @contextmanager
    def writing(self) -> Iterator[None]:
        if self._depth():
            raise ServingLockError(
                "an apply was called from inside InferenceReplica.serving() (or a request) on the same thread: "
                "it would wait for its own read forever. Apply from the consumer loop's thread, outside serving()")
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writer or self._readers:
                    self._cond.wait()
            finally:
                self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


# Sharding types whose shards hold whole rows: a row's values and its scale/bias live in one
# shard, so a published row is written there as it is. TorchRec's CPU sharding of quantized
# models builds table-wise (int8, fp16) and row-wise (int8) ones, and refuses column-wise.
WHOLE_ROW_SHARDINGS = ("table_wise", "row_wise")
TORCHREC_CPU_SHARDING = (
    "TorchRec (1.8) shards a quantized model on CPU with shard_quant_model(model, compute_device='cpu', "
    "sharding_device='cpu') after torchrec.distributed.global_settings.set_propogate_device(True): "
    "table_wise (int8 and fp16 tables) and row_wise (int8 tables, whose sharder needs "
    "quant_state_dict_split_scale_bias); it refuses column_wise on CPU")


def _weight_kind(fqn: str, sparse_type: str) -> str:
    kind = {"int8": INT8, "fp16": FLOAT16}.get(sparse_type)
    if kind is None:
        raise ReplicaMismatchError(f"table {fqn} is {sparse_type}: an inference replica writes int8 and fp16 tables")
    return kind


def _check_not_pruned(tbe: nn.Module, where: str) -> None:
    if int(tbe.index_remappings_array_offsets.numel()) or int(tbe.index_remapping_hash_table_offsets.numel()):
        raise ReplicaMismatchError(f"{where}: a pruned table (rows remapped) cannot be written by row id")


def _unsharded_tables(mod: nn.Module, prefix: str) -> Dict[str, InferenceTable]:
    """The tables of TorchRec's quantized EC / EBC (one FBGEMM module per group of tables)."""
    out: Dict[str, InferenceTable] = {}
    for tbe in trec.quant_tbes(mod):
        _check_not_pruned(tbe, f"{prefix}*")
        for spec, (values, scale_bias) in zip(tbe.embedding_specs, tbe.split_embedding_weights()):
            name, rows, dim = spec[0], int(spec[1]), int(spec[2])
            kind = _weight_kind(prefix + name, spec[3].value)
            shard = TableShard(0, rows, values, scale_bias if kind == INT8 else None)
            out[prefix + name] = InferenceTable(prefix + name, name, rows, dim, kind, [shard])
    return out


def _sharded_tables(mod: nn.Module, prefix: str) -> Dict[str, InferenceTable]:
    """The tables of TorchRec's sharded quantized EC / EBC (``shard_quant_model``): each shard
    is a table of an FBGEMM module of ``tbes_configs()``, placed by its shard metadata."""
    kinds = {info.embedding_config.name: info.param_sharding.sharding_type
             for infos in mod.sharding_type_device_group_to_sharding_infos().values() for info in infos}
    for name, sharding in sorted(kinds.items()):
        if sharding not in WHOLE_ROW_SHARDINGS:
            raise ReplicaMismatchError(
                f"table {prefix}{name} is sharded {sharding} in the inference model: an inference replica writes "
                f"unsharded, table_wise and row_wise quantized tables (a column shard's int8 scale and bias are not "
                f"the whole row's). {TORCHREC_CPU_SHARDING}")
    found: Dict[str, Tuple[int, int, str, List[TableShard]]] = {}
    for tbe, config in mod.tbes_configs().items():
        _check_not_pruned(tbe, f"{prefix}*")
        for spec, table, (values, scale_bias) in zip(tbe.embedding_specs, config.embedding_tables,
                                                     tbe.split_embedding_weights()):
            fqn = prefix + table.name
            kind = _weight_kind(fqn, spec[3].value)
            meta = table.local_metadata
            r0, c0 = (int(x) for x in meta.shard_offsets)
            # the FBGEMM spec's dim is the shard's columns (the metadata's size may count bytes)
            n, cols = int(spec[1]), int(spec[2])
            if spec[0] != table.name or c0 or cols != table.embedding_dim:
                raise ReplicaMismatchError(
                    f"table {fqn}: a shard of rows [{r0}, {r0 + n}) and {cols} of its {table.embedding_dim} columns "
                    f"from column {c0}: an inference replica writes shards of whole rows. {TORCHREC_CPU_SHARDING}")
            entry = found.setdefault(fqn, (int(table.num_embeddings), int(table.embedding_dim), kind, []))
            entry[3].append(TableShard(r0, n, values, scale_bias if kind == INT8 else None))
    out: Dict[str, InferenceTable] = {}
    for fqn, (rows, dim, kind, shards) in found.items():
        shards.sort(key=lambda s: s.row_offset)
        ends = [0] + [s.row_offset + s.rows for s in shards]
        if [s.row_offset for s in shards] != ends[:-1] or ends[-1] != rows:
            raise ReplicaMismatchError(
                f"table {fqn}: this process holds its rows {[(s.row_offset, s.row_offset + s.rows) for s in shards]} "
                f"of {rows}: an inference replica writes a model that holds every shard of its tables "
                "(shard_quant_model's local sharding)")
        name = fqn.rsplit(".", 1)[-1]
        out[fqn] = InferenceTable(fqn, name, rows, dim, kind, shards, kinds.get(name))
    return out


def inference_tables(model: nn.Module) -> Dict[str, InferenceTable]:
    """The FBGEMM tables of a model quantized with TorchRec's inference path, by trainer fqn.

    Args:
        model: the quantized model (``quantize_inference_model(model)``; an EBC quantized with
            ``quantize_embeddings`` too), unsharded or sharded by ``shard_quant_model`` with
            table-wise or row-wise tables.

    Returns:
        fqn -> :class:`InferenceTable`, for every int8 and fp16 table of every quantized
        ``EmbeddingCollection`` / ``EmbeddingBagCollection`` in ``model``, sharded or not.

    Raises:
        ReplicaMismatchError: the model holds no quantized table, a table of a weight type this
            replica does not write (int4, int2, fp32...), a pruned table (its rows are
            remapped), a column-wise (or otherwise not whole-row) sharded table, or a sharded
            table of which the model holds only some shards.
    """
    from torchrec.distributed.quant_embedding import ShardedQuantEmbeddingCollection as ShardedQuantEC
    from torchrec.distributed.quant_embeddingbag import ShardedQuantEmbeddingBagCollection as ShardedQuantEBC
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEBC
    from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEC

    out: Dict[str, InferenceTable] = {}
    for path, mod in model.named_modules():
        if isinstance(mod, (QuantEC, ShardedQuantEC)):
            attr = "embeddings"
        elif isinstance(mod, (QuantEBC, ShardedQuantEBC)):
            attr = "embedding_bags"
        else:
            continue
        prefix = f"{path}.{attr}." if path else f"{attr}."
        sharded = isinstance(mod, (ShardedQuantEC, ShardedQuantEBC))
        out.update(_sharded_tables(mod, prefix) if sharded else _unsharded_tables(mod, prefix))
    if not out:
        raise ReplicaMismatchError(
            "the model holds no quantized embedding table: quantize it with "
            "torchrec.inference.modules.quantize_inference_model(model) first")
    return out


def _format(part: TableDelta) -> str:
    """The record format of a poll's part (``TableDelta.format``; "native" when unset)."""
    return str(getattr(part, "format", None) or "native")


def quantized_rows(table: InferenceTable, part: TableDelta, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (whole rows of one table from a poll, in ``part``'s format) as the table's bytes:
    uint8 ``[n, dim + 4]`` for an int8 table, float16 ``[n, dim]`` for an fp16 table.

    Raises:
        ReplicaMismatchError: the rows have another width than the table, or a format that
            would not give TorchRec's bytes for this table.
    """
    fmt = _format(part)
    n = rows.shape[0]
    rows = rows.reshape(n, -1)
    want = table.dim + 4 if fmt == INT8 else table.dim
    if rows.shape[1] != want:
        raise ReplicaMismatchError(
            f"table {table.fqn}: the inference model's table is {table.rows} x {table.dim} ({table.weight_type}); "
            f"the poll's {fmt} rows have {rows.shape[1]} columns")
    if fmt in (codec.NATIVE, "float32") and rows.dtype == torch.float32:
        if table.weight_type == INT8:
            return codec.quantize_int8(rows)
        return rows.half()
    if fmt == table.weight_type == INT8 and rows.dtype == torch.uint8:
        sb = rows[:, table.dim:].contiguous().view(torch.float16)
        if n and not bool(torch.isfinite(sb).all()):
            raise ReplicaMismatchError(f"table {table.fqn}: an int8 row's scale or bias is not finite")
        return rows
    if fmt == table.weight_type == FLOAT16 and rows.dtype == torch.float16:
        return rows
    raise ReplicaMismatchError(
        f"table {table.fqn} is {table.weight_type} in the inference model; the poll holds {fmt} rows of "
        f"{rows.dtype}, which would not give TorchRec's own {table.weight_type} bytes. Register the replica's "
        f"consumer with format='float32', 'native' (a float32 table) or {table.weight_type!r}")


@dataclass
class _HalvesUpdate:
    """Rows of a column-wise table joined from a poll, to keep once they are applied."""

    ids: torch.Tensor
    rows: torch.Tensor
    known: torch.Tensor


@dataclass
class _ColumnHalves:
    """The float rows of a column-wise table, kept so that a whole row can be quantized when a
    poll holds only some of its column halves (a rank re-sends rows the others did not: a
    publish after a restart, or at-least-once delivery); ``known`` marks the columns received
    (or given by the base)."""

    rows: torch.Tensor
    known: torch.Tensor

    @staticmethod
    def empty(rows: int, dim: int) -> "_ColumnHalves":
        return _ColumnHalves(torch.zeros(rows, dim), torch.zeros(rows, dim, dtype=torch.bool))

    @staticmethod
    def of_base(full: torch.Tensor) -> "_ColumnHalves":
        return _ColumnHalves(full.detach().to(torch.float32).clone(), torch.ones(full.shape, dtype=torch.bool))

    def joined(self, table: InferenceTable, merged: MergedDelta) -> Tuple[torch.Tensor, torch.Tensor, _HalvesUpdate]:
        """Whole float rows for every row any column group of ``merged`` holds.

        Raises:
            IncompletePollError: some row's other columns were never received (no base given).
        """
        ids = merged.global_ids.to(torch.int64)
        rows = self.rows.index_select(0, ids)
        known = self.known.index_select(0, ids)
        for c0, part in merged.column_parts.items():
            st = part.states
            if st is None or not part.ids.numel():
                continue
            st = st.reshape(st.shape[0], -1)
            if st.dtype not in (torch.float32, torch.float16) or c0 + st.shape[1] > table.dim:
                raise ReplicaMismatchError(
                    f"table {table.fqn}: a column-wise table's halves must be float32 or float16 rows within "
                    f"{table.dim} columns; got {st.dtype} columns [{c0}, {c0 + st.shape[1]})")
            pos = torch.searchsorted(ids, part.ids.to(torch.int64))
            rows[pos, c0:c0 + st.shape[1]] = st.to(torch.float32)
            known[pos, c0:c0 + st.shape[1]] = True
        if not bool(known.all()):
            missing = ids[~known.all(dim=1)]
            raise IncompletePollError(
                f"table {table.fqn}: rows {missing[:8].tolist()} ({missing.numel()} rows) arrived as column halves "
                "whose other columns this replica never received, so no whole row can be quantized; give the "
                "replica the float base (InferenceReplica(model, base=load_base(...))); nothing was applied")
        return ids, rows, _HalvesUpdate(ids, rows, known)

    def keep(self, update: _HalvesUpdate) -> None:
        self.rows.index_copy_(0, update.ids, update.rows)
        self.known.index_copy_(0, update.ids, update.known)


def _layout(t: InferenceTable) -> torch.Tensor:
    """A copy of a table's rows in a converted record's layout (shards joined in row order)."""
    if t.weight_type == INT8:
        blocks = [torch.cat([s.values, s.scale_bias], dim=1) for s in t.shards if s.scale_bias is not None]
        return torch.cat(blocks) if len(blocks) > 1 else blocks[0]
    return torch.cat([s.values for s in t.shards]).view(torch.float16)


class InferenceReplica:
    """A TorchRec inference model that follows the trainer's publishes, and serves meanwhile.

    Build it on the quantized model, apply every poll of the snapshots channel in order
    (:meth:`apply_poll`, or :func:`persistent_delta.serve.apply.apply_poll` with the replica in
    place of the tables), and answer requests with :meth:`forward` (or inside
    :meth:`serving`) on any number of other threads.

    Guarantee (see the module note): a request never observes a row whose values and
    scale/bias come from different publishes, nor a row written in part, nor a managed-collision
    table's raw-id map of one poll with its rows of another; with ``poll_atomic=True`` it
    observes all of a poll's rows or none.

    A quantized managed-collision model (``quantize_inference_model`` of an MC-EC / MC-EBC with
    ``MCHManagedCollisionModule``) has its raw-id maps written too (:attr:`maps`,
    :meth:`raw_id_map`); its MCH modules are put in eval mode, so requests never admit or evict.

    Args:
        model: the quantized inference model: unsharded, or sharded table-wise / row-wise by
            ``shard_quant_model`` (see the serving guide).
        chunk_rows: rows written per hold of the lock (bounds how long a request waits).
        poll_atomic: hold the lock over a whole poll instead of per chunk.
        base: the float tables the model was loaded from (:func:`~persistent_delta.serve.apply.load_base`):
            kept for column-wise tables, and, from ``load_base`` or ``bootstrap``, where the
            polls must continue from (each poll is checked as :func:`apply_poll` checks it).

    Raises:
        ReplicaMismatchError: see :func:`inference_tables`.
        InvalidInputError: ``chunk_rows`` < 1.
    """

    def __init__(self, model: nn.Module, *, chunk_rows: int = DEFAULT_CHUNK_ROWS, poll_atomic: bool = False,
                 base: Optional[Mapping[str, torch.Tensor]] = None) -> None:
        if int(chunk_rows) < 1:
            raise InvalidInputError(f"chunk_rows must be >= 1, got {chunk_rows}")
        self.model = model
        self.chunk_rows = int(chunk_rows)
        self.poll_atomic = bool(poll_atomic)
        self.tables = inference_tables(model)
        self._by_name: Dict[str, List[str]] = {}
        for fqn, t in self.tables.items():
            self._by_name.setdefault(t.name, []).append(fqn)
        self._seen = set((base or {}).keys())  # every trainer fqn polled (or in the base): table()'s rivals
        self._lock = _ServingLock()
        self.maps: Dict[str, MchMap] = mch_maps(model, self.tables)
        self._halves: Dict[str, _ColumnHalves] = {}
        for fqn, full in (base or {}).items():
            t = self.table(fqn)
            if tuple(full.shape) != (t.rows, t.dim) or not full.is_floating_point():
                raise ReplicaMismatchError(
                    f"base table {fqn!r} is {tuple(full.shape)} {full.dtype}; the inference model's {t.fqn} is "
                    f"{t.rows} x {t.dim}")
            self._halves[t.fqn] = _ColumnHalves.of_base(full)
        self.continuation = continuation_of(base)  # None: a base that does not say where it continues from

    # ------------------------------------------------------------------ serving (any thread)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model on a request, never during a chunk's write. Thread-safe."""
        with self._lock.reading(), torch.no_grad():
            return self.model(*args, **kwargs)

    @contextmanager
    def serving(self) -> Iterator[nn.Module]:
        """Hold off writes while the block runs, and yield the model (several calls, one view of
        the rows). Thread-safe; do not apply from inside the block (it would wait for itself)."""
        with self._lock.reading():
            yield self.model

    def weights(self, fqn: str) -> torch.Tensor:
        """A copy of one table's rows in TorchRec's layout: int8 ``[rows, dim + 4]`` (values,
        then fp16 scale and bias, as ``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf`` gives
        them), fp16 ``[rows, dim]``. Thread-safe."""
        t = self.table(fqn)
        with self._lock.reading():
            return _layout(t)

    def all_weights(self) -> Dict[str, torch.Tensor]:
        """:meth:`weights` of every table, copied under one hold of the lock (one view of the
        rows). Thread-safe."""
        with self._lock.reading():
            return {fqn: _layout(t) for fqn, t in self.tables.items()}

    def raw_id_map(self, fqn: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(raw ids ascending, slots)`` of a managed-collision table's map in the model (what
        its forward remaps raw ids with). Thread-safe.

        Raises:
            ReplicaMismatchError: no such table, or the table has no managed-collision module.
        """
        t = self.table(fqn)
        found = self.maps.get(t.fqn)
        if found is None:
            raise ReplicaMismatchError(f"table {t.fqn} has no managed-collision module in the inference model")
        with self._lock.reading():
            return found.map()

    def table(self, fqn: str) -> InferenceTable:
        """The inference table a trainer fqn maps to: the same fqn, else the one table of the
        fqn's table name (its last component), unless another trainer table the replica has
        seen (in any poll so far, or its base) has that name too: two trainer tables are never
        written into one, and a table that is another trainer table's own is never taken.

        Raises:
            ReplicaMismatchError: no such table, several tables of that name, or another trainer
                table of that name.
        """
        found = self.tables.get(fqn)
        if found is not None:
            return found
        name = fqn.rsplit(".", 1)[-1]
        named = self._by_name.get(name, [])
        if len(named) != 1:
            why = f"several tables are named so: {sorted(named)}" if named else f"it has {sorted(self.tables)}"
            raise ReplicaMismatchError(f"the inference model has no table for {fqn!r} ({why})")
        rivals = sorted(f for f in self._seen if f != fqn and f.rsplit(".", 1)[-1] == name)
        if rivals:
            raise ReplicaMismatchError(
                f"the inference model has no table {fqn!r}, and its one table named {name!r} ({named[0]}) cannot "
                f"stand in for it: the trainer also has {rivals}, and two trainer tables are never written into "
                "one. Give the inference model the trainer's module paths, or a table per trainer table")
        return self.tables[named[0]]

    # ------------------------------------------------------------------ applying (one thread)

    def apply_poll(self, poll: DeltaPoll, *, complete_only: bool = False, strict: bool = True) -> Applied:
        """Write a snapshots poll's rows into the model in place (see the class's guarantee).

        Call from one thread at a time (the replica's consumer loop); requests may run meanwhile.

        Args:
            poll: a poll of the ``snapshots`` channel.
            complete_only: refuse a poll that is not :attr:`~DeltaPoll.complete`.
            strict: a polled table the model lacks is an error (``False``: skipped).

        Returns:
            What was applied (``rows``: whole rows written; ``nbytes``: bytes written). A
            managed-collision table's slot reassignments (``poll.zch()``) are written into its
            MCH module's map with its rows.

        Raises:
            InvalidInputError: not a snapshots poll.
            IncompletePollError: ``complete_only`` and the poll is not complete; or a
                column-wise table whose halves in the poll hold different rows.
            ReplicaMismatchError: a table the model lacks (``strict``), of other rows or dim,
                or rows of a format that cannot be applied exactly. Nothing was written.
            StaleBaseError: the poll does not continue the ``base`` the replica was built on
                (:mod:`persistent_delta.read.base`). Nothing was written.
        """
        check_poll(poll, complete_only)
        if self.continuation is not None:
            self.continuation.check(poll)
        with torch.no_grad(), intra_op_threads(poll.read_threads):
            commits: List[Tuple[str, _ColumnHalves, _HalvesUpdate]] = []
            plan = self._plan(poll, strict, commits)
            maps = self._planned_maps(poll)
            for fqn, halves, update in commits:
                halves.keep(update)
                self._halves[fqn] = halves
            out = Applied(ranges=poll.ranges, publishes=poll.publishes)
            if self.poll_atomic:
                with self._lock.writing():
                    for table, ids, rows in plan:
                        self._write(table, ids, rows)
                    for update in maps.values():
                        update.map.write(update)
            else:
                for table, ids, rows in plan:
                    update = maps.pop(table.fqn, None)
                    if update is not None:  # the map and the table's rows in one hold
                        with self._lock.writing():
                            self._write(table, ids, rows)
                            update.map.write(update)
                        continue
                    for lo in range(0, ids.numel(), self.chunk_rows):
                        hi = lo + self.chunk_rows
                        with self._lock.writing():
                            self._write(table, ids[lo:hi], rows[lo:hi])
                for update in maps.values():  # reassignments without rows in this poll
                    with self._lock.writing():
                        update.map.write(update)
            for _, ids, rows in plan:
                out.rows += int(ids.numel())
                out.nbytes += rows.numel() * rows.element_size()
        if self.continuation is not None:
            self.continuation.advance(poll)
        out.applied_at = time.time()
        return out

    def _planned_maps(self, poll: DeltaPoll) -> Dict[str, MapUpdate]:
        """The managed-collision maps after the poll's slot reassignments, by table fqn (no
        lock held; nothing written)."""
        out: Dict[str, MapUpdate] = {}
        if not self.maps:
            return out
        for fqn, delta in poll.zch().items():
            try:
                found = self.maps.get(self.table(fqn).fqn)
            except ReplicaMismatchError:
                continue  # a table the model lacks: _plan decides (strict)
            update = found.planned(delta) if found is not None else None
            if update is not None:
                out[found.fqn] = update
        return out

    def _plan(self, poll: DeltaPoll, strict: bool, commits: List[Tuple[str, "_ColumnHalves", "_HalvesUpdate"]]
              ) -> List[Tuple[InferenceTable, torch.Tensor, torch.Tensor]]:
        """Every table's whole rows, converted and checked, before anything is written;
        ``commits`` gets the column-half updates to keep once the rows are written."""
        plan: List[Tuple[InferenceTable, torch.Tensor, torch.Tensor]] = []
        polled = poll.tables()
        self._seen.update(polled)  # (before any table is mapped: a poll's tables are each other's rivals)
        for fqn, parts in polled.items():
            parts = [p for p in parts if p.states is not None]
            if not parts:
                continue
            try:
                table = self.table(fqn)
            except ReplicaMismatchError:
                if strict:
                    raise
                continue
            shard = next((p.shard for p in parts if p.shard is not None), None)
            if shard is not None and shard.global_rows is not None and shard.global_rows != table.rows:
                raise ReplicaMismatchError(
                    f"table {fqn}: the trainer's table has {shard.global_rows} rows, the inference model's "
                    f"{table.fqn} {table.rows}")
            merged = merge_table(fqn, parts)
            ids = merged.global_ids.to(torch.int64)
            if not ids.numel():
                continue
            if int(ids.min()) < 0 or int(ids.max()) >= table.rows:
                raise ReplicaMismatchError(
                    f"table {fqn}: the poll's rows reach global id {int(ids.max())}; the inference model's table "
                    f"{table.fqn} has {table.rows} rows")
            split = merged.column_split or (shard is not None and shard.local_cols is not None
                                            and shard.global_cols is not None and shard.local_cols != shard.global_cols)
            if split and _format(parts[0]) in (codec.NATIVE, "float32", FLOAT16):
                halves = self._halves.get(table.fqn) or _ColumnHalves.empty(table.rows, table.dim)
                ids, rows, commit = halves.joined(table, merged)
                commits.append((table.fqn, halves, commit))
                if _format(parts[0]) == FLOAT16:
                    rows = rows.half()  # float16 -> float32 -> float16 is exact
            elif merged.states is None:
                raise IncompletePollError(
                    f"table {fqn}: its column parts in this poll hold different rows; nothing was applied")
            else:
                rows = merged.states  # whole rows: one column group, or rows joined by the consumer
            plan.append((table, ids, quantized_rows(table, parts[0], rows)))
        return plan

    @staticmethod
    def _write(table: InferenceTable, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Write converted rows at ``ids`` (global row ids) into the shards that hold them
        (caller holds the write lock)."""
        for shard in table.shards:
            # the rows are converted on the host; a device model's tables take them there
            at, part = ids.to(shard.values.device), rows.to(shard.values.device)
            if len(table.shards) > 1:
                inside = (at >= shard.row_offset) & (at < shard.row_offset + shard.rows)
                sel = inside.nonzero().squeeze(1)
                if not sel.numel():
                    continue
                at, part = at.index_select(0, sel) - shard.row_offset, part.index_select(0, sel)
            if shard.scale_bias is None:
                shard.values.index_copy_(0, at, part.contiguous().view(torch.uint8))
            else:
                shard.values.index_copy_(0, at, part[:, :table.dim])
                shard.scale_bias.index_copy_(0, at, part[:, table.dim:])


__all__ = ["InferenceReplica", "InferenceTable", "TableShard", "inference_tables", "quantized_rows"]
