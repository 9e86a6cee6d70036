"""A TorchRec inference model follows a real sharded trainer: after every applied publish its
FBGEMM weights equal TorchRec's own quantization of the trainer's tables at that publish, bit for
bit (int8 and fp16), read from the local log and through the stream.

The trainer is 2 gloo ranks with a row-wise, a table-wise and a column-wise table (the column
halves are joined before quantizing); the replicas are this process, each holding
``quantize_inference_model`` of an unsharded copy of the model.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
import torch

from harness import global_table_weights, run_spawn
from inference_cases import full_tables, publishing_trainer, quantized, same_output, sharded_quantized, torchrec_bytes
from persistent_delta import DeltaConsumer, apply_poll
from persistent_delta.serve.inference import InferenceReplica

pytestmark = pytest.mark.dist

TABLES, ROWS, DIM, STEPS = 3, 100, 8, 4
SHARDING = "row_wise,table_wise,column_wise"


def _job(tmp_path_factory: Any, kind: str) -> Tuple[str, List[Dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp(f"inference-{kind}"))
    return root, run_spawn(publishing_trainer, 2, root, kind, SHARDING, TABLES, ROWS, DIM, STEPS)


@pytest.fixture(scope="module")
def ec_job(tmp_path_factory):
    return _job(tmp_path_factory, "ec")


def _replicas(kind: str, wts: Tuple[str, ...]) -> Dict[str, InferenceReplica]:
    base = global_table_weights(TABLES, ROWS, DIM, seed=0)
    return {wt: InferenceReplica(quantized(kind, base, wt), chunk_rows=16) for wt in wts}


def _expected(results: List[Dict[str, Any]], stamp: int) -> Dict[str, torch.Tensor]:
    return full_tables({r: res["at_publish"][stamp] for r, res in enumerate(results)})


def follow(kind: str, results: List[Dict[str, Any]], polls: Any, wts: Tuple[str, ...] = ("int8", "fp16")) -> int:
    """Apply every poll to a replica of each weight type; after each, compare with TorchRec's
    quantization of the trainer's tables at the poll's newest publish. Returns publishes seen."""
    replicas = _replicas(kind, wts)
    seen = 0
    for poll in polls:
        assert poll.complete
        stamp = max(poll.publishes)
        want = _expected(results, stamp)
        for wt, replica in replicas.items():
            applied = apply_poll(replica, poll, complete_only=True)  # apply_poll hands it to the replica
            assert applied.rows > 0
            expect = torchrec_bytes(kind, want, wt)
            got = replica.all_weights()
            assert sorted(got) == sorted(expect)
            for fqn in expect:
                assert torch.equal(got[fqn], expect[fqn]), (wt, fqn, stamp)
        seen += len(poll.publishes)
    return seen


def _local_polls(root: str, name: str, fmt: str = "native"):
    with DeltaConsumer(root, name, channel="snapshots", format=fmt) as consumer:
        while True:
            poll = consumer.poll(max_bytes=1)  # one publish per poll
            if poll.empty:
                return
            yield poll
            consumer.commit()


def test_every_publish_gives_torchrecs_quantization_of_the_trainers_tables(ec_job):
    root, results = ec_job
    stamps = sorted(results[0]["at_publish"])
    assert follow("ec", results, _local_polls(root, "quantized")) == len(stamps) == STEPS
    # the column-wise table really was split, and training moved every table
    assert any(info["col_offset"] for _, info in results[1]["at_publish"][stamps[0]].values())


@pytest.mark.parametrize("fmt,wt", [("int8", "int8"), ("float16", "fp16"), ("float32", "int8")])
def test_rows_published_in_the_tables_format_are_copied(ec_job, fmt, wt):
    """A consumer registered with the table's own format receives rows already quantized (the
    column-wise table's halves joined by the poll) and the replica copies them: the same bytes."""
    root, results = ec_job
    assert follow("ec", results, _local_polls(root, f"quantized-{fmt}", fmt), wts=(wt,)) == STEPS


