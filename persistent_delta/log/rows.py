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

TorchRec's ``_compute_unique_rows`` does ``unique(return_inverse)`` + ``scatter_reduce``. Here,
from the cheapest case to the most general one, none of them sorting rows:

* **Ordered runs.** When every record's ids are strictly ascending and the records' id ranges
  do not overlap (one publish, one compacted record, row ranges of different shards), no id
  repeats, so the rule cannot matter: the result is the records concatenated in id-range
  order, each row copied once, straight from the record (for one record, a copy of it).
* **Direct address.** Shard-local ids are usually dense: a table over ``[min_id, max_id]``
  gives the ascending unique ids and each one's first (FIRST) or last (LAST) position in log
  order in linear time (numpy's ``minimum.at``/``maximum.at``). Sparse ids use one stable sort instead, which
  for records of ascending ids (a few publishes) only merges the records' runs.
* **Once per poll.** Column-wise shards hold the same ids on every rank: a poll's
  :class:`IdMemo` reuses the first rank's unique ids and picked positions for every rank whose
  concatenated ids are equal (checked), so only the rows are gathered per rank.
* **Gather.** The winning rows are then gathered from the records (which may be views into
  LMDB's map) into the result with ``index_select``, without a copy of the result's size on
  the way (see :func:`gather_rows`). The rule's answer (:class:`RowPlan`) comes before any row
  is copied, so a reader can copy the rows straight to where they belong (a poll's buffer:
  ``read.fetch.finish_ranks``) instead of into memory of their own first.

The result is ascending by id, which is what ``get_unique`` promises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torchrec.distributed.model_tracker.types import UniqueRows, UpdateMode


def _cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))


# Ids are shard-local row numbers, so they are usually dense: when the id span is within this
# factor of the number of ids, a direct-address table (bitmap, or per-row first/last position
# via scatter_reduce) replaces the sort: linear time instead of a sort. Sparse ids fall back to
# the stable sort.
_DENSE_FACTOR = 16


# Direct-address tables hold int32 positions below this many ids (with the sentinel ``n``).
_INT32_POSITIONS = int(np.iinfo(np.int32).max)


def _dense(ids: torch.Tensor) -> Optional[Tuple[int, int]]:
    """``(min_id, span)`` when a direct-address table over ``[min_id, min_id + span)`` is
    cheap, else None."""
    n = ids.numel()
    if ids.dtype in (torch.uint64, torch.uint32, torch.uint16) or ids.device.type != "cpu":
        return None
    lo, hi = torch.aminmax(ids)
    lowest, span = int(lo), int(hi) - int(lo) + 1
    return (lowest, span) if span <= max(_DENSE_FACTOR * n, 1 << 16) else None


def _slots(ids: torch.Tensor, lowest: int) -> torch.Tensor:
    """``ids - lowest`` as int64 (the direct-address table's index)."""
    ids = ids.long()
    return ids - lowest if lowest else ids


# The bookkeeping on ids (compare, nonzero) runs in numpy over the same memory: at these sizes
# (10^4-10^6 elements, one thread) torch's per-call overhead outweighs the work. Row copies stay
# torch's index_select.
def _flatnonzero(mask: np.ndarray) -> torch.Tensor:
    """Positions of the true elements of a 1-D bool array, ascending, as int64 tensor."""
    return torch.from_numpy(np.flatnonzero(mask).astype(np.int64, copy=False))


def _present(found: torch.Tensor, lowest: int, dtype: torch.dtype) -> torch.Tensor:
    """The ids of direct-address slots ``found`` (ascending), in ``dtype``."""
    return (found + lowest if lowest else found).to(dtype)


def is_ascending(ids: torch.Tensor) -> bool:
    """Whether ``ids`` (1-D) is strictly ascending (so also free of repeats)."""
    if ids.numel() < 2:
        return True
    if ids.device.type != "cpu":
        return bool((ids[1:] > ids[:-1]).all())
    a = ids.numpy()
    return bool((a[1:] > a[:-1]).all())


