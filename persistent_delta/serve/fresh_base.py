"""A replica's base from the trainer's checkpoints, and the replica loop that needs no bookkeeping.

Owns: :func:`load_checkpoint_base` (the full tables of the newest complete base with its
increments' rows applied in order, as a :class:`~persistent_delta.read.base.BaseTables` that
knows, per rank, the log position it continues from) and :class:`Follower` (start, restart
and fall-behind recovery of a float-tables replica in one loop).

Design note. The base's DCP files are read offline (no process group): only the tables'
weights (``model.<fqn>.weight``), each assembled whole by DCP from its ranks' chunks, never the
optimizer states. Each increment part holds, per rank, the shard-local ids of the rows changed
since the previous one and their weights: written at ``row_offset + id``, columns
``[col_offset, col_offset + cols)``, in chain order (a later increment's row wins). A
data-parallel table is carried whole with the dense parameters.

Its position: a base or an increment is taken at a step boundary, with the rank's tracker at
batch ``b`` (its state's ``curr_batch_idx``) and every update of that batch done. A publish
stamped ``b`` or earlier holds values no newer than it (publishes come after the step's
backward), so the tables continue from ``b + 1``: a snapshots read from there misses nothing
they lack, and :class:`~persistent_delta.read.base.Continuation` checks every poll against it
(and against the log identities the base recorded: another job's log, or one started afresh,
is refused). A rank that published several times in one batch with ``flush()`` between takes
stamps past its batch; a read from ``b + 1`` then applies those publishes again (at-least-once,
same values).

A replica restarting, or added late, positions its consumer at the tables' position
(``seek``): behind it would apply older publishes again, past it would miss some. When the
log no longer holds that position (``delete_on_read`` freed it, or the consumer was expired),
no read can continue these tables: the :class:`Follower` waits for the trainer's next
increment (every ``every`` steps) and starts from it.
"""

from __future__ import annotations

import io
import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from persistent_delta.checkpoint import chain as chains
from persistent_delta.checkpoint.format import TRACKER_STATE_KEY, read_part, row_ids
from persistent_delta.errors import IncompleteBaseError, OffsetOutOfRangeError, StaleBaseError
from persistent_delta.log.schema import LogIdentity
from persistent_delta.read.base import BaseTables
from persistent_delta.read.consumer import DeltaConsumer
from persistent_delta.read.results import DeltaPoll
from persistent_delta.serve.apply import Applied, apply_poll

logger = logging.getLogger(__name__)



def _weight_key(keys: List[str], fqn: str, base: str) -> str:
    """The DCP key of table ``fqn``'s weights (``model.<fqn>.weight``)."""
    want = f"model.{fqn}.weight"
    if want in keys:
        return want
    found = [k for k in keys if k.startswith("model.") and k.endswith(f".{fqn}.weight")]
    if len(found) != 1:
        raise IncompleteBaseError(f"{base}: no single DCP entry holds table {fqn}'s weights ({want}; found {found})")
    return found[0]


def _load_offline(target: Dict[str, Any], path: str) -> None:
    """``dcp.load`` of ``target`` from the base in ``path`` in this one process (no process
    group), without DCP's warning that it assumes a single process: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(target, storage_reader=FileSystemReader(path), no_dist=True)


def _base_batches(base: str, keys: Dict[str, Any], ranks: int) -> Dict[int, int]:
    """rank -> the tracker's batch when the base was taken (its stored tracker state)."""
    target: Dict[str, Any] = {}
    names: Dict[str, int] = {}
    for rank in range(ranks):
        name = f"{TRACKER_STATE_KEY}.rank_{rank}"
        found = [k for k, v in keys.items() if isinstance(v, BytesStorageMetadata) and k.endswith("." + name)]
        if len(found) != 1:
            raise IncompleteBaseError(f"{base}: {found} hold rank {rank}'s tracker state ({name}), not one entry")
        target[found[0]], names[found[0]] = io.BytesIO(), rank
    _load_offline(target, base)
    out: Dict[int, int] = {}
    for key, rank in names.items():
        state = getattr(target[key], "state", target[key])
        out[rank] = int(state["curr_batch_idx"])
    return out


