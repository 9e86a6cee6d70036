"""Managed-collision (ZCH) side records: what they hold and reading them.

Owns: the meaning of the side records of a managed-collision table (record kinds 2 and 3, stored
under the table's side id: :func:`persistent_delta.log.codec.side_table_id`) and the rule that turns
them into a raw id -> slot map.

A managed-collision table (TorchRec's ``ManagedCollisionEmbeddingCollection`` /
``...BagCollection``) maps *raw* feature ids into a fixed number of *slots*: the table's rows.
The lookups channel holds slot ids as for any table; the side records say which raw ids stand
behind them:

* **raw ids** (``KIND_RAW_IDS``, one per lookup of a batch): ``ids`` are the slot ids looked up
  (shard-local, as the lookups records), states int64 ``[n, 2]`` = (raw id, admitted). A raw id
  that the module has not admitted is looked up in one shared default slot; it is recorded with
  ``admitted = 0`` and never enters a map.
* **slot reassignments** (``KIND_SLOTS``, when the module admits or evicts): ``ids`` are the
  slots whose raw id changed, states int64 ``[n, 2]`` = (raw id taken from the slot, raw id
  given it), :data:`~persistent_delta.log.codec.NO_RAW_ID` for none. An *eviction* is a taken raw
  id that holds no slot afterwards. The trainer also writes one in the first batch after every attach
  and every checkpoint (a *base*: every slot of the shard with its current raw id as both taken
  and given -- no slot changes; bases written before 0.3 have ``NO_RAW_ID`` as taken) and at a
  restore (the checkpoint's raw id for every slot reassigned after the checkpoint).

A publish carries the slot reassignments of the lookups channel since its consumer last read as
one ``KIND_SLOTS`` side record of the snapshots channel (stamped with the publish), and the rows
of every slot whose raw id changed (TorchRec re-initialises them): a replica that reads only the
snapshots channel follows the map and the rows (:func:`slot_moves`).

Applying every reassignment in batch order, from the log start, gives exactly the trainer's
(admitted raw id -> slot) map: a replica's :class:`~persistent_delta.serve.raw_id_map.RawIdMap`
does that. Local reads (:func:`read_side`)
and remote ones (the records a shipper shipped: :func:`shipped_side`, read back by
:mod:`persistent_delta.fleet.remote`) turn records into a :class:`ZchDelta` by one rule,
:func:`side_delta`. Ranges are half-open
``[start_idx, end_idx)``; slot ids in results are global row ids (shard-local + ``row_offset``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from persistent_delta.log import codec
from persistent_delta.errors import CorruptRecordError, InvalidInputError
from persistent_delta.log.deltalog import ReadTxn
from persistent_delta.log.schema import LOOKUPS, TableEntry

RAW, ADMITTED = 0, 1  # columns of a KIND_RAW_IDS record's states
TAKEN, GIVEN = 0, 1  # columns of a KIND_SLOTS record's states
NO_RAW_ID = codec.NO_RAW_ID
ZCH_META = "managed_collision"  # key of a table's shard metadata naming its managed-collision module


def raw_ids_states(raw: torch.Tensor, admitted: torch.Tensor) -> torch.Tensor:
    """The states of a ``KIND_RAW_IDS`` record: int64 ``[n, 2]`` (raw id, admitted 0/1)."""
    return torch.stack([raw.reshape(-1).to(torch.int64), admitted.reshape(-1).to(torch.int64)], dim=1)


def slots_states(taken: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """The states of a ``KIND_SLOTS`` record: int64 ``[n, 2]`` (taken, given)."""
    return torch.stack([taken.reshape(-1).to(torch.int64), given.reshape(-1).to(torch.int64)], dim=1)


def is_managed(entry: TableEntry) -> bool:
    """Whether the tracker recorded the table as a managed-collision table."""
    shard = entry.meta.get("shard")
    return isinstance(shard, dict) and bool(shard.get(ZCH_META))


def _empty() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


@dataclass
class ZchDelta:
    """A managed-collision table's raw-id side over ``[start_idx, end_idx)`` (one rank, or
    merged over ranks).

    Attributes:
        raw_ids: ascending unique admitted raw ids looked up in the range.
        slot_ids: the global slot each of them was looked up in (the last lookup in range).
        unadmitted_raw_ids: ascending unique raw ids looked up without being admitted (they
            shared the default slot; no map holds them).
        slots, taken, given: every slot reassignment in the range, in the order it happened
            (global slot, raw id taken from it, raw id given it; ``NO_RAW_ID`` for none).
        evicted_raw_ids: ascending raw ids taken from a slot in the range that hold no slot at
            its end (as far as the range tells).
        states: rows of the poll's states aligned with ``raw_ids`` (filled by
            :meth:`DeltaPoll.zch`; None when the channel keeps ids only or a slot's row is
            not in the poll).
    """

    fqn: str
    start_idx: int
    end_idx: int
    raw_ids: torch.Tensor = field(default_factory=_empty)
    slot_ids: torch.Tensor = field(default_factory=_empty)
    unadmitted_raw_ids: torch.Tensor = field(default_factory=_empty)
    slots: torch.Tensor = field(default_factory=_empty)
    taken: torch.Tensor = field(default_factory=_empty)
    given: torch.Tensor = field(default_factory=_empty)
    evicted_raw_ids: torch.Tensor = field(default_factory=_empty)
    states: Optional[torch.Tensor] = None
    ranks: List[int] = field(default_factory=list)


def last_per_key(keys: torch.Tensor, values: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Ascending unique ``keys`` and, for each, the value of its last occurrence."""
    if keys.numel() == 0:
        return _empty(), _empty()
    uniq, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    pos = torch.arange(keys.numel(), dtype=torch.int64)
    last = torch.full((uniq.numel(),), -1, dtype=torch.int64).scatter_reduce(0, inverse, pos, "amax")
    return uniq, values.index_select(0, last)


