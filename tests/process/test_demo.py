"""The main job end to end: the replica check passes, and fails when a publish is lost; what a
newcomer sees first (both demos' output) holds no error, traceback or unannounced warning."""

import os
import re
import subprocess
import sys

import pytest

from procs import REPO

DEMO = os.path.join(REPO, "examples", "demo.py")  # `make demo`
SMALL = ["--steps=30", "--kill-at=17", "--checkpoint-every=10", "--publish-every=10", "--rows=3000", "--batch=64"]
ANNOUNCEMENT = re.compile(r"^\[demo\] .*\bwarns?\b.*\(expected\)$")  # admits the warning lines right after it
ANNOUNCED = re.compile(r"^WARNING:persistent_delta\.trainer\.restore:")  # the only kind announced: the restart's
WARNING = re.compile(r"warning|\[WRN\]", re.IGNORECASE)
TROUBLE = re.compile(r"(?<!LAST-)(?i:error)|Traceback")  # LAST-ERROR: a column of `offsets --server`'s SHIPPERS


def run_demo(tmp_path, *extra):
    """The demo's stdout and stderr (its own and its children's) in one stream, in the order written."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, DEMO, *SMALL, f"--out={tmp_path / 'demo'}", *extra],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600, env=env)


def unannounced_trouble(output):
    """The lines of a demo's output that must not be there: an error, a traceback, or a warning
    not announced. An announcement (``[demo] ... warns ... (expected)``) admits the restarted
    trainer's warning lines that follow it, up to the first line that is no warning."""
    bad, admitted = [], False
    for line in output.splitlines():
        if ANNOUNCEMENT.match(line):
            admitted = True
        elif TROUBLE.search(line) or (WARNING.search(line) and not (admitted and ANNOUNCED.match(line))):
            bad.append(line)
        elif not WARNING.search(line):
            admitted = False
    return bad


def test_the_output_check_admits_a_warning_only_right_after_its_announcement():
    announce = "[demo] the restarted trainer now warns that it drops a batch (expected)"
    warn = "WARNING:persistent_delta.trainer.restore:log/rank-0: continuing at batch 21"
    assert unannounced_trouble(f"[demo] start\n{announce}\n{warn}\n{warn}\n[trainer] restarted\n") == []
    assert unannounced_trouble(f"{announce}\n[trainer] restarted\n{warn}\n") == [warn]
    assert unannounced_trouble(f"[demo] start\n{warn}\n{announce}\n") == [warn]
    other = "WARNING:persistent_delta.read.consumer:log: ranks [0] are behind on the snapshots channel"
    assert unannounced_trouble(f"{announce}\n{warn}\n{other}\n{warn}\n") == [other]  # announced: the restore's only
    err = "persistent-delta: error: reading job demo's stream has no stream key"
    assert unannounced_trouble(f"{announce}\n{err}\nTraceback (most recent call last):\n") == [
        err, "Traceback (most recent call last):"]
    assert unannounced_trouble("x.py:3: UserWarning: deprecated\n") == ["x.py:3: UserWarning: deprecated"]
    assert unannounced_trouble("RANK  CHANNEL  RETRIES  LAST-SHIPPED  LAST-ERROR\n") == []


def test_demo_replica_equals_trainer_after_a_sigkill(tmp_path):
    proc = run_demo(tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert unannounced_trouble(proc.stdout) == [], proc.stdout
    assert "SIGKILLed the trainer at step 17" in proc.stdout
    assert "restarted from checkpoint at step 10" in proc.stdout
    assert "[demo] PASS" in proc.stdout
    assert proc.stdout.count(" OK\n") == 3 and "FAIL" not in proc.stdout
    assert "CONSUMER" in proc.stdout and "replica" in proc.stdout  # the offsets table
    noise = [line for line in proc.stdout.splitlines()
             if re.search(r"(site|dist)-packages/.*Warning|is_fx_tracing", line)]
    assert not noise, noise  # torch/TorchRec-internal warnings are silenced in the demo's processes
    assert os.path.isfile(tmp_path / "demo" / "final" / "rank-0.safetensors")  # shard_files.save_local_shards layout


@pytest.mark.slow  # the checker can fail; the demo itself runs in make test
def test_demo_check_fails_when_the_last_publish_is_skipped(tmp_path):
    proc = run_demo(tmp_path, "--skip-publish-at=30")
    assert proc.returncode == 1, proc.stdout[-6000:]
    assert "[demo] FAIL" in proc.stdout


def test_fleet_demo_replica_reads_only_the_stream_and_equals_the_trainer(tmp_path):
    """`make demo-fleet`: a local JetStream server, a shipper (SIGKILLed and restarted with the
    trainer), a replica that cannot open the log; the bit-exact check passes. The commands it
    prints carry the job's stream key, as a user would copy them, and show the remote replica."""
    proc = run_demo(tmp_path, "--fleet")
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert unannounced_trouble(proc.stdout) == [], proc.stdout
    assert "shipper killed and restarted: True" in proc.stdout and "[demo] PASS" in proc.stdout
    assert "REMOTE CONSUMERS" in proc.stdout and "FAIL" not in proc.stdout
    key = re.escape(str(tmp_path / "demo" / "stream.key"))  # the key the demo made, in the command a user copies
    command = rf"^\[demo\] persistent-delta offsets --server nats://127\.0\.0\.1:\d+ --job demo --key-file {key}$"
    assert re.search(command, proc.stdout, re.MULTILINE), proc.stdout
    # the replica reads only the stream: its rows are those of REMOTE CONSUMERS (not of the local log's
    # table), caught up with the stream's end as read with the key (without it: no end, or an error)
    replica = re.findall(r"^([01])\s+replica\s+snapshots\s+(\d+)\s+(\d+)\s", proc.stdout, re.MULTILINE)
    assert len(replica) == 2 and all(offset == end != "0" for _, offset, end in replica), proc.stdout
