"""TorchRec and FBGEMM internals the package reads: every private attribute, in one module.

Owns: each access to a private attribute of a TorchRec or FBGEMM object (written against
TorchRec 1.8.0 and fbgemm-gpu 1.8.0). The trainer and the serving side call these functions by
name, so a TorchRec upgrade that renames an attribute breaks here and nowhere else. It sits at
the top level (it imports nothing of the package), where every layer can reach it.

What is read, and from what:

* a sharded ``EmbeddingCollection``/``EmbeddingBagCollection``: its grouped lookups and their
  sharding types; a grouped lookup's embedding modules; an embedding module's table configs
  and its FBGEMM table-batched embedding (TBE), which holds the shard's rows and optimizer
  state;
* ``ModelDeltaTrackerTrec``'s table discovery, run on a stand-in that carries the fields it
  reads, so the fqns match TorchRec's own tracker exactly;
* a ``DistributedModelParallel``'s wrapped module;
* a managed-collision (MC) sharded module: its inner sharded EC/EBC, its managed-collision
  collection and that collection's modules, the TBE of each table; an
  ``MCHManagedCollisionModule``'s buffers (sorted raw ids, slot mapping), its size, its eviction
  policy, and the names of the two methods the ZCH capture hooks;
* a quantized managed-collision model (the serving side): the float MC wrapper's quantized
  collection and managed-collision collection, and an MCH module's output offset; a quantized
  EC/EBC's FBGEMM modules.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn
from torchrec.distributed.model_tracker.model_delta_tracker import ModelDeltaTrackerTrec

# ------------------------------------------------------------------------------ sharded EC/EBC


def _unwrap(module: nn.Module) -> nn.Module:
    while isinstance(module, torch.nn.parallel.DistributedDataParallel):
        module = module.module
    return module


def sharded_lookups(sharded_module: nn.Module) -> Iterator[Tuple[str, nn.Module]]:
    """(sharding_type, lookup) for every grouped lookup of a sharded EC/EBC, DDP unwrapped
    (TorchRec wraps a data-parallel lookup in DDP)."""
    for stype, lookup in zip(sharded_module._sharding_types, sharded_module._lookups):  # type: ignore[arg-type]
        yield str(stype), _unwrap(lookup)


def embedding_modules(lookup: nn.Module) -> List[nn.Module]:
    """The grouped embedding modules of a lookup (none for a lookup without groups)."""
    return list(getattr(lookup, "_emb_modules", []))


def group_tables(emb_module: nn.Module) -> List[Any]:
    """The ``ShardedEmbeddingTable`` configs of a grouped embedding module, in TBE order."""
    return list(emb_module._config.embedding_tables)  # type: ignore[union-attr, arg-type]


def tbe(emb_module: nn.Module) -> Any:
    """The FBGEMM TBE of a grouped embedding module (None if it has none)."""
    return getattr(emb_module, "_emb_module", None)


def keeps_step_counter(tbe_module: Any) -> bool:
    """Whether a TBE's fused optimizer keeps a step counter of its own: FBGEMM's persistent
    ``iter`` buffer (Adam, LAMB, their partial row-wise forms, ensemble and EMA in-place
    row-wise Adagrad, row-wise Adagrad with global weight decay). TorchRec's fused optimizer
    state does not hold it, nor does the DMP's state dict."""
    return hasattr(tbe_module, "iter") and "iter" not in getattr(tbe_module, "_non_persistent_buffers_set", ())


def optimizer_states(emb_module: nn.Module) -> Any:
    """``split_optimizer_states()`` of a grouped embedding module's TBE: per table, the list of
    its optimizer states (empty for an optimizer without state)."""
    return tbe(emb_module).split_optimizer_states()


# ------------------------------------------------------------------------------ TorchRec's tracker, DMP


class _TrackerFields:
    """The fields ``ModelDeltaTrackerTrec.fqn_to_feature_names`` reads and fills."""

    _clean_fqn_fn = ModelDeltaTrackerTrec._clean_fqn_fn

    def __init__(self, model: nn.Module, fqns_to_skip: List[str]) -> None:
        self._model = model
        self._fqns_to_skip = list(fqns_to_skip)
        self._fqn_to_feature_map: Dict[str, List[str]] = {}
        self.tracked_modules: Dict[str, nn.Module] = {}
        self.table_to_fqn: Dict[str, str] = {}


def tracker_discovery(
    model: nn.Module, fqns_to_skip: List[str]
) -> Tuple[Dict[str, List[str]], Dict[str, nn.Module], Dict[str, str]]:
    """TorchRec's own table discovery (``fqns_to_skip``, DMP/DDP prefixes stripped).

    Returns:
        (fqn -> feature names, module fqn -> tracked module, table name -> fqn).
    """
    fields = _TrackerFields(model, fqns_to_skip)
    fqn_to_features: Dict[str, List[str]] = ModelDeltaTrackerTrec.fqn_to_feature_names(fields)  # type: ignore[arg-type]
    return fqn_to_features, fields.tracked_modules, fields.table_to_fqn


