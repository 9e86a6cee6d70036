"""Ordered apply: a base and increments applied in batch order -- never a gap, an overlap or an
input out of order.

Owns: the order rule for replica inputs (which range each covers and which may follow which)
and the replica those inputs build.

Design note
-----------
Every input covers, per rank, a half-open batch range ``[from, to)``:

* a **base** -- a shard-files directory (:func:`persistent_delta.trainer.save_shards.save_local_shards`)
  taken at batch ``b`` -- holds every batch up to ``b``: the next input starts at ``b + 1``;
* an **increment** -- a replay output (``persistent-delta replay``; its manifest records the
  range read per rank) -- covers exactly its ranges.

:func:`check_order` walks the inputs in the order given and, per rank, compares each
increment's ``from`` with the end of what came before: ``from > end`` is a **gap** (batches
missing), ``from < end < to`` an **overlap** (batches twice), ``to <= end`` (``from < end``) an
input **out of order** (already covered). It raises :class:`OrderError`, naming the input, the
rank and both ranges, before anything is applied: a refused apply changes nothing. A replica
remembers where it ended (:attr:`Replica.next_batch`), so a later apply continues from there and
the same rule holds across calls.

:class:`Replica` is what the inputs build: full tables (global rows; a base loads every row, an
increment's ``snapshot/`` files -- replay with ``--shard-files`` -- overwrite the changed rows,
newest last) and a managed-collision table's raw-id map (:class:`~persistent_delta.serve.raw_id_map.RawIdMap`,
fed the slot reassignments of every span, in order).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_save

from persistent_delta.errors import InvalidInputError, OrderError
from persistent_delta.log.layout import PathLike, atomic_write_bytes
from persistent_delta.log.shard_files import load_raw_id_maps, load_shards, shard_batches, whole_tables
from persistent_delta.log.zch_records import ZchDelta
from persistent_delta.serve.raw_id_map import RawIdMap

REPLICA_FORMAT = "persistent_delta.replica/1"
Ranges = Dict[int, Tuple[int, int]]


@dataclass
class Piece:
    """One input: a base (shard-files directory) or an increment (replay output), with the ranges
    it covers per rank (a base: ``[0, batch_idx + 1)``)."""

    path: str
    kind: str  # "base" | "increment"
    ranges: Ranges
    # increment content, in span order: (fqn, tensors of a span file), and snapshot files
    spans: List[Tuple[int, str, Dict[str, torch.Tensor]]] = field(default_factory=list)
    snapshots: List[Tuple[str, Dict[str, torch.Tensor]]] = field(default_factory=list)


def base_piece(shard_dir: PathLike) -> Piece:
    """A shard-files directory as a base.

    Raises:
        OrderError: a rank file does not record the batch it was taken at.
    """
    path = os.fspath(shard_dir)
    batches = shard_batches(path)
    missing = sorted(r for r, b in batches.items() if b is None)
    if missing:
        raise OrderError(f"{path}: the shard files of ranks {missing} do not record the batch they were taken at "
                         "(written by an older release): they cannot start an ordered apply")
    return Piece(path, "base", {r: (0, int(b) + 1) for r, b in batches.items() if b is not None})


def _describe(p: Piece) -> str:
    return f"{p.path} ({p.kind})"


def check_order(pieces: Sequence[Piece], start: Optional[Dict[int, int]] = None) -> Dict[int, int]:
    """Check that ``pieces`` can be applied in this order, after a replica that ends at
    ``start`` (rank -> next batch; None: the first input sets it). Returns rank -> the batch
    the next input must start at.

    Raises:
        OrderError: a base that is not first (or follows a replica), a gap, an overlap, an input
            out of order, or ranks that differ from the inputs before.
    """
    expect: Optional[Dict[int, int]] = dict(start) if start else None
    prev = "the replica" if start else None
    for i, p in enumerate(pieces):
        if p.kind == "base":
            if i != 0 or start:
                raise OrderError(f"{_describe(p)}: a base must come first, before any increment "
                                 f"(it follows {prev})")
            expect, prev = {r: b for r, (_, b) in p.ranges.items()}, _describe(p)
            continue
        if expect is None:
            expect = {r: a for r, (a, _) in p.ranges.items()}
        if set(p.ranges) != set(expect):
            raise OrderError(f"{_describe(p)}: covers ranks {sorted(p.ranges)}, but {prev or 'the inputs'} covered "
                             f"ranks {sorted(expect)}")
        for r, (a, b) in sorted(p.ranges.items()):
            end = expect[r]
            if a > end:
                raise OrderError(f"{_describe(p)}: rank {r} starts at batch {a}, but {prev} ends at {end}: batches "
                                 f"[{end}, {a}) are missing (a gap)")
            if a < end and b <= end:
                raise OrderError(f"{_describe(p)}: rank {r} covers [{a}, {b}), already covered by {prev} (up to {end}):"
                                 " out-of-order input")
            if a < end:
                raise OrderError(f"{_describe(p)}: rank {r} covers [{a}, {b}), which overlaps {prev} (up to {end}): "
                                 f"batches [{a}, {min(b, end)}) would be applied twice")
            expect[r] = max(a, b)
        prev = _describe(p)
    return expect or {}


@dataclass
class Replica:
    """Tables (fqn -> full table, global rows), raw-id maps and where the inputs ended."""

    tables: Dict[str, torch.Tensor] = field(default_factory=dict)
    raw_ids: RawIdMap = field(default_factory=RawIdMap)
    next_batch: Dict[int, int] = field(default_factory=dict)

    def save(self, path: PathLike) -> str:
        """Write the replica as one safetensors file (atomically)."""
        tensors = {f"table/{fqn}": t.contiguous() for fqn, t in self.tables.items()}
        for fqn in self.raw_ids.tables():
            raw, slots = self.raw_ids.map(fqn)
            tensors[f"zch.raw/{fqn}"], tensors[f"zch.slot/{fqn}"] = raw, slots
        meta = {"format": REPLICA_FORMAT, "next_batch": json.dumps({str(r): b for r, b in self.next_batch.items()})}
        out = os.fspath(path)
        atomic_write_bytes(out, safetensors_save(tensors, metadata=meta))
        return out

    @staticmethod
    def load(path: PathLike) -> "Replica":
        """Read a replica written by :meth:`save`.

        Raises:
            InvalidInputError: not a replica file.
        """
        p = os.fspath(path)
        try:
            with safe_open(p, "pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != REPLICA_FORMAT:
                    raise InvalidInputError(f"{p} is not a replica file (format {meta.get('format')!r})")
                rep = Replica(next_batch={int(r): int(b) for r, b in json.loads(meta["next_batch"]).items()})
                raws = {}
                for key in f.keys():
                    kind, _, fqn = key.partition("/")
                    if kind == "table":
                        rep.tables[fqn] = f.get_tensor(key)
                    elif kind == "zch.raw":
                        raws[fqn] = (f.get_tensor(key), f.get_tensor(f"zch.slot/{fqn}"))
        except InvalidInputError:
            raise
        except Exception as exc:  # noqa: BLE001 - safetensors/json errors on a foreign file
            raise InvalidInputError(f"{p}: malformed replica file ({type(exc).__name__}: {exc})") from exc
        for fqn, (raw, slots) in raws.items():
            rep.raw_ids.apply(ZchDelta(fqn, 0, 0, slots=slots, taken=torch.full_like(raw, -1), given=raw))
        return rep


def apply_pieces(pieces: Sequence[Piece], replica: Optional[Replica] = None) -> Replica:
    """Apply ``pieces`` in order to ``replica`` (a new one when None), after :func:`check_order`
    accepted the whole sequence. Returns the replica (``next_batch`` updated).

    Raises:
        OrderError: see :func:`check_order` (nothing is applied then).
    """
    nxt = check_order(pieces, replica.next_batch if replica is not None else None)
    rep = replica if replica is not None else Replica()
    for p in pieces:
        if p.kind == "base":
            rep.tables.update(whole_tables(p.path, load_shards(p.path)))
            rep.raw_ids = RawIdMap()
            for fqn, maps in load_raw_id_maps(p.path).items():
                raw, slots = torch.cat([m[0] for m in maps]), torch.cat([m[1] for m in maps])
                rep.raw_ids.apply(ZchDelta(fqn, 0, 0, slots=slots, taken=torch.full_like(raw, -1), given=raw))
            continue
        for _, fqn, tensors in p.spans:
            if "zch.slots" in tensors:
                rep.raw_ids.apply(ZchDelta(fqn, 0, 0, slots=tensors["zch.slots"], taken=tensors["zch.taken"],
                                           given=tensors["zch.given"]))
        for fqn, tensors in p.snapshots:
            table = rep.tables.get(fqn)
            ids, values = tensors["ids"], tensors["values"]
            if table is None or table.shape[1:] != values.shape[1:] or (ids.numel() and int(ids.max()) >= table.shape[0]):
                raise InvalidInputError(f"{p.path}: {fqn}: snapshot rows do not fit the replica's table (apply a base "
                                        "shard-files directory first)")
            table[ids.long()] = values.to(table.dtype)
    rep.next_batch = nxt
    return rep
