"""Merging records into unique rows: the FIRST/LAST rule of TorchRec's ``UpdateMode``.

Design note
-----------
Records of one table are concatenated in log order (batch_idx, then append order). For each id,
``UpdateMode.FIRST`` keeps the state of its first occurrence (the value before the interval,
e.g. an embedding before the updates), ``UpdateMode.LAST`` the state of its last occurrence
(the newest optimizer state), and ``UpdateMode.NONE`` keeps ids only.

TorchRec's ``_compute_unique_rows`` does ``unique(return_inverse)`` + ``scatter_reduce``; here a
single stable sort gives both the ascending unique ids and, per run of equal ids, its first
(FIRST) or last (LAST) position in log order. The result is ascending by id, which is what
``get_unique`` promises.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torchrec.distributed.model_tracker.types import UniqueRows, UpdateMode


def _cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return parts[0].clone() if len(parts) == 1 else torch.cat(list(parts))


def compute_unique_rows(
    ids: Sequence[torch.Tensor],
    states: Optional[Sequence[torch.Tensor]],
    mode: UpdateMode,
) -> UniqueRows:
    """Unique rows of the given records, in ascending id order.

    Args:
        ids: 1-D id tensors, in log order (at least one).
        states: per-record states (same row counts as ``ids``), or None for ``UpdateMode.NONE``.
        mode: FIRST keeps each id's first state, LAST its last one, NONE ids only.

    Returns:
        ``UniqueRows`` owning its memory (never a view of the inputs).
    """
    if len(ids) == 0:
        raise ValueError("compute_unique_rows needs at least one record")
    if mode == UpdateMode.NONE or states is None:
        return UniqueRows(ids=torch.unique(_cat(ids), sorted=True), states=None)
    cat_ids = _cat(ids)
    cat_states = torch.cat(list(states)) if len(states) > 1 else states[0]
    n = cat_ids.numel()
    if n == 0:
        return UniqueRows(ids=cat_ids, states=cat_states.clone())
    sorted_ids, order = torch.sort(cat_ids, stable=True)
    keep = torch.empty(n, dtype=torch.bool)
    if mode == UpdateMode.FIRST:
        keep[0] = True
        torch.ne(sorted_ids[1:], sorted_ids[:-1], out=keep[1:])
    else:  # LAST
        keep[-1] = True
        torch.ne(sorted_ids[:-1], sorted_ids[1:], out=keep[:-1])
    picked = order[keep]
    return UniqueRows(ids=sorted_ids[keep], states=cat_states[picked])


def merge_unique(parts: List[UniqueRows], mode: UpdateMode) -> UniqueRows:
    """Merge per-range unique rows given in log order (the same FIRST/LAST rule)."""
    states = None if mode == UpdateMode.NONE else [p.states for p in parts if p.states is not None]
    return compute_unique_rows([p.ids for p in parts], states, mode)  # type: ignore[arg-type]
