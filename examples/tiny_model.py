"""A small sharded TorchRec model on one CPU rank, for the docs' examples and quick experiments.

Owns: nothing of the library; it builds what a trainer already has (a ``DistributedModelParallel``
with fused embedding optimizers) so that the README's and the docs' examples run as written.

    from examples.tiny_model import tiny_trainer
    dmp, batches = tiny_trainer()
    for batch in batches(10):
        dmp(batch).backward()        # the loss; the fused optimizer updates the rows in backward

The tables are ``t0``, ``t1``, ... (features ``f0``, ``f1``, ...), row-wise sharded over a
one-rank gloo group that :func:`tiny_trainer` starts when none is running. Tracked table fqns
are ``sparse.embeddings.t<i>``.
"""

from __future__ import annotations

import datetime
import os
from typing import Callable, Dict, Iterator, Tuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan

from persistent_delta.testing import free_port


class TinyModel(nn.Module):
    """An EmbeddingCollection whose forward returns a loss over the looked-up rows."""

    def __init__(self, tables: int, rows: int, dim: int) -> None:
        super().__init__()
        self.sparse = EmbeddingCollection(tables=[
            EmbeddingConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{i}"])
            for i in range(tables)], device=torch.device("cpu"))

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        out: Dict[str, torch.Tensor] = {k: v.values() for k, v in self.sparse(kjt).items()}
        return sum((v * v).mean() for v in out.values())  # type: ignore[return-value]


def start_one_rank_group() -> None:
    """Join a one-rank gloo process group on 127.0.0.1 unless one is running."""
    if dist.is_initialized():
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))


def tiny_trainer(tables: int = 2, rows: int = 1000, dim: int = 16, batch_size: int = 64,
                 seed: int = 0) -> Tuple[DistributedModelParallel, Callable[[int], Iterator[KeyedJaggedTensor]]]:
    """A row-wise sharded model with fused row-wise Adagrad, and a batch generator.

    Args:
        tables: number of tables (``t0``...), one feature each.
        rows: rows per table.
        dim: embedding dimension.
        batch_size: ids per feature and batch.
        seed: seeds the weights and the ids.

    Returns:
        ``(dmp, batches)``: ``batches(n)`` yields ``n`` KeyedJaggedTensors of skewed ids.
    """
    start_one_rank_group()
    torch.manual_seed(seed)
    model = TinyModel(tables, rows, dim)
    sharder = EmbeddingCollectionSharder(fused_params={
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1})
    plan = construct_module_sharding_plan(model.sparse, {f"t{i}": row_wise(compute_kernel="fused") for i in range(tables)},
                                          local_size=1, world_size=1, device_type="cpu", sharder=sharder)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
                                   device=torch.device("cpu"), plan=ShardingPlan({"sparse": plan}),
                                   sharders=[sharder])
    g = torch.Generator().manual_seed(seed + 1)

    def batches(n: int) -> Iterator[KeyedJaggedTensor]:
        for _ in range(n):
            ids = (torch.rand(tables * batch_size, generator=g) ** 3 * rows).long()  # skewed: low ids are hot
            yield KeyedJaggedTensor.from_lengths_sync(
                keys=[f"f{i}" for i in range(tables)], values=ids,
                lengths=torch.ones(tables * batch_size, dtype=torch.long))

    return dmp, batches
