"""The inference replica: polls written into a TorchRec quantized model in place, bit-exact
with TorchRec's own quantization, refusals typed, and requests that never see a mixed row.

Models are real TorchRec EC/EBC modules quantized with ``quantize_inference_model``; polls are
built by hand in the layout the log's readers return (one rank, or column halves).
"""

from __future__ import annotations

import copy
import threading
import time
from contextlib import nullcontext
from typing import Dict, List, Optional

import pytest
import torch
from torchrec import KeyedJaggedTensor
from torchrec.distributed.model_tracker.types import UniqueRows
from torchrec.inference.modules import quantize_embeddings, quantize_inference_model

from persistent_delta import apply_poll
from persistent_delta.errors import IncompletePollError, InvalidInputError, ReplicaMismatchError, ServingLockError
from persistent_delta.log.schema import ShardInfo
from persistent_delta.serve.inference import InferenceReplica
from persistent_delta.read.results import DeltaPoll, RankDelta, TableDelta

from inference_cases import Sparse as _Sparse

ROWS, DIM = 64, 8
DTYPES = {"int8": torch.int8, "fp16": torch.float16}


def Sparse(kind: str, rows: int = ROWS, dim: int = DIM, tables: int = 2) -> _Sparse:  # noqa: N802 - a model "class"
    """An EC or EBC of two tables under ``sparse`` (the trainer's fqns: ``sparse.embeddings.table_0``)."""
    return _Sparse(kind, rows, dim, tables)


def torchrec_bytes(model: Sparse, dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """TorchRec's own quantization of ``model``'s current tables, in the replica's layout."""
    return InferenceReplica(quantize_inference_model(copy.deepcopy(model), quantization_dtype=dtype)).all_weights()


def poll_of(parts: List[TableDelta], world_size: int = 1, start: int = 1, end: int = 2) -> DeltaPoll:
    ranks: Dict[int, RankDelta] = {}
    for p in parts:
        ranks.setdefault(p.rank, RankDelta(p.rank, "", start, end)).tables[p.fqn] = p
    return DeltaPoll("snapshots", ranks, world_size=world_size)


def part(fqn: str, ids: torch.Tensor, states: torch.Tensor, rank: int = 0, shard: Optional[ShardInfo] = None,
         fmt: Optional[str] = None) -> TableDelta:
    td = TableDelta(fqn, rank, 1, 2, UniqueRows(ids=ids, states=states), ids.to(torch.int64), shard)
    if fmt is not None:
        td.format = fmt  # type: ignore[attr-defined]  # the record format (TableDelta.format)
    return td


@pytest.mark.parametrize("kind", ["ec", "ebc"])
@pytest.mark.parametrize("wt", ["int8", "fp16"])
def test_float_rows_give_torchrecs_own_quantization(kind, wt):
    torch.manual_seed(0)
    model = Sparse(kind)
    replica = InferenceReplica(quantize_inference_model(copy.deepcopy(model), quantization_dtype=DTYPES[wt]))
    assert sorted(replica.tables) == [model.fqn(0), model.fqn(1)]
    for step in range(3):  # three publishes, each changing some rows of both tables
        ids = torch.randperm(ROWS)[:20].sort().values
        parts = []
        for t in range(2):
            w = model.get_parameter(model.fqn(t) + ".weight")
            with torch.no_grad():
                w[ids] += torch.randn(ids.numel(), DIM) * (step + 1)
            parts.append(part(model.fqn(t), ids, w.detach()[ids].clone()))
        applied = apply_poll(replica, poll_of(parts))
        assert applied.rows == 2 * ids.numel()
        want = torchrec_bytes(model, DTYPES[wt])
        got = replica.all_weights()
        for fqn in want:
            assert torch.equal(got[fqn], want[fqn]), (fqn, step)


def test_the_forward_follows_the_applied_rows():
    model = Sparse("ebc")
    replica = InferenceReplica(quantize_inference_model(copy.deepcopy(model)))
    new = torch.randn(ROWS, DIM)
    ids = torch.arange(ROWS)
    replica.apply_poll(poll_of([part(model.fqn(0), ids, new)]))
    model.set_weights({model.fqn(0): new})
    want = quantize_inference_model(copy.deepcopy(model))
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=torch.cat([ids, ids]),
                                              lengths=torch.ones(2 * ROWS, dtype=torch.long))
    assert torch.equal(replica.forward(kjt).values(), want(kjt).values())


