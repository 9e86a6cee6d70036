"""TorchRec's own interfaces served by the log: code written for TorchRec's classes runs on
persistent_delta unchanged.

* :mod:`.delta_store`: :class:`~persistent_delta.adapters.delta_store.LmdbDeltaStore`, TorchRec's
  ``DeltaStore`` (a drop-in for ``DeltaStoreTrec``) on a durable log -- a writer;
* :mod:`.raw_ids`: :class:`~persistent_delta.adapters.raw_ids.PersistentRawIdTracker`, TorchRec's
  ``RawIdTracker`` read side on a tracker's log.

They import the log only (never the trainer, nor the read path's consumers); TorchRec's and
FBGEMM's private attributes are :mod:`persistent_delta.torchrec_internals`'.

The supported names (the package tier; every other module path is internal):
:class:`LmdbDeltaStore` (also at the top level) and :class:`PersistentRawIdTracker`.
"""

from typing import TYPE_CHECKING, Dict

from persistent_delta.exports import lazy_exports

if TYPE_CHECKING:
    from persistent_delta.adapters.delta_store import LmdbDeltaStore
    from persistent_delta.adapters.raw_ids import PersistentRawIdTracker

_EXPORTS: Dict[str, str] = {
    "LmdbDeltaStore": "delta_store", "PersistentRawIdTracker": "raw_ids",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = ["LmdbDeltaStore", "PersistentRawIdTracker"]
