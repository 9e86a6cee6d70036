"""Bases, increments and the one-call restore of a trainer.

Owns: taking a base (a DCP checkpoint of the model and its optimizers), taking increments
every ``every`` steps and on demand, and restoring a DMP model, its fused and dense optimizers
and its tracker from the latest base and its complete increments. The format and the chain
rules are :mod:`persistent_delta.checkpoint`'s.

Design note. An increment is taken on the training thread at a step boundary: the DMP's
forward pre-hook runs before the tracker's ``step()``, when step ``n``'s fused (in-backward)
and dense updates are both done. The rows changed since the previous increment are the ids a
lookups consumer of the tracker's own (``consumer``, registered here) reads since its last
read: every rank's batches, within the rank's shards (the log holds what each rank's shards
were asked for), the window filter's rule included. Their weights and fused optimizer states
(read through the TBE's live ``split_*`` views), the dense parameters, buffers and optimizer
state, the optimizers' ``param_groups`` and the tracker's state are copied at that step (the
rows into buffers kept from one increment to the next, :class:`RowBuffers`); a background
thread (:class:`PartWrite`) writes the part and then its header, beside the next step's
forward. The end of that forward (a forward hook, before the backward updates anything;
or the next increment, base or ``close``) waits for the write and agrees over the ranks that
every part is durable, so a crash never loses more than ``every`` steps. Only then is the
increment's checkpoint marked in the log: retention keeps what a restore of the previous
increment needs until the next one is complete (a crash mid-increment leaves the previous one
the latest, and restorable).

A base replaces the tracker's entry of ``dmp.state_dict()`` by an unmarked copy for the same
reason, and marks it once the base is complete (DCP's ``.metadata`` and the base's info file
written).

Bit-exactness needs what an uninterrupted run has: the same world size, sharding plan, torch
thread count and library versions.
"""

from __future__ import annotations

import concurrent.futures
import copy
import io
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from persistent_delta.checkpoint import chain as chains
from persistent_delta.checkpoint.format import (GROUPS_KEY, BaseInfo, Layout, PartHeader, RankInfo, base_dir,
                                                increment_dir, read_part, write_base_info, write_part, write_rows)
from persistent_delta.errors import CheckpointError, IncrementChainError, InvalidInputError
from persistent_delta.trainer import restore
import persistent_delta.torchrec_internals as trec
from persistent_delta.trainer.sharding import LocalTable

logger = logging.getLogger(__name__)

DEFAULT_CONSUMER = "increments"


@dataclass
class PartWrite:
    """The background write of one rank's part of one increment (then its header)."""

    path: str
    header: PartHeader
    payload: Dict[str, Any]

    def __call__(self) -> PartHeader:
        return write_part(self.path, self.header, self.payload)


@dataclass
class _Pending:
    """An increment whose parts are being written: marked in the log once every rank's is durable."""

    future: "concurrent.futures.Future[PartHeader]"
    state: restore.TrackerState
    seq: int
    step: int


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _everyone(value: Any) -> List[Any]:
    """``value`` of every rank (a collective with a process group)."""
    if _world() == 1:
        return [value]
    out: List[Any] = [None] * _world()
    dist.all_gather_object(out, value)
    return out


def _raise_first(errors: List[Optional[BaseException]]) -> None:
    """Raise the first rank's error on every rank (after :func:`_everyone`): a rank that went on
    alone would wait forever in the next collective."""
    for rank, exc in enumerate(errors):
        if exc is not None:
            if rank == _rank() or isinstance(exc, CheckpointError):
                raise exc
            raise CheckpointError(f"rank {rank} failed: {type(exc).__name__}: {exc}")


def layout_of(tables: Dict[str, LocalTable]) -> Layout:
    """This rank's shards: fqn -> [row_offset, col_offset, local_rows, local_cols]."""
    return {fqn: [t.row_offset, t.col_offset, t.local_rows, t.local_cols] for fqn, t in sorted(tables.items())}


def _table_states(table: LocalTable) -> List[torch.Tensor]:
    """Every fused optimizer state of a shard (live views; none for SGD or data-parallel)."""
    if table.data_parallel or not hasattr(table.tbe, "split_optimizer_states"):
        return []
    states = table.tbe.split_optimizer_states()
    return list(states[table.index]) if states else []


