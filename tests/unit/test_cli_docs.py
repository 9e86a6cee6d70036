"""The package docstrings of ``persistent_delta.cli`` and ``cli.main`` name every subcommand the
parser has, each with the module that exists for it, and no other."""

from __future__ import annotations

import argparse
import importlib
import re

import persistent_delta.cli as cli
main = importlib.import_module("persistent_delta.cli.main")


def _subcommands() -> set:
    parser = main.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices)


def test_both_docstrings_name_every_subcommand_and_its_module():
    names = _subcommands()
    assert len(names) >= 11
    package = cli.__doc__ or ""
    # a module of the cli package (``.offsets``) or the library's module the command calls
    listed = dict(re.findall(r"\* ``([a-z]+)`` \(:mod:`(\.[a-z_]+|persistent_delta(?:\.[a-z_]+)+)`", package))
    assert set(listed) == names, "persistent_delta/cli/__init__.py lists other subcommands than the parser has"
    for module in list(listed.values()) + re.findall(r":mod:`(\.[a-z_]+|persistent_delta(?:\.[a-z_]+)+)`", package):
        importlib.import_module(f"persistent_delta.cli{module}" if module.startswith(".") else module)  # it exists
    first = (main.__doc__ or "").split("\n\n", 1)[0]
    assert set(re.findall(r"[a-z]+", first.split(":", 1)[1])) == names, "cli/main.py's first line names other subcommands"