def test_through_the_stream(ec_job, tmp_path):
    """A shipper carries the log over the in-process transport; a RemoteConsumer's polls are
    applied the same way, with the same result after each."""
    from persistent_delta.fleet.memory import MemoryBroker
    from persistent_delta.fleet.remote import RemoteConsumer
    from persistent_delta.fleet.ship import Shipper
    from persistent_delta.fleet.transport import StreamOptions

    root, results = ec_job
    broker = MemoryBroker()
    broker.connect().ensure_job("job", StreamOptions())
    with Shipper(root, None, "job", channels=["snapshots"], transport=broker.connect()) as shipper:
        while shipper.run_once():
            pass

    def polls():
        with RemoteConsumer(None, "job", "quantized", channel="snapshots", transport=broker.connect(), wait=5) as c:
            while True:
                poll = c.poll(timeout=0.5)
                if poll.empty:
                    return
                yield poll
                c.commit()

    assert follow("ec", results, polls()) == STEPS


# TorchRec's CPU sharding of a quantized model: table-wise (int8 and fp16), row-wise (int8)
SHARDED = [("int8", "table_wise"), ("float16", "table_wise"), ("int8", "row_wise")]


def _requests(kind: str) -> Any:
    """Every id of every table, one id per bag (an EBC's pooled row is the row itself)."""
    from torchrec import KeyedJaggedTensor

    ids = torch.arange(ROWS).repeat(TABLES)
    return KeyedJaggedTensor.from_lengths_sync(keys=[f"f{t}" for t in range(TABLES)], values=ids,
                                               lengths=torch.ones(ids.numel(), dtype=torch.long))


@pytest.fixture
def cpu_sharding():
    """TorchRec's CPU sharding needs ``set_propogate_device(True)`` while the sharded models
    live; the process's setting is restored after the test."""
    from torchrec.distributed.global_settings import get_propogate_device, set_propogate_device

    before = get_propogate_device()
    yield
    set_propogate_device(before)


@pytest.mark.parametrize("kind", ["ec", pytest.param("ebc", marks=pytest.mark.slow)])
def test_a_sharded_inference_model_follows_every_publish(ec_job, tmp_path_factory, kind, cpu_sharding):
    """TorchRec's CPU sharding of the quantized model (``shard_quant_model``, all shards in this
    process): after every publish each sharded replica's FBGEMM weights equal TorchRec's own
    quantization of the trainer's tables, and its forward on every id equals the unsharded
    replica's; the rows it serves really changed (the trainer moved them)."""
    root, results = ec_job if kind == "ec" else _job(tmp_path_factory, kind)
    base = global_table_weights(TABLES, ROWS, DIM, seed=0)
    wt_of = {"int8": "int8", "float16": "fp16"}
    unsharded = {wt: InferenceReplica(quantized(kind, base, wt)) for wt in ("int8", "fp16")}
    replicas = {(fmt, sh): InferenceReplica(sharded_quantized(kind, base, wt_of[fmt], sh), chunk_rows=16)
                for fmt, sh in SHARDED}
    assert {t.sharding for r in replicas.values() for t in r.tables.values()} == {"table_wise", "row_wise"}
    assert any(len(t.shards) == 2 for t in replicas[("int8", "row_wise")].tables.values())
    request = _requests(kind)
    first = {key: r.forward(request) for key, r in replicas.items()}
    seen = 0
    for poll in _local_polls(root, f"sharded-{kind}"):
        stamp = max(poll.publishes)
        want = _expected(results, stamp)
        for wt, replica in unsharded.items():
            apply_poll(replica, poll, complete_only=True)
        for (fmt, sharding), replica in replicas.items():
            assert apply_poll(replica, poll, complete_only=True).rows > 0
            expect = torchrec_bytes(kind, want, wt_of[fmt])
            got = replica.all_weights()
            assert sorted(got) == sorted(expect)
            for fqn in expect:
                assert torch.equal(got[fqn], expect[fqn]), (fmt, sharding, fqn, stamp)
            assert same_output(replica.forward(request), unsharded[wt_of[fmt]].forward(request)), (fmt, sharding, stamp)
        seen += len(poll.publishes)
    assert seen == STEPS
    assert not any(same_output(r.forward(request), first[key]) for key, r in replicas.items())