def test_quantize_embeddings_ebc_is_the_same_table():
    model = Sparse("ebc")
    replica = InferenceReplica(quantize_embeddings(copy.deepcopy(model), dtype=torch.float16, inplace=False))
    assert {t.weight_type for t in replica.tables.values()} == {"float16"}
    with pytest.raises(ReplicaMismatchError, match="quantize_inference_model"):  # it leaves an EC in float
        InferenceReplica(quantize_embeddings(Sparse("ec"), dtype=torch.qint8, inplace=False))


@pytest.mark.parametrize("wt", ["int8", "fp16"])
def test_column_halves_are_joined_before_quantizing(wt):
    model = Sparse("ec")
    replica = InferenceReplica(quantize_inference_model(copy.deepcopy(model), quantization_dtype=DTYPES[wt]))
    ids = torch.tensor([1, 5, 9, 63])
    rows = torch.randn(ids.numel(), DIM) * torch.tensor([1.0] * 4 + [50.0] * 4)  # halves of other ranges
    halves = [part(model.fqn(0), ids, rows[:, c:c + 4], rank=r,
                   shard=ShardInfo("table_0", "column_wise", 0, c, ROWS, 4, ROWS, DIM))
              for r, c in ((0, 0), (1, 4))]
    replica.apply_poll(poll_of(halves, world_size=2), complete_only=True)
    with torch.no_grad():
        model.get_parameter(model.fqn(0) + ".weight")[ids] = rows
    assert torch.equal(replica.all_weights()[model.fqn(0)], torchrec_bytes(model, DTYPES[wt])[model.fqn(0)])
    # a later poll where one rank re-sends rows the other does not: the other half is the one kept
    more = torch.randn(ids.numel(), DIM)
    later = [part(model.fqn(0), ids, more[:, :4], rank=0, shard=halves[0].shard),
             part(model.fqn(0), ids[:2], more[:2, 4:], rank=1, shard=halves[1].shard)]
    replica.apply_poll(poll_of(later, world_size=2))
    with torch.no_grad():
        model.get_parameter(model.fqn(0) + ".weight")[ids, :4] = more[:, :4]
        model.get_parameter(model.fqn(0) + ".weight")[ids[:2], 4:] = more[:2, 4:]
    assert torch.equal(replica.all_weights()[model.fqn(0)], torchrec_bytes(model, DTYPES[wt])[model.fqn(0)])
    # a fresh replica never received the other half of those rows: refused, nothing written ...
    fresh = InferenceReplica(quantize_inference_model(copy.deepcopy(model), quantization_dtype=DTYPES[wt]))
    before = fresh.all_weights()
    with pytest.raises(IncompletePollError, match="base"):
        fresh.apply_poll(poll_of(later, world_size=2))
    assert all(torch.equal(before[f], w) for f, w in fresh.all_weights().items())
    # ... unless it was given the float base
    base = {model.fqn(0): model.get_parameter(model.fqn(0) + ".weight").detach().clone()}
    fresh = InferenceReplica(quantize_inference_model(copy.deepcopy(model), quantization_dtype=DTYPES[wt]), base=base)
    fresh.apply_poll(poll_of(later, world_size=2))
    assert torch.equal(fresh.all_weights()[model.fqn(0)], torchrec_bytes(model, DTYPES[wt])[model.fqn(0)])


