"""A durable ``RawIdTracker``: TorchRec's raw-id tracker API served from the delta log.

Owns: TorchRec's ``get_indexed_lookups(tables, consumer)`` contract on the raw-id side records
of managed-collision tables (:mod:`persistent_delta.log.zch_records`).

TorchRec 1.8.0's ``RawIdTracker`` keeps, in process memory, the raw ids behind each lookup of a
managed-collision table and hands them out per consumer: ``get_indexed_lookups(tables,
consumer)`` returns ``{table name: ([raw ids [n, 1] per lookup, batch order], [runtime meta])}``
for the batches since the consumer last read (the current one included) and moves it past them;
``get_unique``/``get_unique_ids`` return ``{}``. It records only for modules with
``_hash_zch_identities`` (HashZch). :class:`PersistentRawIdTracker` gives the same answers from
the log written by a :class:`~persistent_delta.trainer.tracker.PersistentDeltaTracker` -- for MCH
modules too -- with durable consumer positions (registered lookups consumers of the log: they
hold back retention like any other). :func:`install_raw_id_tracker` registers it where a DMP
keeps its raw-id tracker (``dmp.model_trackers["RAW_ID_TRACKER"]``).

Differences: runtime metadata is not recorded (the second list is always empty); ``delete``
does nothing (retention is the log's, ``delete_on_read``); TorchRec's TBE raw-embedding
streaming consumers (``emb.init_raw_id_tracker``, per-process TBE uuids) are not wired: their
names change every run and would hold retention forever.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple, TypeVar

import torch
from torch import nn
from torchrec.distributed.model_tracker.model_delta_tracker import ModelDeltaTracker
from torchrec.distributed.model_tracker.types import Trackers, UniqueRows
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from persistent_delta.errors import InvalidInputError, UnknownConsumerError
from persistent_delta.log.deltalog import ReadTxn
from persistent_delta.log.schema import check_consumer_name
from persistent_delta.log.zch_records import raw_lookups

Lookups = Dict[str, Tuple[List[torch.Tensor], List[torch.Tensor]]]
_T = TypeVar("_T")


class _DeltaTracker(Protocol):
    """What this module uses of a :class:`~persistent_delta.trainer.tracker.PersistentDeltaTracker`
    (its public API: this module sits below the tracker and does not import it)."""

    zch: Any
    curr_batch_idx: int

    @property
    def per_consumer_batch_idx(self) -> Dict[str, int]: ...

    def add_consumer(self, name: str, from_latest: bool = False) -> None: ...

    def consume_exact(self, consumer: str, read: Callable[[ReadTxn, int, int], _T], empty: _T,
                      delete_on_read: Optional[bool] = None) -> _T: ...


class PersistentRawIdTracker(ModelDeltaTracker):
    """TorchRec's ``RawIdTracker`` read side on a tracker's log (see the module docs).

    The delta tracker records and steps the batch index (``step`` here does nothing: a DMP
    steps every tracker it holds). Training thread of the tracker's process only.

    Args:
        tracker: the :class:`PersistentDeltaTracker` of a model with managed-collision tables.
        consumers: consumer names (default ``["default"]``), registered durably in the log.
        delete_on_read: apply the log's retention after each read (TorchRec's default True).
    """

    def __init__(self, tracker: _DeltaTracker, consumers: Optional[List[str]] = None,
                 delete_on_read: bool = True) -> None:
        if not tracker.zch.tables:
            raise InvalidInputError("the tracked model has no managed-collision tables: no raw ids to serve")
        self._tracker = tracker
        self._delete_on_read = delete_on_read
        self._names = [check_consumer_name(c) for c in (consumers or [self.DEFAULT_CONSUMER])]
        for name in self._names:
            tracker.add_consumer(name)
        self._fqn_of = {t.name: fqn for fqn, t in tracker.zch.tables.items()}

    @property
    def curr_batch_idx(self) -> int:
        return self._tracker.curr_batch_idx

    @property
    def per_consumer_batch_idx(self) -> Dict[str, int]:
        """Committed position of each of this tracker's consumers."""
        offsets = self._tracker.per_consumer_batch_idx
        return {n: offsets[n] for n in self._names if n in offsets}

    def step(self) -> None:
        """Nothing: the delta tracker advances the batch index."""

    def record_lookup(self, kjt: KeyedJaggedTensor, states: torch.Tensor, emb_module: Optional[nn.Module] = None,
                      raw_ids: Optional[torch.Tensor] = None) -> None:
        """Nothing: the delta tracker's hooks record (:mod:`persistent_delta.trainer.zch_capture`)."""

    def get_indexed_lookups(self, tables: List[str], consumer: Optional[str] = None) -> Lookups:
        """TorchRec's ``RawIdTracker.get_indexed_lookups``: per table *name* in ``tables`` with
        raw ids since ``consumer`` last read (up to the current batch, included), ``([raw ids
        [n, 1] of each lookup, in batch order], [])``; commits the consumer's new position.

        Raises:
            UnknownConsumerError: ``consumer`` is not one of this tracker's (an AssertionError).
        """
        name = consumer or self.DEFAULT_CONSUMER
        if name not in self._names:
            raise UnknownConsumerError(f"consumer {name} not present in {self._names}")

        def read(r: ReadTxn, start: int, end: int) -> Lookups:
            out: Lookups = {}
            for table in tables:
                fqn = self._fqn_of.get(table)
                te = r.table(fqn) if fqn is not None else None
                found = raw_lookups(r, te, start, end) if te is not None else []
                if found:
                    out[table] = ([raw for _, _, raw in found], [])
            return out

        # the current batch's raw ids are read too, as TorchRec's are
        return self._tracker.consume_exact(name, read, {}, delete_on_read=self._delete_on_read)

    def get_unique_ids(self, consumer: Optional[str] = None) -> Dict[str, torch.Tensor]:
        return {}

    def get_unique(self, consumer: Optional[str] = None, top_percentage: Optional[float] = 1.0,
                   per_table_percentage: Optional[Dict[str, Tuple[float, str]]] = None,
                   sorted_by_indices: Optional[bool] = True) -> Dict[str, UniqueRows]:
        return {}

    def clear(self, consumer: Optional[str] = None) -> None:
        """Nothing, as TorchRec's."""

    def delete(self, up_to_idx: Optional[int]) -> None:
        """Nothing: the log's retention deletes (``delete_on_read``)."""


def install_raw_id_tracker(dmp: nn.Module, tracker: _DeltaTracker, consumers: Optional[List[str]] = None,
                           delete_on_read: bool = True) -> PersistentRawIdTracker:
    """Register a :class:`PersistentRawIdTracker` as ``dmp``'s raw-id tracker
    (``dmp.model_trackers[Trackers.RAW_ID_TRACKER.name]``) and return it.

    Raises:
        InvalidInputError: ``dmp`` already has a raw-id tracker (TorchRec's, built from
            ``model_tracker_configs``), or the model has no managed-collision tables.
    """
    trackers = getattr(dmp, "model_trackers", None)
    if trackers is None:
        raise InvalidInputError("install_raw_id_tracker() needs a torchrec DistributedModelParallel")
    existing = trackers.get(Trackers.RAW_ID_TRACKER.name)
    if existing is not None:
        raise InvalidInputError(f"this DMP already has a raw-id tracker ({type(existing).__name__})")
    raw = PersistentRawIdTracker(tracker, consumers, delete_on_read)
    trackers[Trackers.RAW_ID_TRACKER.name] = raw
    return raw
