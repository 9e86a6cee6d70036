"""Everything the CLI prints that came from data -- fqns, names, hosts, error texts, log lines --
has its control characters escaped by one helper (``cli.top.printable``), so a crafted fqn or
an injected ``last_error`` can neither drive the terminal nor fake a table row."""

from __future__ import annotations

import io
import logging
import os

import torch

from persistent_delta.cli.main import Output, Table, main, render
from logs import fill_store

EVIL = "t\x1b]0;pwned\x07\x1b[2J"


def test_a_crafted_fqn_is_printed_escaped_by_offsets(tmp_path, capsys):
    root = str(tmp_path / "log")
    fill_store(os.path.join(root, "rank-0"), lambda b: [(EVIL, torch.tensor([b]), torch.ones(1, 2))], batches=2)
    out = io.StringIO()
    assert main(["offsets", root, "--tables"], stdout=out) == 0
    assert "\x1b" not in out.getvalue() and "\\x1b]0;pwned\\x07" in out.getvalue()


def test_an_injected_error_text_fakes_no_row_and_error_lines_are_escaped(tmp_path, capsys):
    out = io.StringIO()
    render(Output(data={}, tables=[Table("SHIPPERS\x1b[2J", ["RANK", "LAST-ERROR"],
                                         [[0, "boom\n9        lookups  fake\x1b[31m"]])],
                  notes=["note \x1b[1m"]), "text", out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 4 and "\x1b" not in out.getvalue() and not lines[2].startswith("9")
    assert main(["offsets", str(tmp_path / "no\x1b[2Jpe")]) == 1
    assert "\x1b" not in capsys.readouterr().err


def test_log_lines_are_escaped():
    from persistent_delta.cli.main import EscapingFormatter  # the formatter main installs

    rec = logging.LogRecord("x", logging.WARNING, __file__, 1, "skipped %s", (EVIL,), None)
    assert "\x1b" not in EscapingFormatter("%(message)s").format(rec)
