"""CPU time of applying a poll into a TorchRec inference model: unsharded vs sharded.

    python -m benchmarks.inference_apply [--quick] [--rounds 5] [--rows 200000] [--poll-rows 50000]

Owns: TorchRec's CPU sharding recipe of a quantized model (:func:`shard_quantized`, which the
tests use too) and the measurement of :meth:`InferenceReplica.apply_poll` on int8 tables held
unsharded, table-wise and row-wise (two shards, both in this process).

Each round applies the same polls (``--poll-rows`` random rows of each of 2 tables of
``--rows`` x 64, float32 rows quantized by the replica) to every variant in turn (interleaved),
including a second unsharded replica (the A/A pair), on one torch thread. One JSON line per
variant: the process CPU time per poll (median, min) over every round.
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from benchmarks._common import emit, log, median

DIM, TABLES = 64, 2


def shard_quantized(model: nn.Module, weight_type: str, sharding: str, world_size: int = 2) -> nn.Module:
    """TorchRec 1.8's CPU sharding of a float model's quantization: every table ``sharding``
    ("table_wise" or "row_wise") over ``world_size`` shards, all in this process
    (``shard_quant_model``'s local sharding), loaded with the quantized weights.

    Sets TorchRec's ``set_propogate_device(True)`` for good: without it the CPU sharding asserts
    CUDA, and the sharded forward reads it too. Row-wise needs the sharder's
    ``quant_state_dict_split_scale_bias`` (int8 only: TorchRec's sharded state fails on fp16's
    absent scale).

    Args:
        model: a float model of ``EmbeddingCollection`` / ``EmbeddingBagCollection`` modules
            (changed: prepared for quantization).
        weight_type: ``"int8"`` or ``"fp16"``.
        sharding: TorchRec's sharding type of every table.
        world_size: shards per row-wise table (and ranks to place tables on).
    """
    from torchrec import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.distributed.fused_params import FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS
    from torchrec.distributed.global_settings import set_propogate_device
    from torchrec.distributed.planner import ParameterConstraints
    from torchrec.distributed.quant_embedding import QuantEmbeddingCollectionSharder
    from torchrec.distributed.quant_embeddingbag import QuantEmbeddingBagCollectionSharder
    from torchrec.inference.modules import DEFAULT_FUSED_PARAMS, quantize_inference_model, shard_quant_model
    from torchrec.quant.embedding_modules import quant_prep_enable_quant_state_dict_split_scale_bias_for_types

    split = weight_type == "int8"
    if split:  # the quantized state dict in the sharded model's keys: weight, weight_qscale, weight_qbias
        quant_prep_enable_quant_state_dict_split_scale_bias_for_types(model, [EmbeddingCollection, EmbeddingBagCollection])
    names = [c.name for m in model.modules() if isinstance(m, (EmbeddingCollection, EmbeddingBagCollection))
             for c in (m.embedding_configs() if isinstance(m, EmbeddingCollection) else m.embedding_bag_configs())]
    dtype = {"int8": torch.int8, "fp16": torch.float16}[weight_type]
    quant = quantize_inference_model(model, quantization_dtype=dtype)
    fused = dict(DEFAULT_FUSED_PARAMS, **{FUSED_PARAM_QUANT_STATE_DICT_SPLIT_SCALE_BIAS: split})
    set_propogate_device(True)
    constraints = {n: ParameterConstraints(sharding_types=[sharding], compute_kernels=["quant"]) for n in names}
    out, _ = shard_quant_model(copy.deepcopy(quant), world_size=world_size, compute_device="cpu",
                               sharding_device="cpu", constraints=constraints,
                               sharders=[QuantEmbeddingCollectionSharder(fused_params=fused),
                                         QuantEmbeddingBagCollectionSharder(fused_params=fused)])
    # the sharded model's FBGEMM modules do not hold the quantized weights; TorchRec's own load
    # fills them (its ``tbes`` buffers are per shard group, not the unsharded model's)
    out.load_state_dict({k: v for k, v in quant.state_dict().items() if ".tbes." not in k}, strict=False)
    return out


def _model(rows: int, seed: int) -> nn.Module:
    from torchrec import EmbeddingCollection, EmbeddingConfig

    torch.manual_seed(seed)
    model = nn.Module()
    model.sparse = EmbeddingCollection(tables=[EmbeddingConfig(
        name=f"t{t}", embedding_dim=DIM, num_embeddings=rows, feature_names=[f"f{t}"]) for t in range(TABLES)])
    return model


def _poll(rows: int, n: int, seed: int) -> Any:
    from torchrec.distributed.model_tracker.types import UniqueRows

    from persistent_delta.read.results import DeltaPoll, RankDelta, TableDelta

    g = torch.Generator().manual_seed(seed)
    rank = RankDelta(0, "", 1, 2)
    for t in range(TABLES):
        ids = torch.randperm(rows, generator=g)[:n].sort().values
        fqn = f"sparse.embeddings.t{t}"
        rank.tables[fqn] = TableDelta(fqn, 0, 1, 2, UniqueRows(ids=ids, states=torch.randn(n, DIM, generator=g)), ids,
                                      None)
    return DeltaPoll("snapshots", {0: rank}, world_size=1)


def run(rows: int, poll_rows: int, rounds: int) -> List[Dict[str, Any]]:
    from torchrec.inference.modules import quantize_inference_model

    from persistent_delta.serve.inference import InferenceReplica

    torch.set_num_threads(1)
    replicas = {
        "unsharded": InferenceReplica(quantize_inference_model(_model(rows, 0))),
        "unsharded (A/A)": InferenceReplica(quantize_inference_model(_model(rows, 0))),
        "table_wise": InferenceReplica(shard_quantized(_model(rows, 0), "int8", "table_wise")),
        "row_wise": InferenceReplica(shard_quantized(_model(rows, 0), "int8", "row_wise")),
    }
    polls = [_poll(rows, poll_rows, s) for s in range(4)]
    cpu: Dict[str, List[float]] = {k: [] for k in replicas}
    for r in range(rounds):
        log("round %d of %d", r + 1, rounds)
        for name, replica in replicas.items():
            for p in polls:
                t0 = time.process_time()
                replica.apply_poll(p)
                cpu[name].append(time.process_time() - t0)
    return [emit("inference_apply", variant=name, rows=rows, poll_rows=poll_rows * TABLES, polls=len(v),
                 cpu_ms_median=1e3 * median(v), cpu_ms_min=1e3 * min(v)) for name, v in cpu.items()]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--poll-rows", type=int, default=50_000, help="rows of each table in a poll")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.rows, args.poll_rows = 2, 20_000, 5_000
    run(args.rows, args.poll_rows, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
