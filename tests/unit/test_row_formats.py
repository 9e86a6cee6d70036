"""Row formats of snapshot records through the writer's conversion, a local read and the
stream: a log whose publishes wrote native, float16 and int8 records (by
:func:`persistent_delta.trainer.publish.encode_formats`, the writer's own step), shipped
through the in-process memory transport; each reader, local or remote, gets exactly its
format's rows, and the remote ones equal the local ones bit for bit."""

from __future__ import annotations

import os
import time

import pytest
import torch

from persistent_delta.errors import CorruptRecordError
from persistent_delta.fleet.memory import MemoryBroker
from persistent_delta.fleet.remote import RemoteConsumer
from persistent_delta.fleet.ship import Shipper
from persistent_delta.log import codec
from persistent_delta.log.deltalog import DeltaLog
from persistent_delta.log.schema import META_SNAPSHOT_END, SNAPSHOTS, ConsumerEntry
from persistent_delta.read.consumer import DeltaReader
from persistent_delta.trainer.operations import GatheredRows, PublishRequest
from persistent_delta.trainer.publish import encode_formats

JOB, DIM, ROWS = "job-formats", 8, 64


def _publish_log(path: str) -> torch.Tensor:
    """Three publishes of table ``t`` (native, float16 and int8 records each); returns the
    table's values at the last one."""
    table = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(3))
    buffers = {}  # converted records' buffers, reused from publish to publish (as the tracker does)
    with DeltaLog(path) as log:
        def setup(w):
            e = w.ensure_table("t")
            e.values_dtype, e.values_tail = "float32", [DIM]
            w.stage_table(e)
        log.write(setup)
        for stamp in (1, 2, 3):
            table[stamp * 5:stamp * 5 + 9] += 0.5  # rows change between publishes
            ids = torch.arange(stamp * 5, stamp * 5 + 9 + stamp)
            t = time.time()
            value, values = codec.gather_record(ids, table, ids, codec.KIND_SNAPSHOT, t)
            request = PublishRequest("serving", stamp + 1, stamp, t, entry=ConsumerEntry(0), buffers=buffers,
                                     tables={"t": GatheredRows(ids, values, value, ("native", "float16", "int8"))})

            def put(w, stamp=stamp, request=request):
                for rec in encode_formats(request, "t"):
                    w.put_record(w.table("t").table_id, stamp, rec, channel=SNAPSHOTS)
                w.set_meta(META_SNAPSHOT_END, stamp + 1)
            log.write(put)
    return table


def test_each_reader_gets_its_format_locally_and_through_the_stream(tmp_path):
    root = str(tmp_path / "log")
    table = _publish_log(os.path.join(root, "rank-0"))
    touched = torch.arange(5, 5 * 3 + 9 + 3)
    want = {"native": table[touched], "float32": table[touched], "float16": table[touched].half(),
            "int8": codec.quantize_int8(table[touched])}
    local = {}
    for fmt, rows in want.items():
        with DeltaReader(root, channel=SNAPSHOTS, format=fmt) as r:
            poll = r.poll()
            (t,), = poll.tables().values()
            assert t.format == fmt and torch.equal(t.global_ids, touched) and torch.equal(t.states, rows), fmt
            assert poll.passed_over == 6  # 3 publishes x the 2 other records
            local[fmt] = poll
    broker = MemoryBroker()
    with Shipper(root, None, JOB, channels=["snapshots"], transport=broker.connect("shipper"), insecure=True) as s:
        s.run(idle_exit_s=0.2)
        assert all(not st["last_error"] for st in s.stats()), s.stats()
    for fmt in ("int8", "float16", "float32"):
        with RemoteConsumer(None, JOB, f"replica-{fmt}", channel=SNAPSHOTS, format=fmt, wait=5, insecure=True,
                            transport=broker.connect(fmt)) as c:
            got = c.poll()
            (t,), = got.tables().values()
            (w,), = local[fmt].tables().values()
            assert got.format == t.format == fmt and got.passed_over > 0
            assert torch.equal(t.global_ids, w.global_ids) and torch.equal(t.states, w.states), fmt


def _torchrec_int8(weights: torch.Tensor, kind: str) -> torch.Tensor:
    """TorchRec's own int8 inference rows of a table holding ``weights`` (uint8 [rows, dim + 4])."""
    from torchrec.inference.modules import quantize_inference_model
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    rows, dim = weights.shape
    if kind == "ec":
        m = EmbeddingCollection(tables=[EmbeddingConfig(name="t", embedding_dim=dim, num_embeddings=rows,
                                                        feature_names=["f"])])
    else:
        m = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name="t", embedding_dim=dim, num_embeddings=rows,
                                                              feature_names=["f"])])
    with torch.no_grad():
        (m.embeddings if kind == "ec" else m.embedding_bags)["t"].weight.copy_(weights)
    q = quantize_inference_model(torch.nn.Sequential(m))[0]
    (values, scale_bias), = q._emb_modules[0].split_embedding_weights()
    return torch.cat([values, scale_bias], dim=1)


