"""Unique rows of some records: the FIRST/LAST rule of TorchRec's ``UpdateMode``, written once.

Owns: the update-mode rule. Every reader (store, consumer, replay), the writer's dedup, compaction
and restore call :func:`compute_unique_rows`; nothing else decides which state of a repeated id
wins, or what ``UpdateMode.NONE`` returns (ids only, states ``None``).

Design note
-----------
Records of one table are concatenated in log order (batch_idx, then append order). For each id,
``UpdateMode.FIRST`` keeps the state of its first occurrence (the value before the interval,
e.g. an embedding before the updates), ``UpdateMode.LAST`` the state of its last occurrence
(the newest optimizer state), and ``UpdateMode.NONE`` keeps ids only.

TorchRec's ``_compute_unique_rows`` does ``unique(return_inverse)`` + ``scatter_reduce``. Here
shard-local ids are usually dense, so a direct-address table gives the ascending unique ids and
each one's first (FIRST) or last (LAST) position in log order in linear time; sparse ids use
one stable sort instead. The result is ascending by id, which is what ``get_unique`` promises.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torchrec.distributed.model_tracker.types import UniqueRows, UpdateMode


def _cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))


# Ids are shard-local row numbers, so they are usually dense: when the largest id is within
# this factor of the number of ids, a direct-address table (bitmap, or per-row first/last
# position via scatter_reduce) replaces the sort: linear time, 3-7x faster measured on Zipf ids
# (16k-650k ids over 200k rows). Sparse ids fall back to the stable sort.
_DENSE_FACTOR = 16


def _dense(ids: torch.Tensor) -> Optional[int]:
    """``max_id + 1`` when a direct-address table over ``ids`` is cheap, else None."""
    n = ids.numel()
    if ids.dtype in (torch.uint64, torch.uint32, torch.uint16) or ids.device.type != "cpu":
        return None
    top = int(ids.max()) + 1
    return top if top <= max(_DENSE_FACTOR * n, 1 << 16) else None


def unique_ids(ids: torch.Tensor) -> torch.Tensor:
    """Ascending unique ids (owning its memory)."""
    if ids.numel() == 0:
        return ids.clone()
    top = _dense(ids)
    if top is None:
        out: torch.Tensor = torch.unique(ids, sorted=True)
        return out
    mask = torch.zeros(top, dtype=torch.bool)
    mask[ids.long()] = True
    return mask.nonzero().squeeze(1).to(ids.dtype)


def first_or_last(ids: torch.Tensor, mode: UpdateMode) -> Tuple[torch.Tensor, torch.Tensor]:
    """Ascending unique ids and, for each, the position of its first (FIRST) or last (LAST)
    occurrence in ``ids``."""
    n = ids.numel()
    top = _dense(ids)
    if top is not None:
        positions = torch.arange(n)
        if mode == UpdateMode.FIRST:
            slot = torch.full((top,), n, dtype=torch.int64)
            slot.scatter_reduce_(0, ids.long(), positions, reduce="amin", include_self=True)
            present = (slot != n).nonzero().squeeze(1)
        else:
            slot = torch.full((top,), -1, dtype=torch.int64)
            slot.scatter_reduce_(0, ids.long(), positions, reduce="amax", include_self=True)
            present = (slot >= 0).nonzero().squeeze(1)
        return present.to(ids.dtype), slot[present]
    sorted_ids, order = torch.sort(ids, stable=True)
    keep = torch.empty(n, dtype=torch.bool)
    if mode == UpdateMode.FIRST:
        keep[0] = True
        torch.ne(sorted_ids[1:], sorted_ids[:-1], out=keep[1:])
    else:  # LAST
        keep[-1] = True
        torch.ne(sorted_ids[:-1], sorted_ids[1:], out=keep[:-1])
    return sorted_ids[keep], order[keep]


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
        return UniqueRows(ids=unique_ids(_cat(ids)), states=None)
    cat_ids = _cat(ids)
    if cat_ids.numel() == 0:
        return UniqueRows(ids=cat_ids.clone(), states=torch.cat(list(states)).clone())
    uniq, picked = first_or_last(cat_ids, mode)
    if uniq.numel() == cat_ids.numel() and len(states) > 1:
        return UniqueRows(ids=uniq, states=scatter_rows(states, picked))
    return UniqueRows(ids=uniq, states=gather_rows(states, picked))


def scatter_rows(parts: Sequence[torch.Tensor], perm: torch.Tensor) -> torch.Tensor:
    """``torch.cat(parts)[perm]`` for a permutation ``perm`` (no id repeats, e.g. records
    the window filter wrote): each row is copied once, straight to its place."""
    dest = torch.empty_like(perm)
    dest[perm] = torch.arange(perm.numel())
    out = torch.empty((perm.numel(), *parts[0].shape[1:]), dtype=parts[0].dtype)
    start = 0
    for p in parts:
        end = start + p.shape[0]
        if end > start:
            out.index_copy_(0, dest[start:end], p)
        start = end
    return out


def gather_rows(parts: Sequence[torch.Tensor], picked: torch.Tensor) -> torch.Tensor:
    """``torch.cat(parts)[picked]`` without concatenating: each picked row is copied twice
    (gathered per part in position order, then scattered to its place), never the rows left
    out (the parts may be views into LMDB's map)."""
    if len(parts) == 1:
        return parts[0].index_select(0, picked)  # (row copies; advanced indexing is several x slower)
    sizes = [p.shape[0] for p in parts]
    order = torch.argsort(picked)
    by_pos = picked.index_select(0, order)
    starts = torch.tensor([0] + sizes, dtype=torch.int64).cumsum_(0)
    bounds = torch.searchsorted(by_pos, starts).tolist()
    offsets = starts.tolist()
    grouped = torch.empty((picked.numel(), *parts[0].shape[1:]), dtype=parts[0].dtype)
    for i, p in enumerate(parts):
        a, b = bounds[i], bounds[i + 1]
        if b > a:
            torch.index_select(p, 0, by_pos[a:b] - offsets[i], out=grouped[a:b])
    out = torch.empty_like(grouped)
    return out.index_copy_(0, order, grouped)