def _evicted(taken: torch.Tensor, given: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Raw ids taken from a slot that hold no slot after the reassignments (in order)."""
    out = taken[taken != NO_RAW_ID]
    if out.numel() == 0:
        return _empty()
    _, final = last_per_key(slots, given)
    out = torch.unique(out)
    kept: torch.Tensor = out[~torch.isin(out, final)]
    return kept


def _check(rec_states: Optional[torch.Tensor], n: int, where: str) -> torch.Tensor:
    if rec_states is None or rec_states.dtype != torch.int64 or tuple(rec_states.shape) != (n, 2):
        raise CorruptRecordError(f"{where}: a managed-collision side record without int64 [n, 2] states")
    return rec_states


def iter_side(
    r: ReadTxn, entry: TableEntry, start_idx: int, end_idx: Optional[int], channel: str = LOOKUPS
) -> Iterable[Tuple[int, int, torch.Tensor, torch.Tensor]]:
    """``(batch_idx, kind, slot ids (int64, shard-local), states [n, 2])`` of a table's side
    records in ``[start_idx, end_idx)`` of ``channel``, in append order (copies: safe after the
    transaction). The snapshots channel holds the slot reassignments each publish carried."""
    for rec in r.iter_records(codec.side_table_id(entry.table_id), start_idx, end_idx, channel=channel):
        if rec.kind not in codec.SIDE_KINDS:
            raise CorruptRecordError(f"{r.path}: record kind {rec.kind} under the side id of {entry.fqn!r}")
        states = _check(rec.states, int(rec.ids.numel()), f"{r.path} {entry.fqn!r} batch {rec.batch_idx}")
        yield rec.batch_idx, rec.kind, rec.ids.to(torch.int64).clone(), states.clone()


SideRecord = Tuple[int, torch.Tensor, torch.Tensor]  # (kind, shard-local slot ids int64, states int64 [n, 2])


def side_delta(
    fqn: str, start_idx: int, end_idx: int, records: Iterable[SideRecord], row_offset: int = 0, where: str = ""
) -> ZchDelta:
    """The rule: one rank's :class:`ZchDelta` of a table over ``[start_idx, end_idx)`` from its
    side records in append order (from the log: :func:`read_side`; from the stream: the
    records :func:`shipped_side` gave the shipper, concatenated over the shipped ranges).

    Raises:
        CorruptRecordError: a record of another kind, or without int64 ``[n, 2]`` states.
    """
    looked_slots: List[torch.Tensor] = []
    looked: List[torch.Tensor] = []
    slots: List[torch.Tensor] = []
    moves: List[torch.Tensor] = []
    for kind, ids, states in records:
        if kind not in codec.SIDE_KINDS:
            raise CorruptRecordError(f"{where or fqn}: record kind {kind} is not a managed-collision side record")
        _check(states, int(ids.numel()), f"{where or fqn}")
        if kind == codec.KIND_RAW_IDS:
            looked_slots.append(ids.to(torch.int64))
            looked.append(states)
        else:
            slots.append(ids.to(torch.int64))
            moves.append(states)
    out = ZchDelta(fqn, start_idx, end_idx, ranks=[])
    if looked:
        st, ls = torch.cat(looked), torch.cat(looked_slots) + row_offset
        admitted = st[:, ADMITTED] != 0
        out.raw_ids, out.slot_ids = last_per_key(st[admitted, RAW], ls[admitted])
        out.unadmitted_raw_ids = torch.unique(st[~admitted, RAW])
        out.unadmitted_raw_ids = out.unadmitted_raw_ids[~torch.isin(out.unadmitted_raw_ids, out.raw_ids)]
    if moves:
        mv = torch.cat(moves)
        out.slots, out.taken, out.given = torch.cat(slots) + row_offset, mv[:, TAKEN].clone(), mv[:, GIVEN].clone()
        out.evicted_raw_ids = _evicted(out.taken, out.given, out.slots)
    return out


def read_side(r: ReadTxn, entry: TableEntry, start_idx: int, end_idx: int, row_offset: int = 0,
              channel: str = LOOKUPS) -> Optional[ZchDelta]:
    """One rank's :class:`ZchDelta` of a table over ``[start_idx, end_idx)`` of ``channel``, or
    None for a table that is not a managed-collision one."""
    if not is_managed(entry):
        return None
    sides = iter_side(r, entry, start_idx, end_idx, channel)
    return side_delta(entry.fqn, start_idx, end_idx, ((k, ids, st) for _, k, ids, st in sides), row_offset,
                      f"{r.path} {entry.fqn!r}")


def slot_moves(
    r: ReadTxn, start_idx: int, end_idx: int, extra: Sequence[Tuple[int, str, int, torch.Tensor, torch.Tensor]] = (),
) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """What a publish carries of the managed-collision tables: per table fqn, every slot
    reassignment of the lookups channel in ``[start_idx, end_idx)`` in order (shard-local slots
    int64, states int64 ``[n, 2]`` = (taken, given)), then those of ``extra`` (``(batch_idx,
    fqn, kind, slots, states)`` of records not committed yet, in order; other kinds and batches
    below ``start_idx`` are passed over). Tables without any are absent."""
    parts: Dict[str, List[Tuple[torch.Tensor, torch.Tensor]]] = {}
    if end_idx > start_idx:
        for fqn, entry in r.tables().items():
            if not is_managed(entry):
                continue
            side_id = codec.side_table_id(entry.table_id)
            for b, seq, value in r.iter_record_views(side_id, start_idx, end_idx):
                if codec.record_header(value).get("k") != codec.KIND_SLOTS:
                    continue  # a lookup's raw ids (most side records): header only
                rec = codec.decode_record(value, key=codec.record_key(side_id, b, seq))
                states = _check(rec.states, int(rec.ids.numel()), f"{r.path} {fqn!r} batch {b}")
                if rec.ids.numel():
                    parts.setdefault(fqn, []).append((rec.ids.to(torch.int64).clone(), states.clone()))
    for b, fqn, kind, ids, states in extra:
        if kind == codec.KIND_SLOTS and b >= start_idx and ids.numel():
            parts.setdefault(fqn, []).append((ids.to(torch.int64), _check(states, int(ids.numel()), fqn)))
    return {fqn: (torch.cat([i for i, _ in p]), torch.cat([s for _, s in p])) for fqn, p in parts.items()}


def reinitialised(states: torch.Tensor) -> torch.Tensor:
    """Of slot reassignments' states, those whose slot changed raw id: TorchRec re-initialised
    its row (an eviction, or an admission into an empty slot), whether or not a batch looked it
    up. A base's rows (taken = given) are not."""
    out: torch.Tensor = states[:, TAKEN] != states[:, GIVEN]
    return out


def reduce_raw_ids(ids: torch.Tensor, states: torch.Tensor) -> SideRecord:
    """Raw-id records (concatenated: slot ids, states ``[n, 2]``) reduced to one that
    :func:`side_delta` reads the same: each admitted raw id once with the last slot it was
    looked up in, then each raw id never admitted in them once (with its last slot)."""
    admitted = states[:, ADMITTED] != 0
    a_raw, a_slot = last_per_key(states[admitted, RAW], ids[admitted].to(torch.int64))
    u_raw, u_slot = last_per_key(states[~admitted, RAW], ids[~admitted].to(torch.int64))
    keep = ~torch.isin(u_raw, a_raw)
    flags = torch.cat([torch.ones(a_raw.numel(), dtype=torch.int64), torch.zeros(int(keep.sum()), dtype=torch.int64)])
    return codec.KIND_RAW_IDS, torch.cat([a_slot, u_slot[keep]]), raw_ids_states(torch.cat([a_raw, u_raw[keep]]), flags)


def shipped_side(r: ReadTxn, entry: TableEntry, start_idx: int, end_idx: int, channel: str = LOOKUPS) -> List[SideRecord]:
    """A table's side records over ``[start_idx, end_idx)`` as at most two records, as the
    shipper ships them: the raw-id records concatenated and reduced (each admitted raw id once,
    with the last slot it was looked up in; each raw id never admitted in the range once), and
    the slot reassignments concatenated in order. :func:`side_delta` gives the same
    :class:`ZchDelta` of them as of the log's records, also when several consecutive ranges'
    records are concatenated (the last slot of a raw id is in the last range that looked it up;
    an id unadmitted in one range and admitted in another is dropped from the unadmitted ids
    either way). Empty for a table that is not a managed-collision one. On the snapshots channel:
    the slot reassignments the publishes carried."""
    if not is_managed(entry):
        return []
    raw_slots: List[torch.Tensor] = []
    raw: List[torch.Tensor] = []
    slots: List[torch.Tensor] = []
    moves: List[torch.Tensor] = []
    for _, kind, ids, states in iter_side(r, entry, start_idx, end_idx, channel):
        (raw_slots if kind == codec.KIND_RAW_IDS else slots).append(ids)
        (raw if kind == codec.KIND_RAW_IDS else moves).append(states)
    out: List[SideRecord] = []
    if raw:
        out.append(reduce_raw_ids(torch.cat(raw_slots), torch.cat(raw)))
    if moves:
        out.append((codec.KIND_SLOTS, torch.cat(slots), torch.cat(moves)))
    return out


def merge_side(fqn: str, parts: List[Tuple[int, ZchDelta]]) -> ZchDelta:
    """One table's :class:`ZchDelta` over ranks (``(rank, delta)`` pairs). Ranks hold disjoint
    slots, so reassignments are concatenated in rank order (their order within a rank kept)."""
    if not parts:
        raise InvalidInputError(f"{fqn}: nothing to merge")
    if len(parts) == 1:
        rank, d = parts[0]
        d.ranks = [rank]
        return d
    cat = lambda name: torch.cat([getattr(d, name) for _, d in parts])  # noqa: E731
    raw, slot = cat("raw_ids"), cat("slot_ids")
    order = torch.argsort(raw, stable=True)
    una = torch.unique(cat("unadmitted_raw_ids"))
    out = ZchDelta(fqn, min(d.start_idx for _, d in parts), max(d.end_idx for _, d in parts),
                   raw_ids=raw[order], slot_ids=slot[order], unadmitted_raw_ids=una[~torch.isin(una, raw)],
                   slots=cat("slots"), taken=cat("taken"), given=cat("given"),
                   ranks=sorted(rank for rank, _ in parts))
    out.evicted_raw_ids = _evicted(out.taken, out.given, out.slots)
    return out


def raw_lookups(
    r: ReadTxn, entry: TableEntry, start_idx: int, end_idx: int
) -> List[Tuple[int, torch.Tensor, torch.Tensor]]:
    """``(batch_idx, shard-local slot ids, raw ids [n, 1])`` of every raw-id record of a table
    in ``[start_idx, end_idx)``, in append order (TorchRec's ``RawIdTracker`` shape)."""
    out = []
    for b, kind, ids, states in iter_side(r, entry, start_idx, end_idx):
        if kind == codec.KIND_RAW_IDS:
            out.append((b, ids, states[:, RAW:RAW + 1].contiguous()))
    return out