def load_checkpoint_base(root: str) -> BaseTables:
    """A replica's starting tables from the trainer's checkpoints: every table whole, in global
    row ids, from the newest complete base under ``root`` (its DCP files, read offline; the
    weights only) with its complete increments' rows applied in order (see the module note).
    Any thread of any process may call it, while the trainer writes more increments.

    Returns:
        fqn -> the full table ``(global_rows, global_cols)``: a
        :class:`~persistent_delta.read.base.BaseTables` whose ``batches`` say, per rank, the
        tracker's batch at the chain's last increment (or the base), ``positions`` where a poll
        applied onto it must start at the latest (that batch + 1), and ``logs`` the ranks' log
        identities the base recorded (a poll of another log is refused).

    Raises:
        IncompleteBaseError: no complete base under ``root`` (take one with
            ``Checkpoints.save_base``), or it holds no weights of a table it records.
        IncrementChainError: its increments are not one chain, or a part is damaged.
        FormatMismatchError: written with another format version.
    """
    chain = chains.latest_chain(root)
    info = chain.info
    metadata = FileSystemReader(chain.base).read_metadata()
    keys = dict(metadata.state_dict_metadata)
    placed: Dict[str, List[int]] = {}  # fqn -> a rank's [row_offset, col_offset, rows, cols]
    for r in info.ranks:
        for fqn, lay in r.layout.items():
            placed.setdefault(fqn, lay)
    target: Dict[str, torch.Tensor] = {}
    key_of: Dict[str, str] = {}
    for fqn in sorted(placed):
        key = _weight_key(list(keys), fqn, chain.base)
        md = keys[key]
        assert isinstance(md, TensorStorageMetadata)
        target[key], key_of[fqn] = torch.empty(tuple(md.size), dtype=md.properties.dtype), key
    _load_offline(target, chain.base)
    tables = {fqn: target[key] for fqn, key in key_of.items()}
    batches = _base_batches(chain.base, keys, info.world_size)
    with torch.no_grad():
        for inc in chain.increments:
            for rank in range(info.world_size):
                part = read_part(inc.path, inc.headers[rank])
                _apply_part(tables, info.ranks[rank].layout, part)
                batches[rank] = int(part["tracker"]["curr_batch_idx"])
    where = f"{len(chain.increments)} increments" if chain.increments else "no increment"
    return BaseTables(tables, positions={r: b + 1 for r, b in batches.items()}, batches=batches,
                      logs={r.rank: LogIdentity(r.log_id, r.log_stamp) for r in info.ranks},
                      source=f"the checkpoint base {chain.base!r} with {where} (step {chain.step})")


def _apply_part(tables: Dict[str, torch.Tensor], layout: Dict[str, List[int]], part: Dict[str, Any]) -> None:
    """Write one rank's part into the full tables: its rows at their global ids, its
    data-parallel tables whole."""
    for fqn, rows in part["rows"].items():
        row_off, col_off, local_rows, cols = layout[fqn]
        ids = row_ids(rows["ids"], local_rows, fqn) + row_off
        table = tables[fqn]
        if col_off == 0 and cols == table.shape[1]:
            table.index_copy_(0, ids, rows["weights"])
        else:
            table[:, col_off:col_off + cols].index_copy_(0, ids, rows["weights"])
    for fqn, table in tables.items():
        whole = part["dense"].get(f"{fqn}.weight")
        if whole is not None and fqn not in part["rows"] and tuple(whole.shape) == tuple(table.shape):
            table.copy_(whole)  # a data-parallel table: carried whole


@dataclass
class _Loaded:
    """What a :class:`Follower` loaded: the chain's base and how many increments."""

    base: str
    increments: int


