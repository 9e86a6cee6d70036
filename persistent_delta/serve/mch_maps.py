"""The raw-id -> slot maps of a quantized managed-collision model, written from polls.

Owns: finding the ``MCHManagedCollisionModule`` of each table of a quantized managed-collision
model (``quantize_inference_model`` of an MC-EC / MC-EBC keeps TorchRec's float
``ManagedCollisionEmbeddingCollection`` wrapper, its managed-collision modules included, and
quantizes the collection inside it; TorchRec's ``QuantManagedCollisionEmbeddingCollection``,
given in a ``quantization_mapping``, holds the same modules), and turning a poll's slot reassignments
(:meth:`persistent_delta.read.results.DeltaPoll.zch`) into those modules' buffers.

Design note:

* **What the forward reads.** An MCH module remaps a raw id by ``searchsorted`` over
  ``_mch_sorted_raw_ids`` (ascending admitted raw ids, then ``int64.max`` for empty positions)
  and takes the slot at the same position of ``_mch_remapped_ids_mapping``; a raw id it does not
  hold goes to the last slot. The eviction metadata buffers (``_mch_counts``...) are read only
  by ``profile()``, which runs in training mode: the replica puts the modules in eval mode, so a
  request never admits or evicts.
* **How a poll is applied.** Each map keeps the replica's ``slot -> raw id`` array (seeded from
  the module's buffers). A poll's reassignments for the table are applied in their order (the
  last per slot wins), then both buffers are rebuilt whole: the admitted raw ids ascending with
  their slots, then ``int64.max`` with the free slots (the mapping stays a permutation of the
  table's slots, as TorchRec keeps it). Everything is computed before the caller takes the write
  lock; :meth:`MchMap.write` only copies into the buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Protocol, Tuple

import torch
from torch import nn

import persistent_delta.torchrec_internals as trec
from persistent_delta.errors import ReplicaMismatchError
from persistent_delta.log.zch_records import NO_RAW_ID, ZchDelta

EMPTY_RAW = torch.iinfo(torch.int64).max  # MCH's marker of an empty position of _mch_sorted_raw_ids


class _Table(Protocol):
    """What this module needs of an inference table (:class:`~persistent_delta.serve.inference.InferenceTable`)."""

    fqn: str
    rows: int


@dataclass
class MapUpdate:
    """A map's buffers after a poll, computed with no lock held (see :meth:`MchMap.planned`)."""

    map: "MchMap"
    slot_raw: torch.Tensor
    sorted_raw: torch.Tensor
    mapping: torch.Tensor
    reassigned: int


