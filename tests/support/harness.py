"""Reusable multi-process TorchRec test harness (CPU, gloo).

Builds a tiny sharded model (EmbeddingCollection or EmbeddingBagCollection plus a
dense Linear), deterministic Zipf-like batches, a train step, a spawn runner and
helpers that expose each rank's local shards (offsets, weights, optimizer state).

Facts this relies on (TorchRec 1.8.0 / fbgemm-gpu-cpu 1.8.0, CPU):

* Tracked table fqns are ``"<module path>.embeddings.<table>"`` for an EC and
  ``"<module path>.embedding_bags.<table>"`` for an EBC, i.e. ``"sparse.embeddings.table_0"``
  here (``ModelDeltaTrackerTrec.table_to_fqn``; DMP/DDP prefixes are stripped).
* The local shard of each table lives in
  ``sharded._lookups[i]._emb_modules[j]._config.embedding_tables[k]`` (a
  ``ShardedEmbeddingTable`` with ``local_rows``, ``local_cols``, ``num_embeddings``,
  ``embedding_dim`` and ``local_metadata: ShardMetadata`` whose ``shard_offsets`` is
  ``[row_offset, col_offset]``); ``sharded._lookups[i]`` is in the same order as
  ``sharded._sharding_types`` (sharding type strings; EC and EBC both have it). The TBE is
  ``_emb_modules[j]._emb_module`` and table k of the group is index k of
  ``split_embedding_weights()`` / ``split_optimizer_states()``.
* ``table_column_wise`` is not supported by the EC sharder (only DP/TW/CW/RW): building
  ``kind="ec", sharding="table_column_wise"`` raises ``ValueError``.
* A data-parallel table (``dp_tables``) sits in ``sharded._lookups[i]`` wrapped in DDP
  (sharding type ``"data_parallel"``), as a ``BatchedDenseEmbedding[Bag]`` whose
  ``_emb_module`` is a ``DenseTableBatchedEmbeddingBagsCodegen`` (``split_embedding_weights()``
  but no ``split_optimizer_states()``); its ``local_metadata`` is None and local size = global
  size. It is not in ``dmp.fused_optimizer``: the dense SGD of ``train_step`` updates it.
  On CPU the dense TBE pools even with ``PoolingMode.NONE`` (pytorch/FBGEMM#4586), which
  breaks an EC's DP lookup; ``build_sharded_model`` gives those TBEs a per-id lookup.
"""

from __future__ import annotations

import datetime
import gc
import os
import pickle
import time
import traceback
import types
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    DenseTableBatchedEmbeddingBagsCodegen,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from persistent_delta.testing import free_port
from torch import nn
from torch.distributed.optim.apply_optimizer_in_backward import _apply_optimizer_in_backward
from torch.multiprocessing.spawn import ProcessException, start_processes
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection
from torchrec import EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embedding_types import ShardedEmbeddingTable
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    ParameterShardingGenerator,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingPlan, ShardingType
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.optimizers import in_backward_optimizer_filter

SPARSE_FQN = "sparse"  # attribute name of the EC/EBC inside the model
DENSE_IN = 4
LR = 0.1
_OPTIMIZERS: Dict[str, Tuple[type, Dict[str, Any]]] = {
    "EXACT_SGD": (torch.optim.SGD, {"lr": LR}),
    "EXACT_ADAGRAD": (torch.optim.Adagrad, {"lr": LR, "eps": 1e-8}),
    "EXACT_ROWWISE_ADAGRAD": (RowWiseAdagrad, {"lr": LR, "eps": 1e-8}),
}
_DENSE_OPTS: "weakref.WeakKeyDictionary[nn.Module, torch.optim.Optimizer]" = (
    weakref.WeakKeyDictionary()
)


def feature_names(num_tables: int) -> Dict[str, List[str]]:
    """Table name -> feature names: table_0 has two features, every other table one."""
    out: Dict[str, List[str]] = {}
    nxt = 0
    for t in range(num_tables):
        n = 2 if t == 0 else 1
        out[f"table_{t}"] = [f"feature_{nxt + i}" for i in range(n)]
        nxt += n
    return out


def global_table_weights(num_tables: int, rows: int, dim: int, seed: int) -> Dict[str, torch.Tensor]:
    """The deterministic full (unsharded) initial weight of every table, keyed by table name."""
    out = {}
    for t in range(num_tables):
        g = torch.Generator().manual_seed(seed * 7919 + t)
        out[f"table_{t}"] = torch.rand(rows, dim, generator=g) * 0.2 - 0.1
    return out


