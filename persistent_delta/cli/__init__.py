"""The ``persistent-delta`` command: twelve subcommands, one module each (here, or the library's
module the command calls: replay and apply are the serving side's, :mod:`persistent_delta.serve`).

* ``offsets`` (:mod:`.offsets`; ``--server``: :mod:`.remote`): consumers' positions, lag and
  health; reset, register or delete a position.
* ``verify`` (:mod:`.verify`): check every record, key, position and meta value.
* ``replay`` (:mod:`persistent_delta.serve.replay`): export a batch range, all ranks merged, as
  safetensors.
* ``apply`` (:mod:`persistent_delta.serve.apply_files`): apply a base and replay outputs to a
  replica, in order.
* ``vacuum`` (:mod:`.vacuum`): reclaim disk space while no process has the log open.
* ``upgrade`` (:mod:`.upgrade`): rewrite logs of an older format version in place.
* ``consolidate`` (:mod:`persistent_delta.checkpoint.consolidate`): fold a base and its increments
  into a new base, offline; then, with ``--remove-older``, the older bases go.
* ``report`` (:mod:`.report`): PNG plots of a job computed from its log.
* ``ship`` (:mod:`.ship`): ship a host's rank logs to a NATS JetStream stream.
* ``keygen`` (:mod:`.keygen`): create a job's stream key file.
* ``exporter`` (:mod:`.exporter`): serve a job's metrics to Prometheus.
* ``top`` (:mod:`.top`): a live view of ranks, consumers and shippers.

:mod:`.main` parses arguments and renders results (``--format text|json``); :mod:`.stopping`
ends the long-running ones (ship, exporter, top) on SIGTERM. The tools import nothing of the
trainer (``tests/unit/test_packages.py``), and ``tests/unit/test_cli_docs.py`` keeps this list
and :mod:`.main`'s equal to the parser's subcommands.
"""

from persistent_delta.cli.main import build_parser, main, run_subcommand

__all__ = ["build_parser", "main", "run_subcommand"]
