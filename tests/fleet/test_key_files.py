"""A stream key file that is a FIFO -- named directly, through a secret volume's symbolic links,
or by ``PERSISTENT_DELTA_STREAM_KEY_FILE`` -- is refused at once, never waited on: by the
library and by every command that takes ``--key-file``, each a real process against a real
server; a key in a secret volume laid out as Kubernetes does (0400) is used by them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Dict, List, Tuple

import torch

from logs import fill_ranks
from procs import REPO

from persistent_delta.cli import main
from persistent_delta.fleet.auth import write_key_file
from persistent_delta.fleet.ship import Shipper

JOB = "job-keys"
# Each of the up to nine processes started at once imports torch first (about 7 s of CPU each):
# generous for a loaded 2-core machine (a make test run hit 90 s with the refusal just printed),
# and a process blocked on a FIFO waits for good, so any deadline tells the two apart.
DEADLINE_S = 240.0


def _secret_volume(base: str, make_key) -> str:
    """``base/key -> ..data/key``, ``..data -> ..<timestamp>``, ``make_key`` making the file."""
    stamp = os.path.join(base, "..2026_12_05_10_00_00.123456789")
    os.makedirs(stamp)
    make_key(os.path.join(stamp, "key"))
    os.symlink(os.path.basename(stamp), os.path.join(base, "..data"))
    os.symlink(os.path.join("..data", "key"), os.path.join(base, "key"))
    return os.path.join(base, "key")


def _commands(root: str, url: str, key: List[str]) -> Dict[str, List[str]]:
    return {
        "offsets": ["offsets", "--server", url, "--job", JOB, *key],
        "ship": ["ship", root, "--server", url, "--job", JOB, *key],
        "exporter": ["exporter", "--server", url, "--job", JOB, "--port", "0", *key],
        "top": ["top", "--server", url, "--job", JOB, "--iterations", "1", *key],
    }


def _start(argv: List[str], env_key: str = "") -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if env_key:
        env["PERSISTENT_DELTA_STREAM_KEY_FILE"] = env_key
    return subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO)


def _finish(procs: Dict[str, subprocess.Popen]) -> Dict[str, Tuple[int, str]]:
    """Each process's exit status and stderr; one still running at the deadline is killed and
    reported as hung (None)."""
    deadline = time.monotonic() + DEADLINE_S
    out: Dict[str, Tuple[int, str]] = {}
    try:
        for name, p in procs.items():
            try:
                _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
                raise AssertionError(f"{name} still waiting on the key file after {DEADLINE_S:g} s: {err[-2000:]}")
            out[name] = (p.returncode, err)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def test_a_fifo_key_file_is_refused_at_once_by_the_library_and_every_command(tmp_path, nats_server):
    """Named directly, through a secret volume's links, or by the environment variable: a
    FIFO is refused with the path and what it is, and nothing waits for a writer."""
    fifo = str(tmp_path / "job.key")
    os.mkfifo(fifo, 0o600)
    linked = _secret_volume(str(tmp_path / "secret"), lambda p: os.mkfifo(p, 0o400))
    root = str(tmp_path / "log")
    fill_ranks(root, lambda r, b: [("t", torch.tensor([b]), None)], ranks=1, batches=2)
    code = ("import sys\nfrom persistent_delta.errors import KeyFileError\n"
            "from persistent_delta.fleet.auth import read_key_file\n"
            "try:\n    read_key_file(sys.argv[1])\nexcept KeyFileError as e:\n"
            "    sys.exit(f'{e.refused}: {e}')\n")
    procs = {"library": _start(["-c", code, fifo]), "library via links": _start(["-c", code, linked])}
    for name, argv in _commands(root, nats_server.url, ["--key-file", fifo]).items():
        procs[name] = _start(["-m", "persistent_delta", *argv])
    procs["top via links"] = _start(["-m", "persistent_delta", *_commands(root, nats_server.url,
                                                                         ["--key-file", linked])["top"]])
    procs["ship via the environment"] = _start(["-m", "persistent_delta", *_commands(root, nats_server.url,
                                                                                    [])["ship"]], env_key=fifo)
    for name, (rc, err) in _finish(procs).items():
        path = f"{linked} (-> {os.path.realpath(linked)})" if "links" in name else fifo
        assert rc == 1 and f"stream key file {path} is refused: it is a FIFO" in err, (name, rc, err[-2000:])
        assert "Traceback" not in err, (name, err[-2000:])


def test_a_key_in_a_secret_volume_is_used_by_the_shipper_and_the_tools(tmp_path, nats_server, capsys):
    """``key -> ..data/key -> ..<timestamp>/key`` of mode 0400: a shipper signs with it and
    ``offsets --server`` reads the job under it; at mode 0644 (a secret volume's default) the
    tool is refused with the mode and the fix."""
    key = _secret_volume(str(tmp_path / "secret"), write_key_file)
    os.chmod(os.path.realpath(key), 0o400)
    root = str(tmp_path / "log")
    fill_ranks(root, lambda r, b: [("t", torch.tensor([b]), None)], ranks=1, batches=4)
    with Shipper(root, nats_server.url, JOB, channels=["lookups"], key=key) as s:
        s.run(idle_exit_s=0.5)
    assert main(["offsets", *_commands(root, nats_server.url, ["--key-file", key])["offsets"][1:],
                 "--format", "json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["rejected_markers"] == 0 and found["streams"], found
    os.chmod(os.path.realpath(key), 0o644)
    assert main(_commands(root, nats_server.url, ["--key-file", key])["offsets"]) == 1
    err = capsys.readouterr().err
    assert "mode 0644 lets others read it" in err and "defaultMode: 0400" in err, err
