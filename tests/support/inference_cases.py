"""Inference-replica helpers: an unsharded TorchRec model with the trainer's table fqns, TorchRec's
own quantization of given tables, and a spawnable trainer rank that publishes every step and
keeps its shards at each publish (for the per-publish bit-exact check)."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec import KeyedJaggedTensor
from torchrec.distributed.model_tracker.types import TrackingMode
from torchrec.inference.modules import quantize_inference_model

from harness import build_sharded_model, make_batches, table_shard_info, train_step
from persistent_delta import PersistentTrackerConfig, attach
from persistent_delta.serve.inference import InferenceReplica

WEIGHT_TYPES = {"int8": torch.int8, "fp16": torch.float16}


class Sparse(nn.Module):
    """An EC or EBC of ``tables`` tables named ``table_<t>`` under ``sparse``: the trainer's fqns
    (``sparse.embeddings.table_0``, ``sparse.embedding_bags.table_0``), unsharded."""

    def __init__(self, kind: str, rows: int, dim: int, tables: int = 2) -> None:
        super().__init__()
        if kind == "ec":
            self.sparse: nn.Module = EmbeddingCollection(tables=[EmbeddingConfig(
                name=f"table_{t}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{t}"])
                for t in range(tables)])
        else:
            self.sparse = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
                name=f"table_{t}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{t}"])
                for t in range(tables)])
        self.attr = "embeddings" if kind == "ec" else "embedding_bags"

    def forward(self, kjt: KeyedJaggedTensor) -> Any:
        return self.sparse(kjt)

    def fqn(self, t: int) -> str:
        return f"sparse.{self.attr}.table_{t}"

    def set_weights(self, weights: Mapping[str, torch.Tensor]) -> "Sparse":
        """Copy ``weights`` (fqn or table name -> full table) into the tables; returns self."""
        with torch.no_grad():
            for key, w in weights.items():
                name = key.rsplit(".", 1)[-1]
                self.get_parameter(f"sparse.{self.attr}.{name}.weight").copy_(w)
        return self


def quantized(kind: str, tables: Mapping[str, torch.Tensor], weight_type: str) -> nn.Module:
    """``quantize_inference_model`` of an unsharded model holding ``tables`` (name or fqn -> full)."""
    first = next(iter(tables.values()))
    model = Sparse(kind, first.shape[0], first.shape[1], len(tables)).set_weights(tables)
    return quantize_inference_model(model, quantization_dtype=WEIGHT_TYPES[weight_type])


def sharded_quantized(kind: str, tables: Mapping[str, torch.Tensor], weight_type: str, sharding: str,
                      world_size: int = 2) -> nn.Module:
    """TorchRec's CPU sharding of ``quantized(kind, tables, weight_type)``: every table
    ``sharding`` ("table_wise" or "row_wise") over ``world_size`` shards, all in this process,
    loaded with the quantized tables' weights (:func:`benchmarks.inference_apply.shard_quantized`;
    it sets TorchRec's ``set_propogate_device(True)`` for good)."""
    from benchmarks.inference_apply import shard_quantized

    first = next(iter(tables.values()))
    model = Sparse(kind, first.shape[0], first.shape[1], len(tables)).set_weights(tables)
    return shard_quantized(model, weight_type, sharding, world_size)


def same_output(a: Any, b: Any) -> bool:
    """Two forwards of an EC (feature -> JaggedTensor) or an EBC (KeyedTensor, features in any
    order) hold the same values."""
    if hasattr(a, "to_dict"):
        a, b = a.to_dict(), b.to_dict()
        return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    return sorted(a) == sorted(b) and all(torch.equal(a[k].values(), b[k].values()) for k in a)


def torchrec_bytes(kind: str, tables: Mapping[str, torch.Tensor], weight_type: str) -> Dict[str, torch.Tensor]:
    """TorchRec's own quantization of ``tables``, fqn -> rows in the replica's layout
    (:meth:`InferenceReplica.all_weights`)."""
    return InferenceReplica(quantized(kind, {k: v.clone() for k, v in tables.items()}, weight_type)).all_weights()


def full_tables(shards: Mapping[int, Mapping[str, Tuple[torch.Tensor, Dict[str, Any]]]]) -> Dict[str, torch.Tensor]:
    """Full tables from every rank's ``fqn -> (local weights, table_shard_info)``."""
    out: Dict[str, torch.Tensor] = {}
    for per_rank in shards.values():
        for fqn, (w, info) in per_rank.items():
            t = out.setdefault(fqn, torch.full((info["global_rows"], info["global_cols"]), float("nan")))
            r0, c0 = info["row_offset"], info["col_offset"]
            t[r0:r0 + w.shape[0], c0:c0 + w.shape[1]] = w
    for fqn, t in out.items():
        assert not t.isnan().any(), f"{fqn}: the shards do not cover the table"
    return out


def publishing_trainer(rank: int, world_size: int, root: str, kind: str, sharding: str, num_tables: int,
                       rows: int, dim: int, steps: int) -> Dict[str, Any]:
    """Train ``steps`` steps, ``publish("serving")`` after each; return this rank's shards at
    every publish (stamp -> fqn -> (weights, shard info))."""
    dmp = build_sharded_model(rank, world_size, kind, sharding, "EXACT_ROWWISE_ADAGRAD", num_tables=num_tables,
                              rows=rows, dim=dim)
    t = attach(dmp, PersistentTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, consumers=["serving"], path=root))
    info = table_shard_info(dmp)
    at_publish: Dict[int, Dict[str, Tuple[torch.Tensor, Dict[str, Any]]]] = {}
    for b in make_batches(kind, steps, 8, seed=5, world_size=world_size, rank=rank, num_tables=num_tables, rows=rows):
        train_step(dmp, b)
        stamp = t.curr_batch_idx
        t.publish("serving", formats=("native", "int8", "float16"))  # what the replicas' consumers read
        at_publish[stamp] = {fqn: (lt.weights().detach().clone(), info[fqn]) for fqn, lt in t.local_tables.items()}
    t.close()
    return {"at_publish": at_publish}