def _ends(t: torch.Tensor) -> Tuple[int, int]:
    """First and last element of a non-empty 1-D tensor (numpy's scalars are cheaper than
    torch's 0-d tensors here)."""
    if t.device.type == "cpu":
        a = t.numpy()
        return int(a[0]), int(a[-1])
    return int(t[0]), int(t[-1])


def ordered_runs(ids: Sequence[torch.Tensor]) -> Optional[List[int]]:
    """The indices of the non-empty tensors of ``ids`` in ascending id order, when each is
    strictly ascending and their id ranges do not overlap (so no id occurs twice); else None.
    Linear in the ids (one comparison each), no sort of ids."""
    runs: List[Tuple[int, int, int]] = []
    for i, t in enumerate(ids):
        if t.numel():
            first, last = _ends(t)
            if runs and first <= runs[0][1] and runs[0][0] <= last:
                return None  # overlaps the first record: found at the second record of most lookups
            runs.append((first, last, i))
    runs.sort()
    for (_, last, _), (first, _, _) in zip(runs, runs[1:]):
        if first <= last:
            return None  # (end points first: records that overlap never pay the full check)
    if not all(is_ascending(ids[i]) for _, _, i in runs):
        return None
    return [i for _, _, i in runs]


def unique_ids(ids: torch.Tensor) -> torch.Tensor:
    """Ascending unique ids (owning its memory)."""
    if ids.numel() == 0 or is_ascending(ids):
        return ids.clone()
    dense = _dense(ids)
    if dense is None:
        out: torch.Tensor = torch.unique(ids, sorted=True)
        return out
    lowest, span = dense
    # numpy: one thread, calloc'ed (torch.zeros + index_put start an OpenMP team, which competes
    # with training for the cores)
    mask = np.zeros(span, dtype=np.bool_)
    mask[_slots(ids, lowest).numpy()] = True
    return _present(_flatnonzero(mask), lowest, ids.dtype)


# Sparse ids made of at most this many ascending runs (records as the writer and publish store
# them, in log order) are ordered by numpy's stable sort (timsort), which finds the runs and only
# merges them: O(n log runs); anything else goes to torch's sort (timsort loses on shuffled ids).
_FEW_RUNS = 64