def test_float16_halves_of_other_rows_are_joined():
    model = Sparse("ec")
    replica = InferenceReplica(quantize_inference_model(copy.deepcopy(model), quantization_dtype=torch.float16))
    shards = [ShardInfo("table_0", "column_wise", 0, c, ROWS, 4, ROWS, DIM) for c in (0, 4)]
    ids = torch.tensor([1, 5, 9])
    old, new = torch.randn(3, DIM).half(), torch.randn(3, DIM).half()
    for rows, n in ((old, 3), (new, 1)):  # both halves of every row, then one rank's halves of one row only
        replica.apply_poll(poll_of([part(model.fqn(0), ids, rows[:, :4], 0, shards[0], "float16"),
                                    part(model.fqn(0), ids[:n], rows[:n, 4:], 1, shards[1], "float16")], 2))
    want = torch.cat([new[:, :4], torch.cat([new[:1, 4:], old[1:, 4:]])], dim=1)
    assert torch.equal(replica.all_weights()[model.fqn(0)][ids], want)


def test_int8_and_float16_records_are_copied_as_they_are():
    model = Sparse("ebc")
    q8 = InferenceReplica(quantize_inference_model(copy.deepcopy(model)))
    q16 = InferenceReplica(quantize_inference_model(copy.deepcopy(model), quantization_dtype=torch.float16))
    ids = torch.tensor([0, 7, 30])
    rows = torch.randn(ids.numel(), DIM)
    int8 = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(rows, 8)
    q8.apply_poll(poll_of([part(model.fqn(1), ids, int8, fmt="int8")]))
    assert torch.equal(q8.all_weights()[model.fqn(1)][ids], int8)
    q16.apply_poll(poll_of([part(model.fqn(1), ids, rows.half(), fmt="float16")]))
    assert torch.equal(q16.all_weights()[model.fqn(1)][ids], rows.half())
    # formats that would not give TorchRec's bytes are refused, naming the table and the format
    for replica, bad, fmt in [(q8, rows.bfloat16(), "bfloat16"), (q8, rows.half(), "float16"),
                              (q16, int8, "int8"), (q16, rows.bfloat16(), "bfloat16"), (q8, rows.double(), None)]:
        before = replica.all_weights()
        with pytest.raises(ReplicaMismatchError, match="table_1"):
            replica.apply_poll(poll_of([part(model.fqn(0), ids, rows), part(model.fqn(1), ids, bad, fmt=fmt)]))
        assert all(torch.equal(before[f], w) for f, w in replica.all_weights().items())  # table_0 neither
    # an int8 record whose scale is not a number
    nan = int8.clone()
    nan[0, DIM:DIM + 2] = torch.tensor([float("nan")], dtype=torch.float16).view(torch.uint8)
    with pytest.raises(ReplicaMismatchError, match="scale"):
        q8.apply_poll(poll_of([part(model.fqn(1), ids, nan, fmt="int8")]))


def test_tables_are_matched_by_name_and_checked():
    model = Sparse("ec")
    replica = InferenceReplica(quantize_inference_model(copy.deepcopy(model)))
    ids = torch.tensor([2, 3])
    rows = torch.randn(2, DIM)
    # another module path, the same table name (e.g. the trainer wraps the collection)
    replica.apply_poll(poll_of([part("model.tower.sparse.embeddings.table_0", ids, rows)]))
    assert torch.equal(replica.all_weights()[model.fqn(0)][ids],
                       torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(rows, 8))
    cases = [
        ([part("sparse.embeddings.table_9", ids, rows)], "no table"),
        ([part(model.fqn(0), ids, torch.randn(2, DIM * 2))], "columns"),
        ([part(model.fqn(0), torch.tensor([3, ROWS]), rows)], "rows"),
        ([part(model.fqn(0), ids, rows, shard=ShardInfo("table_0", "row_wise", 0, 0, 2, DIM, ROWS * 2, DIM))],
         "rows"),
    ]
    for parts, what in cases:
        with pytest.raises(ReplicaMismatchError, match=what):
            replica.apply_poll(poll_of(parts))
    replica.apply_poll(poll_of([part("sparse.embeddings.table_9", ids, rows)]), strict=False)  # skipped
    with pytest.raises(InvalidInputError, match="snapshots"):
        replica.apply_poll(DeltaPoll("lookups", {}))
    with pytest.raises(IncompletePollError):
        replica.apply_poll(poll_of([part(model.fqn(0), ids, rows)], world_size=2), complete_only=True)
    with pytest.raises(ReplicaMismatchError, match="no quantized"):
        InferenceReplica(Sparse("ec"))
    with pytest.raises(InvalidInputError):
        InferenceReplica(quantize_inference_model(Sparse("ec")), chunk_rows=0)


