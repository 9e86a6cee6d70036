"""Reading a job's logs from any process: consumers, polls and their results.

Owns nothing itself. Its modules: :mod:`.polling` (the one ``Consumer`` protocol, its poll
arguments and byte cut), :mod:`.consumer` (``DeltaConsumer`` and ``DeltaReader`` on local logs),
:mod:`.fetch` (a poll planned and copied across ranks), :mod:`.results` (what a poll returns)
and :mod:`.base` (a replica's base and the rule a poll must continue it by).

The supported names (the package tier; every other module path is internal):

* :class:`Consumer`: the protocol every consumer implements (local, or remote:
  :class:`persistent_delta.fleet.RemoteConsumer`);
* :class:`DeltaConsumer` (a registered consumer, its position durable in the log) and
  :class:`DeltaReader` (a position in memory only);
* :class:`DeltaPoll`, :class:`RankDelta`, :class:`TableDelta`, :class:`MergedDelta`: a poll, per
  rank, per table, and one table merged over ranks at global row ids.
"""

from typing import TYPE_CHECKING, Dict

from persistent_delta.exports import lazy_exports

if TYPE_CHECKING:
    from persistent_delta.read.consumer import DeltaConsumer, DeltaReader
    from persistent_delta.read.polling import Consumer
    from persistent_delta.read.results import DeltaPoll, MergedDelta, RankDelta, TableDelta

_EXPORTS: Dict[str, str] = {
    "Consumer": "polling", "DeltaConsumer": "consumer", "DeltaReader": "consumer", "DeltaPoll": "results",
    "RankDelta": "results", "TableDelta": "results", "MergedDelta": "results",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = ["Consumer", "DeltaConsumer", "DeltaReader", "DeltaPoll", "RankDelta", "TableDelta", "MergedDelta"]
