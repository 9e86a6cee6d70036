"""``attach``: a :class:`~persistent_delta.trainer.tracker.PersistentDeltaTracker` inside a
TorchRec ``DistributedModelParallel``.

Owns: registering a tracker in a DMP as TorchRec registers its own (``dmp.model_trackers``), so
that ``DMP.forward`` steps it and ``dmp.get_delta_tracker()`` returns it.
"""

from __future__ import annotations

from torch import nn
from torchrec.distributed.model_tracker.types import Trackers

from persistent_delta.config import PersistentTrackerConfig
from persistent_delta.errors import InvalidInputError
from persistent_delta.torchrec_internals import dmp_wrapped_module
from persistent_delta.trainer.tracker import PersistentDeltaTracker


def attach(dmp: nn.Module, config: PersistentTrackerConfig) -> PersistentDeltaTracker:
    """Build a :class:`PersistentDeltaTracker` for a ``DistributedModelParallel`` and register
    it, so that ``dmp.get_delta_tracker()`` returns it and ``DMP.forward`` steps it.

    The tracker's state joins the model's: ``dmp.state_dict()`` carries it under a key of its
    rank's, ``"persistent_delta_tracker.rank_<rank>"`` (one opaque value, so that
    torch.distributed.checkpoint keeps every rank's own; writing it marks a checkpoint, taking
    it does not), and ``dmp.load_state_dict(checkpoint)`` takes that entry out and restores the
    tracker before the next step, ``get_unique`` or ``publish`` (after the optimizer state is
    loaded too), as ``tracker.load_state_dict`` does; the key ``"persistent_delta_tracker"`` of
    older checkpoints loads too. A model without a tracker loads such a checkpoint as well: the
    DMP reports the key in ``unexpected_keys`` (pop it first to keep the report empty). If the
    log holds batches after its latest checkpoint mark and the first step comes with no
    restore, the tracker warns (logging and ``RuntimeWarning``). ``tracker.close()`` removes it
    from the DMP.

    Raises:
        InvalidInputError: ``dmp`` is not a DMP, or it already has a delta tracker.
    """
    trackers, wrapped = getattr(dmp, "model_trackers", None), dmp_wrapped_module(dmp)
    if trackers is None or wrapped is None:
        raise InvalidInputError("attach() needs a torchrec DistributedModelParallel")
    existing = trackers.get(Trackers.DELTA_TRACKER.name)
    if existing is not None:
        raise InvalidInputError(f"this DMP already has a delta tracker ({type(existing).__name__}); close it first")
    tracker = PersistentDeltaTracker(wrapped, config, dmp=dmp)
    trackers[Trackers.DELTA_TRACKER.name] = tracker
    return tracker


__all__ = ["attach"]
