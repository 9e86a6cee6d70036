"""Caps on a publish: which of the due rows one ``publish()`` carries, and which it defers.

Owns: the check of ``max_rows``/``max_bytes``/``order`` and the choice of rows. A publish's
*due* rows are the rows earlier capped publishes of the consumer deferred (stored,
:mod:`persistent_delta.log.deferred`) and the rows changed since the consumer last read. A capped
publish carries a prefix of them in due order and defers the rest, durably, to the next
publish of that consumer: nothing is lost, and since every publish gathers the values of its
own call and is stamped later than the one before, a deferred row is carried with its value at
that later publish (a row changed again while deferred is carried once, with its newest value).

Order (``order="oldest"``, the only one): deferred rows first -- table by table (fqn order),
each table's in the order they were deferred -- then the newly changed rows, table by table,
ids ascending. The prefix stops at the first row that does not fit: no row overtakes an older
one, so a row deferred with ``D`` rows due before it is carried within ``ceil(D / max_rows)``
publishes. Most-changed first is not offered: a measure of change needs each row's value at
its last publish, which the trainer does not keep (a second copy of every published row), and
the tracked states of deferred rows are gone once their lookups records are deleted.

Caps count per rank (each rank publishes its own shards). ``max_bytes`` counts the row bytes of
the publish's native records -- ids (8 bytes) plus the row values in the table's dtype, headers
aside -- so it also bounds the gather on the training thread, which reads only the rows carried.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from persistent_delta.errors import InvalidInputError
from persistent_delta.log.deferred import Deferred
from persistent_delta.trainer.sharding import LocalTable

ORDERS = ("oldest",)
ID_BYTES = 8  # an int64 id of a snapshot record

__all__ = ["ORDERS", "PublishCap", "check_cap", "select"]


@dataclass(frozen=True)
class PublishCap:
    """What one publish may carry (None: no bound of that kind).

    Attributes:
        max_rows: rows over all tables of this rank.
        max_bytes: ids plus row values over all tables of this rank (see the module docs).
        order: the due order (``"oldest"``).
    """

    max_rows: Optional[int] = None
    max_bytes: Optional[int] = None
    order: str = "oldest"


def _positive(name: str, value: object) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"{name} must be a positive int or None, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise InvalidInputError(f"{name} must be a positive int or None, got {value}")
    return value


def row_bytes(table: LocalTable) -> int:
    """Bytes one row of ``table`` counts against ``max_bytes`` (its id and its values)."""
    w = table.weights()
    return ID_BYTES + int(w.shape[1]) * w.element_size()


def check_cap(max_rows: object, max_bytes: object, order: object,
              tables: Mapping[str, LocalTable]) -> Optional[PublishCap]:
    """The cap of a ``publish()`` call; None when it has none.

    Raises:
        InvalidInputError: ``max_rows``/``max_bytes`` not a positive int (or None), an unknown
            ``order``, or a ``max_bytes`` below one row of some table (that row could never be
            carried).
    """
    rows, nbytes = _positive("max_rows", max_rows), _positive("max_bytes", max_bytes)
    if order not in ORDERS:
        raise InvalidInputError(
            f"order must be one of {ORDERS}, got {order!r} (most-changed first is not offered: see "
            "persistent_delta.trainer.caps)")
    if nbytes is not None:
        for fqn, t in sorted(tables.items()):
            if row_bytes(t) > nbytes:
                raise InvalidInputError(
                    f"max_bytes={nbytes} is smaller than one row of table {fqn!r} ({row_bytes(t)} bytes with its id): "
                    "such a row could never be published")
    if rows is None and nbytes is None:
        return None
    return PublishCap(rows, nbytes, str(order))


def _fresh(unread: torch.Tensor, deferred: torch.Tensor) -> torch.Tensor:
    """The unread ids that are not deferred already (a row changed again while deferred keeps
    its place)."""
    if deferred.numel() == 0 or unread.numel() == 0:
        return unread
    return unread[~torch.isin(unread, deferred)]


def select(
    due: Deferred,
    unread: Mapping[str, torch.Tensor],
    tables: Mapping[str, LocalTable],
    cap: Optional[PublishCap],
) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """Split the due rows into those this publish carries and those it defers.

    Args:
        due: the consumer's stored deferred rows.
        unread: fqn -> ids changed since the consumer last read (ascending, unique).
        tables: this rank's tables (rows of other tables are left out, as an uncapped
            publish does).
        cap: the publish's cap (None: carry everything due).

    Returns:
        (carried, deferred): fqn -> ids ascending (tables with none absent); fqn -> ids in
        due order (tables with none absent).
    """
    fqns = sorted(f for f in set(due.ids) | set(unread) if f in tables)
    empty = torch.empty(0, dtype=torch.int64)
    old = {f: due.ids.get(f, empty).to(torch.int64) for f in fqns}
    new = {f: _fresh(unread.get(f, empty).to(torch.int64), old[f]) for f in fqns}
    # the due order: every table's deferred rows, then every table's new rows
    segments: List[Tuple[str, torch.Tensor]] = [(f, old[f]) for f in fqns] + [(f, new[f]) for f in fqns]
    rows_left = None if cap is None else cap.max_rows
    bytes_left = None if cap is None else cap.max_bytes
    taken: Dict[str, List[torch.Tensor]] = {}
    left: Dict[str, List[torch.Tensor]] = {}
    full = False
    for fqn, ids in segments:
        n = int(ids.numel())
        if n == 0:
            continue
        k = 0 if full else n
        if not full and rows_left is not None:
            k = min(k, rows_left)
        if not full and bytes_left is not None:
            k = min(k, bytes_left // row_bytes(tables[fqn]))
        if k:
            taken.setdefault(fqn, []).append(ids[:k])
            if rows_left is not None:
                rows_left -= k
            if bytes_left is not None:
                bytes_left -= k * row_bytes(tables[fqn])
        if k < n:
            full = True  # later rows wait: none overtakes an older one
            left.setdefault(fqn, []).append(ids[k:])
    carried = {f: torch.cat(p).sort().values if len(p) > 1 else p[0].sort().values for f, p in taken.items()}
    deferred = {f: torch.cat(p) if len(p) > 1 else p[0] for f, p in left.items()}
    return carried, deferred