class SparseDenseModel(nn.Module):
    """EC/EBC under ``self.sparse`` plus a dense Linear under ``self.dense``; returns a scalar loss."""

    def __init__(self, kind: str, num_tables: int, rows: int, dim: int) -> None:
        super().__init__()
        self.kind = kind
        feats = feature_names(num_tables)
        self.sparse: nn.Module
        if kind == "ec":
            self.sparse = EmbeddingCollection(
                tables=[EmbeddingConfig(name=t, embedding_dim=dim, num_embeddings=rows,
                                        feature_names=f) for t, f in feats.items()],
                device=torch.device("meta"))
        elif kind == "ebc":
            self.sparse = EmbeddingBagCollection(
                tables=[EmbeddingBagConfig(name=t, embedding_dim=dim, num_embeddings=rows,
                                           feature_names=f) for t, f in feats.items()],
                device=torch.device("meta"))
        else:
            raise ValueError(f"kind must be 'ec' or 'ebc', got {kind!r}")
        self.dense = nn.Linear(DENSE_IN, dim)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """loss = sum_f <emb_f, tanh(dense(x)) of its sample> + 0.5*||emb_f||^2 (row-dependent grads)."""
        d = torch.tanh(self.dense(dense))  # [B, dim]
        loss = d.sum() * 0.0
        out = self.sparse(kjt)
        if self.kind == "ebc":
            for f in out.keys():
                pooled = out[f]
                loss = loss + (pooled * d).sum() + 0.5 * pooled.pow(2).sum()
        else:
            for jt in out.values():
                vals = jt.values()
                per_id = d.repeat_interleave(jt.lengths().long(), dim=0)
                loss = loss + (vals * per_id).sum() + 0.5 * vals.pow(2).sum()
        return loss


def _plan_generator(sharding: str, table_idx: int, world_size: int) -> ParameterShardingGenerator:
    if sharding == "data_parallel":
        return data_parallel()
    if sharding == "row_wise":
        return row_wise()
    if sharding == "table_wise":
        return table_wise(rank=table_idx % world_size)
    if sharding in ("column_wise", "table_column_wise"):
        gen = column_wise(ranks=list(range(world_size)))
        if sharding == "column_wise":
            return gen

        def _twcw(*a: Any, **kw: Any) -> ParameterSharding:
            return replace(gen(*a, **kw), sharding_type=ShardingType.TABLE_COLUMN_WISE.value)

        return _twcw
    raise ValueError(f"unknown sharding {sharding!r}")


def _unpooled_dense_lookup(tbe: DenseTableBatchedEmbeddingBagsCodegen, indices: torch.Tensor,
                           offsets: torch.Tensor, per_sample_weights: Any = None,
                           feature_requires_grad: Any = None,
                           batch_size_per_feature_per_rank: Any = None) -> torch.Tensor:
    """What ``DenseTableBatchedEmbeddingBagsCodegen`` with ``PoolingMode.NONE`` returns on a GPU:
    one row per id, [num_ids, D], differentiable into ``tbe.weights``."""
    del per_sample_weights, feature_requires_grad, batch_size_per_feature_per_rank
    num_features = tbe.weights_offsets.numel()
    batch = (offsets.numel() - 1) // num_features
    out = []
    for f in range(num_features):
        lo, hi = int(offsets[f * batch]), int(offsets[(f + 1) * batch])
        dim, start = int(tbe.feature_dims[f]), int(tbe.weights_offsets[f])
        flat = start + indices[lo:hi, None] * dim + torch.arange(dim, device=indices.device)
        out.append(tbe.weights[flat])
    return torch.cat(out) if out else tbe.weights.new_empty((0, tbe.max_D))


def _fix_cpu_unpooled_dense(dmp: nn.Module) -> None:
    """Work around fbgemm-gpu-cpu (1.8.0, pytorch/FBGEMM#4586): on CPU the dense TBE pools even
    with ``PoolingMode.NONE``, so an EC's data-parallel lookup returns [B*features, D] instead of
    one row per id and TorchRec's output split fails. The EC's DP TBEs get a correct lookup."""
    for _fqn, stype, emb, _i, _t in list(_iter_local_tables(dmp)):
        tbe = emb._emb_module
        if (stype == ShardingType.DATA_PARALLEL.value and isinstance(tbe, DenseTableBatchedEmbeddingBagsCodegen)
                and tbe.pooling_mode == PoolingMode.NONE and tbe.weights.device.type == "cpu"
                and "forward" not in vars(tbe)):
            tbe.forward = types.MethodType(_unpooled_dense_lookup, tbe)  # type: ignore[method-assign]


