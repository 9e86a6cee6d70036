"""A quantized managed-collision model's raw-id maps: slot reassignments written into TorchRec's
MCH buffers remap raw ids as the trainer's map does (TorchRec's own remap reads them), bad
reassignments and unsupported modules refused, typed; and a request served while polls are
applied never remaps a raw id with one publish's map and reads the slot's row of another."""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed.model_tracker.types import UniqueRows
from torchrec.inference.modules import quantize_inference_model
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
from torchrec.modules.mc_modules import LFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule
from torchrec.sparse.jagged_tensor import JaggedTensor

from persistent_delta.errors import ReplicaMismatchError
from persistent_delta.log.zch_records import NO_RAW_ID, ZchDelta
from persistent_delta.serve.inference import InferenceReplica
from persistent_delta.read.results import DeltaPoll, RankDelta, TableDelta

SLOTS, DIM = 16, 4


def _model(slots: int = SLOTS) -> torch.nn.Module:
    ec = EmbeddingCollection(tables=[EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=SLOTS,
                                                     feature_names=["f"])])
    mcc = ManagedCollisionCollection(managed_collision_modules={"t": MCHManagedCollisionModule(
        zch_size=slots, device=torch.device("cpu"), eviction_policy=LFU_EvictionPolicy(), eviction_interval=2,
        input_hash_size=1000)}, embedding_configs=ec.embedding_configs())
    model = torch.nn.Module()
    model.sparse = ManagedCollisionEmbeddingCollection(ec, mcc, return_remapped_features=False)
    return quantize_inference_model(model)


def _delta(slots, taken, given) -> ZchDelta:
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    return ZchDelta("sparse.t", 0, 1, slots=t(slots), taken=t(taken), given=t(given))


def _remap(replica: InferenceReplica, raw) -> list:
    mcm = replica.maps["sparse._embedding_module.embeddings.t"].module
    return mcm.remap({"t": JaggedTensor(values=torch.tensor(raw), lengths=torch.ones(len(raw), dtype=torch.long))}
                     )["t"].values().tolist()


def test_reassignments_in_order_give_torchrecs_remap():
    replica = InferenceReplica(_model())
    mc = replica.maps["sparse._embedding_module.embeddings.t"]
    assert not mc.module.training  # eval: requests neither admit nor evict
    # slot 3 taken by 10, then 10 evicted for 12; slot 5 to 7; slot 9 to 10 (10 moved)
    for d in (_delta([3, 5], [NO_RAW_ID, NO_RAW_ID], [10, 7]), _delta([3, 9], [10, NO_RAW_ID], [12, 10])):
        mc.write(mc.planned(d))
    raw, slots = replica.raw_id_map("t")
    assert raw.tolist() == [7, 10, 12] and slots.tolist() == [5, 9, 3]
    assert sorted(mc.mapping.tolist()) == list(range(SLOTS))  # still a permutation of the slots
    assert _remap(replica, [12, 7, 10, 99]) == [3, 5, 9, SLOTS - 1]  # 99: never admitted, the default slot
    # an eviction without a successor: the slot is empty, the raw id falls to the default slot
    mc.write(mc.planned(_delta([5], [7], [NO_RAW_ID])))
    assert _remap(replica, [7, 12]) == [SLOTS - 1, 3]


def test_bad_reassignments_and_models_are_refused():
    replica = InferenceReplica(_model())
    mc = replica.maps["sparse._embedding_module.embeddings.t"]
    with pytest.raises(ReplicaMismatchError, match="slot 16"):
        mc.planned(_delta([16], [NO_RAW_ID], [4]))
    assert mc.planned(_delta([], [], [])) is None
    model = _model()
    model.sparse._managed_collision_collection._managed_collision_modules["t"] = MCHManagedCollisionModule(
        zch_size=SLOTS // 2, device=torch.device("cpu"), eviction_policy=LFU_EvictionPolicy(), eviction_interval=2,
        input_hash_size=1000)
    with pytest.raises(ReplicaMismatchError, match="8 slots"):
        InferenceReplica(model)


# ----------------------------------------------------------------------------- serving while applying

SERVE_SLOTS, SERVE_DIM, PUBLISHES = 4096, 32, 5
FQN = "sparse._managed_collision_collection._managed_collision_modules.t"  # the trainer's fqn of an MC table


