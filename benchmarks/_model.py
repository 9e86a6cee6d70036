"""A small but real recommendation model for the step benchmarks, sharded by TorchRec on CPU.

``RecModel``: an ``EmbeddingCollection`` of ``num_tables`` tables (one feature each, fused
``EXACT_ROWWISE_ADAGRAD`` applied in backward), a bottom MLP on dense features, sum pooling of
the ``pooling`` ids of each sample per feature, and a top MLP to one logit (BCE loss). The dense
parameters are trained with Adagrad. ``build_dmp`` shards it with ``DistributedModelParallel``
over the default process group (gloo on CPU, NCCL on a GPU: ``device``) and sets every table from
a seed, so models built with the same seed are identical. ``optimizer="adagrad"`` fuses
``EXACT_ADAGRAD`` instead (a per-element momentum, what TorchRec's MOMENTUM_LAST reads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim.apply_optimizer_in_backward import _apply_optimizer_in_backward
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.optimizers import in_backward_optimizer_filter

from benchmarks._common import ZipfIds

DENSE_IN = 13
# optimizer name -> (the optimizer TorchRec fuses into the TBE, its arguments)
OPTIMIZERS: Dict[str, Tuple[type, Dict[str, float]]] = {
    "rowwise_adagrad": (RowWiseAdagrad, {"lr": 0.05, "eps": 1e-8}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.05, "eps": 1e-8}),
}


def torch_device(device: str) -> torch.device:
    """``"cpu"``, or ``"cuda"``: this process's current CUDA device (``torch.cuda.set_device``)."""
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)


@dataclass(frozen=True)
class Workload:
    num_tables: int = 4
    rows: int = 200_000
    dim: int = 64
    batch: int = 2048
    pooling: int = 8
    zipf_s: float = 1.05
    sharding: str = "row_wise"  # or "table_wise"


class RecModel(nn.Module):
    def __init__(self, w: Workload) -> None:
        super().__init__()
        self.w = w
        self.features = [f"f{t}" for t in range(w.num_tables)]
        self.sparse = EmbeddingCollection(
            tables=[
                EmbeddingConfig(name=f"t{t}", embedding_dim=w.dim, num_embeddings=w.rows, feature_names=[f])
                for t, f in enumerate(self.features)
            ],
            device=torch.device("meta"),
        )
        self.bottom = nn.Sequential(nn.Linear(DENSE_IN, 128), nn.ReLU(), nn.Linear(128, w.dim), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(w.dim * (w.num_tables + 1), 256), nn.ReLU(), nn.Linear(256, 1))

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor, labels: torch.Tensor) -> torch.Tensor:
        b = dense.shape[0]
        parts = [self.bottom(dense)]
        out = self.sparse(kjt)
        for f in self.features:
            parts.append(out[f].values().view(b, self.w.pooling, self.w.dim).sum(1))
        logit = self.top(torch.cat(parts, dim=1)).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logit, labels)


def build_dmp(w: Workload, seed: int = 0, device: str = "cpu", optimizer: str = "rowwise_adagrad") -> DistributedModelParallel:
    """Shard a :class:`RecModel` over the default process group (must be initialised; NCCL for
    ``device="cuda"``, one GPU per rank) with the fused ``optimizer`` (:data:`OPTIMIZERS`)."""
    torch.manual_seed(seed)
    model = RecModel(w)
    opt_cls, opt_kw = OPTIMIZERS[optimizer]
    _apply_optimizer_in_backward(opt_cls, model.sparse.parameters(), dict(opt_kw))
    ws = dist.get_world_size()
    gens = {f"t{t}": (row_wise() if w.sharding == "row_wise" else table_wise(rank=t % ws)) for t in range(w.num_tables)}
    dev = torch_device(device)
    plan = construct_module_sharding_plan(model.sparse, gens, local_size=ws, world_size=ws, device_type=dev.type)
    pg = dist.GroupMember.WORLD
    assert pg is not None
    dmp = DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(pg), device=dev, plan=ShardingPlan({"sparse": plan})
    )
    # Identical tables for identical seeds (DMP initialises its own shards otherwise).
    with torch.no_grad():
        for i, (fqn, t) in enumerate(sorted(_local_weights(dmp).items())):
            g = torch.Generator().manual_seed(seed * 7919 + i)
            t.copy_(torch.rand(t.shape, generator=g) * 0.02 - 0.01)
    dense_params = dict(in_backward_optimizer_filter(dmp.named_parameters())).values()
    dmp._bench_opt = torch.optim.Adagrad(list(dense_params), lr=0.01)  # type: ignore[attr-defined]
    dmp._bench_features = model.features  # type: ignore[attr-defined]
    return dmp


def _local_weights(dmp: nn.Module) -> Dict[str, torch.Tensor]:
    from torchrec.distributed.embedding import ShardedEmbeddingCollection

    out: Dict[str, torch.Tensor] = {}
    for path, mod in dmp.named_modules():
        if not isinstance(mod, ShardedEmbeddingCollection):
            continue
        for lookup in mod._lookups:
            while isinstance(lookup, nn.parallel.DistributedDataParallel):
                lookup = lookup.module
            for emb in lookup._emb_modules:
                ws = emb._emb_module.split_embedding_weights()
                for i, t in enumerate(emb._config.embedding_tables):
                    out[f"{path}.{t.name}"] = ws[i]
    return out


@dataclass
class BatchData:
    dense: torch.Tensor
    values: torch.Tensor
    lengths: torch.Tensor
    labels: torch.Tensor


def make_batches(w: Workload, n: int, seed: int, rank: int = 0, device: str = "cpu") -> List[BatchData]:
    """``n`` batches of Zipf ids (one sampler per table, fixed ``pooling`` ids per sample), on
    ``device`` (the ids drawn on CPU: the same batches on every device)."""
    dev = torch_device(device)
    samplers = [ZipfIds(w.rows, w.zipf_s, seed * 1000 + t) for t in range(w.num_tables)]
    g = torch.Generator().manual_seed(seed * 31 + rank)
    out = []
    lengths = torch.full((w.num_tables * w.batch,), w.pooling, dtype=torch.int64)
    for _ in range(n):
        vals = torch.cat([s.sample(w.batch * w.pooling) for s in samplers])
        out.append(
            BatchData(
                dense=torch.rand(w.batch, DENSE_IN, generator=g).to(dev),
                values=vals.to(dev),
                lengths=lengths.to(dev),
                labels=(torch.rand(w.batch, generator=g) > 0.5).float().to(dev),
            )
        )
    return out


def train_step(dmp: Any, b: BatchData) -> None:
    """Forward (DMP steps its trackers), backward with the fused embedding update, dense step."""
    opt = dmp._bench_opt
    opt.zero_grad(set_to_none=True)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=dmp._bench_features, values=b.values, lengths=b.lengths)
    loss = dmp(b.dense, kjt, b.labels)
    loss.backward()
    opt.step()
