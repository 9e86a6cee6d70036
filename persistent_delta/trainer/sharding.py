"""What this rank holds of each tracked table.

Owns: a rank's shard of a table (placement, weights, optimizer state), read out of TorchRec and
FBGEMM through :mod:`persistent_delta.torchrec_internals` (which holds every private
attribute it reads).

For every table fqn that TorchRec's tracker would track (``"<module>.embeddings.<table>"`` for
an EC, ``"<module>.embedding_bags.<table>"`` for an EBC, DMP/DDP prefixes stripped), this
module finds the local shard: its sharding type, the shard's row/column offsets and sizes
(``ShardedEmbeddingTable.local_metadata.shard_offsets``), and the FBGEMM TBE that holds it
(table ``k`` of a grouped embedding module of one of the sharded module's lookups), from which
the current rows and the optimizer state are read.

The shard metadata is written into the log's table entries so that tools can map shard-local
ids to global row ids (``global_id = local_id + row_offset``; column-wise shards hold the
columns ``[col_offset, col_offset + local_cols)`` of the same rows).

A data-parallel table (sharding type ``"data_parallel"``) is replicated: every rank holds all of
it (row and column offset 0, local size = global size; TorchRec gives it no shard metadata). Its
lookup is DDP-wrapped and its TBE is a dense ``DenseTableBatchedEmbeddingBagsCodegen`` trained by
the dense optimizer: it has weights but no fused optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from torch import nn

from persistent_delta.errors import InvalidInputError
from persistent_delta.log.schema import DATA_PARALLEL
import persistent_delta.torchrec_internals as trec


@dataclass
class LocalTable:
    """This rank's shard of one tracked table."""

    fqn: str
    table_name: str
    sharding_type: str
    row_offset: int
    col_offset: int
    local_rows: int
    local_cols: int
    global_rows: int
    global_cols: int
    emb_module: nn.Module  # BatchedFusedEmbedding[Bag]; BatchedDenseEmbedding[Bag] for data-parallel
    index: int  # index of the table inside the TBE's split_* lists

    @property
    def data_parallel(self) -> bool:
        """Whether the table is replicated on every rank (no fused optimizer state)."""
        return self.sharding_type == DATA_PARALLEL

    def metadata(self, kind: str) -> Dict[str, Any]:
        """The serialisable shard metadata stored in the log."""
        return {
            "table_name": self.table_name,
            "module_kind": kind,
            "sharding_type": self.sharding_type,
            "row_offset": self.row_offset,
            "col_offset": self.col_offset,
            "local_rows": self.local_rows,
            "local_cols": self.local_cols,
            "global_rows": self.global_rows,
            "global_cols": self.global_cols,
        }

    @property
    def tbe(self) -> Any:
        """The FBGEMM TBE that holds the shard (table ``index`` of it)."""
        return trec.tbe(self.emb_module)

    def weights(self) -> torch.Tensor:
        """The whole local shard (a live view into the TBE); for a data-parallel table this
        rank's replica of the whole table."""
        w: torch.Tensor = self.tbe.split_embedding_weights()[self.index]
        return w

    def optimizer_state(self) -> Optional[torch.Tensor]:
        """The first optimizer state of the shard (momentum1: per row for row-wise Adagrad,
        per element for Adagrad), a live view; None for optimizers without state (SGD) and for
        a data-parallel table (its optimizer is the dense one, outside the TBE)."""
        if self.data_parallel or not hasattr(self.tbe, "split_optimizer_states"):
            return None
        states = self.tbe.split_optimizer_states()
        if not states or not states[self.index]:
            return None
        s: torch.Tensor = states[self.index][0]
        return s


def shard_weights(tables: Dict[str, LocalTable], fqns: Iterable[str]) -> Dict[str, torch.Tensor]:
    """:meth:`LocalTable.weights` of each of ``fqns`` (tables of ``tables``), splitting each
    TBE's weights once: a split builds a view of every table in the TBE, and a publish reads
    several tables of one TBE."""
    split: Dict[int, List[torch.Tensor]] = {}
    out: Dict[str, torch.Tensor] = {}
    for fqn in fqns:
        t = tables[fqn]
        tbe = t.tbe
        views = split.get(id(tbe))
        if views is None:
            views = split[id(tbe)] = tbe.split_embedding_weights()
        out[fqn] = views[t.index]
    return out


def has_fused_state(stype: str, emb_module: nn.Module) -> bool:
    """Whether a grouped embedding module keeps its optimizer state in its TBE (fused, readable
    with ``split_optimizer_states``): not so for a data-parallel table's dense TBE."""
    return stype != DATA_PARALLEL and hasattr(trec.tbe(emb_module), "split_optimizer_states")


def iter_group_tables(sharded_module: nn.Module) -> Iterator[Tuple[str, nn.Module, int, Any]]:
    """(sharding_type, emb_module, index, ShardedEmbeddingTable) for every local shard."""
    for stype, lookup in trec.sharded_lookups(sharded_module):
        for emb in trec.embedding_modules(lookup):
            for i, t in enumerate(trec.group_tables(emb)):
                yield stype, emb, i, t


def local_tables(tracked_modules: Dict[str, nn.Module], table_to_fqn: Dict[str, str]) -> Dict[str, LocalTable]:
    """fqn -> :class:`LocalTable` for every tracked table with a shard on this rank.

    Raises:
        InvalidInputError: a rank holds two shards of one table (not supported).
    """
    out: Dict[str, LocalTable] = {}
    for module in tracked_modules.values():
        for stype, emb, i, t in iter_group_tables(module):
            fqn = table_to_fqn.get(t.name)
            if fqn is None:
                continue
            if fqn in out:
                raise InvalidInputError(
                    f"{fqn}: this rank holds more than one shard of the table, which persistent_delta "
                    "does not track; use a plan with at most one shard per table per rank"
                )
            md = t.local_metadata
            if str(stype) == DATA_PARALLEL or md is None:
                # replicated (TorchRec leaves local_metadata None): the whole table at offset 0
                row_off, col_off = 0, 0
            else:
                row_off, col_off = int(md.shard_offsets[0]), int(md.shard_offsets[1])
            out[fqn] = LocalTable(
                fqn=fqn,
                table_name=t.name,
                sharding_type=str(stype),
                row_offset=row_off,
                col_offset=col_off,
                local_rows=int(t.local_rows),
                local_cols=int(t.local_cols),
                global_rows=int(t.num_embeddings),
                global_cols=int(t.embedding_dim),
                emb_module=emb,
                index=i,
            )
    return out


def feature_index(emb_module: nn.Module) -> Dict[str, int]:
    """feature name -> index of its table inside ``emb_module``'s TBE."""
    out: Dict[str, int] = {}
    for i, t in enumerate(trec.group_tables(emb_module)):
        for f in t.feature_names:
            out.setdefault(f, i)
    return out
