"""The tools: ``persistent-delta offsets | replay | verify | vacuum``.

Each tool is a data function in its own module (:mod:`.offsets`, :mod:`.replay`,
:mod:`.verify`, :mod:`.vacuum`) returning dataclasses; :mod:`.main` parses arguments and
renders results. The tools read logs through the reader side of the package (log, delivery,
results, consumer) and import nothing of the trainer.
"""

from persistent_delta.cli.main import build_parser, main, run_subcommand

__all__ = ["build_parser", "main", "run_subcommand"]