# ----------------------------------------------------------------------------- serving while applying

SERVE_ROWS, SERVE_DIM, PUBLISHES = 4096, 64, 6


def _serve_case(replica: InferenceReplica, tables: List[torch.Tensor], seconds: float) -> Dict[str, int]:
    """Apply ``tables[1:]`` one publish after another while a thread serves single-id bags of
    every row; return how many served rows matched no publish allowed at that time."""
    fqn = "sparse.embedding_bags.table_0"
    ids = torch.arange(SERVE_ROWS)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0"], values=ids, lengths=torch.ones(SERVE_ROWS, dtype=torch.long))
    # the output of each publish's weights, served alone
    outputs = []
    for w in tables:
        replica.apply_poll(poll_of([part(fqn, ids, w)]))
        outputs.append(replica.forward(kjt).values())
    replica.apply_poll(poll_of([part(fqn, ids, tables[0])]))
    expect = torch.stack(outputs)  # [publishes + 1, rows, dim]
    history = [0]  # the publish applied at each position (0: the starting tables)
    done = [0]  # positions of history applied completely
    stop = threading.Event()
    bad = {"mixed": 0, "requests": 0, "out_of_window": 0}

    def serve() -> None:
        while not stop.is_set():
            lo = done[0]
            out = replica.forward(kjt).values()
            hi = len(history) - 1
            match = (expect == out[None]).all(dim=2)  # [publishes + 1, rows]
            allowed = sorted(set(history[lo:hi + 1]))
            bad["mixed"] += int((~match.any(dim=0)).sum())
            bad["out_of_window"] += int((~match[allowed].any(dim=0)).sum())
            bad["requests"] += 1

    server = threading.Thread(target=serve)
    server.start()
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            for p in list(range(1, len(tables))) + [0]:
                history.append(p)
                replica.apply_poll(poll_of([part(fqn, ids, tables[p])]))
                done[0] = len(history) - 1
    finally:
        stop.set()
        server.join()
    return bad


def _serving_tables() -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    # every row changes between publishes, and its range (so its scale) with it
    return [torch.randn(SERVE_ROWS, SERVE_DIM, generator=g) * (1 + p) for p in range(PUBLISHES)]


@pytest.mark.parametrize("poll_atomic", [False, True], ids=["chunks", "per_poll"])
def test_a_request_never_sees_a_mixed_row(poll_atomic):
    replica = InferenceReplica(quantize_inference_model(Sparse("ebc", SERVE_ROWS, SERVE_DIM, tables=1)),
                               chunk_rows=512, poll_atomic=poll_atomic)
    bad = _serve_case(replica, _serving_tables(), seconds=1.0)
    assert bad["requests"] > 3, bad
    assert bad["mixed"] == 0 and bad["out_of_window"] == 0, bad


def test_without_the_lock_requests_see_mixed_rows():
    """The check above can fail: with the lock taken away, served rows mix one publish's values
    with another's scale and bias."""
    replica = InferenceReplica(quantize_inference_model(Sparse("ebc", SERVE_ROWS, SERVE_DIM, tables=1)),
                               chunk_rows=SERVE_ROWS)
    replica._lock.writing = nullcontext  # type: ignore[method-assign]
    bad = _serve_case(replica, _serving_tables(), seconds=1.0)
    assert bad["mixed"] > 0, bad


