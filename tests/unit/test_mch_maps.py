"""A quantized managed-collision model's raw-id maps: slot reassignments written into TorchRec's
MCH buffers remap raw ids as the trainer's map does (TorchRec's own remap reads them), bad
reassignments and unsupported modules refused, typed."""

from __future__ import annotations

import pytest
import torch
from torchrec import EmbeddingCollection, EmbeddingConfig
from torchrec.inference.modules import quantize_inference_model
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingCollection
from torchrec.modules.mc_modules import LFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule
from torchrec.sparse.jagged_tensor import JaggedTensor

from persistent_delta.errors import ReplicaMismatchError
from persistent_delta.log.zch_records import NO_RAW_ID, ZchDelta
from persistent_delta.read.inference import InferenceReplica

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