def test_a_column_wise_sharded_inference_model_is_refused(cpu_sharding):
    """TorchRec builds a column-wise sharded quantized model only for CUDA (here on the meta
    device): its shards split rows, whose int8 scale and bias are the whole row's. Refused, with
    what TorchRec's CPU sharding allows."""
    import copy

    from torchrec.distributed.planner import ParameterConstraints
    from torchrec.inference.modules import shard_quant_model

    from persistent_delta.errors import ReplicaMismatchError

    quant = quantized("ec", global_table_weights(2, ROWS, DIM, seed=0), "int8")
    constraints = {f"table_{t}": ParameterConstraints(sharding_types=["column_wise"], compute_kernels=["quant"],
                                                      min_partition=4) for t in range(2)}
    model, _ = shard_quant_model(copy.deepcopy(quant), world_size=2, compute_device="cuda", sharding_device="meta",
                                 constraints=constraints)
    with pytest.raises(ReplicaMismatchError, match="column_wise.*table_wise .*row_wise"):
        InferenceReplica(model)


@pytest.mark.slow
def test_ebc(tmp_path_factory):
    root, results = _job(tmp_path_factory, "ebc")
    assert follow("ebc", results, _local_polls(root, "quantized")) == STEPS


def _start_ranks(root: str, steps: int) -> list:
    import os
    import subprocess
    import sys

    from persistent_delta.testing import free_port
    from procs import REPO

    support = os.path.join(REPO, "tests", "support")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    port = free_port()
    return [subprocess.Popen([sys.executable, os.path.join(support, "inference_trainer_ranks.py"), root, str(r),
                              str(port), str(steps)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env) for r in (0, 1)]


@pytest.mark.slow
def test_after_a_sigkill_and_a_restore(tmp_path):
    """The trainer is SIGKILLed mid-run (after a checkpoint and a few publishes), restarted and
    restored from the checkpoint (its tracker re-delivers the rows touched after it). A replica
    applying every publish -- the lost timeline's included -- equals TorchRec's quantization of
    the trainer's tables at each publish it can compare, and at the last one."""
    import os
    import signal
    import time

    root = str(tmp_path / "log")
    pub = tmp_path / "pub"
    procs = _start_ranks(root, 100)
    deadline = time.monotonic() + 300
    while len([f for f in os.listdir(pub) if not f.endswith(".tmp")] if pub.exists() else []) < 2 * 7:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            [p.stderr.read()[-3000:] for p in procs if p.poll() is not None]
        time.sleep(0.05)
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait()
    procs = _start_ranks(root, 5)
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-3000:] for _, e in outs]
    start = int(outs[0][0].split("START", 1)[1].split()[0])

    def shards_at(stamp: int):
        files = [pub / f"{stamp}.{r}" for r in (0, 1)]
        return {r: torch.load(f, weights_only=False) for r, f in enumerate(files)} if all(f.exists() for f in files) \
            else None

    base = global_table_weights(2, 100, 8, seed=0)
    replicas = {wt: InferenceReplica(quantized("ec", base, wt), base={f"sparse.embeddings.{n}": w for n, w in base.items()})
                for wt in ("int8", "fp16")}
    compared = []
    with DeltaConsumer(root, "quantized", channel="snapshots") as consumer:
        while True:
            poll = consumer.poll(max_bytes=1)
            if poll.empty:
                break
            stamp = max(poll.publishes)
            for wt, replica in replicas.items():
                apply_poll(replica, poll, complete_only=True)
            consumer.commit()
            shards = shards_at(stamp)
            if shards is None:  # killed between the publish and saving its shards
                continue
            want = full_tables(shards)
            for wt, replica in replicas.items():
                expect = torchrec_bytes("ec", want, wt)
                got = replica.all_weights()
                for fqn in expect:
                    assert torch.equal(got[fqn], expect[fqn]), (wt, fqn, stamp, start)
            compared.append(stamp)
    assert compared and compared[-1] >= start + 5 - 1, (compared, start)
    assert any(s >= start for s in compared) and any(s < start for s in compared), (compared, start)