def build_sharded_model(rank: int, world_size: int, kind: str, sharding: str, optimizer: str,
                        num_tables: int = 2, rows: int = 100, dim: int = 8,
                        seed: int = 0, dp_tables: Sequence[int] = ()) -> DistributedModelParallel:
    """Shard a ``SparseDenseModel`` on CPU over the default (gloo) process group.

    Every table uses ``sharding`` (or, for a comma-separated list, table t the t-th kind,
    cycling: ``"row_wise,table_wise,column_wise"``; table-wise puts table t on rank t % world_size;
    column-wise/table_column_wise split the columns evenly over all ranks, so dim must
    divide by world_size and each shard dim should be a multiple of 4). Embeddings use
    the fused (in-backward) FBGEMM optimizer ``optimizer`` with lr 0.1; the dense Linear
    gets a plain SGD (lr 0.1) that ``train_step`` steps. Weights are set from
    ``global_table_weights(seed)`` after sharding, so equal seeds give identical models.

    ``dp_tables``: indices of tables planned data-parallel instead (``sharding="data_parallel"``
    plans all). TorchRec replicates such a table on every rank in a dense FBGEMM TBE
    (``DenseTableBatchedEmbeddingBagsCodegen``) behind a DDP-wrapped lookup: no fused
    optimizer; its weight is an ordinary parameter that the dense SGD steps after DDP's
    gradient all-reduce, so the replicas stay equal.
    """
    if kind == "ec" and sharding == "table_column_wise":
        raise ValueError("EmbeddingCollectionSharder does not support table_column_wise")
    opt_cls, opt_kw = _OPTIMIZERS[optimizer]
    shardings = sharding.split(",")  # "row_wise,column_wise": table t gets shardings[t % 2]
    torch.manual_seed(seed)
    model = SparseDenseModel(kind, num_tables, rows, dim)
    # TorchRec's sharder adds keys to the kwargs dict it finds on the param: pass a copy.
    _apply_optimizer_in_backward(opt_cls, model.sparse.parameters(), dict(opt_kw))
    module_plan = construct_module_sharding_plan(
        model.sparse,
        {f"table_{t}": _plan_generator("data_parallel" if t in dp_tables else shardings[t % len(shardings)], t,
                                       world_size)
         for t in range(num_tables)},
        local_size=world_size, world_size=world_size, device_type="cpu")
    pg = dist.GroupMember.WORLD
    assert pg is not None, "run inside run_spawn (needs an initialised process group)"
    assert dist.get_rank() == rank and dist.get_world_size() == world_size
    dmp = DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"),
        plan=ShardingPlan({SPARSE_FQN: module_plan}))
    _fix_cpu_unpooled_dense(dmp)
    full = global_table_weights(num_tables, rows, dim, seed)
    with torch.no_grad():
        for fqn, info in table_shard_info(dmp).items():
            w = get_local_weights(dmp, fqn)
            r, c = info["row_offset"], info["col_offset"]
            w.copy_(full[fqn.rsplit(".", 1)[1]][r:r + info["local_rows"], c:c + info["local_cols"]])
    _DENSE_OPTS[dmp] = torch.optim.SGD(
        dict(in_backward_optimizer_filter(dmp.named_parameters())).values(), lr=LR)
    return dmp


def use_dense_optimizer(dmp: DistributedModelParallel, optimizer: Any) -> None:
    """Make ``train_step`` step ``optimizer`` (e.g. a TorchRec ``KeyedOptimizerWrapper`` of an
    Adam, whose state a checkpoint must carry) instead of the plain dense SGD."""
    _DENSE_OPTS[dmp] = optimizer


@dataclass
class Batch:
    """One rank's model input: dense features [B, DENSE_IN] and the sparse KJT."""

    dense: torch.Tensor
    sparse: KeyedJaggedTensor


def make_batches(kind: str, num_batches: int, batch_size: int, seed: int, world_size: int,
                 rank: int, num_tables: int = 2, rows: int = 100,
                 zipf_s: float = 1.2, max_len: int = 3) -> List[Batch]:
    """Deterministic per-rank batches; ids are Zipf(s) over a seed-fixed permutation of rows.

    Bag lengths are uniform in [0, max_len] (zero-length bags included). ``kind`` is
    accepted for symmetry; EC and EBC take the same input.
    """
    del kind
    feats = [f for fs in feature_names(num_tables).values() for f in fs]
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    probs = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** zipf_s
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7_919 + world_size)
    out = []
    for _ in range(num_batches):
        lengths = torch.randint(0, max_len + 1, (len(feats) * batch_size,), generator=g)
        n = int(lengths.sum())
        ids = perm[torch.multinomial(probs, max(n, 1), replacement=True, generator=g)][:n]
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=feats, values=ids.long(), lengths=lengths)
        out.append(Batch(torch.rand(batch_size, DENSE_IN, generator=g), kjt))
    return out


