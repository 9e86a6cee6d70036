"""The ported TorchRec examples end to end (``examples/two_tower_fleet.py``,
``examples/dlrm_data_parallel.py``): each runs at a small size and its bit-exact check passes;
the integration line counts their docstrings state are the lines marked ``# [pd]``.

The two-tower runs are also the test of remote consumers during a trainer restore: the shipper
runs all along, both ranks are SIGKILLed at random instants after a checkpoint and restart from
it (the tracker restored with the model's ``load_state_dict``, or by ``tracker.load_state_dict``),
and the replica, reading only the stream, ends bit-exact with the trainer; without the
tracker's restore the same check fails."""

import ast
import json
import os
import re
import subprocess
import sys

import pytest

from procs import REPO

TWO_TOWER = os.path.join(REPO, "examples", "two_tower_fleet.py")
DLRM_DP = os.path.join(REPO, "examples", "dlrm_data_parallel.py")


def run_example(script, out, *flags):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, script, f"--out={out}", *flags], capture_output=True, text=True,
                          timeout=900, env=env, cwd=REPO)
    result_file = os.path.join(out, "result.json")
    result = json.load(open(result_file)) if os.path.exists(result_file) else None
    return proc, result


def marked_lines(script, function):
    """The lines of ``function`` in ``script`` marked ``# [pd]`` (the integration)."""
    source = open(script).read()
    node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == function)
    lines = source.splitlines()[node.lineno - 1:node.end_lineno]
    return [line for line in lines if re.search(r"#\s*\[pd\](?!`)", line)]  # not the docstrings' ``# [pd]``


@pytest.mark.parametrize("script", [TWO_TOWER, DLRM_DP])
def test_stated_integration_line_counts_are_the_marked_lines(script):
    doc = ast.get_docstring(ast.parse(open(script).read()))
    stated = {m.group(2): int(m.group(1)) for m in re.finditer(r"\*\*(\d+) lines in the (trainer|replica)\*\*", doc)}
    assert stated == {"trainer": len(marked_lines(script, "train")),
                      "replica": len(marked_lines(script, "replica"))}, stated


@pytest.mark.slow
@pytest.mark.parametrize("restore,mode", [("model", "ID_ONLY"), ("tracker", "ROWWISE_ADAGRAD")])
def test_two_tower_remote_replica_bit_exact_through_sigkills_and_restores(tmp_path, restore, mode):
    out = tmp_path / "tt"
    proc, result = run_example(TWO_TOWER, out, "--steps=40", "--kills=2", "--checkpoint-every=10",
                               "--publish-every=5", "--rows=2048", f"--restore={restore}", f"--mode={mode}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result is not None and result["ok"] and result["kills"] == 2, result
    assert len(result["tables"]) == 2 and all(t["mismatched"] == 0 for t in result["tables"].values()), result
    assert "PermissionError" not in proc.stderr  # the replica never tried the trainer's log


@pytest.mark.slow
def test_two_tower_check_fails_without_the_trackers_restore(tmp_path):
    """The model restored, the tracker's state left out: the rows of the lost steps stay on the
    replica, and the check says so (and the tracker warned)."""
    out = tmp_path / "tt"
    proc, result = run_example(TWO_TOWER, out, "--steps=30", "--kills=1", "--checkpoint-every=10",
                               "--publish-every=5", "--rows=2048", "--restore=none")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result is not None and not result["ok"], result
    assert sum(t["mismatched"] for t in result["tables"].values()) > 0, result
    assert "without a tracker restore" in proc.stderr


@pytest.mark.slow
def test_dlrm_data_parallel_replica_bit_exact_with_the_replicated_table(tmp_path):
    out = tmp_path / "dp"
    proc, result = run_example(DLRM_DP, out, "--steps=12", "--rows=500", "--publish-every=4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result is not None and result["ok"], result
    assert len(result["tables"]) == 26 and all(t["mismatched"] == 0 for t in result["tables"].values()), result
    assert result["dp_copies_equal"]  # DDP kept the replicated table's copies equal on both ranks
    assert result["dp_parts"] == 2  # both ranks published their own rows of the replicated table
