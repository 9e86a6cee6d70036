"""Bases and increments: their on-disk format and the offline rules (no trainer involved).

A base is a torch.distributed.checkpoint (DCP) directory of the model and its optimizers; an
increment holds, per rank, the rows changed since the previous one. :mod:`.format` owns the
layout and the stored entries, :mod:`.chain` which base and increments a restore uses. Taking
them and restoring a model is the trainer's (:mod:`persistent_delta.trainer.increments`).

The supported names (the package tier; every other module path is internal): :func:`list_bases`
and :func:`latest_chain` (the bases in a directory, and the base and increments a restore would
use), :class:`Chain` and :class:`BaseInfo` (what they return and record). Taking bases and
increments is :class:`persistent_delta.trainer.Checkpoints`.
"""

from typing import TYPE_CHECKING, Dict

from persistent_delta.exports import lazy_exports

if TYPE_CHECKING:
    from persistent_delta.checkpoint.chain import Chain, latest_chain, list_bases
    from persistent_delta.checkpoint.format import BaseInfo

_EXPORTS: Dict[str, str] = {
    "list_bases": "chain", "latest_chain": "chain", "Chain": "chain", "BaseInfo": "format",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = ["list_bases", "latest_chain", "Chain", "BaseInfo"]
