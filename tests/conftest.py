"""Shared fixtures for every kind of test. Every log lives under pytest's ``tmp_path``.

The tests come in four folders by what they start: ``unit/`` (in-process, fast), ``process/``
(child processes, gloo ranks, SIGKILLs), ``fleet/`` (a local NATS JetStream server) and ``fuzz/``
(state machines, damage fuzzing, soaks). Modules they share live in ``support/``, which is put on
``sys.path`` here: tests import them by bare name (``from harness import run_spawn``), and the
scripts in it run as ``python tests/support/<name>.py``.
"""

from __future__ import annotations

import os
import sys

import pytest

SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)

from nats_servers import nats_cluster, nats_server  # noqa: E402,F401 - fixtures for every test


def _session_stream_key() -> None:
    """Stream data is authenticated ("no key, no data"): every shipper and remote consumer of the
    tests -- and the child processes they start, which inherit the environment -- holds one
    session key, named by ``PERSISTENT_DELTA_STREAM_KEY_FILE``. Tests of the key handling itself
    pass keys explicitly or clear the variable."""
    import atexit
    import shutil
    import tempfile

    from persistent_delta.fleet.auth import write_key_file

    if os.environ.get("PERSISTENT_DELTA_STREAM_KEY_FILE"):
        return
    d = tempfile.mkdtemp(prefix="pd-test-key-")
    atexit.register(shutil.rmtree, d, True)
    path = os.path.join(d, "stream.key")
    write_key_file(path)
    os.environ["PERSISTENT_DELTA_STREAM_KEY_FILE"] = path


_session_stream_key()


@pytest.fixture
def log_dir(tmp_path) -> str:
    return str(tmp_path / "log")
