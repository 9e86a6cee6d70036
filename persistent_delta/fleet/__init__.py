"""Across hosts: a host's rank logs shipped to a stream (NATS JetStream), read by remote
consumers on other hosts.

Owns nothing itself. Its modules: :mod:`.subjects` (subject names and bucket keys),
:mod:`.wire` (the wire format), :mod:`.auth` (stream keys, authenticators), :mod:`.permissions`
(the server permissions each side needs), :mod:`.streams` (a job's stream layout),
:mod:`.transport` (the ``Transport`` seam), :mod:`.connect`, :mod:`.nats` and :mod:`.memory` (its
implementations), :mod:`.ranges` (range markers), :mod:`.ship` (the shipper, ``upload_base``),
and the remote consumer: :mod:`.remote` (its thin front), :mod:`.claim` (the one-process claim
and its heartbeat), :mod:`.positions` and :mod:`.coordinator` (stored positions and their
history), :mod:`.fetcher`, :mod:`.assembly` and :mod:`.delivery` (fetching, marker assembly,
what a poll takes) and :mod:`.bootstrap` (a replica's start from the ranks' bases).

The supported names (the package tier; every other module path is internal):

* :class:`Shipper`, :func:`upload_base`: the shipper side;
* :class:`RemoteConsumer`: a consumer of a job's stream (the :class:`persistent_delta.read.Consumer`
  protocol);
* :func:`open_transport`, :class:`Transport`, :class:`ConnectOptions`: a connection to the server;
* :class:`StreamKey`, :func:`generate_key`, :func:`write_key_file`, :func:`read_key_file`: the
  job's stream key;
* :func:`authorization_block`, :func:`shipper_permissions`, :func:`consumer_permissions`: the
  NATS permissions of each side;
* :class:`Layout`: a job's stream layout (one stream, or one per group of ranks).
"""

from typing import TYPE_CHECKING, Dict

from persistent_delta.exports import lazy_exports

if TYPE_CHECKING:
    from persistent_delta.fleet.auth import StreamKey, generate_key, read_key_file, write_key_file
    from persistent_delta.fleet.connect import open_transport
    from persistent_delta.fleet.permissions import authorization_block, consumer_permissions, shipper_permissions
    from persistent_delta.fleet.remote import RemoteConsumer
    from persistent_delta.fleet.ship import Shipper, upload_base
    from persistent_delta.fleet.streams import Layout
    from persistent_delta.fleet.transport import ConnectOptions, Transport

_EXPORTS: Dict[str, str] = {
    "Shipper": "ship", "upload_base": "ship", "RemoteConsumer": "remote",
    "open_transport": "connect", "Transport": "transport", "ConnectOptions": "transport",
    "StreamKey": "auth", "generate_key": "auth", "write_key_file": "auth", "read_key_file": "auth",
    "authorization_block": "permissions", "shipper_permissions": "permissions", "consumer_permissions": "permissions",
    "Layout": "streams",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = ["Shipper", "upload_base", "RemoteConsumer", "open_transport", "Transport", "ConnectOptions", "StreamKey",
           "generate_key", "write_key_file", "read_key_file", "authorization_block", "shipper_permissions",
           "consumer_permissions", "Layout"]
