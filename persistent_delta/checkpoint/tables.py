"""A chain's tables, offline: every table's weights whole, as of the chain's last increment.

Owns: :func:`read_tables` (the newest complete base's weights, read from its DCP files in this
one process without a process group, with its complete increments' rows applied in order) and
:meth:`ChainTables.shard` (one rank's shards cut out of them again). A replica's fresh base
(:func:`persistent_delta.serve.load_checkpoint_base`) and a base uploaded to the stream from
the trainer's checkpoints (:mod:`persistent_delta.fleet.checkpoint_bases`) are both built on it.

Design note. Only the tables' weights (``model.<fqn>.weight``) are read, each assembled whole
by DCP from its ranks' chunks, never the optimizer states. Each increment part holds, per rank,
the shard-local ids of the rows changed since the previous one and their weights: written at
``row_offset + id``, columns ``[col_offset, col_offset + cols)``, in chain order (a later
increment's row wins). A data-parallel table is carried whole with the dense parameters.

Its position: a base or an increment is taken at a step boundary, with the rank's tracker at
batch ``b`` (its state's ``curr_batch_idx``) and every update of that batch done. A publish
stamped ``b`` or earlier holds values no newer than it (publishes come after the step's
backward), so the tables continue from ``b + 1``.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from persistent_delta.checkpoint import chain as chains
from persistent_delta.checkpoint.format import TRACKER_STATE_KEY, Layout, read_part, row_ids
from persistent_delta.errors import IncompleteBaseError
from persistent_delta.log.rows import scatter_rows
from persistent_delta.log.schema import LogIdentity


@dataclass
class ChainTables:
    """Every table whole as of a chain's last increment (or its base).

    Attributes:
        tables: fqn -> the full table ``(global_rows, global_cols)``.
        batches: rank -> the tracker's batch at the chain's last increment (or the base): the
            tables continue from ``batch + 1``.
        logs: rank -> the identity of the rank's log the base recorded.
        layouts: rank -> fqn -> ``[row_offset, col_offset, rows, cols]`` of its shard.
        base: the base's directory; increments: how many were applied; step: the training
            step of the last one (or the base's).
    """

    tables: Dict[str, torch.Tensor]
    batches: Dict[int, int]
    logs: Dict[int, LogIdentity]
    layouts: Dict[int, Layout]
    base: str
    increments: int
    step: int

    @property
    def source(self) -> str:
        where = f"{self.increments} increments" if self.increments else "no increment"
        return f"the checkpoint base {self.base!r} with {where} (step {self.step})"

    def shard(self, rank: int) -> Dict[str, torch.Tensor]:
        """fqn -> rank ``rank``'s shard of each table it holds (a contiguous copy)."""
        out = {}
        for fqn, (row_off, col_off, rows, cols) in self.layouts[rank].items():
            out[fqn] = self.tables[fqn][row_off:row_off + rows, col_off:col_off + cols].contiguous()
        return out


def _weight_key(keys: List[str], fqn: str, base: str) -> str:
    """The DCP key of table ``fqn``'s weights (``model.<fqn>.weight``)."""
    want = f"model.{fqn}.weight"
    if want in keys:
        return want
    found = [k for k in keys if k.startswith("model.") and k.endswith(f".{fqn}.weight")]
    if len(found) != 1:
        raise IncompleteBaseError(f"{base}: no single DCP entry holds table {fqn}'s weights ({want}; found {found})")
    return found[0]


def _load_offline(target: Dict[str, Any], path: str) -> None:
    """``dcp.load`` of ``target`` from the base in ``path`` in this one process (no process
    group), without DCP's warning that it assumes a single process: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(target, storage_reader=FileSystemReader(path), no_dist=True)


def _base_batches(base: str, keys: Dict[str, Any], ranks: int) -> Dict[int, int]:
    """rank -> the tracker's batch when the base was taken (its stored tracker state)."""
    target: Dict[str, Any] = {}
    names: Dict[str, int] = {}
    for rank in range(ranks):
        name = f"{TRACKER_STATE_KEY}.rank_{rank}"
        found = [k for k, v in keys.items() if isinstance(v, BytesStorageMetadata) and k.endswith("." + name)]
        if len(found) != 1:
            raise IncompleteBaseError(f"{base}: {found} hold rank {rank}'s tracker state ({name}), not one entry")
        target[found[0]], names[found[0]] = io.BytesIO(), rank
    _load_offline(target, base)
    out: Dict[int, int] = {}
    for key, rank in names.items():
        state = getattr(target[key], "state", target[key])
        out[rank] = int(state["curr_batch_idx"])
    return out


def read_tables(root: str) -> ChainTables:
    """Every table whole from the newest complete chain under ``root`` (see the module note).
    Any thread of any process may call it, while the trainer writes more increments.

    Raises:
        IncompleteBaseError: no complete base under ``root`` (take one with
            ``Checkpoints.save_base``), or it holds no weights of a table it records.
        IncrementChainError: its increments are not one chain, or a part is damaged.
        FormatMismatchError: written with another format version.
    """
    chain = chains.latest_chain(root)
    info = chain.info
    metadata = FileSystemReader(chain.base).read_metadata()
    keys = dict(metadata.state_dict_metadata)
    placed: Dict[str, List[int]] = {}  # fqn -> a rank's [row_offset, col_offset, rows, cols]
    for r in info.ranks:
        for fqn, lay in r.layout.items():
            placed.setdefault(fqn, lay)
    target: Dict[str, torch.Tensor] = {}
    key_of: Dict[str, str] = {}
    for fqn in sorted(placed):
        key = _weight_key(list(keys), fqn, chain.base)
        md = keys[key]
        if not isinstance(md, TensorStorageMetadata) or len(md.size) != 2:
            raise IncompleteBaseError(f"{chain.base}: the DCP entry {key} of table {fqn} is not a 2-D tensor")
        target[key], key_of[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype), key
    _load_offline(target, chain.base)
    tables = {fqn: target[key] for fqn, key in key_of.items()}
    batches = _base_batches(chain.base, keys, info.world_size)
    with torch.no_grad():
        for inc in chain.increments:
            for rank in range(info.world_size):
                part = read_part(inc.path, inc.headers[rank])
                _apply_part(tables, info.ranks[rank].layout, part)
                batches[rank] = int(part["tracker"]["curr_batch_idx"])
    return ChainTables(tables, batches, logs={r.rank: LogIdentity(r.log_id, r.log_stamp) for r in info.ranks},
                       layouts={r.rank: dict(r.layout) for r in info.ranks}, base=chain.base,
                       increments=len(chain.increments), step=chain.step)


def _apply_part(tables: Dict[str, torch.Tensor], layout: Layout, part: Dict[str, Any]) -> None:
    """Write one rank's part into the full tables: its rows at their global ids, its
    data-parallel tables whole."""
    for fqn, rows in part["rows"].items():
        row_off, col_off, local_rows, cols = layout[fqn]
        ids = row_ids(rows["ids"], local_rows, fqn) + row_off
        table = tables[fqn]
        scatter_rows(table if col_off == 0 and cols == table.shape[1] else table[:, col_off:col_off + cols], ids,
                     rows["weights"])
    for fqn, table in tables.items():
        whole = part["dense"].get(f"{fqn}.weight")
        if whole is not None and fqn not in part["rows"] and tuple(whole.shape) == tuple(table.shape):
            table.copy_(whole)  # a data-parallel table: carried whole


__all__ = ["ChainTables", "read_tables"]
