"""Capture: which TorchRec modules are tracked, where the tracker hooks in, and what a lookup
hands to the writer.

Owns: table discovery (TorchRec's own fqn rules), hook registration, and the hot-path split of
a lookup into per-table records. Everything here runs on the training thread: records keep
references to ids and optimizer-state rows (or start non-blocking device-to-host copies) and
the background writer does the rest (:mod:`persistent_delta.trainer.writer`).

One copy on CPU, on purpose: EMBEDDING copies each lookup's output (the rows the model was
given) into a block of :class:`LookupBlocks`, reused from step to step, instead of keeping a
reference to it. The output is autograd's memory; kept until the writer has encoded it, it
lives past the next step's forward, which then cannot reuse it: glibc's default thresholds hand
the step fresh pages (mapped, or a heap top it trimmed) and the training thread page-faults
them in, every step. Measured on the ``step_cpu`` workload (16.8 MB of rows a step): holding
each output one step longer, with no library code, costs ~3,800 minor faults and ~14 ms of
CPU a ~145 ms step; the copy into a reused block ~1.4 ms and no faults (benchmarks/README.md,
"The step by CPU time").

Hooks, as TorchRec's tracker: ``post_lookup_tracker_fn`` of ``ShardedEmbeddingCollection`` /
``ShardedEmbeddingBagCollection`` (ID_ONLY, EMBEDDING) or ``optim_state_tracker_fn`` of their
grouped lookups (MOMENTUM_*, ROWWISE_ADAGRAD), and ``post_odist_tracker_fn`` for
``auto_compact``.

Data-parallel (replicated) tables: the post-lookup hook fires for their DDP-wrapped lookup too,
so ID_ONLY/EMBEDDING record each rank's own lookups of them (a consumer's ``merged()`` takes the
union over ranks). They have no fused optimizer state, so the optimizer-state modes leave them
out (see :func:`register_hooks`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup, GroupedPooledEmbeddingsLookup
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.model_tracker.types import TrackingMode, UniqueRows
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from persistent_delta.log import codec
from persistent_delta.log.alloc import ResultBuffers
from persistent_delta.errors import InvalidInputError, UnsupportedModeError, UnsupportedTrackingError
from persistent_delta.log.records import AppendRecord
import persistent_delta.torchrec_internals as trec
from persistent_delta.trainer.sharding import LocalTable, feature_index, has_fused_state

logger = logging.getLogger(__name__)

Hooked = List[Tuple[nn.Module, str]]


class Discovery:
    """TorchRec's table discovery (``fqns_to_skip``, DMP/DDP prefix stripping), run through its
    own ``ModelDeltaTrackerTrec.fqn_to_feature_names``
    (:func:`persistent_delta.torchrec_internals.tracker_discovery`) so fqns match its tracker's
    exactly."""

    def __init__(self, model: nn.Module, fqns_to_skip: List[str]) -> None:
        self._fqn_to_feature_map, self.tracked_modules, self.table_to_fqn = trec.tracker_discovery(
            model, list(fqns_to_skip))
        self.feature_to_fqn: Dict[str, str] = {}
        for fqn, features in self._fqn_to_feature_map.items():
            for f in features:
                self.feature_to_fqn.setdefault(f, fqn)

    @property
    def fqn_to_feature_map(self) -> Dict[str, List[str]]:
        return self._fqn_to_feature_map

    def module_kind(self, fqn: str) -> str:
        """``"ebc"`` or ``"ec"``: the kind of sharded module that holds table ``fqn``."""
        module = self.tracked_modules.get(fqn.rsplit(".", 2)[0])
        return "ebc" if isinstance(module, ShardedEmbeddingBagCollection) else "ec"


_MODES = (TrackingMode.ID_ONLY, TrackingMode.EMBEDDING, TrackingMode.MOMENTUM_LAST, TrackingMode.MOMENTUM_DIFF,
          TrackingMode.ROWWISE_ADAGRAD)


def check_mode(mode: TrackingMode, modules: Dict[str, nn.Module]) -> None:
    """Refuse a tracking mode the modules cannot serve, with TorchRec's exception types."""
    if mode not in _MODES:
        raise UnsupportedModeError(f"Tracking mode {mode} is not supported")
    for module in modules.values():
        if isinstance(module, ShardedEmbeddingBagCollection) and mode == TrackingMode.EMBEDDING:
            raise UnsupportedTrackingError(
                "EBC's lookup returns pooled embeddings and currently, we do not support tracking raw embeddings. "
                "(TrackingMode.EMBEDDING needs an EmbeddingCollection, as in TorchRec; use ID_ONLY or an "
                "optimizer-state mode for an EmbeddingBagCollection)"
            )


