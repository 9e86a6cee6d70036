"""TorchRec's own interfaces served by the log: code written for TorchRec's classes runs on
persistent_delta unchanged.

* :mod:`.delta_store`: :class:`~persistent_delta.adapters.delta_store.LmdbDeltaStore`, TorchRec's
  ``DeltaStore`` (a drop-in for ``DeltaStoreTrec``) on a durable log -- a writer;
* :mod:`.raw_ids`: :class:`~persistent_delta.adapters.raw_ids.PersistentRawIdTracker`, TorchRec's
  ``RawIdTracker`` read side on a tracker's log.

They import the log only (never the trainer, nor the read path's consumers); TorchRec's and
FBGEMM's private attributes are :mod:`persistent_delta.torchrec_internals`'.
"""
