"""The log: one rank's append-only LMDB directory, its records and the rules on positions.

Owns nothing itself. Its modules, by role: :mod:`.schema` (the stored entries, typed) and
:mod:`.codec` (their bytes, a format version checked on open); :mod:`.lmdbenv` (py-lmdb's process
rules: shared environments, the fork guard, the writer lock, map growth, error mapping) and
:mod:`.deltalog` (typed transactions on a log); :mod:`.records` (append, delete, compact),
:mod:`.rows` (the FIRST/LAST rule), :mod:`.position_rules` (what a position means: bounds, read
start, retention); :mod:`.layout` (the log root's directories and files), :mod:`.watch`
(waiting for a commit), :mod:`.alloc` (reused poll buffers), :mod:`.deferred` (a capped
publish's deferred rows), :mod:`.shard_files` (the shard-file format), :mod:`.zch_records`
(managed-collision side records).

The supported names (the package tier; every other module path is internal):

* :class:`LogIdentity`: which log of a rank data came from (its id and creation time);
* :func:`atomic_write_bytes`: write a file the way the log writes its own files (a temp file,
  fsynced, then renamed), for checkpoints and keys written beside a log.
"""

from typing import TYPE_CHECKING, Dict

from persistent_delta.exports import lazy_exports

if TYPE_CHECKING:
    from persistent_delta.log.layout import atomic_write_bytes
    from persistent_delta.log.schema import LogIdentity

_EXPORTS: Dict[str, str] = {"LogIdentity": "schema", "atomic_write_bytes": "layout"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = ["LogIdentity", "atomic_write_bytes"]