def test_int8_rows_are_torchrecs_own_and_column_halves_join_to_them():
    """The int8 format is the bytes TorchRec's inference quantization stores (EC and EBC);
    column halves flagged int8 and joined by a poll (join_int8) give the same whole rows, and a
    half quantized alone would not."""
    from torchrec.distributed.model_tracker.types import UniqueRows

    from persistent_delta.log.schema import ShardInfo
    from persistent_delta.read.results import RankDelta, join_int8, table_delta

    weights = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(5)) * 3
    for kind in ("ec", "ebc"):
        assert torch.equal(codec.quantize_int8(weights), _torchrec_int8(weights, kind)), kind
    ids = torch.tensor([1, 4, 9, 30])
    ranks = {}
    for rank, c0 in ((0, 0), (1, DIM // 2)):
        shard = ShardInfo("t", "column_wise", 0, c0, ROWS, DIM // 2, ROWS, DIM)
        half = weights[ids, c0:c0 + DIM // 2]  # what a rank stores of a column-wise int8 record: float32 halves
        ids_r = ids if rank == 0 else torch.cat([ids, torch.tensor([50])])  # row 50: one half only
        half = half if rank == 0 else torch.cat([half, weights[50:51, c0:c0 + DIM // 2]])
        ranks[rank] = RankDelta(rank, "", 1, 2, {"t": table_delta("t", rank, 1, 2, UniqueRows(ids_r, half), shard,
                                                                   fmt="int8")})
    join_int8(ranks)
    assert "t" not in ranks[1].tables and ranks[0].unjoined == 1
    t = ranks[0].tables["t"]
    assert t.format == "int8" and t.shard.local_cols == DIM and torch.equal(t.global_ids, ids)
    assert torch.equal(t.states, _torchrec_int8(weights, "ec")[ids])
    assert not torch.equal(codec.quantize_int8(weights[ids, :DIM // 2])[:, :DIM // 2], t.states[:, :DIM // 2])


def test_float_formats_are_casts_and_int8_needs_float_rows():
    from persistent_delta.errors import InvalidInputError

    rows = torch.randn(5, DIM)
    ids = torch.arange(5)

    def converted(fmt):  # as a publish writes them: cast on their way into the record
        dtype, _ = codec.format_states(fmt, rows.dtype, (DIM,))
        return codec.decode_record(codec.encode_cast(ids, rows, dtype, fmt=fmt)).states

    assert torch.equal(converted("float16"), rows.to(torch.float16))
    assert torch.equal(converted("bfloat16"), rows.to(torch.bfloat16))
    assert codec.stored_format("float32", torch.float32) == "native"  # written once, as native
    with pytest.raises(InvalidInputError, match="float32 or float16"):
        codec.format_states("int8", torch.bfloat16, (DIM,))
    with pytest.raises(InvalidInputError, match="'native', 'float32'"):
        codec.check_format("int4")


def test_a_registration_keeps_its_format(tmp_path):
    from persistent_delta.errors import ConfigMismatchError, InvalidInputError
    from persistent_delta.read.consumer import DeltaConsumer

    root = str(tmp_path / "log")
    _publish_log(os.path.join(root, "rank-0"))
    with DeltaConsumer(root, "replica", channel=SNAPSHOTS, format="int8") as c:
        assert c.poll().format == "int8"
    with pytest.raises(ConfigMismatchError, match="'int8' rows"):
        DeltaConsumer(root, "replica", channel=SNAPSHOTS, format="float16")
    with pytest.raises(InvalidInputError, match="snapshots"):
        DeltaConsumer(root, "other", format="int8")
    with DeltaLog(os.path.join(root, "rank-0"), readonly=True) as log:
        assert log.read(lambda r: r.consumer("replica")).format == "int8"


def test_a_forged_format_is_refused():
    value = codec.encode_record(torch.arange(2), torch.zeros(2, 4), codec.KIND_SNAPSHOT, fmt="float16")
    with pytest.raises(CorruptRecordError, match="float16"):  # states of another dtype than the format's
        codec.decode_record_rows(value)
    import msgpack
    good = codec.encode_record(torch.arange(2), torch.zeros(2, 4, dtype=torch.float16), codec.KIND_SNAPSHOT,
                               fmt="float16")
    head_len = int.from_bytes(good[:4], "big")
    header = msgpack.unpackb(bytes(good[8:8 + head_len]))
    header["f"] = "float17"
    forged_head = msgpack.packb(header)
    assert len(forged_head) == head_len
    forged = bytearray(good)
    forged[8:8 + head_len] = forged_head
    codec.checksum_record(forged)
    with pytest.raises(CorruptRecordError, match="float17"):
        codec.decode_record_rows(forged)