def dmp_wrapped_module(dmp: nn.Module) -> Optional[nn.Module]:
    """The module a ``DistributedModelParallel`` wraps (None for anything else)."""
    wrapped = getattr(dmp, "_dmp_wrapped_module", None)
    return wrapped if isinstance(wrapped, nn.Module) else None


# ------------------------------------------------------------------------------ managed collision

# The MCH module's methods the ZCH capture wraps (an eviction, and the buffers' re-sort after it).
MCH_UPDATE_AND_EVICT = "_update_and_evict"
MCH_SORT_BUFFERS = "_sort_mch_buffers"


def mc_collection_of(module: nn.Module) -> Optional[nn.Module]:
    """The managed-collision collection of any module that holds one (a sharded or a quantized
    managed-collision EC/EBC, TorchRec's ``QuantManagedCollisionEmbeddingCollection``); None
    for a module without one."""
    mcc = getattr(module, "_managed_collision_collection", None)
    return mcc if isinstance(mcc, nn.Module) else None


def mc_embedding_module_of(module: nn.Module) -> Optional[nn.Module]:
    """The embedding collection a managed-collision wrapper holds (``quantize_inference_model``
    keeps the float wrapper and quantizes this one); None for a module without one (TorchRec's
    ``QuantManagedCollisionEmbeddingCollection`` is itself the collection)."""
    inner = getattr(module, "_embedding_module", None)
    return inner if isinstance(inner, nn.Module) else None


def mc_embedding_module(mc_module: nn.Module) -> nn.Module:
    """The sharded EC/EBC inside a sharded managed-collision EC/EBC."""
    inner = mc_embedding_module_of(mc_module)
    if inner is None:
        raise AttributeError(f"{type(mc_module).__name__} holds no embedding module (_embedding_module)")
    return inner


def mc_collection(mc_module: nn.Module) -> nn.Module:
    """The ``ShardedManagedCollisionCollection`` of a sharded managed-collision EC/EBC."""
    mcc = mc_collection_of(mc_module)
    if mcc is None:
        raise AttributeError(f"{type(mc_module).__name__} holds no managed-collision collection")
    return mcc


def mc_modules(mcc: nn.Module) -> Dict[str, nn.Module]:
    """Table name -> managed-collision module of a managed-collision collection."""
    return dict(mcc._managed_collision_modules.items())  # type: ignore[operator, union-attr]


def table_tbes(mc_module: nn.Module) -> Dict[str, Tuple[Any, int]]:
    """Table name -> (TBE, index of the table in it) of a sharded managed-collision EC/EBC
    (empty when TorchRec keeps no such map)."""
    return dict(getattr(mc_module, "_table_to_tbe_and_index", {}))


def mch_size(mcm: nn.Module) -> int:
    """The number of slots of an MCH module's shard."""
    return int(mcm._zch_size)  # type: ignore[arg-type]


def mch_sorted_raw_ids(mcm: nn.Module) -> torch.Tensor:
    """An MCH module's raw ids, ascending (empty positions hold the int64 maximum); live."""
    out: torch.Tensor = mcm._mch_sorted_raw_ids  # type: ignore[assignment]
    return out


def mch_slot_mapping(mcm: nn.Module) -> torch.Tensor:
    """The slot (global row) of each position of :func:`mch_sorted_raw_ids`; live."""
    out: torch.Tensor = mcm._mch_remapped_ids_mapping  # type: ignore[assignment]
    return out


def quant_tbes(quant_collection: nn.Module) -> List[nn.Module]:
    """The FBGEMM modules of TorchRec's quantized EC/EBC, one per group of tables (registered as
    ``tbes`` only by ``quantize_inference_model``, not by ``quantize_embeddings``)."""
    return list(getattr(quant_collection, "_emb_modules", []))


def mch_output_offset(mcm: nn.Module) -> int:
    """The first slot an MCH module maps to (0 for an unsharded module)."""
    return int(mcm._output_global_offset)  # type: ignore[arg-type]


def mch_eviction_policy(mcm: nn.Module) -> Any:
    """An MCH module's eviction policy (it may be shared by several modules)."""
    return mcm._eviction_policy


__all__ = [
    "MCH_SORT_BUFFERS",
    "MCH_UPDATE_AND_EVICT",
    "dmp_wrapped_module",
    "embedding_modules",
    "group_tables",
    "mc_collection",
    "mc_collection_of",
    "mc_embedding_module",
    "mc_embedding_module_of",
    "mc_modules",
    "mch_eviction_policy",
    "mch_output_offset",
    "mch_size",
    "mch_slot_mapping",
    "mch_sorted_raw_ids",
    "keeps_step_counter",
    "optimizer_states",
    "quant_tbes",
    "sharded_lookups",
    "table_tbes",
    "tbe",
    "tracker_discovery",
]