def register_hooks(
    modules: Dict[str, nn.Module], mode: TrackingMode, record: Callable[..., None],
    compact: Optional[Callable[[], None]],
) -> Hooked:
    """Register ``record`` (and ``compact`` for ``auto_compact``) on the tracked modules;
    returns what was hooked, for :func:`unregister_hooks`.

    ID_ONLY and EMBEDDING hook the modules' post-lookup callable, which sees every lookup,
    data-parallel tables' included: each rank records the ids it looked up itself.

    The optimizer-state modes (MOMENTUM_LAST, MOMENTUM_DIFF, ROWWISE_ADAGRAD) hook the grouped
    lookups whose TBE keeps the optimizer state (fused). A data-parallel table has none (its
    weights are trained by the dense optimizer after DDP's all-reduce), so these modes skip it,
    with one warning naming the skipped tables; it is then never recorded and ``get_unique``
    leaves it out. TorchRec 1.8.0 skips it silently in MOMENTUM_DIFF / ROWWISE_ADAGRAD and
    refuses the whole model with a bare ``AssertionError`` in MOMENTUM_LAST; here MOMENTUM_LAST
    skips it too, so the sharded tables of such a model are still tracked.

    Raises:
        InvalidInputError: an optimizer-state mode on a table group whose fused optimizer keeps
            no state (e.g. EXACT_SGD).
    """
    hooked: Hooked = []
    skipped: List[str] = []
    for module_fqn, module in modules.items():
        if mode in (TrackingMode.ID_ONLY, TrackingMode.EMBEDDING):
            module.register_post_lookup_tracker_fn(record)  # type: ignore[operator]
            hooked.append((module, "post_lookup_tracker_fn"))
        else:
            for stype, inner in trec.sharded_lookups(module):
                if not isinstance(inner, (GroupedEmbeddingsLookup, GroupedPooledEmbeddingsLookup)):
                    continue
                groups = trec.embedding_modules(inner)
                if not all(has_fused_state(stype, emb) for emb in groups):
                    skipped += [_table_fqn(module_fqn, module, t.name) for emb in groups for t in trec.group_tables(emb)]
                    continue
                for emb in groups:
                    states = trec.optimizer_states(emb)
                    if states in ([], None) or not any(s for s in states):
                        raise InvalidInputError(
                            f"tracking mode {mode.name} needs an optimizer with state (EXACT_ADAGRAD, "
                            "EXACT_ROWWISE_ADAGRAD, ...); this table group's optimizer keeps none (e.g. EXACT_SGD)"
                        )
                inner.register_optim_state_tracker_fn(record)
                hooked.append((inner, "optim_state_tracker_fn"))
        if compact is not None:
            module.register_post_odist_tracker_fn(compact)  # type: ignore[operator]
            hooked.append((module, "post_odist_tracker_fn"))
    if skipped:
        logger.warning("tracking mode %s skips %s: no fused optimizer state (data-parallel tables are trained by "
                       "the dense optimizer); ID_ONLY and EMBEDDING track them", mode.name, ", ".join(sorted(skipped)))
    return hooked


def _table_fqn(module_fqn: str, module: nn.Module, table_name: str) -> str:
    """TorchRec's tracker fqn of a table of ``module`` (``<module>.embeddings.<table>`` for an
    EC, ``<module>.embedding_bags.<table>`` for an EBC), for messages."""
    attr = "embedding_bags" if isinstance(module, ShardedEmbeddingBagCollection) else "embeddings"
    return f"{module_fqn}.{attr}.{table_name}" if module_fqn else f"{attr}.{table_name}"


