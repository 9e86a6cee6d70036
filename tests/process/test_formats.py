"""Row formats of published snapshots: what each snapshots consumer receives.

A real 2-rank job (a column-wise table and a replicated one) publishes while one snapshots
consumer per row format is registered; each consumer's polls, applied to a replica in that
format, must equal the trainer's tables at the last publish converted to that format:
``.to(dtype)`` for float16/bfloat16, and for int8 the rows TorchRec's own inference
quantization (``quantize_inference_model``) stores for the same tables -- the column-wise
table's halves joined and quantized as whole rows. Also: each consumer gets only its format,
registration keeps a format, forged formats are refused.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
import torch

from harness import global_table_weights, run_spawn
from persistent_delta.errors import ConfigMismatchError, InvalidInputError
from persistent_delta.log import codec
from persistent_delta.serve.apply import apply_poll
from persistent_delta.read.consumer import DeltaConsumer
from tracker_cases import FORMAT_CONSUMERS, publish_formats_case

# A 2-rank job costs ~40 s here: make test-all. make test keeps the fast checks of the same
# contract (tests/unit/test_row_formats.py: conversion, filter, int8 = TorchRec's rows, the join).
pytestmark = [pytest.mark.dist, pytest.mark.slow]

NUM_TABLES, ROWS, DIM = 2, 100, 8


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Tuple[str, Dict[str, torch.Tensor]]:
    root = str(tmp_path_factory.mktemp("formats"))
    results: List[Dict[str, Any]] = run_spawn(publish_formats_case, 2, root, "column_wise", (1,))
    want: Dict[str, torch.Tensor] = {}
    for res in results:
        for fqn, (w, info) in res["shards"].items():
            table = want.setdefault(fqn, torch.full((info["global_rows"], info["global_cols"]), float("nan")))
            r0, c0 = info["row_offset"], info["col_offset"]
            table[r0:r0 + w.shape[0], c0:c0 + w.shape[1]] = w
    assert len(want) == NUM_TABLES and not any(t.isnan().any() for t in want.values())
    return root, want


def _torchrec_int8(tables: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """TorchRec's own int8 inference rows of these full tables (fqn -> uint8 [rows, dim + 4])."""
    from torchrec.inference.modules import quantize_inference_model
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    names = {fqn.rsplit(".", 1)[-1]: fqn for fqn in tables}
    ec = EmbeddingCollection(tables=[EmbeddingConfig(name=n, embedding_dim=DIM, num_embeddings=ROWS,
                                                     feature_names=[f"f_{n}"]) for n in sorted(names)])
    with torch.no_grad():
        for n, fqn in names.items():
            ec.embeddings[n].weight.copy_(tables[fqn])
    model = torch.nn.Sequential(ec)
    q = quantize_inference_model(model)
    qec = q[0]
    out: Dict[str, torch.Tensor] = {}
    for tbe in qec._emb_modules:  # FBGEMM IntNBitTableBatchedEmbeddingBagsCodegen
        for spec, (values, scale_bias) in zip(tbe.embedding_specs, tbe.split_embedding_weights()):
            out[names[spec[0]]] = torch.cat([values, scale_bias], dim=1)  # values, then fp16 scale and bias
    return out


def _replica(fmt: str, want: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Empty replica tables of ``fmt`` (NaN / 0xFF where nothing was published)."""
    base = global_table_weights(NUM_TABLES, ROWS, DIM, seed=0)
    out = {}
    for fqn in want:
        init = base[fqn.rsplit(".", 1)[-1]]
        if fmt == "int8":
            out[fqn] = codec.quantize_int8(init)
        else:
            out[fqn] = init.to({"native": torch.float32, "float32": torch.float32, "float16": torch.float16,
                                "bfloat16": torch.bfloat16}[fmt])
    return out


def _apply(poll: Any, replica: Dict[str, torch.Tensor]) -> None:
    """Apply a poll: float formats by ``apply_poll``, int8 (whole rows: one part per table
    but a replicated one's) through ``merged()`` (newest publish wins across ranks)."""
    for fqn, parts in poll.tables().items():
        for p in parts:
            assert p.format == poll.format
            if poll.format == "int8":
                assert p.states.dtype == torch.uint8 and p.states.shape[1] == DIM + 4
                assert len(parts) == 1 or p.shard.replicated
    if poll.format != "int8":
        apply_poll(replica, poll)
        return
    for fqn, m in poll.merged().items():
        replica[fqn].index_copy_(0, m.global_ids, m.states)
    with pytest.raises(InvalidInputError, match="int8"):
        apply_poll(replica, poll)  # float tables' apply refuses int8 rows


@pytest.mark.parametrize("name", sorted(FORMAT_CONSUMERS))
def test_each_format_round_trips(job, name):
    root, want = job
    fmt = FORMAT_CONSUMERS[name]
    replica = _replica(fmt, want)
    with DeltaConsumer(root, name, channel="snapshots", format=fmt, register=False) as c:
        poll = c.poll()
        assert poll.num_rows and poll.format == fmt
        _apply(poll, replica)
        assert poll.unjoined == 0
        assert poll.passed_over > 0  # the other formats' records were there, and passed over
        again = c.poll()
        assert again.empty
    if fmt == "int8":
        ref = _torchrec_int8(want)
        for fqn in want:
            bad = (replica[fqn] != ref[fqn]).any(1).nonzero().flatten().tolist()
            assert not bad, (fqn, bad[:10], replica[fqn][bad[:2]], ref[fqn][bad[:2]])  # bit-equal, scale and bias too
        # a column half quantized alone differs: the join is needed
        fqn = next(f for f in want if "table_0" in f)
        assert not torch.equal(codec.quantize_int8(want[fqn][:, :DIM // 2])[:, :DIM // 2], ref[fqn][:, :DIM // 2])
    else:
        dtype = {"native": torch.float32, "float32": torch.float32, "float16": torch.float16,
                 "bfloat16": torch.bfloat16}[fmt]
        for fqn in want:
            assert replica[fqn].dtype == dtype and torch.equal(replica[fqn], want[fqn].to(dtype)), fqn


def test_registration_keeps_its_format(job):
    root, _ = job
    with pytest.raises(ConfigMismatchError, match="'int8' rows"):
        DeltaConsumer(root, "replica-int8", channel="snapshots", format="float16", register=False)
    with pytest.raises(InvalidInputError, match="'int8'"):
        DeltaConsumer(root, "replica-x", channel="snapshots", format="int4")
    with pytest.raises(InvalidInputError, match="snapshots"):
        DeltaConsumer(root, "replica-y", format="int8")
