"""Operating a job: positions and health of every consumer, Prometheus metrics, the exporter.

Owns: nothing itself; its modules are :mod:`.positions` (what local consumers read and still
have to read), :mod:`.remote_positions` (the same for a job's stream and its shippers),
:mod:`.health` (a consumer's status over a sliding window of its commits) and :mod:`.metrics`
(Prometheus collectors, ``serve_metrics``). ``prometheus_client`` is needed by
:mod:`.metrics` only (``pip install persistent_delta[ops]``).
"""