def test_two_trainer_tables_of_one_name_are_never_written_into_one():
    """Two towers' ``table_0`` (or a table the model lacks beside a same-named one it has) are
    refused, in one poll and across polls; nothing is written; ``strict=False`` skips the table
    that has no table of its own."""
    model = Sparse("ec")
    replica = InferenceReplica(quantize_inference_model(copy.deepcopy(model)))
    before = replica.all_weights()
    ids, rows = torch.tensor([2, 3]), torch.randn(2, DIM)
    own, other = model.fqn(0), "item_tower.embeddings.table_0"
    with pytest.raises(ReplicaMismatchError, match="item_tower.embeddings.table_0.*never written into one"):
        replica.apply_poll(poll_of([part(own, ids, rows), part(other, ids, -rows)]))
    assert all(torch.equal(before[f], w) for f, w in replica.all_weights().items())  # nothing written
    replica.apply_poll(poll_of([part(own, ids, rows), part(other, ids, -rows)]), strict=False)
    want = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(rows, 8)
    assert torch.equal(replica.all_weights()[own][ids], want)  # the exact table, not the other tower's rows

    # across polls: the other tower alone, after the exact one was seen in an earlier poll
    fresh = InferenceReplica(quantize_inference_model(copy.deepcopy(model)))
    fresh.apply_poll(poll_of([part(own, ids, rows)]))
    with pytest.raises(ReplicaMismatchError, match="never written into one"):
        fresh.apply_poll(poll_of([part(other, ids, -rows)]))
    assert torch.equal(fresh.all_weights()[own][ids], want)

    # two fallbacks onto one table (neither is the model's own fqn)
    fresh = InferenceReplica(quantize_inference_model(copy.deepcopy(model)))
    with pytest.raises(ReplicaMismatchError, match="never written into one"):
        fresh.apply_poll(poll_of([part("a.embeddings.table_0", ids, rows), part("b.embeddings.table_0", ids, -rows)]))
    with pytest.raises(ReplicaMismatchError, match="never written into one"):
        fresh.table("a.embeddings.table_0")


def test_a_nested_read_finishes_while_an_apply_waits():
    """The read side is reentrant per thread: a request inside ``serving()`` runs while an
    apply on another thread waits for the outer hold (with a lock that prefers the writer and
    is not reentrant, both threads wait forever: the request thread is joined with a timeout)."""
    model = Sparse("ec")
    replica = InferenceReplica(quantize_inference_model(copy.deepcopy(model)))
    ids, rows = torch.tensor([1, 4]), torch.randn(2, DIM)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=torch.cat([ids, ids]),
                                              lengths=torch.ones(4, dtype=torch.long))
    applied, waiting = threading.Event(), threading.Event()
    seen: Dict[str, object] = {}

    def apply() -> None:
        replica.apply_poll(poll_of([part(model.fqn(0), ids, rows)]))
        applied.set()

    def request() -> None:
        with replica.serving():
            writer = threading.Thread(target=apply, daemon=True)
            writer.start()
            deadline = time.monotonic() + 5
            while not replica._lock._writers_waiting and time.monotonic() < deadline:
                time.sleep(0.001)
            seen["waiting"] = replica._lock._writers_waiting  # the apply now waits for this hold
            waiting.set()
            seen["weights"] = replica.weights(model.fqn(0))  # nested reads on the reading thread
            seen["forward"] = replica.forward(kjt)
            seen["applied_inside"] = applied.is_set()
        writer.join(5)

    thread = threading.Thread(target=request, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the nested read waited for the apply, which waits for the outer read"
    assert seen["waiting"] == 1 and seen["applied_inside"] is False
    assert seen["weights"].shape == (ROWS, DIM + 4)
    assert applied.is_set()
    assert torch.equal(replica.weights(model.fqn(0))[ids], torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(rows, 8))


def test_an_apply_inside_serving_is_refused_not_a_deadlock():
    """(Run on a thread joined with a timeout: waiting for its own read would hang forever.)"""
    model = Sparse("ec")
    replica = InferenceReplica(quantize_inference_model(copy.deepcopy(model)))
    before = replica.all_weights()
    raised: List[BaseException] = []

    def inside() -> None:
        with replica.serving():
            try:
                replica.apply_poll(poll_of([part(model.fqn(0), torch.tensor([1]), torch.randn(1, DIM))]))
            except ServingLockError as exc:
                raised.append(exc)

    thread = threading.Thread(target=inside, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "an apply inside serving() waited for its own read"
    assert raised and "inside InferenceReplica.serving" in str(raised[0])
    assert all(torch.equal(before[f], w) for f, w in replica.all_weights().items())
    replica.apply_poll(poll_of([part(model.fqn(0), torch.tensor([1]), torch.randn(1, DIM))]))  # the lock is free