def unregister_hooks(hooked: Hooked, owner: object) -> None:
    """Remove the callables of ``owner`` that :func:`register_hooks` installed."""
    for module, attr in hooked:
        fn = getattr(module, attr, None)
        if fn is not None and getattr(fn, "__self__", None) is owner:
            setattr(module, attr, None)


class LookupBlocks:
    """Reused blocks for the EMBEDDING lookups' rows on CPU (see the module docstring).

    A block is handed out again once no record views it any more (the writer has encoded and
    dropped the step's records: :class:`~persistent_delta.log.alloc.ResultBuffers`' rule), so
    in steady state every step copies into memory whose pages are already in place.

    Memory: at most ``lookups per step x steps`` blocks stay referenced here, ``steps`` being
    ``min(STEPS, max_pending_steps + 2)`` (the step being captured, the one the writer commits,
    one queued); each block is 1.25-4x a lookup's rows. While the writer lags further behind, the
    extra steps' blocks are not kept: each is unmapped once written, and within the writer's
    ``max_pending_bytes`` like any captured record.
    """

    STEPS = 3

    def __init__(self, max_pending_steps: int) -> None:
        self._steps = max(1, min(self.STEPS, max_pending_steps + 2))
        self._blocks = ResultBuffers(keep=self._steps)
        self._lookups = 0  # lookups in the step being captured
        self._per_step = 1  # the most lookups seen in one step

    def copy(self, rows: torch.Tensor) -> torch.Tensor:
        """A copy of ``rows`` (contiguous, on CPU) in a reused block."""
        self._lookups += 1
        if self._lookups > self._per_step:
            self._per_step = self._lookups
            self._blocks.resize(self._per_step * self._steps)
        out = self._blocks.take(rows.numel() * rows.element_size()).view(rows.dtype).view(rows.shape)
        out.copy_(rows)
        return out

    def next_step(self) -> None:
        self._lookups = 0

    def stats(self) -> Tuple[int, int]:
        """(blocks allocated, blocks reused) so far."""
        return self._blocks.allocated, self._blocks.reused


