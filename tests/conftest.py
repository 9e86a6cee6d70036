"""Shared fixtures. Every log lives under pytest's ``tmp_path``."""

from __future__ import annotations

import pytest


@pytest.fixture
def log_dir(tmp_path) -> str:
    return str(tmp_path / "log")