def _state_rows(state: torch.Tensor, rows: int) -> bool:
    """Whether an optimizer state has one entry per row of the shard (else it is kept whole)."""
    return state.dim() >= 1 and state.shape[0] == rows


class RowBuffers:
    """Where an increment's copies of rows go: one tensor per table and state, kept from one
    increment to the next and grown as needed, so that the copy at the step writes into memory
    already paged in rather than into fresh allocations. It holds the largest increment's rows
    between increments. A buffer is reused only once the previous increment's write finished
    (:class:`Checkpoints` waits for it before the next copy). Not thread-safe: the training
    thread uses it."""

    _GROWTH = 1.25  # room for the next increments' rows to vary without a new allocation

    def __init__(self) -> None:
        self._held: Dict[Tuple[str, int], torch.Tensor] = {}

    def take(self, key: Tuple[str, int], rows: int, like: torch.Tensor) -> torch.Tensor:
        """An uninitialised ``(rows, *like.shape[1:])`` tensor of ``like``'s dtype and device."""
        held = self._held.get(key)
        if held is None or held.shape[0] < rows or held.shape[1:] != like.shape[1:] or \
                held.dtype != like.dtype or held.device != like.device:
            held = torch.empty((int(rows * self._GROWTH) + 1, *like.shape[1:]), dtype=like.dtype, device=like.device)
            self._held[key] = held
        return held[:rows]

    def clear(self) -> None:
        self._held.clear()


def capture_rows(tables: Dict[str, LocalTable], ids: Dict[str, torch.Tensor],
                 buffers: Optional[RowBuffers] = None) -> Dict[str, Dict[str, Any]]:
    """Copies of the current weights and fused optimizer states of the rows ``ids`` (shard-local)
    of every sharded table of this rank: into ``buffers`` when given (valid until the next
    capture into them), else into new tensors."""
    out: Dict[str, Dict[str, Any]] = {}
    for fqn, t in tables.items():
        if t.data_parallel:
            continue  # replicated: with the dense parameters, whole
        i = ids.get(fqn, torch.empty(0, dtype=torch.int64)).reshape(-1).long()
        sources = [t.weights().detach()] + [s.detach() for s in _table_states(t)]
        at = i.to(sources[0].device)
        copies: List[torch.Tensor] = []
        for k, src in enumerate(sources):
            if k and not _state_rows(src, t.local_rows):
                copies.append(src.clone())  # kept whole
            elif buffers is None:
                copies.append(src.index_select(0, at))  # several times faster than indexing by a tensor
            else:
                copies.append(torch.index_select(src, 0, at, out=buffers.take((fqn, k), len(at), src)))
        out[fqn] = {"ids": i.clone(), "weights": copies[0], "states": copies[1:]}
    return out


def apply_rows(tables: Dict[str, LocalTable], parts: Sequence[Dict[str, Dict[str, Any]]]) -> None:
    """Write the rows of a chain's increment parts (``parts[j]`` is part ``j``'s ``"rows"``, in
    chain order) into this rank's shards, weights and fused optimizer states, each row with its
    newest value (:func:`~persistent_delta.checkpoint.format.write_rows`, from the parts'
    memory-mapped tensors). A state kept whole comes from the newest part."""
    with torch.no_grad():
        for fqn in sorted({f for rows in parts for f in rows}):
            mine = [rows[fqn] for rows in parts if fqn in rows]
            t = tables[fqn]
            states = _table_states(t)
            for k, s in enumerate(states):
                if not _state_rows(s, t.local_rows):
                    s.copy_(mine[-1]["states"][k])
            rowwise = [k for k, s in enumerate(states) if _state_rows(s, t.local_rows)]
            write_rows([t.weights()] + [states[k] for k in rowwise],
                       [(p["ids"], [p["weights"]] + [p["states"][k] for k in rowwise]) for p in mine])