class Follower:
    """A replica's float tables kept equal to the trainer's, from its checkpoints and its
    publishes, with no bookkeeping by the user: built, it loads the newest base and increments
    under ``checkpoints`` (:func:`load_checkpoint_base`) and moves ``consumer`` to their
    position; :meth:`step` polls, applies and commits. When the consumer's position is gone --
    its publishes deleted or the consumer expired (``OffsetOutOfRangeError``), or a poll does
    not continue the tables (``StaleBaseError``: moved by a reset policy, another log) -- it
    loads the newest chain again, once the trainer has written a newer one, and goes on from
    there. A replica that crashed starts the same way: a new :class:`Follower`, the same
    consumer name.

    Not thread-safe: one thread calls :meth:`step`; read :attr:`tables` between steps.

    Args:
        consumer: a snapshots ``DeltaConsumer`` of the trainer's log root (native rows).
        checkpoints: the trainer's checkpoint root (``Checkpoints(..., root=)``).
        wait: seconds to wait for a complete base to appear (a replica started with its trainer).

    Raises:
        IncompleteBaseError: no complete base after ``wait``.
        IncrementChainError, FormatMismatchError: as :func:`load_checkpoint_base`.
    """

    def __init__(self, consumer: DeltaConsumer, checkpoints: str, wait: float = 0.0) -> None:
        self.consumer, self.root = consumer, checkpoints
        self.reloads = 0
        deadline = time.monotonic() + wait
        while True:
            try:
                self._reload()
                break
            except IncompleteBaseError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def _latest(self) -> _Loaded:
        chain = chains.latest_chain(self.root)
        return _Loaded(chain.base, len(chain.increments))

    def _reload(self) -> None:
        """Load the newest chain and move the consumer to its position on every rank."""
        self.loaded = self._latest()  # first: a newer chain written meanwhile is loaded at the next recovery
        self.tables = load_checkpoint_base(self.root)
        for rank, position in self.tables.positions.items():
            self.consumer.seek(position, rank=rank)
        self.reloads += 1
        self._waiting = False
        logger.info("replica tables from %s; consumer %s at %s", self.tables.source, self.consumer.name,
                    self.tables.positions)

    def step(self, timeout: float = 1.0, max_bytes: Optional[int] = None) -> Optional[Applied]:
        """Poll, apply the poll onto :attr:`tables` (``complete_only``) and commit. Returns what
        was applied, or None when the tables were loaded again (or wait for the trainer's next
        increment: the consumer's position is gone and no newer chain exists yet).

        Raises:
            RanksBehindError, IncompletePollError: as ``apply_poll(complete_only=True)``.
            CheckpointError: the newest chain cannot be read.
        """
        try:
            poll: DeltaPoll = self.consumer.poll(timeout=timeout, max_bytes=max_bytes)
            applied = apply_poll(self.tables, poll, complete_only=True)
        except (OffsetOutOfRangeError, StaleBaseError) as exc:
            return self._recover(exc, timeout)
        self.consumer.commit()
        return applied

    def _recover(self, exc: BaseException, timeout: float) -> None:
        if self._latest() == self.loaded:
            log = logger.debug if self._waiting else logger.warning
            self._waiting = True
            log("replica %s cannot continue its tables (%s): waiting for the trainer's next increment",
                           self.consumer.name, exc)
            for rank, position in self.tables.positions.items():
                self.consumer.seek(position, rank=rank)
            time.sleep(timeout)
            return None
        logger.warning("replica %s loads the newest checkpoint again: %s", self.consumer.name, exc)
        self._reload()
        return None

    def positions(self) -> Tuple[Dict[int, int], Dict[int, int]]:
        """(where the tables continue from, the channel's end now), per rank."""
        return self.tables.positions, self.consumer.end_offsets()


__all__ = ["Follower", "load_checkpoint_base"]
