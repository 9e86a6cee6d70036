"""Helpers that run code in real, separate Python processes (crash and multi-process tests)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUPPORT = os.path.dirname(os.path.abspath(__file__))  # the modules tests share; some run as scripts


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


@dataclass(frozen=True)
class OtherUid:
    """How to run this repo's Python code as another, unprivileged user (``nobody``)."""

    python: str
    uid: int
    gid: int
    pythonpath: List[str]

    def env(self, home: str) -> Dict[str, str]:
        """A minimal environment for the other user: no root HOME, this repo and its packages."""
        return {"PATH": "/usr/bin:/bin", "HOME": home, "PYTHONPATH": os.pathsep.join(self.pythonpath),
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


_OTHER_UID: List[Optional[OtherUid]] = []


def other_uid() -> Optional[OtherUid]:
    """Running as root: an interpreter of this Python version that ``nobody`` can run, with this
    venv's packages importable (checked once by importing torch, nats and persistent_delta as
    ``nobody``); ``None`` when not root or no such interpreter exists. The venv's own interpreter
    usually lives under an owner-only home (pyenv under /root), so the system's same-version
    interpreter is tried too: extension modules are built for the version's ABI, not the build."""
    if _OTHER_UID:
        return _OTHER_UID[0]
    found: Optional[OtherUid] = None
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        import pwd

        try:
            nobody = pwd.getpwnam("nobody")
        except KeyError:
            nobody = None
        if nobody is not None:
            here = os.path.dirname(os.path.abspath(__file__))
            paths = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], REPO, here]
            version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
            for python in (os.path.realpath(sys.executable), f"/usr/bin/{version}", f"/usr/local/bin/{version}"):
                if not os.path.exists(python):
                    continue
                cand = OtherUid(python, nobody.pw_uid, nobody.pw_gid, list(dict.fromkeys(paths)))
                try:
                    probe = subprocess.run(
                        [python, "-c", "import torch, nats, persistent_delta.fleet.remote"], env=cand.env("/tmp"),
                        user=cand.uid, group=cand.gid, extra_groups=[], capture_output=True, timeout=120)
                except (OSError, subprocess.SubprocessError):
                    continue
                if probe.returncode == 0:
                    found = cand
                    break
    _OTHER_UID.append(found)
    return found


class RankProcs:
    """The rank processes of one multi-rank run of a script in ``tests/support`` (rank ``r``
    gets ``args(r, port)``, and ``env(r)`` merged into the environment), their stdout lines read
    as they come; stderr of rank ``r`` goes to ``<stderr_prefix>-<r>``."""

    def __init__(self, script: str, args: Callable[[int, int], List[str]], stderr_prefix: str, ranks: int = 2,
                 env: Optional[Callable[[int], Dict[str, str]]] = None) -> None:
        from persistent_delta.testing import free_port

        base = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        port = free_port()
        self.lines: List[List[List[str]]] = [[] for _ in range(ranks)]
        self.errs = [f"{stderr_prefix}-{r}" for r in range(ranks)]
        self.procs = [subprocess.Popen([sys.executable, os.path.join(SUPPORT, script), *args(r, port)],
                                       stdout=subprocess.PIPE, stderr=open(self.errs[r], "w"), text=True,
                                       env=dict(base, **(env(r) if env else {})))
                      for r in range(ranks)]
        for r in range(ranks):
            threading.Thread(target=self._read, args=(r,), daemon=True).start()

    def _read(self, r: int) -> None:
        for line in self.procs[r].stdout:  # type: ignore[union-attr]
            self.lines[r].append(line.split())

    def stderr(self, tail: int = 4000) -> str:
        """The end of every rank's stderr, for assertion messages."""
        return "\n".join(f"--- rank {r} ---\n" + open(e).read()[-tail:] for r, e in enumerate(self.errs))

    def words(self, word: str) -> List[List[str]]:
        """Every line (split in words) of any rank that starts with ``word``."""
        return [ln for lines in self.lines for ln in list(lines) if ln[:1] == [word]]
