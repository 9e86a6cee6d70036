"""Opening a transport for a server URL.

Owns: :func:`open_transport`, the default :class:`~persistent_delta.fleet.transport.Transport`
for a server URL: :class:`persistent_delta.fleet.nats.Connection` (NATS JetStream). It sits
above both modules, so the protocol module never imports an implementation. nats-py stays
optional: :mod:`persistent_delta.fleet.nats` imports it only when a connection is opened.
"""

from __future__ import annotations

from typing import Optional

from persistent_delta.fleet.nats import Connection
from persistent_delta.fleet.transport import ConnectOptions, ServerSpec, Transport


def open_transport(server: ServerSpec, options: Optional[ConnectOptions] = None, wait: float = 0.0) -> Transport:
    """The default transport for a server URL: NATS JetStream (``nats://HOST:PORT``,
    ``tls://``; several, comma-separated or a list, for a cluster).

    Args:
        server: the URL(s).
        options: authentication and TLS.
        wait: seconds to keep trying to connect.

    Raises:
        TransportError: the servers cannot be reached within ``wait``.
        InvalidInputError: no server given.
    """
    return Connection(server, options, wait=wait)


__all__ = ["open_transport"]