def _plain_tensors(sd: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """The entries of a model state dict that are one whole tensor on every rank (dense
    parameters, buffers, data-parallel tables): not sharded (ShardedTensor, DTensor)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor) and not isinstance(v, (ShardedTensor, DTensor))}


def _local_sharded(sd: Dict[str, Any]) -> List[str]:
    """The table fqns (``<fqn>.weight``'s ``<fqn>``) of a model state dict's sharded entries with
    a shard on this rank."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return [k.rsplit(".", 1)[0] for k, v in sd.items() if isinstance(v, ShardedTensor) and v.local_shards()]


def _groups(optimizer: Any) -> List[Dict[str, Any]]:
    """An optimizer's ``param_groups`` without the parameters (learning rates and the like)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] if optimizer else []


def _set_groups(optimizer: Any, groups: List[Dict[str, Any]]) -> None:
    if optimizer is None:
        return
    for g, saved in zip(optimizer.param_groups, groups):
        g.update(saved)


def _to_bytes(value: Any) -> io.BytesIO:
    """One opaque value for DCP (stored whole, as bytes)."""
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return buf


def _from_bytes(buf: io.BytesIO) -> Any:
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _has_state(sd: Dict[str, Any]) -> bool:
    return any(len(v) for v in sd.get("state", {}).values())


class Checkpoints:
    """Bases, increments every ``every`` steps, and the one-call restore of a DMP trainer.

    Every rank builds one (after :func:`~persistent_delta.trainer.attach.attach`) and calls
    each method at the same step: they are collectives. The training thread calls them; the
    part files are written by a background thread. A *step* is a training-mode forward of the
    DMP (with its backward and optimizer steps): ``step`` counts them, from 0 or from what
    :meth:`restore` returned. Between increments it keeps the memory of the largest
    increment's row copies (:class:`RowBuffers`), until :meth:`close`.

    Args:
        dmp: the ``DistributedModelParallel``, with its fused optimizer (``dmp.fused_optimizer``).
        dense_optimizer: the optimizer of the dense parameters (and data-parallel tables), a
            TorchRec ``KeyedOptimizer`` (``KeyedOptimizerWrapper``): a restore into a fresh
            one builds its state first (``init_state()``). None: no dense optimizer.
        root: the directory of the bases (shared by the ranks, as for DCP).
        every: take an increment every this many steps (None: on demand only).
        tracker: the DMP's ``PersistentDeltaTracker`` (default ``dmp.get_delta_tracker()``).
        consumer: the name of the tracker's lookups consumer the increments read.

    Raises:
        InvalidInputError: no tracker, ``every`` < 1, a dense optimizer without ``init_state``, a
            sharded table the tracker does not track (``fqns_to_skip``).
    """

    def __init__(self, dmp: nn.Module, dense_optimizer: Any, root: str, every: Optional[int] = None,
                 tracker: Any = None, consumer: str = DEFAULT_CONSUMER) -> None:
        if every is not None and int(every) < 1:
            raise InvalidInputError(f"every must be at least 1 step, not {every}")
        tracker = tracker if tracker is not None else dmp.get_delta_tracker()
        if tracker is None or not hasattr(tracker, "checkpoint_state"):
            raise InvalidInputError("Checkpoints needs the DMP's PersistentDeltaTracker: attach() one first")
        if dense_optimizer is not None and not hasattr(dense_optimizer, "init_state"):
            raise InvalidInputError(
                f"the dense optimizer must be a TorchRec KeyedOptimizer (KeyedOptimizerWrapper), not "
                f"{type(dense_optimizer).__name__}: a restore builds a fresh one's state with init_state()")
        self.dmp, self.dense, self.root, self.every = dmp, dense_optimizer, root, every
        self.tracker, self.consumer = tracker, consumer
        self.fused = getattr(dmp, "fused_optimizer", None)
        self.step = 0
        self._forward_open = False  # a training forward ran whose step is not counted yet
        self._base: Optional[Tuple[str, BaseInfo]] = None
        self._seq, self._last_step = 0, -1
        self._pending: Optional[_Pending] = None
        self._buffers = RowBuffers()  # the increments' row copies, reused (the last write done first)
        self._tables: Dict[str, LocalTable] = tracker.local_tables
        self._layout = layout_of(self._tables)
        managed = sorted(name.replace("_dmp_wrapped_module.", "") for name, m in dmp.named_modules()
                         if trec.mc_collection_of(m) is not None)
        if managed:
            raise InvalidInputError(
                f"{managed} hold managed-collision (ZCH) tables: an increment does not carry their raw-id maps (which "
                "raw id each row holds), so a restore would pair the increments' rows with the base's maps. Take full "
                "DCP checkpoints of this model (dmp.state_dict() carries the maps and the tracker's state)")
        model_state = self._model_state()
        untracked = sorted(set(_local_sharded(model_state)) - set(self._tables))
        if untracked:
            raise InvalidInputError(
                f"tables {untracked} are sharded but not tracked (fqns_to_skip): an increment would miss their rows. "
                "Track every sharded table to take increments")
        counted = sorted(fqn for fqn, t in self._tables.items() if t.tbe is not None and trec.keeps_step_counter(t.tbe))
        if counted:
            raise InvalidInputError(
                f"tables {counted} use a fused optimizer with a step counter of its own "
                f"({getattr(self._tables[counted[0]].tbe, 'optimizer', '?')}: FBGEMM's iter, used by Adam, LAMB and EMA "
                "in-place row-wise Adagrad), which neither TorchRec's optimizer state nor an increment holds: a restore "
                "would not be bit-exact. Take increments with EXACT_SGD, EXACT_ADAGRAD or EXACT_ROWWISE_ADAGRAD, or "
                "full DCP checkpoints")
        tracker.add_consumer(consumer)  # after the checks: a refused Checkpoints holds back no retention
        self._dense_refs = _plain_tensors(model_state)
        self.run_id = _everyone(uuid.uuid4().hex)[0]  # rank 0's: every part of this run carries it
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd-increments")
        self._hooks: List[Any] = [dmp.register_forward_pre_hook(self._before_forward),
                                  dmp.register_forward_hook(self._after_forward)]

    @property
    def base(self) -> Optional[str]:
        """The directory of the base the next increment follows (None before one)."""
        return self._base[0] if self._base is not None else None

    # ------------------------------------------------------------------ steps
    def _before_forward(self, module: nn.Module, args: Any) -> None:
        """A training forward starts: the previous one's step is done; take an increment when due."""
        if not module.training:
            return
        self._count_step()
        if self.every and self._base is not None and self.step % self.every == 0 and self.step != self._last_step:
            self.save_increment()
        self._forward_open = True

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """The forward after an increment's capture ran beside its write: wait for it now, before
        this step's backward updates anything, so a crash never loses more than ``every`` steps."""
        if module.training and self._pending is not None:
            self._finish_pending()

    def _count_step(self) -> None:
        if self._forward_open:
            self.step += 1
            self._forward_open = False

    def _model_state(self) -> Dict[str, Any]:
        sd: Dict[str, Any] = self.dmp.state_dict()
        return sd

    def _tracker_key(self, sd: Dict[str, Any]) -> str:
        key = restore.state_key(self.tracker.rank)
        found = [k for k in sd if k == key or k.endswith("." + key)]
        if len(found) != 1:
            raise InvalidInputError(f"the model's state dict holds {found} for the tracker's {key!r}, not one entry")
        return found[0]

    # ------------------------------------------------------------------ bases
    def save_base(self) -> str:
        """Take a base at the current step (a collective): ``dcp.save`` of ``{"model":
        dmp.state_dict(), "fused": ..., "dense": ...}`` to ``<root>/base-<step>``, then its info
        file; the tracker's checkpoint is marked once it is complete. Increments follow it.
        Returns its directory.

        Raises:
            IncrementChainError: a complete base of this step exists already.
        """
        self._count_step()
        self._finish_pending()
        path = base_dir(self.root, self.step)
        errors = _everyone(self._check_new_base(path) if _rank() == 0 else None)
        _raise_first(errors)
        self.tracker.get_unique_ids(self.consumer)  # increments start from here: the base holds the rest
        sd = self._model_state()
        key = self._tracker_key(sd)
        marked: restore.TrackerState = sd[key]
        sd[key] = restore.TrackerState(marked.state)  # written unmarked: marked once the base is complete
        state: Dict[str, Any] = {"model": sd}
        # an optimizer without state (EXACT_SGD; a dense one before its first step) is left out:
        # DCP stores no key for an empty state, and its load would miss it
        for name, opt in self._optimizers().items():
            osd = opt.state_dict()
            if _has_state(osd):
                state[name] = osd
        # TorchRec's optimizers leave their param_groups (learning rates) out of state_dict()
        state[GROUPS_KEY] = _to_bytes(self._groups())
        base_id = _everyone(uuid.uuid4().hex)[0]
        dcp.save(state, checkpoint_id=path)
        ident = self.tracker.log.read(lambda r: r.identity())
        ranks = _everyone(RankInfo(_rank(), ident.log_id, ident.stamp, self._layout))
        info = BaseInfo(base_id, self.step, _world(), ranks, "fused" in state, "dense" in state)
        if _rank() == 0:
            write_base_info(path, info)
        if _world() > 1:
            dist.barrier()
        marked.mark()
        self._base, self._seq, self._last_step = (path, info), 0, self.step
        logger.info("base taken at step %d: %s", self.step, path)
        return path

    @staticmethod
    def _check_new_base(path: str) -> Optional[BaseException]:
        """Rank 0, before a base: refuse to replace a complete one; clear a save that did not finish."""
        try:
            chains.open_base(path)
        except CheckpointError:
            if os.path.isdir(path):
                logger.warning("removing %s: a base save that did not finish", path)
                shutil.rmtree(path)
            return None
        return IncrementChainError(f"{path}: a complete base of step {os.path.basename(path)} exists already")

    # ------------------------------------------------------------------ increments
    def save_increment(self) -> Optional[str]:
        """Take an increment at the current step (a collective): the rows changed since the
        previous one, copied now, written by a background thread. Returns its directory (None
        when nothing was trained since the previous increment or the base).

        Raises:
            CheckpointError: no base yet, or a rank failed to write the previous increment.
        """
        self._count_step()
        self._finish_pending()
        if self._base is None:
            raise CheckpointError("no base to follow: take one first (Checkpoints.save_base) or restore()")
        if self.step == self._last_step:
            return None
        base, info = self._base
        ids = self.tracker.get_unique_ids(self.consumer)
        state: restore.TrackerState = self.tracker.checkpoint_state()
        dense = {k: v.detach().clone() for k, v in self._dense_refs.items()}
        payload = {"rows": capture_rows(self._tables, ids, self._buffers), "dense": dense,
                   "dense_optimizer": copy.deepcopy(self.dense.state_dict()) if self.dense is not None else None,
                   "dense_groups": _groups(self.dense), "fused_groups": _groups(self.fused),
                   "tracker": dict(state.state)}
        ident = self.tracker.log.read(lambda r: r.identity())
        seq = self._seq + 1
        header = PartHeader(info.base_id, seq, self.step, self._last_step, self.run_id, _rank(), _world(),
                            ident.log_id, ident.stamp, self._layout, 0, 0,
                            rows={f: int(p["ids"].numel()) for f, p in payload["rows"].items()})
        path = increment_dir(base, seq)
        self._pending = _Pending(self._pool.submit(PartWrite(path, header, payload)), state, seq, self.step)
        self._seq, self._last_step = seq, self.step
        return path

    def _finish_pending(self) -> None:
        """Wait for the increment being written, agree that every rank's part is durable, and
        mark its checkpoint in the log (a collective)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        exc = pending.future.exception()
        _raise_first(_everyone(exc))
        pending.state.mark()

    def close(self) -> None:
        """Finish the increment being written (a collective), stop the writer thread and
        unhook. Idempotent; the tracker stays open."""
        if not self._hooks:
            return
        try:
            self._finish_pending()
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks = []
            self._pool.shutdown(wait=True)
            self._buffers.clear()

    # ------------------------------------------------------------------ restore
    def restore(self) -> int:
        """Restore the model, its fused and dense optimizers and the tracker from the complete
        chain that reaches the furthest step (:func:`~persistent_delta.checkpoint.chain.latest_chain`;
        ties: the newer base), its base and then its increments in order (a collective, before
        training on). Trailing incomplete increments (a crash while one was written) and newer
        incomplete bases are removed. Returns the step restored to; training goes on from it, and the
        increments go on after the restored one.

        Raises:
            IncompleteBaseError: no complete base under ``root``.
            IncrementChainError: a gap, a duplicate, a part of another base, job or run, a
                damaged part; or the base is of another job (another log of a rank).
            ShardLayoutError: another world size, plan or column split than the base's.
        """
        self._finish_pending()
        chain = self._agreed_chain()
        rank = _rank()
        parts: List[Dict[str, Any]] = []
        error: Optional[BaseException] = None
        try:
            chains.check_layout(chain.info, rank, _world(), self._layout)
            ident = self.tracker.log.read(lambda r: r.identity())
            mine = chain.info.ranks[rank]
            if (mine.log_id, mine.log_stamp) != (ident.log_id, ident.stamp):
                raise IncrementChainError(f"{chain.base}: a base of rank {rank}'s log {mine.log_id}, not of this job's "
                                          f"{ident.describe()} (another job, or a log started afresh)")
            for inc in chain.increments:
                parts.append(read_part(inc.path, inc.headers[rank]))
        except BaseException as exc:  # noqa: BLE001 - every rank raises the first rank's error
            error = exc
        _raise_first(_everyone(error))
        tracker_state = self._load_base(chain)
        apply_rows(self._tables, [part["rows"] for part in parts])
        if parts:  # the dense state, param_groups and tracker state are whole in each part: the last one's
            last = parts[-1]
            if self.dense is not None and not self.dense.state and _has_state(last["dense_optimizer"]):
                self.dense.init_state()  # a base taken before the first step: build the state to load
            with torch.no_grad():
                for k, v in last["dense"].items():
                    self._dense_refs[k].copy_(v)
            if self.dense is not None:
                self.dense.load_state_dict(last["dense_optimizer"])
                _set_groups(self.dense, last["dense_groups"])
            _set_groups(self.fused, last["fused_groups"])
            tracker_state = last["tracker"]
        if self.fused is not None:
            self.fused.zero_grad()  # TorchRec's fused optimizer hands its lr to the TBE here
        self.tracker.load_state_dict(tracker_state)
        if rank == 0:
            self._remove_leftovers(chain)
        if _world() > 1:
            dist.barrier()
        self.step, self._forward_open = chain.step, False
        self._base, self._seq, self._last_step = (chain.base, chain.info), len(chain.increments), chain.step
        logger.info("restored step %d from %s and %d increments", chain.step, chain.base, len(chain.increments))
        return chain.step

    def _agreed_chain(self) -> chains.Chain:
        """Rank 0's view of the newest chain, on every rank (or its error, raised on every rank)."""
        result: Any = None
        if _rank() == 0:
            try:
                result = chains.latest_chain(self.root)
            except CheckpointError as exc:
                result = exc
        if _world() > 1:
            box = [result]
            dist.broadcast_object_list(box, src=0)
            result = box[0]
        if isinstance(result, BaseException):
            raise result
        out: chains.Chain = result
        return out

    def _load_base(self, chain: chains.Chain) -> Any:
        """Load the base with DCP into the model and optimizers; returns its tracker state."""
        if self.dense is not None and chain.info.dense_state and not self.dense.state:
            self.dense.init_state()  # a fresh optimizer's state, for DCP to load into
        model = self._model_state()
        target: Dict[str, Any] = {"model": model}
        stored = {"fused": chain.info.fused_state, "dense": chain.info.dense_state}
        opts = {name: opt for name, opt in self._optimizers().items() if stored[name]}
        for name, opt in opts.items():
            target[name] = opt.state_dict()
        target[GROUPS_KEY] = io.BytesIO()
        dcp.load(target, checkpoint_id=chain.base)
        tracker_state = model.pop(self._tracker_key(model))
        self.dmp.load_state_dict(model)
        for name, opt in opts.items():
            opt.load_state_dict(target[name])
        groups = _from_bytes(target[GROUPS_KEY])
        for name, opt in self._optimizers().items():
            _set_groups(opt, groups.get(name, []))
        return tracker_state

    def _optimizers(self) -> Dict[str, Any]:
        """The fused and dense optimizers, by their key in a base."""
        return {name: opt for name, opt in (("fused", self.fused), ("dense", self.dense)) if opt is not None}

    def _groups(self) -> Dict[str, List[Dict[str, Any]]]:
        """Each optimizer's param_groups without the parameters (none for a missing optimizer)."""
        return {name: _groups(opt) for name, opt in self._optimizers().items()}

    @staticmethod
    def _remove_leftovers(chain: chains.Chain) -> None:
        """Rank 0 after a restore: what a crash left past the restored chain goes, so no part of
        the lost timeline mixes with the next increments."""
        for path in chain.leftovers:
            logger.warning("removing %s: an increment that did not complete before the crash", path)
            shutil.rmtree(path, ignore_errors=True)
        root = os.path.dirname(chain.base)
        for step, path in chains.list_bases(root):
            if step <= chain.info.step:
                continue
            try:
                chains.open_base(path)  # complete: a consolidated base the restored chain went past; kept
            except CheckpointError:
                logger.warning("removing %s: a base save that did not finish before the crash", path)
                shutil.rmtree(path, ignore_errors=True)

    def __enter__(self) -> "Checkpoints":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Checkpoints", "DEFAULT_CONSUMER", "PartWrite", "RowBuffers", "apply_rows", "capture_rows", "layout_of"]
