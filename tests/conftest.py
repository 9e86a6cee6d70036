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


@pytest.fixture
def log_dir(tmp_path) -> str:
    return str(tmp_path / "log")