def train_step(dmp: DistributedModelParallel, batch: Batch) -> None:
    """Forward, backward (fused embedding update) and the dense SGD step."""
    opt = _DENSE_OPTS.get(dmp)
    if opt is not None:
        opt.zero_grad()
    loss = dmp(batch.dense, batch.sparse)
    loss.backward()
    if opt is not None:
        opt.step()


def _iter_local_tables(dmp: nn.Module) -> Iterator[Tuple[str, str, nn.Module, int, ShardedEmbeddingTable]]:
    """Yield (fqn, sharding_type, emb_module, index_in_tbe, ShardedEmbeddingTable) for local shards."""
    for path, mod in dmp.named_modules():
        if not isinstance(mod, (ShardedEmbeddingCollection, ShardedEmbeddingBagCollection)):
            continue
        clean = path
        for p in ("_dmp_wrapped_module.module.", "module."):
            if clean.startswith(p):
                clean = clean[len(p):]
                break
        attr = "embedding_bags" if hasattr(mod, "embedding_bags") else "embeddings"
        for stype, lookup in zip(mod._sharding_types, mod._lookups):
            while isinstance(lookup, torch.nn.parallel.DistributedDataParallel):
                lookup = lookup.module
            for emb in lookup._emb_modules:
                for i, t in enumerate(emb._config.embedding_tables):
                    yield f"{clean}.{attr}.{t.name}", stype, emb, i, t


def table_shard_info(dmp: nn.Module) -> Dict[str, Dict[str, Any]]:
    """fqn -> {sharding_type, row_offset, col_offset, local_rows, local_cols, global_rows,
    global_cols} for every table with a shard on this rank (one shard per rank assumed)."""
    info: Dict[str, Dict[str, Any]] = {}
    for fqn, stype, _emb, _i, t in _iter_local_tables(dmp):
        assert fqn not in info, f"more than one local shard of {fqn} on this rank"
        md = t.local_metadata
        # a data-parallel table has no shard metadata: every rank holds all of it
        assert md is not None or stype == ShardingType.DATA_PARALLEL.value, (fqn, stype)
        offsets = md.shard_offsets if md is not None else [0, 0]
        info[fqn] = dict(sharding_type=stype, row_offset=int(offsets[0]),
                         col_offset=int(offsets[1]), local_rows=t.local_rows,
                         local_cols=t.local_cols, global_rows=t.num_embeddings,
                         global_cols=t.embedding_dim)
    return info


def get_tbe(dmp: nn.Module, fqn: str) -> Tuple[Any, int]:
    """The FBGEMM TBE holding this rank's shard of ``fqn`` and the table's index in it
    (``emb._emb_module`` of the ``BatchedFusedEmbedding[Bag]`` in the lookup; for a
    data-parallel table the ``DenseTableBatchedEmbeddingBagsCodegen`` of a
    ``BatchedDenseEmbedding[Bag]``, which has no optimizer state)."""
    for f, _s, emb, i, _t in _iter_local_tables(dmp):
        if f == fqn:
            tbe = emb._emb_module
            assert isinstance(tbe, (SplitTableBatchedEmbeddingBagsCodegen, DenseTableBatchedEmbeddingBagsCodegen)), type(tbe)
            return tbe, i
    raise KeyError(f"{fqn} has no shard on this rank")


def get_local_weights(dmp: nn.Module, fqn: str) -> torch.Tensor:
    """This rank's whole local shard of ``fqn`` (a live view: writes go into the TBE)."""
    tbe, i = get_tbe(dmp, fqn)
    w: torch.Tensor = tbe.split_embedding_weights()[i]
    return w


def get_local_rows(dmp: nn.Module, fqn: str, local_ids: torch.Tensor) -> torch.Tensor:
    """Current values (a copy) of the given shard-local rows of ``fqn`` on this rank."""
    return get_local_weights(dmp, fqn)[local_ids.long()].detach().clone()


