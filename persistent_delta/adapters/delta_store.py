"""``LmdbDeltaStore``: TorchRec's ``DeltaStore`` on a durable LMDB log.

A drop-in for ``DeltaStoreTrec`` with the same semantics, except where listed:

* records survive ``close()`` and process crashes; reopening the path gives back exactly what
  was there;
* ``get_unique`` returns empty tensors for a table with nothing left (TorchRec raises);
* ids come back in ascending order (TorchRec's order is unspecified);
* appending a ``batch_idx`` lower than the table's last one is refused (the log is append-only),
  as are float or negative ids, states whose rows differ from the ids, and missing states when
  the update mode needs them.

Each public mutation (``append``, ``delete``, ``compact``) is one LMDB write transaction.

Owns: the adaptation of TorchRec's ``DeltaStore`` interface to the log, nothing else; the record
operations are :mod:`persistent_delta.log.records`'.
"""

from __future__ import annotations

import logging
import os
import types
from typing import Dict, List, Mapping, Optional, Sequence, Union

import torch
from torchrec.distributed.model_tracker.delta_store import DeltaStore
from torchrec.distributed.model_tracker.types import IndexedLookup, UniqueRows, UpdateMode

from persistent_delta.config import Durability, LogOptions
from persistent_delta.errors import InvalidInputError
from persistent_delta.log.position_rules import safe_compact
from persistent_delta.log.deltalog import DeltaLog
from persistent_delta.log.records import (
    AppendRecord,
    delete_below,
    encode_records,
    read_lookups,
    read_unique,
    write_records,
)
from persistent_delta.log.schema import MAX_BATCH_IDX, check_batch_idx

logger = logging.getLogger(__name__)

class LmdbDeltaStore(DeltaStore):
    """TorchRec ``DeltaStore`` whose records live in an LMDB log directory.

    Thread-safety: methods may be called from any thread of the opening process. Only one
    process may hold a store open on a path (writer lock); readers use :class:`DeltaLog` with
    ``readonly=True`` or :class:`~persistent_delta.DeltaConsumer`.

    Args:
        path: the log directory (created if missing).
        updateMode: the update mode of the records. Reopening a log with another mode raises
            :class:`~persistent_delta.errors.ConfigMismatchError`.
        durability: see :class:`~persistent_delta.Durability` (default:
            ``PERSISTENT_DELTA_DURABILITY``, else ``ON_FLUSH``).
        map_size: initial LMDB map size (grows by itself; default ``PERSISTENT_DELTA_MAP_SIZE``).
        readonly: open for reading only; mutations raise ``ReadOnlyLogError``.
        options: full :class:`LogOptions`, instead of the two shortcuts above.

    Raises:
        LogLockedError: another process holds the log open for writing.
        FormatMismatchError, ConfigMismatchError, NotALogError: see their docs.
    """

    def __init__(
        self,
        path: Union[str, "os.PathLike[str]"],
        updateMode: UpdateMode = UpdateMode.NONE,
        *,
        durability: Optional[Union[Durability, str]] = None,
        map_size: Optional[int] = None,
        readonly: bool = False,
        options: Optional[LogOptions] = None,
    ) -> None:
        if not isinstance(updateMode, UpdateMode):
            raise InvalidInputError(f"updateMode must be a torchrec UpdateMode, got {updateMode!r}")
        self.updateMode = updateMode
        opts = options or LogOptions.resolve(durability=durability, map_size=map_size)
        self._log = DeltaLog(os.fspath(path), readonly=readonly, update_mode=updateMode.value, options=opts)

    @property
    def log(self) -> DeltaLog:
        """The underlying :class:`DeltaLog`."""
        return self._log

    @property
    def path(self) -> str:
        return self._log.path

    # ------------------------------------------------------------------ DeltaStore API
    def append(
        self,
        batch_idx: int,
        fqn: str,
        ids: torch.Tensor,
        states: Optional[torch.Tensor] = None,
        raw_ids: Optional[torch.Tensor] = None,
        runtime_meta: Optional[torch.Tensor] = None,
    ) -> None:
        """Append one record of ``fqn`` at ``batch_idx`` (one transaction).

        Raises:
            InvalidInputError: bad ids/states, or ``batch_idx`` below the table's last one.
        """
        if raw_ids is not None or runtime_meta is not None:
            raise InvalidInputError("raw_ids/runtime_meta (RawIdTracker) are not stored by LmdbDeltaStore")
        self.append_many([AppendRecord(batch_idx, fqn, ids, states)])

    def append_many(self, records: Sequence[AppendRecord]) -> int:
        """Append several records in one transaction (group commit); returns bytes written."""
        encoded = encode_records(records, self.updateMode)
        if not encoded:
            return 0
        return self._log.write(lambda w: write_records(w, encoded))

    def delete(self, up_to_idx: Optional[int] = None) -> None:
        """Delete records with ``batch_idx < up_to_idx``; ``None`` deletes everything."""
        if up_to_idx is not None:
            check_batch_idx(up_to_idx, "up_to_idx")
        n, nbytes = self._log.write(lambda w: delete_below(w, up_to_idx))
        logger.debug("deleted %d records (%d bytes) below %s in %s", n, nbytes, up_to_idx, self.path)

    def compact(self, start_idx: int, end_idx: int) -> None:
        """Merge, per table, two or more records in ``[start_idx, end_idx)`` into one record
        stamped ``start_idx``. When consumers are registered in the log, the range is split at
        their positions (:func:`persistent_delta.log.position_rules.safe_compact`), so no read changes.

        Raises:
            AssertionError: ``start_idx >= end_idx`` (the type TorchRec raises).
        """
        check_batch_idx(start_idx, "start_idx")
        check_batch_idx(end_idx, "end_idx")
        if start_idx >= end_idx:
            raise AssertionError(f"start_idx {start_idx} must be smaller than end_idx, but got {end_idx}")
        merged = self._log.write(lambda w: safe_compact(w, self.updateMode, start_idx, end_idx))
        if merged:
            logger.debug("compacted [%d, %d) in %s: %s", start_idx, end_idx, self.path, merged)

    def get_unique(self, from_idx: int = 0) -> Dict[str, UniqueRows]:
        """Per table, unique ids (ascending) with states per update mode, from ``from_idx``.

        A table with nothing left gives empty tensors.
        """
        if isinstance(from_idx, bool) or not isinstance(from_idx, int) or from_idx > MAX_BATCH_IDX:
            raise InvalidInputError(f"from_idx must be an int below 2**63 (negative reads everything), got {from_idx!r}")
        return self._log.read(lambda r: read_unique(r, self.updateMode, max(0, from_idx)))

    def get_indexed_lookups(self, start_idx: int, end_idx: int) -> Dict[str, List[IndexedLookup]]:
        """Per listed table, copies of its records with ``start_idx <= batch_idx < end_idx``."""
        return self._log.read(lambda r: read_lookups(r, start_idx, end_idx))

    @property
    def per_fqn_lookups(self) -> Mapping[str, List[IndexedLookup]]:
        """Read-only view: fqn -> all records as ``IndexedLookup`` (copies; costly on big logs)."""
        return types.MappingProxyType(self._log.read(lambda r: read_lookups(r, 0, None)))

    # ------------------------------------------------------------------ lifecycle
    def flush(self) -> None:
        """Make everything appended so far survive an OS crash (fsync)."""
        self._log.flush()

    def close(self) -> None:
        """Close the log; later calls raise ``LogClosedError``. Idempotent."""
        self._log.close()

    def __enter__(self) -> "LmdbDeltaStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LmdbDeltaStore({self.path!r}, updateMode={self.updateMode})"