def _stable_sort(ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``ids`` sorted ascending, and the stable order (int64 positions) that sorts them."""
    if ids.device.type == "cpu" and ids.numel() > 1:
        a = ids.numpy()
        if np.count_nonzero(a[1:] < a[:-1]) < _FEW_RUNS:
            perm = np.argsort(a, kind="stable").astype(np.int64, copy=False)
            return torch.from_numpy(a[perm]), torch.from_numpy(perm)
    sorted_ids, order = torch.sort(ids, stable=True)
    return sorted_ids, order


def first_or_last(ids: torch.Tensor, mode: UpdateMode) -> Tuple[torch.Tensor, torch.Tensor]:
    """Ascending unique ids and, for each, the position of its first (FIRST) or last (LAST)
    occurrence in ``ids``."""
    n = ids.numel()
    dense = _dense(ids)
    if dense is not None:
        # numpy's unbuffered ufunc.at (numpy >= 1.25): one thread, no OpenMP team, less
        # per-call overhead than torch's scatter_reduce
        lowest, span = dense
        slots = _slots(ids, lowest).numpy()
        # positions as int32 when they (and the sentinel n) fit: the table (span entries,
        # filled and scanned whole) is then half the memory, which is most of this path's time
        pos_dtype = np.int32 if n < _INT32_POSITIONS else np.int64
        positions = np.arange(n, dtype=pos_dtype)
        if mode == UpdateMode.FIRST:
            slot = np.full(span, n, dtype=pos_dtype)
            np.minimum.at(slot, slots, positions)
            found = np.flatnonzero(slot != n)
        else:
            slot = np.full(span, -1, dtype=pos_dtype)
            np.maximum.at(slot, slots, positions)
            found = np.flatnonzero(slot >= 0)
        picked = slot[found].astype(np.int64, copy=False)
        return _present(torch.from_numpy(found), lowest, ids.dtype), torch.from_numpy(picked)
    sorted_ids, order = _stable_sort(ids)
    keep = torch.empty(n, dtype=torch.bool)
    if mode == UpdateMode.FIRST:
        keep[0] = True
        torch.ne(sorted_ids[1:], sorted_ids[:-1], out=keep[1:])
    else:  # LAST
        keep[-1] = True
        torch.ne(sorted_ids[:-1], sorted_ids[1:], out=keep[:-1])
    return sorted_ids[keep], order[keep]


class IdMemo:
    """The id work of one table's records (ascending unique ids, and each one's picked
    position under the FIRST/LAST rule), kept for the next call with equal ids: a poll over
    column-wise shards reads the same ids on every rank (each rank holds a column slice of the
    same rows), so the rule runs once per table and poll, not once per rank. Equality is
    checked (one comparison of the concatenated ids), never assumed. One poll's; not shared
    between threads."""

    def __init__(self) -> None:
        self._kept: Dict[Tuple[object, UpdateMode], Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def first_or_last(self, key: object, ids: torch.Tensor, mode: UpdateMode, owned: bool
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
        """:func:`first_or_last` of ``ids``; ``owned``: ``ids`` is the caller's own memory
        (else a view, maybe into a map whose transaction ends: the memo keeps a copy)."""
        hit = self._kept.get((key, mode))
        if hit is not None and hit[0].dtype == ids.dtype and torch.equal(hit[0], ids):
            return hit[1], hit[2]  # (the same tensors for every rank: a poll's results are read-only)
        uniq, picked = first_or_last(ids, mode)
        if hit is None:  # the first rank's work is kept (row-wise shards: never hit, one kept)
            self._kept[(key, mode)] = (ids if owned else ids.clone(), uniq, picked)
        return uniq, picked


@dataclass
class RowPlan:
    """Unique rows of some records, decided but not yet copied (:func:`plan_unique_rows`).

    ``ids``: the ascending unique ids (owned). The rows are the records' rows ``parts`` (may be
    views into LMDB's map: copy them while its transaction is open), taken whole in the order
    ``runs`` (no id repeats), or at the positions ``picked`` of their concatenation. ``parts``
    None: ids only (``UpdateMode.NONE``). A reader that knows where the rows should land (a
    slice of a poll's buffer) copies them there once with :meth:`gather_into`.
    """

    ids: torch.Tensor
    parts: Optional[List[torch.Tensor]] = None
    runs: Optional[List[int]] = None
    picked: Optional[torch.Tensor] = None

    @property
    def row_shape(self) -> Tuple[int, ...]:
        """The shape of one row (the parts' trailing shape)."""
        assert self.parts is not None
        return tuple(self.parts[0].shape[1:])

    def new_rows(self) -> Optional[torch.Tensor]:
        """The rows in memory of their own (None for ids only)."""
        if self.parts is None:
            return None
        out = torch.empty((self.ids.numel(), *self.row_shape), dtype=self.parts[0].dtype)
        self.gather_into(out)
        return out

    def gather_into(self, out: torch.Tensor) -> None:
        """Copy the rows into ``out``: ``(len(ids), *row_shape)`` of the parts' dtype, each row
        contiguous, rows at any stride (e.g. a column slice of a wider buffer)."""
        assert self.parts is not None
        if self.runs is not None:
            a = 0
            for i in self.runs:
                n = self.parts[i].shape[0]
                out[a:a + n].copy_(self.parts[i])
                a += n
            return
        assert self.picked is not None
        gather_rows(self.parts, self.picked, out)


def plan_unique_rows(
    ids: Sequence[torch.Tensor],
    states: Optional[Sequence[torch.Tensor]],
    mode: UpdateMode,
    memo: Optional[IdMemo] = None,
    key: object = None,
) -> RowPlan:
    """The unique rows of the given records, in ascending id order, as a :class:`RowPlan`
    (the rule applied to the ids; no row copied). Arguments as :func:`compute_unique_rows`."""
    if len(ids) == 0:
        raise ValueError("compute_unique_rows needs at least one record")
    parts = None if mode == UpdateMode.NONE or states is None else list(states)
    runs = ordered_runs(ids)
    if runs is not None and len(runs) > 0:
        # No id repeats: the rule cannot matter; each row is copied once, in id order.
        out_ids = ids[runs[0]].clone() if len(runs) == 1 else torch.cat([ids[i] for i in runs])
        return RowPlan(out_ids, parts, runs=runs)
    if parts is None:
        return RowPlan(unique_ids(_cat(ids)))
    cat_ids = _cat(ids)
    if cat_ids.numel() == 0:
        return RowPlan(cat_ids.clone(), parts, picked=torch.empty(0, dtype=torch.int64))
    uniq, picked = first_or_last(cat_ids, mode) if memo is None else \
        memo.first_or_last(key, cat_ids, mode, owned=cat_ids is not ids[0])
    return RowPlan(uniq, parts, picked=picked)


def compute_unique_rows(
    ids: Sequence[torch.Tensor],
    states: Optional[Sequence[torch.Tensor]],
    mode: UpdateMode,
    memo: Optional[IdMemo] = None,
    key: object = None,
) -> UniqueRows:
    """Unique rows of the given records, in ascending id order.

    Args:
        ids: 1-D id tensors, in log order (at least one).
        states: per-record states (same row counts as ``ids``), or None for ``UpdateMode.NONE``.
        mode: FIRST keeps each id's first state, LAST its last one, NONE ids only.
        memo: reuse the id work of an earlier call under ``key`` whose ids were equal
            (:class:`IdMemo`; the same result either way).
        key: what identifies the ids in ``memo``.

    Returns:
        ``UniqueRows`` owning its memory (never a view of the inputs).
    """
    plan = plan_unique_rows(ids, states, mode, memo, key)
    return UniqueRows(ids=plan.ids, states=plan.new_rows())


# Records holding at most this many bytes together are concatenated (a sequential copy, which
# stays in the CPU's cache at this size) and the picked rows gathered from there: the chunked
# gather below costs more in scattered writes than this extra sequential copy.
_CONCAT_BYTES = 8 << 20
# Larger records: the picked rows pass through a buffer of about this many bytes (it stays in
# the CPU cache) on their way to the result, so that the only allocation of the result's size
# is the result (page-faulting in a second one costs more than the gather itself).
_CHUNK_BYTES = 512 << 10


def row_cells(t: torch.Tensor, row_bytes: int) -> np.ndarray:
    """A tensor's rows (of ``row_bytes`` > 0 bytes, each contiguous, at any stride) as a 1-D
    numpy array of opaque row-sized cells over its memory, whatever the dtype. numpy copies such a cell with one
    ``memcpy``: ``cells[dest] = other_cells`` scatters rows faster than
    ``torch.index_copy_`` (:func:`scatter_rows`, the gather below). The cells share ``t``'s memory, also
    when ``t`` requires grad (through ``detach()``)."""
    if t.shape[0] == 0:
        return np.empty(0, dtype=np.dtype((np.void, row_bytes)))  # (reshape(0, -1) is ambiguous)
    raw = t.detach().reshape(t.shape[0], -1).view(torch.uint8).numpy()
    return raw.view(np.dtype((np.void, row_bytes))).reshape(t.shape[0])


def scatter_rows(target: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """``target[ids] = rows`` in place, for distinct ``ids`` within ``target``'s rows (the caller
    checked them); ``rows`` is ``(len(ids), *target's row shape)``. On the CPU, with one dtype and
    each row of both contiguous (a column slice of a wider table included), the rows are copied
    as numpy row cells (:func:`row_cells`: one ``memcpy`` a row, about twice as fast as
    ``index_copy_``, which goes element by element); otherwise by ``index_copy_``. The one row
    scatter of a replica's apply and of a checkpoint chain's rows."""
    row_bytes = (int(rows.shape[1]) if rows.dim() == 2 else 1) * rows.element_size()
    if (target.device.type == rows.device.type == ids.device.type == "cpu" and target.dtype == rows.dtype
            and tuple(rows.shape) == (len(ids), *target.shape[1:]) and row_bytes > 0
            and ((target.dim() == 2 and target.stride(1) == 1 and rows.stride(1) == 1)
                 or (target.dim() == 1 and target.is_contiguous() and rows.is_contiguous()))):
        row_cells(target, row_bytes)[ids.numpy()] = row_cells(rows, row_bytes)
    else:
        target.index_copy_(0, ids.to(target.device, torch.long), rows.to(target.device))


def _take(src: torch.Tensor, picked: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    """``src[picked]`` (rows), into ``out`` when given (any row stride: ``index_select`` writes
    a column slice in place, cheaper than a contiguous gather and a copy or numpy's row
    cells)."""
    if out is None:
        return src.index_select(0, picked)  # (row copies; cheaper than advanced indexing)
    return torch.index_select(src, 0, picked, out=out)


def gather_rows(parts: Sequence[torch.Tensor], picked: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``torch.cat(parts)[picked]`` for distinct positions ``picked`` (the parts may be views
    into LMDB's map), into ``out`` when given: ``(len(picked), *row shape)``, each row
    contiguous, rows at any stride (a column slice of a wider buffer); returns the result.

    One part: one ``index_select``. Several parts holding at most ``_CONCAT_BYTES`` together:
    concatenated (a sequential copy that stays in the CPU cache), then one ``index_select``.
    Larger: per part, its picked rows in position order are gathered into a cache-sized buffer
    and copied from there to their places in the result (a part picked whole is copied there
    directly), so each picked row is read from its part once, never the rows left out, and the
    only allocation of the result's size is the result. A bitmap over the positions orders
    them, not a sort."""
    if len(parts) == 1:
        return _take(parts[0], picked, out)
    if sum(p.nbytes for p in parts) <= _CONCAT_BYTES:
        return _take(torch.cat(list(parts)), picked, out)
    sizes = [p.shape[0] for p in parts]
    total, m = sum(sizes), picked.numel()
    where = picked.numpy()
    chosen = np.zeros(total, dtype=np.bool_)
    chosen[where] = True
    by_pos = np.flatnonzero(chosen).astype(np.int64, copy=False)  # the picked positions, ascending
    dest_of = np.empty(total, dtype=np.int64)
    dest_of[where] = np.arange(m)
    dest = dest_of[by_pos]  # where each of them goes in the result
    starts = np.cumsum([0] + sizes)
    bounds = np.searchsorted(by_pos, starts).tolist()
    tail = parts[0].shape[1:]
    if out is None:
        out = torch.empty((m, *tail), dtype=parts[0].dtype)
    row_bytes = out[:1].nbytes
    if row_bytes == 0:
        return out  # no rows, or rows of no bytes: nothing to copy
    chunk = max(1, _CHUNK_BYTES // row_bytes)
    buf = torch.empty((min(chunk, m), *tail), dtype=out.dtype)
    out_cells, buf_cells = row_cells(out, row_bytes), row_cells(buf, row_bytes)
    for i, p in enumerate(parts):
        a, b = bounds[i], bounds[i + 1]
        if a == b:
            continue  # nothing picked from this part (an empty record among them, say)
        if b - a == sizes[i]:
            # every row of the part is picked (records of a filtered window hold each id once):
            # in part order, straight to their places
            out_cells[dest[a:b]] = row_cells(p, row_bytes)
            continue
        rows = torch.from_numpy(by_pos[a:b] - starts[i])
        for c in range(0, b - a, chunk):
            k = min(chunk, b - a - c)
            torch.index_select(p, 0, rows[c:c + k], out=buf[:k])
            out_cells[dest[a + c:a + c + k]] = buf_cells[:k]
    return out
