"""A real Prometheus scrapes the exporter (reading the log from outside) and a trainer's own
endpoint while the trainer and two consumers run, one of them stalled: the lag it stores is the
lag ``offsets`` reports, the statuses are ok and stalled, the batch index and publishes are the
trainer's (and ``top`` reads the same writer from the trainer's endpoint)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from procs import REPO, SUPPORT
from prometheus_server import BINARY, MISSING, prometheus

pytest.importorskip("prometheus_client")

from persistent_delta import DeltaConsumer  # noqa: E402
from persistent_delta.cli.top import snapshot  # noqa: E402
from persistent_delta.ops.metrics import HEALTH_CODES  # noqa: E402
from persistent_delta.ops.positions import describe  # noqa: E402
from persistent_delta.testing import free_port  # noqa: E402

JOB = "metrics-test"
STALL_AFTER = 2.0


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _line(proc: subprocess.Popen, word: str, timeout: float = 180.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(word):
            return line.split()[1]
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"no {word} line from the trainer (exit {proc.poll()}): {proc.stderr.read()[-3000:]}")


@pytest.mark.skipif(BINARY is None, reason=MISSING)
def test_prometheus_sees_the_lag_offsets_reports(tmp_path):
    root, stop = str(tmp_path / "job"), str(tmp_path / "stop")
    trainer = subprocess.Popen([sys.executable, os.path.join(SUPPORT, "metrics_trainer.py"), root, "60", stop],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    exporter = None
    try:
        trainer_port = _line(trainer, "PORT")
        slow = DeltaConsumer(root, "slow")  # registers at the start, commits once, then stalls
        slow.commit()
        reader = DeltaConsumer(root, "reader")
        port = free_port()
        exporter = subprocess.Popen(
            [sys.executable, "-m", "persistent_delta", "exporter", root, "--job", JOB, "--port", str(port),
             "--stall-after", str(STALL_AFTER)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
        done = threading.Event()

        def read() -> None:  # a healthy consumer, reading while the trainer trains
            while not done.is_set():
                reader.poll(timeout=0.2)
                reader.commit()

        t = threading.Thread(target=read)
        t.start()
        try:
            last = int(_line(trainer, "DONE"))
        finally:
            done.set()
            t.join()
        reader.poll()
        reader.commit()
        # top's view reads the trainer's writer from its endpoint
        view = snapshot(root, metrics=[f"http://127.0.0.1:{trainer_port}/metrics"])
        assert not view.errors and [(w.rank, w.batch_index, w.queue_depth) for w in view.writers] == [("0", last, 0)]
        with prometheus(str(tmp_path / "prom"), {"exporter": f"127.0.0.1:{port}",
                                                 "trainer": f"127.0.0.1:{trainer_port}"}) as prom:
            time.sleep(STALL_AFTER)  # the slow consumer's silence outlasts the least stall
            ranks = describe(root, stall_after_s=STALL_AFTER)
            want_lag, want_health = {}, {}
            for r in ranks:
                for c in r.consumers:
                    key = (("channel", c.channel), ("consumer", c.name), ("job", JOB), ("rank", str(r.rank)))
                    want_lag[key] = float(c.lag)
                    want_health[key] = float(HEALTH_CODES[c.health])
            by_name = {dict(k)["consumer"]: v for k, v in want_lag.items()}
            assert by_name["slow"] >= 50 and by_name["reader"] == 0, by_name
            assert {dict(k)["consumer"]: v for k, v in want_health.items()}["slow"] == HEALTH_CODES["stalled"]
            prom.wait_for(f'persistent_delta_consumer_lag_batches{{job="{JOB}"}}', want_lag)
            health = prom.wait_for(f'persistent_delta_consumer_health{{job="{JOB}"}}', want_health)
            assert {dict(k)["consumer"]: v for k, v in health.items()}["reader"] == HEALTH_CODES["ok"]
            prom.wait_for(f'persistent_delta_batch_index{{job="{JOB}"}}', {(("job", JOB), ("rank", "0")): float(last)})
            commits = prom.wait_for(f'persistent_delta_writer_commits_total{{job="{JOB}"}}')
            assert min(commits.values()) > 0
            publishes = prom.wait_for(f'persistent_delta_publishes_total{{job="{JOB}"}}')
            assert list(publishes.values()) == [60 // 5]
        slow.close()
        reader.close()
    finally:
        open(stop, "w").close()
        for proc in (exporter, trainer):
            if proc is None:
                continue
            if proc is exporter:
                proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
