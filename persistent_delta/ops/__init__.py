"""Operating a job: positions and health of every consumer, Prometheus metrics, the exporter.

Owns: nothing itself; its modules are :mod:`.positions` (what local consumers read and still
have to read), :mod:`.remote_positions` (the same for a job's stream and its shippers),
:mod:`.health` (a consumer's status over a sliding window of its commits) and :mod:`.metrics`
(Prometheus collectors, ``serve_metrics``). ``prometheus_client`` is needed by
:mod:`.metrics` only (``pip install persistent_delta[ops]``).

The supported names (the package tier; every other module path is internal):

* :func:`describe` (local consumers' positions, lag and pending rows: ``persistent-delta
  offsets``) and :class:`Health` (a consumer's status);
* :func:`serve_metrics` (the Prometheus exporter; needs ``prometheus_client``);
* :class:`StreamEnds`, :func:`stream_ends_of`: each rank's end on a job's stream, read from
  its authenticated range markers.
"""

from typing import TYPE_CHECKING, Dict

from persistent_delta.exports import lazy_exports

if TYPE_CHECKING:
    from persistent_delta.ops.health import Health
    from persistent_delta.ops.metrics import serve_metrics
    from persistent_delta.ops.positions import describe
    from persistent_delta.ops.remote_positions import StreamEnds, stream_ends_of

_EXPORTS: Dict[str, str] = {
    "describe": "positions", "Health": "health", "serve_metrics": "metrics",
    "StreamEnds": "remote_positions", "stream_ends_of": "remote_positions",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = ["describe", "Health", "serve_metrics", "StreamEnds", "stream_ends_of"]
