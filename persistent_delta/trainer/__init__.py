"""The trainer side: the tracker TorchRec's sharded modules call, its background writer,
publish, restore and checkpoints.

Owns nothing itself. Its modules: :mod:`.tracker` (the tracker TorchRec's
``DistributedModelParallel`` steps), :mod:`.attach` (``attach``: a tracker on a model),
:mod:`.tracker_state` (the tracker's state in a model checkpoint), :mod:`.capture` and :mod:`.zch_capture` (what the tracker
takes from each lookup, and from managed-collision tables), :mod:`.operations` and :mod:`.writer`
(the named operations and the thread that commits them), :mod:`.window` (the read window's
filter), :mod:`.publish`, :mod:`.caps`, :mod:`.unread` and :mod:`.consume` (publishing and
reading a trainer consumer), :mod:`.restore` (a restart from a model checkpoint),
:mod:`.save_shards` (a replica's base as shard files), :mod:`.sharding` (the local shards of
the tables), :mod:`.topk` (the hottest rows) and :mod:`.increments` (bases and increments).

The supported names (the package tier; every other module path is internal):

* :class:`PersistentTrackerConfig`, :class:`PersistentDeltaTracker`: the tracker (``attach``
  is :func:`persistent_delta.attach`);
* :func:`save_local_shards`: a rank's table shards as a replica's base;
* :func:`cpu_eviction_fallback`: managed-collision eviction on CPU-only hosts;
* :class:`Checkpoints`: bases and increments of a training job.
"""

from typing import TYPE_CHECKING, Dict

from persistent_delta.exports import lazy_exports

if TYPE_CHECKING:
    from persistent_delta.trainer.increments import Checkpoints
    from persistent_delta.trainer.save_shards import save_local_shards
    from persistent_delta.trainer.tracker import PersistentDeltaTracker, PersistentTrackerConfig
    from persistent_delta.trainer.zch_capture import cpu_eviction_fallback

_EXPORTS: Dict[str, str] = {
    "PersistentTrackerConfig": "tracker", "PersistentDeltaTracker": "tracker",
    "save_local_shards": "save_shards", "cpu_eviction_fallback": "zch_capture", "Checkpoints": "increments",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = ["PersistentTrackerConfig", "PersistentDeltaTracker", "save_local_shards",
           "cpu_eviction_fallback", "Checkpoints"]
