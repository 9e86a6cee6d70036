"""Issue 16 item 4: ordered apply for every model. Shard checkpoints record their batch, replay
outputs their [from, to); apply (function and CLI) refuses a gap, an overlap or an input out of
order, and a base plus increments applied in order rebuild the trainer's tables (and, for a
managed-collision model, its raw-id map)."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import torch

from harness import run_spawn
from persistent_delta.cli import main
from persistent_delta.serve.apply_files import apply_inputs
from persistent_delta.serve.replay import replay
from persistent_delta.errors import OrderError
from persistent_delta.serve.ordered import Replica
from persistent_delta.log.shard_files import load_shards, full_rows, shard_batches
from procs import REPO
from zch_cases import ordered_case

pytestmark = pytest.mark.dist


def _setup(tmp_path, kind: str):
    root, ck = str(tmp_path / "log"), str(tmp_path)
    out = run_spawn(ordered_case, 2, root, ck, kind, timeout=240)
    b0, b1, b2 = out[0]["batches"]
    assert shard_batches(os.path.join(ck, "ckpt0")) == {0: b0, 1: b0}  # a shard checkpoint records its batch
    outs = {}
    for name, a, b, ckpt in (("inc1", b0 + 1, b1 + 1, "ckpt1"), ("inc2", b1 + 1, b2 + 1, "ckpt2"),
                             ("gap", b1 + 2, b2 + 1, "ckpt2"), ("overlap", b1, b2 + 1, "ckpt2")):
        outs[name] = str(tmp_path / name)
        replay(root, outs[name], from_batch=a, to_batch=b, shard_files=os.path.join(ck, ckpt))
    return ck, outs, out[0]["maps"], (b0, b1, b2)


def _final_tables(ckpt: str):
    return {fqn: full_rows(fqn, shards, torch.arange(shards[0][0].global_rows)) for fqn, shards in load_shards(ckpt).items()}


def _check_refusals(ck: str, outs: dict, tmp_path) -> None:
    base = os.path.join(ck, "ckpt0")
    for inputs, word in (([base, outs["inc2"]], "gap"), ([base, outs["inc1"], outs["inc1"]], "out-of-order"),
                         ([base, outs["inc1"], outs["overlap"]], "overlaps"), ([outs["inc1"], base], "base must come first"),
                         ([base, outs["inc1"], outs["gap"]], "gap")):
        with pytest.raises(OrderError, match=word):
            apply_inputs(inputs, out=str(tmp_path / "never.safetensors"))
        assert not os.path.exists(tmp_path / "never.safetensors")  # a refused apply writes nothing
    # the CLI: clear error on stderr, nonzero exit, nothing written
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-m", "persistent_delta", "apply", base, outs["inc2"], "--out",
                           str(tmp_path / "never.safetensors")], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1 and "a gap" in proc.stderr and "rank 0 starts at batch" in proc.stderr, proc.stderr
    assert not os.path.exists(tmp_path / "never.safetensors")


def test_ordered_apply_rebuilds_a_plain_model_and_refuses_bad_order(tmp_path):
    ck, outs, _, (b0, b1, b2) = _setup(tmp_path, "plain")
    _check_refusals(ck, outs, tmp_path)
    # in two calls: the replica remembers where it ended
    first = str(tmp_path / "replica.safetensors")
    buf = io.StringIO()
    assert main(["apply", os.path.join(ck, "ckpt0"), outs["inc1"], "--out", first], stdout=buf) == 0, buf.getvalue()
    assert Replica.load(first).next_batch == {0: b1 + 1, 1: b1 + 1}
    with pytest.raises(OrderError, match="out-of-order"):
        apply_inputs([outs["inc1"]], replica=first)
    rep = apply_inputs([outs["inc2"]], replica=first)
    assert rep.next_batch == {0: b2 + 1, 1: b2 + 1}
    got, want = Replica.load(first).tables, _final_tables(os.path.join(ck, "ckpt2"))
    assert set(got) == set(want)
    for fqn in want:
        assert torch.equal(got[fqn], want[fqn]), fqn


def test_ordered_apply_rebuilds_a_zch_models_tables_and_raw_id_map(tmp_path):
    ck, outs, maps, _ = _setup(tmp_path, "mc")
    _check_refusals(ck, outs, tmp_path)
    dest = str(tmp_path / "replica.safetensors")
    apply_inputs([os.path.join(ck, "ckpt0"), outs["inc1"], outs["inc2"]], out=dest)
    rep = Replica.load(dest)
    want = _final_tables(os.path.join(ck, "ckpt2"))
    for fqn in want:
        assert torch.equal(rep.tables[fqn], want[fqn]), fqn
    for fqn in rep.raw_ids.tables():
        assert rep.raw_ids.as_dict(fqn) == maps[fqn.rsplit(".", 1)[1]], fqn
    assert len(rep.raw_ids.tables()) == 2
