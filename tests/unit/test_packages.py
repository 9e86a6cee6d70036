"""The package rules of ``[tool.persistent_delta.packages]`` (pyproject.toml) hold for every import,
and the package picture of docs/architecture.md is the one drawn from that table."""

from __future__ import annotations

import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("packages_tool", os.path.join(REPO, "tools", "packages.py"))
packages = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(packages)


def test_every_import_keeps_the_package_rules():
    bad = packages.violations(packages.load_rules())
    assert not bad, "\n".join(bad)


def test_readers_fleet_and_cli_never_reach_the_trainer():
    rules = packages.load_rules()
    for name in ("log", "read", "serve", "adapters", "fleet", "cli"):
        assert "trainer" not in rules[name].imports, name


def test_the_serving_side_sits_above_the_read_path_and_beside_the_fleet():
    """serve/ applies what read/ returns; it reaches a stream only through the consumer
    protocol, so neither read/ nor fleet/ imports it."""
    rules = packages.load_rules()
    assert "read" in rules["serve"].imports and "fleet" not in rules["serve"].imports
    for name in ("log", "read", "fleet", "adapters"):
        assert "serve" not in rules[name].imports, name


# One room per idea: no module of the package is over MAX_LINES; the tracker's wiring and the
# modules split out of RemoteConsumer stay at SMALL_LINES or fewer.
MAX_LINES = 800
SMALL_LINES = 500
SMALL = ["trainer/tracker.py", "fleet/remote.py", "fleet/claim.py", "fleet/positions.py", "fleet/coordinator.py",
         "fleet/fetcher.py", "fleet/assembly.py", "fleet/delivery.py", "fleet/bootstrap.py", "fleet/connect.py"]


def module_lines(pkg: str = os.path.join(REPO, "persistent_delta")) -> dict:
    """Path relative to the package -> its number of lines, for every module."""
    out = {}
    for root, _, files in os.walk(pkg):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                with open(path) as fh:
                    out[os.path.relpath(path, pkg)] = sum(1 for _ in fh)
    return out


def test_no_module_holds_more_than_one_room():
    lines = module_lines()
    assert not {m: n for m, n in lines.items() if n > MAX_LINES}, f"modules over {MAX_LINES} lines"
    assert not {m: lines[m] for m in SMALL if lines[m] > SMALL_LINES}, f"modules over {SMALL_LINES} lines"


def test_the_size_check_sees_a_long_module(tmp_path):
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "short.py").write_text("x = 1\n")
    assert module_lines(str(tmp_path)) == {"long.py": MAX_LINES + 1, "short.py": 1}


def test_the_architecture_page_shows_the_picture_drawn_from_the_rules():
    page = open(os.path.join(REPO, "docs", "architecture.md")).read()
    assert packages.picture(packages.load_rules()) in page, \
        "run `python tools/packages.py` and paste it into docs/architecture.md"


def _write(root, rel, text):
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def test_the_checker_sees_an_upward_import_a_private_name_and_a_cycle(tmp_path):
    """The checks above can fail: a log module importing the trainer, a private name used
    across modules and an import cycle are each reported."""
    pkg = str(tmp_path / "persistent_delta")
    _write(pkg, "__init__.py", "")
    _write(pkg, "errors.py", "")
    _write(pkg, "log/__init__.py", "")
    _write(pkg, "log/codec.py", "from persistent_delta.trainer.writer import Writer\n")
    _write(pkg, "trainer/__init__.py", "")
    _write(pkg, "trainer/writer.py", "from persistent_delta.log import codec\nx = codec._SECRET\n")
    _write(pkg, "read/__init__.py", "")
    _write(pkg, "read/a.py", "from persistent_delta.read.b import _helper\n")
    _write(pkg, "read/b.py", "from persistent_delta.read import a\n")
    bad = "\n".join(packages.violations(packages.load_rules(), pkg))
    assert "log.codec:1 imports trainer.writer" in bad
    assert "codec._SECRET" in bad
    assert "private names ['_helper']" in bad
    assert "import cycle" in bad
