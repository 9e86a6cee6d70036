"""The ``persistent-delta`` command line, through ``main(argv)`` and through real subprocesses
(``python -m persistent_delta``, ``tools/*.py``): offsets describe/reset/register/delete, output
formats, dry runs, errors on stderr with a nonzero exit, inspection never creating a log."""

from __future__ import annotations

import io
import json
import os
import runpy
import subprocess
import sys
from typing import Any, Dict, List

import pytest
import torch
from torchrec.distributed.model_tracker.types import UpdateMode

from persistent_delta import DeltaConsumer
from persistent_delta.cli import main
from logs import Record, fill_ranks
from persistent_delta.log.deltalog import DeltaLog
from procs import REPO


def _three_t_some_u(rank: int, b: int) -> List[Record]:
    """Batch b has 3 ids of "t" and b % 3 + 1 ids of "u" (ids only)."""
    return [("t", torch.tensor([b, b + 10, b + 20]), None), ("u", torch.arange(b % 3 + 1), None)]


def _json(argv: List[str]) -> Any:
    buf = io.StringIO()
    assert main(argv + ["--format", "json"], stdout=buf) == 0
    return json.loads(buf.getvalue())


def _offsets(root: str) -> Dict[int, Dict[str, int]]:
    out = {}
    for r in _json(["offsets", root])["ranks"]:
        out[r["rank"]] = {c["name"]: c["offset"] for c in r["consumers"]}
    return out


def test_describe_lag_pending_and_tables(tmp_path):
    root = str(tmp_path / "log")
    fill_ranks(root, _three_t_some_u, ranks=2, batches=8)
    with DeltaConsumer(root, "c") as c:
        c.poll(max_batches=5)
        c.commit()
    data = _json(["offsets", root, "--tables"])
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    for r in data["ranks"]:
        (c,) = r["consumers"]
        assert (c["name"], c["offset"], c["log_start"], c["log_end"], c["lag"]) == ("c", 5, 0, 8, 3)
        with DeltaLog(r["path"], readonly=True) as log:
            keys = log.read(lambda t: [k for e in t.tables().values() for k in t.iter_record_keys(e.table_id, 5, 8)])
        assert c["pending_records"] == 6 and c["pending_bytes"] == sum(n for _, _, n in keys)
        assert c["pending_rows"] == 3 * 3 + (5 % 3 + 1) + (6 % 3 + 1) + (7 % 3 + 1)
        assert c["registered_by"] == "external" and c["status"] == "ok" and c["commit_time"] > 0
        tables = {t["fqn"]: t for t in r["tables"]}
        assert tables["t"]["records"] == 8 and tables["t"]["rows"] == 24 and tables["t"]["last_batch_idx"] == 7
    buf = io.StringIO()
    assert main(["offsets", root], stdout=buf) == 0
    text = buf.getvalue()
    assert "CONSUMER" in text and "PENDING-ROWS" in text and "\n0     c " in text.replace("  ", "  ")


