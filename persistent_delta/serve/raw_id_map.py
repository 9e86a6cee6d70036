"""A replica's raw-id map of managed-collision tables, built from polls or replay outputs.

Owns: :class:`RawIdMap`, the (admitted raw id -> global slot) map a replica keeps by applying
slot reassignments in order. The side records it applies, and the rule that turns them into a
:class:`~persistent_delta.log.zch_records.ZchDelta`, are :mod:`persistent_delta.log.zch_records`';
the maps inside a quantized managed-collision model are :mod:`persistent_delta.serve.mch_maps`'.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from persistent_delta.log.zch_records import NO_RAW_ID, ZchDelta, last_per_key


def _empty() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


class RawIdMap:
    """A replica's (admitted raw id -> global slot) map of managed-collision tables, built by
    applying slot reassignments in order (:meth:`apply`). Memory: one int64 per slot of each
    table (``global_rows``, the table's size)."""

    def __init__(self) -> None:
        self._slot_raw: Dict[str, torch.Tensor] = {}

    def _table(self, fqn: str, need: int) -> torch.Tensor:
        cur = self._slot_raw.get(fqn)
        if cur is None or cur.numel() < need:
            grown = torch.full((max(need, 2 * (0 if cur is None else cur.numel())),), NO_RAW_ID, dtype=torch.int64)
            if cur is not None:
                grown[: cur.numel()] = cur
            self._slot_raw[fqn] = cur = grown
        return cur

    def apply(self, delta: ZchDelta) -> int:
        """Apply a range's reassignments (their order kept; the last one of a slot wins).
        Returns the number applied. Apply ranges in order, without gaps
        (:mod:`persistent_delta.serve.ordered` checks that for replay outputs)."""
        if delta.slots.numel() == 0:
            return 0
        slots, given = last_per_key(delta.slots, delta.given)
        table = self._table(delta.fqn, int(slots.max()) + 1)
        table[slots] = given
        return int(delta.slots.numel())

    def tables(self) -> List[str]:
        return sorted(self._slot_raw)

    def map(self, fqn: str) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(raw_ids ascending, global slots)`` of a table's admitted raw ids."""
        table = self._slot_raw.get(fqn)
        if table is None:
            return _empty(), _empty()
        slots = (table != NO_RAW_ID).nonzero().squeeze(1)
        raw = table.index_select(0, slots)
        order = torch.argsort(raw)
        return raw[order], slots[order]

    def as_dict(self, fqn: str) -> Dict[int, int]:
        """raw id -> global slot (small tables, tests and examples)."""
        raw, slots = self.map(fqn)
        return dict(zip(raw.tolist(), slots.tolist()))


__all__ = ["RawIdMap"]
