"""Every reader of an ordinary EMBEDDING log past the 8 MiB gather threshold, with empty
records among the parts (each read crashed with "cannot reshape tensor of 0 elements"): the
trainer's get_unique, DeltaReader, a registered DeltaConsumer, replay, and the shipper with a
RemoteConsumer on a real NATS server all return the same rows."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from safetensors.torch import load_file

from harness import run_spawn
from large_log_cases import STEPS, large_embedding_log
from persistent_delta import DeltaConsumer
from persistent_delta.cli import main as cli_main
from persistent_delta.fleet.remote import RemoteConsumer
from persistent_delta.fleet.ship import Shipper
from persistent_delta.read.consumer import DeltaReader

pytestmark = pytest.mark.dist


def _same(got, want, who):
    for fqn, (ids, states) in want.items():
        assert ids.numel() * states[0].nbytes > 8 << 20, "the read does not cross the 8 MiB threshold"
        g_ids, g_states = got[fqn]
        assert torch.equal(g_ids, ids), (who, fqn)
        assert torch.equal(g_states, states), (who, fqn)


def _merged(poll):
    return {fqn: (m.global_ids, m.states) for fqn, m in poll.merged().items()}


def _first_of(polls):
    """Several polls in order, joined by the FIRST rule (an id keeps its earliest row)."""
    out = {}
    for poll in polls:
        for fqn, (ids, states) in _merged(poll).items():
            if fqn not in out:
                out[fqn] = (ids, states)
                continue
            old_ids, old_states = out[fqn]
            new = ~torch.isin(ids, old_ids)
            all_ids = torch.cat([old_ids, ids[new]])
            order = torch.argsort(all_ids)
            out[fqn] = (all_ids[order], torch.cat([old_states, states[new]])[order])
    return out


def test_every_reader_of_a_large_embedding_log(tmp_path, nats_server):
    root = str(tmp_path / "deltas")
    want = run_spawn(large_embedding_log, 1, root)[0]  # one rank: local ids are global ids
    with DeltaReader(root) as reader:
        _same(_merged(reader.poll()), want, "DeltaReader")
    with DeltaConsumer(root, "serving") as consumer:
        _same(_merged(consumer.poll()), want, "DeltaConsumer")
    out = str(tmp_path / "replay")
    assert cli_main(["replay", root, "--from-batch", "0", "--to-batch", str(STEPS + 1), "--out", out,
                     "--format", "json"], stdout=open(os.devnull, "w")) == 0
    with open(os.path.join(out, "manifest.json")) as f:
        files = {e["fqn"]: os.path.join(out, e["path"]) for e in json.load(f)["files"]}
    replayed = {fqn: (load_file(p)["ids"], load_file(p)["states"]) for fqn, p in files.items()}
    _same(replayed, want, "replay")
    with Shipper(root, nats_server.url, "large", channels=["lookups"]).start() as shipper:
        deadline = time.monotonic() + 120
        while not (shipper.stats() and shipper.stats()[0]["position"] >= STEPS) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert shipper.stats()[0]["position"] >= STEPS, shipper.stats()
    with RemoteConsumer(nats_server.url, "large", "remote", wait=30) as remote:
        polls = []  # a poll returns what the stream holds so far: poll to the end
        while not polls or polls[-1].ranges[0][1] < STEPS + 1:
            polls.append(remote.poll(timeout=10))
            assert len(polls) < 50, [p.ranges for p in polls]
        assert any(p.ranges[0][1] - p.ranges[0][0] > 100 for p in polls)  # (large reads, not one batch each)
        _same(_first_of(polls), want, "RemoteConsumer")
