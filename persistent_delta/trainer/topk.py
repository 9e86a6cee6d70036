"""Top-k: keep the fraction of each table's rows that changed most (``top_percentage``).

Owns: the change measure per tracking mode and the selection. TorchRec's tracker accepts
``top_percentage``/``per_table_percentage`` and ignores them; here they are honoured:
EMBEDDING by ``||current row - tracked first value||``, MOMENTUM_LAST by the momentum norm,
MOMENTUM_DIFF / ROWWISE_ADAGRAD by the state difference. Rows left out are not re-delivered.
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Optional, Sequence, Tuple, Union

import torch
from torchrec.distributed.model_tracker.types import TrackingMode, UniqueRows

from persistent_delta.errors import InvalidInputError
from persistent_delta.trainer.sharding import LocalTable

TableFraction = Union[float, Tuple[float, str]]


def fractions(
    mode: TrackingMode, fqns: Sequence[str], top: Optional[float], per_table: Optional[Mapping[str, TableFraction]]
) -> Optional[Dict[str, float]]:
    """fqn -> fraction of rows to keep, or None when every table keeps all of them.

    Raises:
        InvalidInputError: a fraction outside (0, 1], an unknown criterion, or top-k in
            ID_ONLY mode (no measure of change).
    """
    top = 1.0 if top is None else float(top)
    out = {fqn: top for fqn in fqns}
    for fqn, spec in (per_table or {}).items():
        frac, criterion = (spec, "") if isinstance(spec, (int, float)) else spec
        if criterion not in ("", "norm", "default"):
            raise InvalidInputError(f"per_table_percentage[{fqn!r}]: unknown criterion {criterion!r}")
        out[fqn] = float(frac)
    for fqn, f in out.items():
        if not 0.0 < f <= 1.0 or math.isnan(f):
            raise InvalidInputError(f"fraction for {fqn!r} must be in (0, 1], got {f}")
    if all(f == 1.0 for f in out.values()):
        return None
    if mode == TrackingMode.ID_ONLY:
        raise InvalidInputError("top_percentage needs tracked states: ID_ONLY has no measure of change")
    return out


def scores(mode: TrackingMode, table: Optional[LocalTable], rows: UniqueRows) -> torch.Tensor:
    """How much each row changed (see the module docs)."""
    states = rows.states
    if states is None:
        raise InvalidInputError("top-k needs tracked states")
    if mode == TrackingMode.EMBEDDING and table is not None:
        weights = table.weights()
        current = weights[rows.ids.to(weights.device).long()].to(states.device)
        diff = current.float() - states.float().view(current.shape)
        out: torch.Tensor = diff.norm(dim=1)
        return out
    s = states.float()
    out = s.abs() if s.dim() == 1 else s.reshape(s.shape[0], -1).norm(dim=1)
    return out


def top(mode: TrackingMode, table: Optional[LocalTable], rows: UniqueRows, fraction: float, sort_ids: bool) -> UniqueRows:
    """The ``ceil(fraction * n)`` rows that changed most; ids ascending with ``sort_ids``,
    else by score (highest first)."""
    n = rows.ids.numel()
    if fraction >= 1.0 or n == 0:
        return rows
    k = max(1, math.ceil(fraction * n))
    picked = torch.topk(scores(mode, table, rows), k, sorted=True).indices
    if sort_ids:
        picked = picked.sort().values
    return UniqueRows(ids=rows.ids[picked], states=None if rows.states is None else rows.states[picked])
