"""Managed-collision (ZCH) tables on the trainer: raw ids, slot reassignments and evictions as
side records of the batch that made them.

Owns: finding a sharded model's managed-collision modules, the hooks that capture what they do,
and the side records a restart or restore writes. What the records mean and how a replica
applies them: :mod:`persistent_delta.log.zch_records`.

What runs where (TorchRec 1.8.0, fbgemm-gpu-cpu 1.8.0):

* ``MCHManagedCollisionModule`` (sorted raw ids + slot mapping, evictions every
  ``eviction_interval`` batches): tracked. TorchRec's own tracker hook never fires for it (it
  fires only for modules with ``_hash_zch_identities``), so the raw ids come from our hook on
  ``ShardedManagedCollisionCollection.get_lookup_value`` (the module's input and output of one
  lookup), and reassignments from hooks on the module's ``_update_and_evict`` path: the eviction
  policy's chosen buffer positions give the slots and the raw ids taken from them, the buffers
  just before their re-sort give the raw ids admitted -- O(slots reassigned) per eviction.
* ``HashZchManagedCollisionModule``: its raw ids ("identities") reach TorchRec's
  ``post_lookup_tracker_fn`` of the sharded collection, which we install, so its lookups are
  recorded exactly as ``RawIdTracker`` records them; its slot reassignments are not recorded.
  It cannot train on CPU: fbgemm-gpu-cpu's ``zero_collision_hash`` accepts only read-only
  lookups (``RuntimeError: Expected readonly to be true, but got false.`` at the first training
  forward), so only its eval-mode lookups are tested here.

Capture stays on the hot path's terms: the hooks keep references to the lookup's tensors (raw
ids, slot ids) and compute only the admitted flag of the ids looked up in the default slot; the
writer thread encodes. On a GPU the records go through the same non-blocking copy to pinned host
memory as a lookup's, with a CUDA event the writer waits for
(:meth:`~persistent_delta.trainer.capture.Capture.add`). Every hook is an instance attribute
removed by :meth:`ZchCapture.unhook`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torchrec.distributed.mc_embedding import ShardedManagedCollisionEmbeddingCollection
from torchrec.distributed.mc_embeddingbag import ShardedManagedCollisionEmbeddingBagCollection
from torchrec.modules.hash_mc_modules import HashZchManagedCollisionModule
from torchrec.distributed.model_tracker.types import TrackingMode
from torchrec.modules.mc_modules import MCHManagedCollisionModule

from persistent_delta.log import codec
from persistent_delta.log.deltalog import WriteTxn
from persistent_delta.log.records import AppendRecord
from persistent_delta.log.zch_records import GIVEN, NO_RAW_ID, ZCH_META, iter_side, raw_ids_states, slots_states
import persistent_delta.torchrec_internals as trec

logger = logging.getLogger(__name__)

_MC_MODULES = (ShardedManagedCollisionEmbeddingCollection, ShardedManagedCollisionEmbeddingBagCollection)
_EMPTY_RAW = torch.iinfo(torch.int64).max  # MCH's marker of an empty buffer position


class _Table:
    """One managed-collision table with a shard on this rank."""

    def __init__(self, fqn: str, name: str, mcc: Any, mcm: Any, row_offset: int, rows: int,
                 tbe: Any = None) -> None:
        self.fqn, self.name, self.mcc, self.mcm, self.tbe = fqn, name, mcc, mcm, tbe  # tbe: (TBE, index) or None
        self.row_offset, self.rows = row_offset, rows
        self.kind = "mch" if isinstance(mcm, MCHManagedCollisionModule) else "hash_zch"
        self.base_pending = True  # the first lookup after attach writes the whole map first
        self.moving: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None  # positions, slots, taken
        self.evicting = False  # inside this module's _update_and_evict (a policy may be shared)

    def default_slot(self) -> int:
        """Shard-local slot that MCH gives every raw id it has not admitted."""
        return trec.mch_size(self.mcm) - 1

    def slot_raw(self) -> torch.Tensor:
        """Shard-local slot -> raw id (``NO_RAW_ID`` for an empty slot) from the MCH buffers."""
        sorted_raw, mapping = trec.mch_sorted_raw_ids(self.mcm), trec.mch_slot_mapping(self.mcm)
        out = torch.full((self.rows,), NO_RAW_ID, dtype=torch.int64)
        held = sorted_raw != _EMPTY_RAW
        out[mapping[held] - self.row_offset] = sorted_raw[held]
        return out


def _clean(path: str) -> str:
    for p in ("_dmp_wrapped_module.module.", "_dmp_wrapped_module.", "module."):
        if path.startswith(p):
            return path[len(p):]
    return path


class ZchCapture:
    """The managed-collision tables of a model and the hooks that record them.

    ``tables``: fqn -> (table name, row_offset, local_rows) of the tracker's tables on this rank;
    ``emit``: where captured side records go (the tracker's capture of the current batch);
    ``batch_idx``: the batch being recorded; ``config``: the tracker's
    :class:`~persistent_delta.config.PersistentTrackerConfig` (``zch_raw_ids=False``: no side
    records; an MC table's lookups, and the slots an eviction re-initialised, are still
    recorded, as any table's changed rows). Training thread only.
    """

    def __init__(self, model: nn.Module, tables: Dict[str, Tuple[str, int, int]],
                 emit: Callable[[AppendRecord], None], batch_idx: Callable[[], int], config: Any = None) -> None:
        self._emit, self._batch_idx = emit, batch_idx
        self._raw_ids = bool(getattr(config, "zch_raw_ids", True))
        self._mode = getattr(config, "tracking_mode", None)
        self.tables: Dict[str, _Table] = {}
        self._hooked: List[Tuple[Any, str]] = []
        self._chained: Dict[int, Any] = {}  # a collection's previous post-lookup hook (TorchRec's RawIdTracker)
        by_name: Dict[str, List[str]] = {}
        for fqn, (name, _, _) in tables.items():
            by_name.setdefault(name, []).append(fqn)
        self._embedding_modules: List[Any] = []
        for path, module in model.named_modules():
            if not isinstance(module, _MC_MODULES):
                continue
            self._embedding_modules.append(trec.mc_embedding_module(module))
            mcc = trec.mc_collection(module)
            tbes = trec.table_tbes(module)
            for name, mcm in trec.mc_modules(mcc).items():
                fqns = [f for f in by_name.get(name, []) if f.startswith(_clean(path) + ".") or not _clean(path)]
                if not fqns:
                    continue  # skipped (fqns_to_skip) or no shard here
                if not isinstance(mcm, (MCHManagedCollisionModule, HashZchManagedCollisionModule)):
                    logger.warning("%s: managed-collision module %s is not tracked (raw ids unknown)", fqns[0],
                                   type(mcm).__name__)
                    continue
                _, row_offset, rows = tables[fqns[0]]
                self.tables[fqns[0]] = _Table(fqns[0], name, mcc, mcm, row_offset, rows, tbes.get(name))

    def describe(self, fqn: str) -> Dict[str, Any]:
        """What the table entry's shard metadata says about a managed-collision table (nothing
        when its raw ids are not recorded)."""
        t = self.tables.get(fqn)
        return {} if t is None or not self._raw_ids else {ZCH_META: t.kind}

    def rebase(self) -> None:
        """The next lookup of every table writes a base first (the whole map of the shard): the
        tracker asks at every checkpoint, so a replica registered after the log start moved
        past the first base still gets every raw id (retention keeps what follows the latest
        checkpoint)."""
        for t in self.tables.values():
            t.base_pending = True

    # ------------------------------------------------------------------ hooks
    def hook(self) -> None:
        """Install the hooks (instance attributes) on every managed-collision collection, and
        on the sharded EC/EBC inside each MC module: TorchRec's MC module calls its ``compute``
        directly, which never calls the post-lookup tracker callable (only
        ``compute_and_output_dist`` does), so without this hook no tracker -- TorchRec's
        included -- sees an MC table's lookups."""
        if self.tables:
            for ec in self._embedding_modules:
                self._set(ec, "compute", self._compute_hook(ec, ec.compute))
        for mcc in {id(t.mcc): t.mcc for t in self.tables.values()}.values() if self._raw_ids else []:
            self._set(mcc, "get_lookup_value", self._lookup_hook(mcc, mcc.get_lookup_value))
            if any(t.kind == "hash_zch" for t in self.tables.values() if t.mcc is mcc):
                # TorchRec's RawIdTracker may hold this hook already (DMP builds it first): chain it
                self._set(mcc, "post_lookup_tracker_fn", self._hash_zch_hook(mcc.post_lookup_tracker_fn))
        for t in self.tables.values():
            if t.kind == "mch":
                mcm, policy = t.mcm, trec.mch_eviction_policy(t.mcm)
                evict, sort = trec.MCH_UPDATE_AND_EVICT, trec.MCH_SORT_BUFFERS
                self._set(mcm, evict, self._evict_hook(t, getattr(mcm, evict)))
                self._set(policy, "update_metadata_and_generate_eviction_scores",
                          self._policy_hook(t, policy.update_metadata_and_generate_eviction_scores))
                self._set(mcm, sort, self._sort_hook(t, getattr(mcm, sort)))

    def _touched(self, t: _Table, slots: torch.Tensor) -> None:
        """A reassigned slot's row is re-initialised by TorchRec (``_evict``) whether or not this
        batch looks it up: record it as changed (a lookups record), so ``get_unique`` and
        ``publish`` deliver it. ID_ONLY: ids; EMBEDDING: the row before the reset (the FIRST
        value). Optimizer-state modes: not recorded (the reset zeroes the state)."""
        if self._mode == TrackingMode.ID_ONLY:
            self._record(t, codec.KIND_LOOKUP, slots, None)
        elif self._mode == TrackingMode.EMBEDDING and t.tbe is not None:
            tbe, index = t.tbe
            weights = tbe.split_embedding_weights()[int(index)]
            self._record(t, codec.KIND_LOOKUP, slots, weights[slots].detach().clone())

    def _hash_zch_hook(self, prev: Optional[Callable[..., None]]) -> Callable[..., None]:
        def record(kjt: Any, states: torch.Tensor, emb_module: Any = None, raw_ids: Optional[torch.Tensor] = None,
                   runtime_meta: Optional[torch.Tensor] = None) -> None:
            self._hash_zch_record(kjt, raw_ids)
            if prev is not None:
                prev(kjt, states, emb_module, raw_ids, runtime_meta)

        record.chained = prev  # type: ignore[attr-defined]
        return record

    def _set(self, obj: Any, attr: str, fn: Callable[..., Any]) -> None:
        if attr == "post_lookup_tracker_fn":
            self._chained[id(obj)] = getattr(fn, "chained", None)
        object.__setattr__(obj, attr, fn)
        self._hooked.append((obj, attr))

    def unhook(self) -> None:
        """Remove every hook :meth:`hook` installed."""
        for obj, attr in reversed(self._hooked):
            if attr == "post_lookup_tracker_fn":
                object.__setattr__(obj, attr, self._chained.pop(id(obj), None))
            elif attr in vars(obj):
                object.__delattr__(obj, attr)
        self._hooked = []

    def _record(self, t: _Table, kind: int, ids: torch.Tensor, states: Optional[torch.Tensor]) -> None:
        self._emit(AppendRecord(self._batch_idx(), t.fqn, ids, states, kind=kind))

    def _base(self, t: _Table) -> None:
        """Every slot of the shard with its current raw id (a replica starts over from it)."""
        t.base_pending = False
        if t.kind != "mch":
            return
        given = t.slot_raw()  # taken = given: no slot changes (a publish re-sends no row for a base)
        self._record(t, codec.KIND_SLOTS, torch.arange(t.rows, dtype=torch.int64), slots_states(given, given))

    @staticmethod
    def _compute_hook(ec: Any, orig: Callable[..., Any]) -> Callable[..., Any]:
        def compute(ctx: Any, dist_input: Any) -> Any:
            out = orig(ctx, dist_input)
            record = ec.post_lookup_tracker_fn
            if record is not None:  # what compute_and_output_dist does after each lookup
                for features, embs in zip(dist_input, out):
                    record(features, embs, ec, None)
            return out

        return compute

    def _lookup_hook(self, mcc: Any, orig: Callable[..., Any]) -> Callable[..., Any]:
        tables = {t.name: t for t in self.tables.values() if t.mcc is mcc}

        def get_lookup_value(table: str, features: Any, write_weights: Optional[torch.Tensor] = None) -> Any:
            t = tables.get(table)
            if t is not None and t.base_pending:
                self._base(t)
            out = orig(table, features, write_weights=write_weights)
            if t is not None and t.kind == "mch":
                raw = features.values().detach()
                slots = out[table].values().detach()
                admitted = torch.ones_like(slots, dtype=torch.bool)
                maybe = slots == t.default_slot()
                if bool(maybe.any()):  # only ids in the default slot may be unadmitted
                    sorted_raw = trec.mch_sorted_raw_ids(t.mcm)
                    cand = raw[maybe]
                    pos = torch.searchsorted(sorted_raw[:-1], cand)
                    admitted[maybe] = sorted_raw[pos] == cand
                self._record(t, codec.KIND_RAW_IDS, slots, raw_ids_states(raw, admitted))
            return out

        return get_lookup_value

    def _evict_hook(self, t: _Table, orig: Callable[..., Any]) -> Callable[..., Any]:
        def _update_and_evict(*args: Any, **kwargs: Any) -> Any:
            t.moving, t.evicting = None, True
            try:
                return orig(*args, **kwargs)
            finally:
                t.moving, t.evicting = None, False

        return _update_and_evict

    def _policy_hook(self, t: _Table, orig: Callable[..., Any]) -> Callable[..., Any]:
        def update_metadata_and_generate_eviction_scores(*args: Any, **kwargs: Any) -> Any:
            result = orig(*args, **kwargs)
            if not t.evicting:
                return result
            positions = result[0]
            sorted_raw, mapping = trec.mch_sorted_raw_ids(t.mcm), trec.mch_slot_mapping(t.mcm)
            taken = sorted_raw[positions].clone()
            taken[taken == _EMPTY_RAW] = NO_RAW_ID
            t.moving = (positions.clone(), mapping[positions] - t.row_offset, taken)
            return result

        return update_metadata_and_generate_eviction_scores

    def _sort_hook(self, t: _Table, orig: Callable[..., Any]) -> Callable[..., Any]:
        def _sort_mch_buffers() -> Any:
            if t.evicting and t.moving is not None:  # between the assignment and the re-sort
                positions, slots, taken = t.moving
                t.moving = None
                given = trec.mch_sorted_raw_ids(t.mcm)[positions].clone()
                given[given == _EMPTY_RAW] = NO_RAW_ID
                changed = taken != given
                if bool(changed.any()):
                    if self._raw_ids:
                        self._record(t, codec.KIND_SLOTS, slots[changed], slots_states(taken[changed], given[changed]))
                    self._touched(t, slots[changed])
            return orig()

        return _sort_mch_buffers

    def _hash_zch_record(self, kjt: Any, raw_ids: Optional[torch.Tensor]) -> None:
        """TorchRec's hook of a HashZch lookup: ``kjt`` holds shard-local slots (keyed by table),
        ``raw_ids`` the identities of those slots ``[n, k]`` (the first column is the raw id)."""
        if raw_ids is None or kjt.values().numel() == 0:
            return
        raw = raw_ids.detach().view(kjt.values().numel(), -1)[:, 0]
        offset = 0
        for key in kjt.keys():
            slots = kjt[key].values().detach()
            n = slots.numel()
            t = next((x for x in self.tables.values() if x.name == key), None)
            if t is not None and n:
                self._record(t, codec.KIND_RAW_IDS, slots,
                             raw_ids_states(raw[offset:offset + n], torch.ones(n, device=raw.device)))
            offset += n

    # ------------------------------------------------------------------ maps, restore
    def current_maps(self) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
        """fqn -> (raw ids ascending, global slots) of this rank's admitted raw ids (MCH)."""
        out = {}
        for fqn, t in self.tables.items():
            if t.kind != "mch":
                continue
            slot_raw = t.slot_raw()
            slots = (slot_raw != NO_RAW_ID).nonzero().squeeze(1)
            raw = slot_raw[slots]
            order = torch.argsort(raw)
            out[fqn] = (raw[order], slots[order] + t.row_offset)
        return out

    def redeliver(self, w: WriteTxn, first: int, stamp: int) -> List[AppendRecord]:
        """At a restore: the side records of the lost batches ``[first, stamp)`` are deleted and
        every slot reassigned in them gets the restored model's raw id back, as one slot record
        stamped ``stamp`` (taken: the lost timeline's last raw id of the slot)."""
        out: List[AppendRecord] = []
        if not self._raw_ids:
            return out
        for fqn, t in self.tables.items():
            entry = w.table(fqn)
            if entry is None or t.kind != "mch":
                continue
            slots, given = [], []
            for _, kind, ids, states in iter_side(w, entry, first, stamp):
                if kind == codec.KIND_SLOTS:
                    slots.append(ids)
                    given.append(states[:, GIVEN])
            w.delete_records(codec.side_table_id(entry.table_id), first, stamp)
            t.base_pending = True
            if not slots:
                continue
            all_slots, all_given = torch.cat(slots), torch.cat(given)
            uniq, inverse = torch.unique(all_slots, return_inverse=True)
            last = torch.full((uniq.numel(),), -1, dtype=torch.int64).scatter_reduce(
                0, inverse, torch.arange(all_slots.numel()), "amax")
            out.append(AppendRecord(stamp, fqn, uniq, slots_states(all_given[last], t.slot_raw()[uniq]),
                                    kind=codec.KIND_SLOTS))
        return out


def _reset_weight_momentum_cpu(self: Any, pruned_indices: torch.Tensor, pruned_indices_offsets: torch.Tensor,
                               logical_table_ids: torch.Tensor, buffer_ids: torch.Tensor) -> None:
    """``fbgemm::reset_weight_momentum`` in Python: zero the evicted rows and their optimizer
    state, as the CUDA kernel does."""
    weights, states = self.split_embedding_weights(), self.split_optimizer_states()
    with torch.no_grad():
        for k, t in enumerate(logical_table_ids.tolist()):
            idx = pruned_indices[int(pruned_indices_offsets[k]):int(pruned_indices_offsets[k + 1])].long()
            weights[t][idx] = 0
            for s in states[t]:
                s[idx] = 0


def cpu_eviction_fallback(dmp: nn.Module) -> int:
    """Let MCH evict on CPU: ``fbgemm::reset_weight_momentum`` (called at an MCH module's
    first eviction) has no CPU kernel in fbgemm-gpu-cpu 1.8.0, so the TBEs of managed-collision
    tables get a Python version. Not needed on GPU. Returns the TBEs patched."""
    import types

    n = 0
    for module in dmp.modules():
        for tbe, _ in trec.table_tbes(module).values():
            tbe.reset_embedding_weight_momentum = types.MethodType(_reset_weight_momentum_cpu, tbe)
            n += 1
    return n