class Capture:
    """The records of the batch being recorded: references, device-to-host copies, or, for
    EMBEDDING on CPU, one copy of each lookup's rows into a reused block (:class:`LookupBlocks`).

    Training thread only.
    """

    def __init__(self, mode: TrackingMode, feature_to_fqn: Dict[str, str], max_pending_steps: int = 64) -> None:
        self._mode = mode
        self._feature_to_fqn = feature_to_fqn
        self._feature_index: Dict[int, Dict[str, int]] = {}
        self.pending: List[AppendRecord] = []
        self.events: List[Any] = []
        self.blocks = LookupBlocks(max_pending_steps) if mode == TrackingMode.EMBEDDING else None

    def add(self, record: AppendRecord) -> None:
        """Add a record captured by another hook (a managed-collision table's side records and
        re-initialised rows: :mod:`.zch_capture`) to the batch being recorded. Its tensors on a
        device are copied to pinned host memory without blocking, as a lookup's are
        (:meth:`_keep_all`: the writer waits for the copy's event); on CPU it is kept as it is."""
        if record.ids.device.type != "cpu" or (record.states is not None and record.states.device.type != "cpu"):
            ids, states = self._keep_all(record.ids, record.states)
            record = dataclasses.replace(record, ids=ids, states=states)
        self.pending.append(record)

    def take(self) -> Tuple[List[AppendRecord], List[Any]]:
        """The records and device events captured so far (and forget them)."""
        out = (self.pending, self.events)
        self.pending, self.events = [], []
        if self.blocks is not None:
            self.blocks.next_step()
        return out

    def _keep_all(self, *ts: Optional[torch.Tensor]) -> List[Any]:
        """Each of ``ts`` as a record keeps it (None stays None): a detached reference on CPU; on
        a device, a non-blocking copy into pinned host memory, with one event after the last
        copy, waited for by the writer (the stream is not stalled). A lookup's ids and rows are
        kept whole, one copy each, and split on the host."""
        out = [None if t is None else t.detach() for t in ts]
        device = next((t.device for t in out if t is not None and t.device.type != "cpu"), None)
        if device is None:
            return out
        for i, t in enumerate(out):
            if t is not None and t.device.type != "cpu":
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                out[i] = host
        if device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self.events.append(ev)
        return out

    def _append(self, batch_idx: int, feature: str, ids: torch.Tensor, states: Optional[torch.Tensor]) -> None:
        """A record of kept tensors (:meth:`_keep_all`)."""
        self.pending.append(AppendRecord(batch_idx, self._feature_to_fqn[feature], ids, states))

    def _add(self, batch_idx: int, feature: str, ids: torch.Tensor, states: Optional[torch.Tensor]) -> None:
        kept_ids, kept_states = self._keep_all(ids, states)
        self._append(batch_idx, feature, kept_ids, kept_states)

    def lookup(self, batch_idx: int, kjt: KeyedJaggedTensor, states: torch.Tensor, emb_module: Optional[nn.Module]) -> None:
        """Split one lookup into one record per feature (the writer merges a table's records
        of a batch with the FIRST/LAST rule, off the training thread)."""
        keys = kjt.keys()
        if not keys:
            return
        values = kjt.values()
        lengths = kjt.length_per_key()
        if self._mode == TrackingMode.ID_ONLY:
            (kept,) = self._keep_all(values)  # on a device: one copy of the lookup's ids, split on the host
            for key, ids in zip(keys, kept.split(lengths)):
                self._append(batch_idx, key, ids, None)
        elif self._mode == TrackingMode.EMBEDDING:
            n = values.numel()
            if n == 0:
                return
            if states.numel() % n != 0:
                raise InvalidInputError(f"ids and embeddings size mismatch: {n} ids, {states.numel()} values")
            rows = states.detach().view(n, -1)
            if rows.device.type == "cpu" and self.blocks is not None:
                rows = self.blocks.copy(rows)  # not autograd's memory: see the module docstring
            kept_ids, kept_rows = self._keep_all(values, rows)  # on a device: two copies, one event
            for key, ids, emb in zip(keys, kept_ids.split(lengths), kept_rows.split(lengths)):
                self._append(batch_idx, key, ids, emb)
        else:
            if emb_module is None:
                raise InvalidInputError(f"tracking mode {self._mode.name} needs the embedding module")
            index = self._feature_index.get(id(emb_module))
            if index is None:
                index = self._feature_index[id(emb_module)] = feature_index(emb_module)
            opt_states = trec.optimizer_states(emb_module)
            for key, ids in zip(keys, values.split(lengths)):
                rows = opt_states[index[key]][0][ids]
                if self._mode == TrackingMode.MOMENTUM_LAST:
                    rows = rows.norm(dim=1) if rows.dim() > 1 else rows.abs()
                self._add(batch_idx, key, ids, rows)


def row_shapes(mode: TrackingMode, table: LocalTable) -> Dict[str, Any]:
    """The dtype and row shape (after the first dim) of a table's tracked states in ``mode``
    and of its values (the snapshots channel), as stored in its table entry at attach, so that
    an empty result has shape ``(0, *row_shape)`` before any record was written."""
    weights = table.weights()
    out: Dict[str, Any] = {"values_dtype": codec.dtype_name(weights.dtype), "values_tail": list(weights.shape[1:])}
    if mode == TrackingMode.EMBEDDING:
        out.update(states_dtype=out["values_dtype"], states_tail=out["values_tail"])
    elif mode != TrackingMode.ID_ONLY:
        state = table.optimizer_state()
        if state is not None:
            tail = [] if mode == TrackingMode.MOMENTUM_LAST else list(state.shape[1:])
            out.update(states_dtype=codec.dtype_name(state.dtype), states_tail=tail)
    return out


def read_states(mode: TrackingMode, tables: Dict[str, LocalTable], rows: Dict[str, UniqueRows]) -> Dict[str, UniqueRows]:
    """What ``get_unique`` returns as states: MOMENTUM_DIFF / ROWWISE_ADAGRAD give the change
    since the recorded (first) state, current minus recorded (TorchRec's rule); other modes
    the recorded states."""
    if mode in (TrackingMode.MOMENTUM_DIFF, TrackingMode.ROWWISE_ADAGRAD):
        for fqn, r in rows.items():
            state = tables[fqn].optimizer_state() if fqn in tables else None
            if state is not None and r.states is not None:
                r.states = state[r.ids.to(state.device).long()].to(r.states.device) - r.states
    return rows