class MchMap:
    """One table's raw-id -> slot map in a quantized managed-collision model: the buffers of its
    ``MCHManagedCollisionModule``, written in place.

    Args:
        fqn: the table's fqn in the trainer's words.
        module: the table's ``MCHManagedCollisionModule`` (unsharded: output offset 0).
    """

    def __init__(self, fqn: str, module: nn.Module) -> None:
        self.fqn = fqn
        self.module = module
        # TorchRec's MCH keeps its map in private buffers (mc_modules.MCHManagedCollisionModule)
        self.sorted_raw: torch.Tensor = trec.mch_sorted_raw_ids(module)
        self.mapping: torch.Tensor = trec.mch_slot_mapping(module)
        self.size = int(self.sorted_raw.numel())
        sorted_raw, mapping = self.sorted_raw.cpu(), self.mapping.cpu()  # planned on the host
        held = sorted_raw != EMPTY_RAW
        self.slot_raw = torch.full((self.size,), NO_RAW_ID, dtype=torch.int64)
        self.slot_raw[mapping[held]] = sorted_raw[held]

    def planned(self, delta: ZchDelta) -> Optional[MapUpdate]:
        """The buffers after ``delta``'s reassignments (in order), or None when it has none.

        Raises:
            ReplicaMismatchError: a reassigned slot outside the table.
        """
        if not delta.slots.numel():
            return None
        slots = delta.slots.to(torch.int64)
        if int(slots.min()) < 0 or int(slots.max()) >= self.size:
            raise ReplicaMismatchError(
                f"table {self.fqn}: the poll reassigns slot {int(slots.max())}; the inference model's managed-collision "
                f"module has {self.size} slots")
        # the last reassignment of each slot wins: scatter in order, a later write overwrites
        last = torch.full((self.size,), -1, dtype=torch.int64)
        last.scatter_reduce_(0, slots, torch.arange(slots.numel(), dtype=torch.int64), "amax")
        touched = (last >= 0).nonzero().squeeze(1)
        slot_raw = self.slot_raw.clone()
        slot_raw[touched] = delta.given.to(torch.int64).index_select(0, last.index_select(0, touched))
        held = (slot_raw != NO_RAW_ID).nonzero().squeeze(1)
        raw = slot_raw.index_select(0, held)
        order = torch.argsort(raw)
        free = torch.ones(self.size, dtype=torch.bool)
        free[held] = False
        sorted_raw = torch.cat([raw.index_select(0, order),
                                torch.full((self.size - held.numel(),), EMPTY_RAW, dtype=torch.int64)])
        mapping = torch.cat([held.index_select(0, order), free.nonzero().squeeze(1)])
        return MapUpdate(self, slot_raw, sorted_raw, mapping, int(slots.numel()))

    def write(self, update: MapUpdate) -> None:
        """Copy a planned update into the module's buffers (caller holds the write lock)."""
        self.sorted_raw.copy_(update.sorted_raw)
        self.mapping.copy_(update.mapping)
        self.slot_raw = update.slot_raw

    def map(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(raw ids ascending, slots)`` the module holds (caller keeps writes out)."""
        held = self.sorted_raw != EMPTY_RAW
        return self.sorted_raw[held].cpu(), self.mapping[held].cpu()


def mch_maps(model: nn.Module, tables: Mapping[str, _Table]) -> Dict[str, MchMap]:
    """The raw-id maps of every managed-collision table of a quantized model, by table fqn,
    with their modules put in eval mode (a module in training mode admits and evicts raw ids
    on every forward).

    Args:
        model: the quantized model.
        tables: its inference tables by fqn (:func:`~persistent_delta.serve.inference.inference_tables`).

    Raises:
        ReplicaMismatchError: a managed-collision module that is not an MCH module (HashZch...),
            one of another size than its table, a sharded one, or one with no table.
    """
    from torchrec.modules.mc_modules import MCHManagedCollisionModule
    from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEC

    out: Dict[str, MchMap] = {}
    for path, mod in model.named_modules():
        # TorchRec's quantized MC collections keep the float model's ManagedCollisionCollection
        mcc = trec.mc_collection_of(mod)
        if mcc is None:
            continue
        if type(mod).__name__.startswith("Sharded"):
            raise ReplicaMismatchError(
                f"{path}: a sharded managed-collision inference module; an inference replica writes the raw-id maps "
                "of an unsharded quantized managed-collision model")
        # quantize_inference_model keeps the float MC wrapper and quantizes its _embedding_module;
        # TorchRec's QuantManagedCollisionEmbeddingCollection is itself the quantized collection
        emb, emb_path = mod, path
        inner = trec.mc_embedding_module_of(mod)
        if inner is not None:  # the module path TorchRec's named_modules() gives it
            emb, emb_path = inner, f"{path}._embedding_module" if path else "_embedding_module"
        attr = "embeddings" if isinstance(emb, QuantEC) else "embedding_bags"
        prefix = f"{emb_path}.{attr}." if emb_path else f"{attr}."
        for name, mcm in trec.mc_modules(mcc).items():
            fqn = prefix + name
            if not isinstance(mcm, MCHManagedCollisionModule):
                raise ReplicaMismatchError(
                    f"table {fqn}: its managed-collision module is a {type(mcm).__name__}; an inference replica writes "
                    "the raw-id maps of MCHManagedCollisionModule")
            table = tables.get(fqn)
            size, offset = int(trec.mch_sorted_raw_ids(mcm).numel()), trec.mch_output_offset(mcm)
            if table is None or table.rows != size or offset:
                raise ReplicaMismatchError(
                    f"table {fqn}: its MCH module maps to {size} slots from {offset}; the "
                    f"inference model's table has {table.rows if table is not None else 'no'} rows")
            mcm.eval()
            out[fqn] = MchMap(fqn, mcm)
    return out


__all__ = ["EMPTY_RAW", "MapUpdate", "MchMap", "mch_maps"]
