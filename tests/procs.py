"""Helpers that run code in real, separate Python processes (crash and multi-process tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, *args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (a real separate process) with the repo importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def popen_python(code: str, *args: str) -> subprocess.Popen:
    """Start ``code`` in a separate interpreter, stdout/stderr piped (for kill tests)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )


def fill_filesystem(path: str) -> str:
    """Fill the filesystem of ``path`` with a filler file until it is full; returns its name."""
    import uuid

    filler = os.path.join(path, f"filler-{uuid.uuid4().hex}")
    with open(filler, "wb", buffering=0) as f:
        for chunk in (64 << 10, 4 << 10, 512):  # down to the last block
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError:
                pass
    return filler