def get_local_optimizer_state(dmp: nn.Module, fqn: str) -> List[torch.Tensor]:
    """``split_optimizer_states()`` of the TBE for ``fqn`` (views): [] for EXACT_SGD,
    [momentum1 (local_rows, local_cols)] for EXACT_ADAGRAD, [momentum1 (local_rows,)]
    for EXACT_ROWWISE_ADAGRAD; [] for a data-parallel table (no fused optimizer)."""
    tbe, i = get_tbe(dmp, fqn)
    if isinstance(tbe, DenseTableBatchedEmbeddingBagsCodegen):
        return []
    states = tbe.split_optimizer_states()
    return list(states[i]) if states else []


def init_gloo(rank: int = 0, world_size: int = 1, port: int = 0, timeout: float = 60.0) -> None:
    """Join a gloo group on localhost (``port`` 0: a free one; one rank only), one torch thread."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port or free_port()))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout))


class SpawnError(RuntimeError):
    """A spawned rank raised; the message holds every failed rank's traceback, earliest first."""


def _spawn_entry(rank: int, fn: Callable[..., Any], world_size: int, port: int,
                 queue: Any, timeout: float, args: Tuple[Any, ...]) -> None:
    init_gloo(rank, world_size, port, timeout)
    try:
        result = fn(rank, world_size, *args)
        queue.put((rank, True, time.time(), pickle.dumps(result)))
    except BaseException:
        queue.put((rank, False, time.time(), traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()
        # The group's C++ object (and its gloo worker threads) lives until the last reference,
        # often a cycle through the model, is collected. Left to interpreter exit, a worker
        # still dropping the last collective's tensors needs the GIL while Python finalizes,
        # and the process aborts ("terminate called without an active exception"). Collect
        # now, so the group is destroyed (its threads joined) while the interpreter is whole.
        gc.collect()


def run_spawn(fn: Callable[..., Any], world_size: int, *args: Any,
              timeout: float = 300.0) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes.

    Each child joins a gloo group on a fresh free localhost port (collective timeout =
    ``timeout``), runs ``fn`` with one torch thread, and destroys the group at the end.
    Returns the per-rank return values (must be picklable; tensors are copied). If any
    rank raises, the others are terminated and ``SpawnError`` is raised with all failed
    ranks' tracebacks, the first failure (root cause) first. If the children are not
    done after ``timeout`` seconds they are killed and ``TimeoutError`` is raised.
    ``fn`` and ``args`` must be picklable: define ``fn`` at module level of an
    importable module (spawn children re-import it; they inherit the parent's sys.path).
    """
    queue = mp.get_context("spawn").SimpleQueue()
    ctx = start_processes(  # type: ignore[no-untyped-call]
        _spawn_entry, args=(fn, world_size, free_port(), queue, timeout, args),
        nprocs=world_size, join=False, start_method="spawn")
    results: Dict[int, Any] = {}
    errors: List[Tuple[float, int, str]] = []

    def drain() -> None:
        while not queue.empty():
            r, ok, t, payload = queue.get()
            if ok:
                results[r] = pickle.loads(payload)
            else:
                errors.append((t, r, payload))

    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=0.2):
            drain()
            if time.monotonic() > deadline:
                raise TimeoutError(f"run_spawn({getattr(fn, '__name__', fn)}) exceeded {timeout}s")
    except ProcessException as e:
        drain()
        msgs = [f"--- rank {r} ---\n{tb}" for _t, r, tb in sorted(errors)] or [str(e)]
        raise SpawnError("\n".join(msgs)) from e
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    drain()
    return [results.get(r) for r in range(world_size)]


def _smoke(rank: int, world_size: int, kind: str, sharding: str, optimizer: str) -> Dict[str, Any]:
    dmp = build_sharded_model(rank, world_size, kind, sharding, optimizer)
    info = table_shard_info(dmp)
    before = {f: get_local_weights(dmp, f).clone() for f in info}
    for b in make_batches(kind, 5, 4, seed=1, world_size=world_size, rank=rank):
        train_step(dmp, b)
    changed = {f: int((get_local_weights(dmp, f) != before[f]).any(1).sum()) for f in info}
    return {"info": info, "changed_rows": changed,
            "opt_shapes": {f: [tuple(s.shape) for s in get_local_optimizer_state(dmp, f)] for f in info}}


if __name__ == "__main__":
    for k, s, o in [("ec", "row_wise", "EXACT_ROWWISE_ADAGRAD"), ("ebc", "table_column_wise", "EXACT_ADAGRAD")]:
        t0 = time.monotonic()
        res = run_spawn(_smoke, 2, k, s, o)
        print(k, s, o, f"{time.monotonic() - t0:.1f}s")
        for r, x in enumerate(res):
            print(" rank", r, x)
