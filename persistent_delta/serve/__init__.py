"""The serving side: applies what :mod:`persistent_delta.read` returns; reaches a job's stream
only through the consumer protocol (:class:`~persistent_delta.read.polling.Consumer`: it never
imports :mod:`persistent_delta.fleet`).

* :mod:`.apply`: :func:`~persistent_delta.serve.apply.load_base` (a replica's starting tables
  from shard files) and :func:`~persistent_delta.serve.apply.apply_poll` (a poll into full
  tables), the one definition of "applied";
* :mod:`.inference`: :class:`~persistent_delta.serve.inference.InferenceReplica`, polls applied
  into a TorchRec quantized inference model, and :mod:`.mch_maps`, its managed-collision maps;
* :mod:`.raw_id_map`: :class:`~persistent_delta.serve.raw_id_map.RawIdMap`, a replica's raw-id
  map of managed-collision tables;
* :mod:`.replay` (the increment files: ``persistent-delta replay``'s export format),
  :mod:`.ordered` (the order rule and the offline replica file) and :mod:`.apply_files`
  (``persistent-delta apply``: reading and applying bases and increments in order);
* :mod:`.fresh_base`: :func:`~persistent_delta.serve.fresh_base.load_checkpoint_base` (a
  replica's full tables from the trainer's newest checkpoint base and increments) and
  :class:`~persistent_delta.serve.fresh_base.Follower` (the serving loop that takes a fresh base
  on start, restart, or a position lost to retention).

A base's continuation rule (:class:`~persistent_delta.read.base.BaseTables`) stays in
:mod:`persistent_delta.read`: a remote consumer's ``bootstrap()`` returns one too, and
:mod:`persistent_delta.fleet` does not import this package.

The supported names (the package tier; every other module path is internal):
:func:`load_base`, :func:`apply_poll`, :class:`Applied` (also at the top level),
:class:`InferenceReplica`, :class:`RawIdMap`, :func:`load_checkpoint_base` and :class:`Follower`.
"""

from typing import TYPE_CHECKING, Dict

from persistent_delta.exports import lazy_exports

if TYPE_CHECKING:
    from persistent_delta.serve.apply import Applied, apply_poll, load_base
    from persistent_delta.serve.fresh_base import Follower, load_checkpoint_base
    from persistent_delta.serve.inference import InferenceReplica
    from persistent_delta.serve.raw_id_map import RawIdMap

_EXPORTS: Dict[str, str] = {
    "load_base": "apply", "apply_poll": "apply", "Applied": "apply", "InferenceReplica": "inference",
    "RawIdMap": "raw_id_map", "load_checkpoint_base": "fresh_base", "Follower": "fresh_base",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = ["load_base", "apply_poll", "Applied", "InferenceReplica", "RawIdMap", "load_checkpoint_base", "Follower"]