def _serving_model() -> torch.nn.Module:
    ec = EmbeddingCollection(tables=[EmbeddingConfig(name="t", embedding_dim=SERVE_DIM, num_embeddings=SERVE_SLOTS,
                                                     feature_names=["f"])])
    mcc = ManagedCollisionCollection(managed_collision_modules={"t": MCHManagedCollisionModule(
        zch_size=SERVE_SLOTS, device=torch.device("cpu"), eviction_policy=LFU_EvictionPolicy(), eviction_interval=2,
        input_hash_size=1 << 20)}, embedding_configs=ec.embedding_configs())
    model = torch.nn.Module()
    model.sparse = ManagedCollisionEmbeddingCollection(ec, mcc, return_remapped_features=False)
    return quantize_inference_model(model)


def _publishes() -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Per publish: raw id r's slot (every publish moves every raw id) and the rows by slot (raw
    id r's row at slot[r]; a row of its own per raw id and publish)."""
    g = torch.Generator().manual_seed(5)
    raw = SERVE_SLOTS - 1  # the last slot is MCH's default
    out = []
    for p in range(PUBLISHES):
        slot = torch.randperm(raw, generator=g)
        rows = torch.zeros(SERVE_SLOTS, SERVE_DIM)
        rows[slot] = torch.randn(raw, SERVE_DIM, generator=g) * (1 + p)
        out.append((slot, rows))
    return out


def _poll(prev_slot: Optional[torch.Tensor], slot: torch.Tensor, rows: torch.Tensor) -> DeltaPoll:
    """A snapshots poll of one publish: every row, and the slot reassignments from ``prev_slot``."""
    raw = torch.arange(slot.numel())
    taken = torch.full((SERVE_SLOTS,), NO_RAW_ID, dtype=torch.int64)
    if prev_slot is not None:
        taken[prev_slot] = raw
    slots = torch.arange(SERVE_SLOTS - 1)
    given = torch.empty(SERVE_SLOTS - 1, dtype=torch.int64)
    given[slot] = raw
    z = ZchDelta(FQN, 1, 2, slots=slots, taken=taken[:-1], given=given)
    ids = torch.arange(SERVE_SLOTS)
    td = TableDelta(FQN, 0, 1, 2, UniqueRows(ids=ids, states=rows), ids, None, zch=z)
    rank = RankDelta(0, "", 1, 2)
    rank.tables[FQN] = td
    return DeltaPoll("snapshots", {0: rank}, world_size=1)


def _serve_case(replica: InferenceReplica, seconds: float, after: Callable[[], None] = lambda: None
                ) -> Dict[str, int]:
    """Apply the publishes in a loop while a thread looks up every raw id; count served rows
    that are no publish's row of that raw id (a map of one publish with rows of another)."""
    pubs = _publishes()
    raw = torch.arange(SERVE_SLOTS - 1)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=raw, lengths=torch.ones(raw.numel(), dtype=torch.long))

    def served() -> torch.Tensor:
        with replica.serving() as model, torch.no_grad():
            return model.sparse(kjt)[0]["f"].values()

    expect, prev = [], None
    for slot, rows in pubs:
        replica.apply_poll(_poll(prev, slot, rows))
        after()
        expect.append(served())
        prev = slot
    expect_all = torch.stack(expect)  # [publishes, raw ids, dim]
    stop = threading.Event()
    bad = {"mixed": 0, "requests": 0}

    def serve() -> None:
        while not stop.is_set():
            out = served()
            bad["mixed"] += int((~(expect_all == out[None]).all(dim=2).any(dim=0)).sum())
            bad["requests"] += 1

    server = threading.Thread(target=serve)
    server.start()
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            for p, (slot, rows) in enumerate(pubs):
                replica.apply_poll(_poll(prev, slot, rows))
                after()
                prev = slot
    finally:
        stop.set()
        server.join()
    return bad


def test_a_request_never_remaps_with_one_publishs_map_and_reads_anothers_rows():
    replica = InferenceReplica(_serving_model(), chunk_rows=256)  # rows in chunks; an MC table's rows and map in one
    bad = _serve_case(replica, seconds=1.0)
    assert bad["requests"] > 3 and bad["mixed"] == 0, bad


def test_with_the_map_written_apart_requests_mix_publishes():
    """The check above can fail: with the map written in a hold of its own after the rows,
    requests between the two remap raw ids to the previous publish's slots."""
    replica = InferenceReplica(_serving_model(), chunk_rows=256)
    held: List[Tuple[Callable[..., None], object]] = []
    for mc in replica.maps.values():
        mc.write = lambda update, write=mc.write: held.append((write, update))  # type: ignore[method-assign]

    def write_maps() -> None:
        time.sleep(0.002)  # requests run between the rows' hold and the map's
        while held:
            write, update = held.pop()
            with replica._lock.writing():
                write(update)

    bad = _serve_case(replica, seconds=1.0, after=write_maps)
    assert bad["mixed"] > 0, bad
