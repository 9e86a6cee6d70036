"""The main job end to end: the replica check passes, and fails when a publish is lost."""

import os
import re
import subprocess
import sys

import pytest

from procs import REPO

DEMO = os.path.join(REPO, "examples", "demo.py")  # `make demo`
SMALL = ["--steps=30", "--kill-at=17", "--checkpoint-every=10", "--publish-every=10", "--rows=3000", "--batch=64"]


def run_demo(tmp_path, *extra):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, DEMO, *SMALL, f"--out={tmp_path / 'demo'}", *extra],
                          capture_output=True, text=True, timeout=600, env=env)


def test_demo_replica_equals_trainer_after_a_sigkill(tmp_path):
    proc = run_demo(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "SIGKILLed the trainer at step 17" in proc.stdout
    assert "restarted from checkpoint at step 10" in proc.stdout
    assert "[demo] PASS" in proc.stdout
    assert proc.stdout.count(" OK\n") == 3 and "FAIL" not in proc.stdout
    assert "CONSUMER" in proc.stdout and "replica" in proc.stdout  # the offsets table
    noise = [line for line in (proc.stdout + proc.stderr).splitlines()
             if re.search(r"(site|dist)-packages/.*Warning|is_fx_tracing", line)]
    assert not noise, noise  # torch/TorchRec-internal warnings are silenced in the demo's processes
    assert os.path.isfile(tmp_path / "demo" / "final" / "rank-0.safetensors")  # shard_files.save_local_shards layout


@pytest.mark.slow  # the checker can fail; the demo itself runs in make test
def test_demo_check_fails_when_the_last_publish_is_skipped(tmp_path):
    proc = run_demo(tmp_path, "--skip-publish-at=30")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[demo] FAIL" in proc.stdout


def test_fleet_demo_replica_reads_only_the_stream_and_equals_the_trainer(tmp_path):
    """`make demo-fleet`: a local JetStream server, a shipper (SIGKILLed and restarted with the
    trainer), a replica that cannot open the log; the bit-exact check passes."""
    proc = run_demo(tmp_path, "--fleet")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "shipper killed and restarted: True" in proc.stdout and "[demo] PASS" in proc.stdout
    assert "REMOTE CONSUMERS" in proc.stdout and "FAIL" not in proc.stdout