def test_reset_register_delete_dry_run_then_execute(tmp_path, capsys):
    root = str(tmp_path / "log")
    fill_ranks(root, _three_t_some_u, ranks=2, batches=8)
    with DeltaConsumer(root, "c") as c:
        c.seek(6)
        c.commit()
    # dry run (the default) prints the plan and changes nothing
    buf = io.StringIO()
    assert main(["offsets", root, "--reset", "c", "--to-earliest"], stdout=buf) == 0
    assert buf.getvalue().startswith("DRY RUN") and " reset " in buf.getvalue()
    assert _offsets(root) == {0: {"c": 6}, 1: {"c": 6}}
    data = _json(["offsets", root, "--reset", "c", "--shift-by", "-2", "--execute"])
    assert [(x["old"], x["new"], x["applied"]) for x in data["changes"]] == [(6, 4, True)] * 2
    assert _offsets(root) == {0: {"c": 4}, 1: {"c": 4}}
    data = _json(["offsets", root, "--reset", "c", "--to-batch", "99", "--execute"])
    assert [x["new"] for x in data["changes"]] == [8, 8] and "clamped" in data["changes"][0]["note"]
    assert main(["offsets", root, "--reset", "c", "--to-latest", "--execute"], stdout=io.StringIO()) == 0
    # register: dry run, then at a batch
    data = _json(["offsets", root, "--register", "new", "--to-batch", "3"])
    assert [x["action"] for x in data["changes"]] == ["register"] * 2 and "new" not in _offsets(root)[0]
    _json(["offsets", root, "--register", "new", "--to-batch", "3", "--execute"])
    assert _offsets(root) == {0: {"c": 8, "new": 3}, 1: {"c": 8, "new": 3}}
    data = _json(["offsets", root, "--register", "new", "--execute"])
    assert [x["action"] for x in data["changes"]] == ["exists"] * 2
    # delete
    _json(["offsets", root, "--delete", "new"])
    assert "new" in _offsets(root)[0]
    _json(["offsets", root, "--delete", "new", "--execute"])
    assert _offsets(root) == {0: {"c": 8}, 1: {"c": 8}}
    # errors: stderr, prefixed, exit 1; usage errors exit 2
    capsys.readouterr()
    assert main(["offsets", root, "--delete", "new", "--execute"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("persistent-delta: error: consumer 'new' is not registered")
    assert main(["offsets", root, "--reset", "c"]) == 1
    assert "--to-earliest" in capsys.readouterr().err
    assert main(["offsets", root, "--reset", "c", "--to-latest", "--to-earliest"]) == 1
    assert main(["offsets", root, "--reset", "bad name", "--to-latest"]) == 1
    assert main(["offsets", root, "--execute"]) == 1
    assert main(["offsets"]) == 2
    assert main(["nope", root]) == 2
    assert main(["offsets", root, "--format", "yaml"]) == 2


def test_inspection_never_creates(tmp_path, capsys):
    missing = str(tmp_path / "nothing")
    for cmd in ("offsets", "verify", "vacuum"):
        assert main([cmd, missing]) == 1
        assert capsys.readouterr().err.startswith(f"persistent-delta: error: {missing}: no such directory")
    assert main(["replay", missing, "--from-batch", "0", "--to-batch", "1", "--dry-run"]) == 1
    os.makedirs(missing)
    assert main(["offsets", missing]) == 1
    assert "holds no persistent_delta log" in capsys.readouterr().err
    assert os.listdir(missing) == []
    assert main(["--help"]) == 0


def _run(*argv: str) -> "subprocess.Popen[str]":
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO)


def test_subprocesses_module_and_tools(tmp_path, monkeypatch, capsys):
    """Real processes (started together): ``python -m persistent_delta`` (JSON) and a tools/
    script failing; stderr is not a terminal, so no progress bar is drawn. The other tools/
    script runs here as ``__main__``."""
    root, out = str(tmp_path / "log"), str(tmp_path / "out")
    fill_ranks(root, _three_t_some_u, ranks=2, batches=8)
    module = _run("-m", "persistent_delta", "offsets", root, "--register", "ext", "--execute", "--format", "json")
    error = _run(os.path.join("tools", "inspect_offsets.py"), str(tmp_path / "missing"))
    code, stdout, stderr = module.wait(timeout=120), module.stdout.read(), module.stderr.read()  # type: ignore[union-attr]
    assert code == 0 and stderr == "", stderr
    assert [c["action"] for c in json.loads(stdout)["changes"]] == ["register", "register"]
    code, stdout, stderr = error.wait(timeout=120), error.stdout.read(), error.stderr.read()  # type: ignore[union-attr]
    assert code == 1 and stdout == "" and stderr.startswith("persistent-delta: error:"), stderr
    with DeltaConsumer(root, "ext", register=False) as c:
        assert c.committed() == {0: 0, 1: 0}
    monkeypatch.setattr(sys, "argv", ["replay.py", root, "--from-batch", "2", "--to-batch", "6", "--span", "2",
                                      "--out", out])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(os.path.join(REPO, "tools", "replay.py"), run_name="__main__")
    assert exit_info.value.code == 0
    assert "2 span(s)" in capsys.readouterr().out and os.path.isfile(os.path.join(out, "manifest.json"))


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_one_renderer_for_every_command(tmp_path, fmt):
    root = str(tmp_path / "log")
    fill_ranks(root, _three_t_some_u, ranks=1, batches=8)
    for argv in (["offsets", root], ["verify", root], ["replay", root, "--from-batch", "0", "--to-batch", "2",
                                                          "--dry-run"], ["vacuum", root]):
        buf = io.StringIO()
        assert main(argv + ["--format", fmt], stdout=buf) == 0, argv
        if fmt == "json":
            json.loads(buf.getvalue())
        else:
            assert buf.getvalue().strip() and not buf.getvalue().lstrip().startswith("{")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty", [True, False])
def test_progress_bar_only_on_a_terminal(tmp_path, monkeypatch, tty):
    root = str(tmp_path / "log")
    fill_ranks(root, _three_t_some_u, ranks=1, batches=8)
    err = _Terminal() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    argv = ["replay", root, "--from-batch", "0", "--to-batch", "8", "--span", "2", "--dry-run"]
    assert main(argv, stdout=io.StringIO()) == 0
    assert main(["verify", root], stdout=io.StringIO()) == 0
    assert main(["vacuum", root], stdout=io.StringIO()) == 0
    assert main(["upgrade", root, "--execute"], stdout=io.StringIO()) == 0
    if tty:
        assert "replay" in err.getvalue() and "span" in err.getvalue()
        assert "vacuum" in err.getvalue() and "rank" in err.getvalue()
        assert "upgrade" in err.getvalue()
    else:
        assert err.getvalue() == ""
